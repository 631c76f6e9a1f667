"""The train flow: validate, start or join Ray, create the model actors once, run one subflow per episode.

The flow process is the Ray driver. Actors are created in `launch` (never in a task: an actor made inside a
task dies with it) and killed on the way out, failures included. Per-episode metrics go to the terminal
(progress bar + a metrics line every `log_interval` episodes), to `run_dir/metrics.jsonl`, and to Prefect
artifacts. What is restored on resume and what a checkpoint record holds is `chatlearn.checkpoint.resume`.
"""

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import get_client, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.context import FlowRunContext

from chatlearn.checkpoint.data_checkpoint import DataCheckpoint
from chatlearn.checkpoint.model_checkpoint import restore_rng_state
from chatlearn.checkpoint.resume import checkpoint_dirs, data_checkpoint_dir, resume_point
from chatlearn.checkpoint.run_config import inspect_run_dir, record_start
from chatlearn.config import ChatLearnConfig
from chatlearn.models.parallel import ParallelDims
from chatlearn.runtime.calls.recovery import ProcessLost, alive_node_ids, process_loss
from chatlearn.runtime.calls.stopping import Stopped, stop_signal, stopping
from chatlearn.runtime.calls.waiting import wait
from chatlearn.runtime.cluster.placement import PlacementError, table_text
from chatlearn.runtime.context import RunContext
from chatlearn.runtime.episodes import episodes_for
from chatlearn.runtime.launch import launch
from chatlearn.runtime.prefect import api_link
from chatlearn.runtime.prefect.prevalidated import ConfigParam, PrevalidatedFlow, config_of
from chatlearn.runtime.prefect.subflows import Subflows
from chatlearn.runtime.prepared import PreparedRun, handed_down, prepare_run
from chatlearn.runtime.records.prefect_server import configured_api_url
from chatlearn.runtime.records.recorder import RunRecorder
from chatlearn.runtime.records.reporting import artifact_key
from chatlearn.runtime.records.run_lock import lock_run_dir
from chatlearn.runtime.records.run_record import claim_run_dir, train_run_name
from chatlearn.runtime.records.traces import TRACE_DIR
from chatlearn.runtime.weights.sync import sync_routes
from chatlearn.utils.errors import RunError
from chatlearn.utils.storage import writing
from flows.episode_flow import episode_name, episode_runner
from flows.model_calls import PrefectCalls
from flows.pins import check_run
from flows.stage_tasks import evaluate


@api_link.keeps_result  # the result of a finished run survives the API failing to record its final state
def _train(config: ConfigParam | None = None, config_path: str | None = None, overrides: list[str] | None = None,
           modules: dict[str, Any] | None = None, engine: str | None = None) -> dict:
    """Train with a ChatLearn config; returns the last episode's metrics.

    Args:
        config: the whole config (the run form of a `chatlearn deploy` deployment, pre-filled with its config)
        config_path: a YAML config instead of `config` (relative to the run's working directory); default:
            the embedded default
        overrides: dotted `key=value` overrides applied on top, e.g. `runtime.num_episode=3`
        modules: model objects by role (Python callers only)
        engine: the engine (`rlhf`, `grpo`, `dpo`, `online_dpo`); default: `runtime.engine`
    """
    t_start = time.perf_counter()
    check_run(config, config_path, overrides, engine, modules)  # a deployment's run: its code as deployed
    # a direct call prepared the run before the flow run existed; a deployment run prepares it here: config
    # checks, model paths, data, prompt lengths (ConfigError, DataError) before any actor exists
    prepared = handed_down() or prepare_run(
        deployment_run(config_of(config, config_path, overrides, engine, modules)), modules, engine)
    cfg = prepared.cfg
    run_dir = Path(cfg.runtime.run_dir)
    # one run per run directory until the end (RunError naming the holder; `chatlearn train` already holds it:
    # re-entry only counts up), and the run and checkpoint directories writable, checked before Ray starts
    lock = lock_run_dir(run_dir, checkpoint_dirs(cfg))
    try:
        with api_link.watch(configured_api_url()):  # a deployment run's too: the API going away stops nothing
            return _train_locked(prepared, run_dir, t_start)
    except Exception as exc:
        if stopping():  # whatever a stop broke on its way (a killed actor, Ray's signal check): the flow run
            raise Stopped(stop_signal() or "SIGTERM") from exc  # ends Crashed "interrupted", not Failed
        raise
    finally:
        lock.release()


@dataclass
class Progress:
    """Where a run is, for a restart after a lost model process: the episode running (None: starting), and
    whether this run committed a checkpoint yet (then the restart resumes from it)."""

    episode: int | None = None
    committed: bool = False


def _train_locked(prepared: PreparedRun, run_dir: Path, t_start: float) -> dict:
    """`_train` with the run directory locked: the resume point, the actors, the episodes.

    A model process that dies (killed, out of memory, its node lost) does not end the run: the remaining
    actors are torn down, a fresh set is started, and the run resumes from its last checkpoint as a re-run
    would (exact), at most `runtime.max_restarts` times (`chatlearn.runtime.calls.recovery`).
    """
    cfg = prepared.cfg
    # complete, a continuation, refused (a config that changes results: RunDirConflict) or started over
    state = inspect_run_dir(cfg)
    if state.complete:
        msg = state.complete_message(cfg)
        get_run_logger().info(msg)
        sys.stderr.write(f"chatlearn: {msg}\n")
        summary = run_dir / "summary.json"
        return json.loads(summary.read_text()) if summary.is_file() else {}
    if state.start_over:
        msg = (f"starting over in {run_dir} ({state.start_over}); the earlier run's "
               f"{state.record.get('episodes_done', 0)} committed episode(s) of metrics, checkpoints and final "
               "policy are replaced as this run writes its own")
        get_run_logger().warning(msg)
        sys.stderr.write(f"chatlearn: warning: {msg}\n")
    run_dir.mkdir(parents=True, exist_ok=True)
    claim_run_dir(run_dir)  # a SIGKILLed earlier run here still shows Running: mark it Crashed, record us
    record_start(cfg, state)
    restarts = 0
    progress = Progress()
    previous: ProcessLost | None = None
    while True:
        try:
            return _attempt(prepared, run_dir, t_start, progress)
        except PlacementError as exc:
            if previous is None or not previous.nodes:
                raise
            # the lost node took capacity the layout needs: fail naming it (ChatLearn's layouts are fixed)
            raise RunError(f"{previous.message}; the model layout no longer fits the remaining cluster: {exc}") \
                from exc
        except ProcessLost as lost:
            previous = lost
            restarts += 1
            limit = cfg.runtime.max_restarts
            if restarts > limit:
                raise RunError(f"{lost.message}; gave up after {limit} restart(s) (runtime.max_restarts)") from lost
            if progress.committed:  # this run's own checkpoints are the restart point, whatever the config
                cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(
                    update={"enable_resume_training": True, "load_data_checkpoint_iteration": None})})
                prepared = prepared.with_config(cfg)
            msg = (f"{lost.message}; recreating the model processes and resuming from the last checkpoint "
                   f"(restart {restarts} of at most {limit})")
            get_run_logger().warning(msg)
            sys.stderr.write(f"chatlearn: warning: {msg}\n")
            t_start = time.perf_counter()


def _attempt(prepared: PreparedRun, run_dir: Path, t_start: float, progress: Progress) -> dict:
    """One start of the run's actors, from the resume point, to the end (or a ProcessLost)."""
    cfg = prepared.cfg
    resumed = resume_point(cfg)  # a missing or bad chosen record fails here too
    progress.episode = None
    with launch(prepared, PrefectCalls(), data_checkpoint_dir(cfg)) as ctx:
        processes = ctx.actors.processes()
        nodes_before = alive_node_ids()
        try:
            summary = _start(ctx, prepared, resumed)
            sys.stderr.write(f"ready to train in {time.perf_counter() - t_start:.1f}s (workers, model setup, "
                             "first sync)\n")
            last = _run_episodes(ctx, cfg, run_dir, resumed, time.perf_counter() - t_start, summary, progress)
        except Exception as exc:
            lost = None if stopping() else process_loss(exc, processes, nodes_before, progress.episode)
            if lost is None:
                raise
            raise lost from exc
    _show_outputs(cfg, last)
    return last


def _start(ctx: RunContext, prepared: PreparedRun, resumed: DataCheckpoint | None) -> dict[str, Any]:
    """Before the first episode: the resume point's state loaded, the first weight sync, what the rollout carries;
    returns what the run's summary says of the exported model (its trainable and total parameters)."""
    plan, timeout = ctx.spec.plan, ctx.spec.runtime.stage_timeout_s
    _show_placement(ctx)
    _show_layouts(prepared.cfg)
    if resumed is not None:  # the trainers' checkpoints, the relay window and the driver's RNG, as at the record
        wait([ctx.actors.heads(m)[0].load_checkpoint.remote(resumed.train_iteration) for m in plan.trainers],
             "resume", timeout)
        if resumed.relay_path:
            wait(ctx.stream.load_relay.remote(resumed.relay_path), "resume", timeout)
        restore_rng_state(resumed.rng_state)
        msg = (f"resuming after episode {resumed.episode + 1} (trainer iteration {resumed.train_iteration}, "
               f"{resumed.consumed_samples} samples consumed) from {ctx.spec.data_checkpoint_path}")
        get_run_logger().info(msg)
        sys.stderr.write(msg + "\n")  # the terminal shows it whatever the Prefect log level
    # ChatLearn syncs all parameters once before the first episode: inference copies start as the trainers.
    rt = ctx.spec.runtime
    sync_routes(ctx.sync_routes, ctx.actors.process, concurrent=rt.concurrent_comm,
                max_workers=rt.param_sync_max_workers)
    if resumed is not None:  # inference copies that may lag their trainer come from their own checkpoint
        lagging = [m for m in ctx.spec.checkpoint_models if m not in plan.trainers]
        wait([ctx.actors.heads(m)[0].load_checkpoint.remote(resumed.train_iteration) for m in lagging], "resume",
             timeout)
    ctx.rollout.start(ctx, resumed)  # pipelined: the published versions; partial rollouts: those in flight
    params = _parameter_counts(ctx, plan.trainers)
    for name in plan.trainers:  # e.g. where GRPO's old log-probs come from
        for line in prepared.engine.modules[name].run_notes(plan):
            sys.stderr.write(line + "\n")
    return params.get(plan.export, {})


def deployment_run(cfg: ChatLearnConfig) -> ChatLearnConfig:
    """A deployment's runs (scheduled, from the UI, triggered) each get their own run directory,
    ``run_dir/<deployment>-<scheduled time, UTC>``, unless ``deployment.runs: continue``: a later run would
    otherwise find the first one complete and do nothing, or be refused once the form changed a field. A retry
    of the same flow run keeps its scheduled time, so it resumes its own directory."""
    ctx = FlowRunContext.get()
    flow_run = ctx.flow_run if ctx is not None else None
    if flow_run is None or flow_run.deployment_id is None or cfg.deployment.runs == "continue":
        return cfg
    with get_client(sync_client=True) as client:
        name = client.read_deployment(flow_run.deployment_id).name
    when = (flow_run.expected_start_time or flow_run.created or datetime.now(UTC)).astimezone(UTC)
    exp = f"{name}-{when:%Y%m%d-%H%M%S}"
    rt = cfg.runtime
    update: dict[str, Any] = {"exp_name": exp}
    if rt.data_checkpoint_path:  # an explicit record folder would be shared by every run otherwise
        update["data_checkpoint_path"] = os.path.join(rt.data_checkpoint_path, exp)
    return cfg.model_copy(update={"runtime": rt.model_copy(update=update)})


def _show_outputs(cfg: ChatLearnConfig, last: dict[str, Any]) -> None:
    """Where the run's results are, as an artifact of this flow run: what a triggered eval reads
    (`flows.eval_flow.outputs_of_run`) and what the UI shows."""
    rows = [{"output": "run_dir", "path": str(Path(cfg.runtime.run_dir).resolve())}]
    if last.get("final_policy"):
        rows.append({"output": "final_policy", "path": str(Path(last["final_policy"]).resolve())})
    traces = Path(cfg.runtime.run_dir) / TRACE_DIR
    if traces.is_dir():  # every sample of every episode (`chatlearn trace RUN_DIR`)
        rows.append({"output": "traces", "path": str(traces.resolve())})
    api_link.send(create_table_artifact, key=artifact_key(cfg.runtime.exp_name, "outputs"), table=rows,
                  description=f"where the outputs of {cfg.runtime.exp_name} are")


def _parameter_counts(ctx: RunContext, trainers: list[str]) -> dict[str, dict[str, int]]:
    """Trainable vs total parameters of each trainer (LoRA trains a small share), printed once."""
    infos = dict(zip(trainers, wait([ctx.actors.heads(m)[0].call.remote("info") for m in trainers], "setup",
                                    ctx.spec.runtime.stage_timeout_s), strict=True))
    out = {}
    for name, info in infos.items():
        if "trainable_params" in info:
            t, n = int(info["trainable_params"]), int(info["total_params"])
            out[name] = {"trainable_params": t, "total_params": n}
            sys.stderr.write(f"{name}: {t:,} trainable of {n:,} parameters ({100.0 * t / max(1, n):.2f}%)\n")
    return out


def _show_placement(ctx: RunContext) -> None:
    """The realised placement: a table on the terminal and a Prefect artifact (one row per worker process)."""
    rows, exp = ctx.placement, ctx.spec.runtime.exp_name
    sys.stderr.write(f"placement ({len(rows)} worker process{'es' if len(rows) != 1 else ''}):\n{table_text(rows)}\n")
    api_link.send(create_table_artifact, key=artifact_key(exp, "placement"), table=rows,
                  description=f"where each model rank of {exp} runs")


def _show_layouts(cfg: ChatLearnConfig) -> None:
    """One line per model whose replicas span processes: how they split (chatlearn.models.parallel)."""
    parts = []
    for name, m in cfg.models.items():
        procs = m.layout.processes
        if procs < 2:
            continue
        dims = ParallelDims.of(procs, m.tensor_model_parallel_size or 1, m.zero_size or 1,
                               m.pipeline_model_parallel_size or 1)
        kinds = [f"{label} {getattr(dims, d)}" for d, label in (("dp", "DP"), ("shard", "ZeRO"), ("tp", "TP"),
                                                                 ("pp", "PP")) if getattr(dims, d) > 1]
        parts.append(f"{name} {' x '.join(kinds)}")
    if parts:
        sys.stderr.write(f"parallel layouts: {', '.join(parts)}\n")


train_flow = PrevalidatedFlow(fn=_train, name="chatlearn-train", log_prints=True, flow_run_name=train_run_name)


def _run_episodes(ctx: RunContext, cfg: ChatLearnConfig, run_dir: Path, resumed: DataCheckpoint | None,
                  startup_seconds: float, summary: dict[str, Any], progress: Progress) -> dict:
    """The episodes from the resume point on: run one, record it, commit its checkpoint. ``progress`` says which
    episode is running and whether this run committed a checkpoint yet (what a restart after a lost process
    resumes from)."""
    rt = cfg.runtime
    first = resumed.episode + 1 if resumed is not None else 0
    consumed, iteration = ((resumed.consumed_samples, resumed.train_iteration) if resumed is not None
                           else (rt.consumed_samples, 0))
    recorder = RunRecorder(cfg, run_dir, first, ctx.spec.data_checkpoint_path, startup_seconds)
    # each episode a subflow run of this flow run (records sent in the background), its flow run created one
    # episode ahead; inside the train flow run while the Prefect API is away (api_link)
    subflows = Subflows(episode_runner(ctx.spec.plan))
    failed = True
    try:
        if resumed is None and rt.enable_eval_before_training and ctx.eval_dataset_size:
            # ChatLearn 1.0.3's enable_eval_before_training: the baseline the eval curve starts from
            recorder.before_training(evaluate(ctx, -1, trained={"iteration": 0})["metrics"]["eval_reward_mean"])
        episodes = episodes_for(
            ctx, lambda ep, params, nxt: subflows(episode_name(ep), params,
                                                  next_name=episode_name(nxt) if nxt is not None else None),
            first, consumed, prepare=lambda ep: subflows.prepare(episode_name(ep)))
        try:
            for episode in range(first, rt.num_episode):
                progress.episode = episode
                metrics = episodes.run(episode, consumed, iteration)
                consumed, iteration = metrics["consumed_samples"], metrics["iteration"]
                recorder.record(metrics)
                if metrics["checkpoint_paths"]:
                    recorder.commit(metrics)
                    progress.committed = True
        finally:
            episodes.close()
        failed = False
    finally:
        subflows.close()
        recorder.close(failed)
    extra: dict[str, Any] = {}
    if ctx.spec.plan.export:
        path = run_dir / "final" / "policy"
        with writing("the final policy", path):  # a full disk, in the actor too: one RunError naming the path
            path.parent.mkdir(parents=True, exist_ok=True)
            wait(ctx.actors.heads(ctx.spec.plan.export)[0].call.remote("export_hf", str(path)), "export",
                 rt.stage_timeout_s)
        extra["final_policy"] = str(path)
    extra.update(summary)  # e.g. the exported model's trainable/total parameters
    return recorder.finish(extra)
