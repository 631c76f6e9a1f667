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
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext

from chatlearn.checkpoint.data_checkpoint import DataCheckpoint, DataCheckpointStore
from chatlearn.checkpoint.model_checkpoint import restore_rng_state
from chatlearn.checkpoint.resume import (
    checkpoint_dirs,
    commit_data_checkpoint,
    data_checkpoint_dir,
    resume_point,
)
from chatlearn.checkpoint.run_config import inspect_run_dir, record_progress, record_start
from chatlearn.config import ChatLearnConfig
from chatlearn.config.engine_checks import max_new_tokens
from chatlearn.data.partial_rollout import PartialRollouts, RolloutBuffer
from chatlearn.data.relay import RelayCheckpointError
from chatlearn.models.parallel import ParallelDims
from chatlearn.runtime.calls.handles import RunHandle
from chatlearn.runtime.calls.recovery import ProcessLost, alive_node_ids, process_loss
from chatlearn.runtime.calls.stopping import Stopped, stop_signal, stopping
from chatlearn.runtime.calls.waiting import MIN_STEP_TIMEOUT_S, StageClock, wait
from chatlearn.runtime.cluster.launch import launch
from chatlearn.runtime.cluster.model_group import ModelGroup
from chatlearn.runtime.cluster.placement import PlacementError, table_text
from chatlearn.runtime.pipeline import Pipeline
from chatlearn.runtime.plan import ResolvedEngine
from chatlearn.runtime.prefect import api_link
from chatlearn.runtime.prefect.prevalidated import ConfigParam, PrevalidatedFlow, config_of
from chatlearn.runtime.prefect.subflows import Subflows
from chatlearn.runtime.prepared import PreparedRun, handed_down, prepare_run
from chatlearn.runtime.records.prefect_server import configured_api_url
from chatlearn.runtime.records.profiling import EpisodeInstruments
from chatlearn.runtime.records.reporting import (
    EpisodeReporter,
    RunArtifacts,
    artifact_key,
    flow_run_url,
    json_safe,
    run_summary,
    user_row,
)
from chatlearn.runtime.records.run_lock import lock_run_dir
from chatlearn.runtime.records.run_record import claim_run_dir, train_run_name
from chatlearn.runtime.records.trackers import Trackers
from chatlearn.runtime.weights.sync import sync_routes
from chatlearn.runtime.weights.versions import WeightVersions, generation_version
from chatlearn.utils.errors import RunError
from chatlearn.utils.faults import crash_point
from chatlearn.utils.storage import writing
from flows.episode_flow import episode_name, episode_runner
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
    cfg, eng = prepared.cfg, prepared.engine
    resumed = resume_point(cfg)  # a missing or bad chosen record fails here too
    progress.episode = None
    with launch(prepared, data_checkpoint_dir(cfg)) as (run, groups, stream):
        processes = {name: run.actor(name) for reps in run.actors.values() for rep in reps for name in rep}
        nodes_before = alive_node_ids()
        try:
            last = _start_and_run(cfg, eng, run, groups, stream, run_dir, resumed, t_start, progress)
        except Exception as exc:
            lost = None if stopping() else process_loss(exc, processes, nodes_before, progress.episode)
            if lost is None:
                raise
            raise lost from exc
    _show_outputs(cfg, last)
    return last


def _start_and_run(cfg: ChatLearnConfig, eng: ResolvedEngine, run: RunHandle, groups: dict[str, ModelGroup],
                   stream: Any, run_dir: Path, resumed: DataCheckpoint | None, t_start: float,
                   progress: Progress) -> dict:
    _show_placement(run)
    _show_layouts(cfg)
    heads = {name: group.heads[0] for name, group in groups.items()}
    if resumed is not None:  # the trainers' checkpoints, the relay window and the driver's RNG, as at the record
        wait([heads[m].load_checkpoint.remote(resumed.train_iteration) for m in eng.plan.trainers], "resume",
             run.stage_timeout_s)
        if resumed.relay_path:
            wait(stream.load_relay.remote(resumed.relay_path), "resume", run.stage_timeout_s)
        restore_rng_state(resumed.rng_state)
        msg = (f"resuming after episode {resumed.episode + 1} (trainer iteration {resumed.train_iteration}, "
               f"{resumed.consumed_samples} samples consumed) from {run.data_checkpoint_path}")
        get_run_logger().info(msg)
        sys.stderr.write(msg + "\n")  # the terminal shows it whatever the Prefect log level
    # ChatLearn syncs all parameters once before the first episode: inference copies start as the trainers.
    sync_routes(run.sync_routes, run.actor, concurrent=run.concurrent_comm,
                max_workers=run.param_sync_max_workers)
    if resumed is not None:  # inference copies that may lag their trainer come from their own checkpoint
        lagging = [m for m in run.checkpoint_models if m not in eng.plan.trainers]
        wait([heads[m].load_checkpoint.remote(resumed.train_iteration) for m in lagging], "resume",
             run.stage_timeout_s)
    if cfg.runtime.max_staleness > 0:  # pipelined: the policy generates on published versions of the trainer
        _start_versions(run, eng, resumed)
    if cfg.runtime.use_partial_rollout:
        _start_partial(cfg, run, resumed)
    params = _parameter_counts(heads, eng.plan.trainers, run.stage_timeout_s)
    if eng.name == "grpo":  # say where the ratio's old log-probs come from
        src = ("the trainer's forward pass in the score stage" if eng.plan.calls(eng.plan.trainers[0], "forward_step")
               else "generation (the policy holds the trainer's weights, synced every episode)")
        sys.stderr.write(f"old log-probs: {src}\n")
    startup = time.perf_counter() - t_start
    sys.stderr.write(f"ready to train in {startup:.1f}s (workers, model setup, first sync)\n")
    return _run_episodes(cfg, run, groups, run_dir, resumed, startup, params.get(eng.plan.export, {}), progress)


def _start_versions(run: RunHandle, eng: ResolvedEngine, resumed: DataCheckpoint | None) -> None:
    """Pipelined episodes: the trainer's weights as the current version, and on resume the older versions the
    next episodes generate on, from the checkpoint (`chatlearn.runtime.weights.versions`)."""
    route = next(r for r in run.sync_routes if r.dst == eng.plan.producer)
    run.versions = WeightVersions(route, run.actor, run.max_staleness, run.stage_timeout_s)
    clock = StageClock("resume" if resumed else "setup", -1, max(run.stage_timeout_s or 0, MIN_STEP_TIMEOUT_S))
    if resumed is not None:
        missing = [v for v in range(generation_version(resumed.episode + 1, run.max_staleness), resumed.episode + 1)
                   if v not in resumed.policy_versions]
        if missing:
            raise RunError(f"the data checkpoint of episode {resumed.episode + 1} in {run.data_checkpoint_path} "
                           f"has no policy weights of version(s) {missing}, which runtime.max_staleness "
                           f"{run.max_staleness} generates on next (was it written by a run with a smaller "
                           f"max_staleness?)")
        run.versions.restore(resumed.policy_versions)
    run.versions.publish(resumed.episode + 1 if resumed is not None else 0, clock)


def _start_partial(cfg: ChatLearnConfig, run: RunHandle, resumed: DataCheckpoint | None) -> None:
    """Partial rollouts: nothing in flight at the start; on resume, the responses in flight the checkpoint holds
    (`chatlearn.data.partial_rollout`)."""
    rt = cfg.runtime
    budgets = rt.partial_rollout_manager_config.round_budgets(max_new_tokens(cfg, run.plan.producer))
    run.partial = PartialRollouts(budgets, run.group_size, run.generation_batch_size, keep=rt.max_staleness + 1,
                                  mini_response=rt.partial_rollout_manager_config.mini_response_per_prompt)
    buffer = None
    if resumed is not None:
        if not resumed.partial_rollouts:
            raise RunError(f"the data checkpoint of episode {resumed.episode + 1} in {run.data_checkpoint_path} "
                           "holds no partial rollouts, which runtime.use_partial_rollout continues (was it written "
                           "by a run without partial rollouts?)")
        try:
            buffer = RolloutBuffer.load(resumed.partial_rollouts)
        except (OSError, RelayCheckpointError) as exc:
            raise RunError(f"the partial rollouts of episode {resumed.episode + 1}'s data checkpoint cannot be "
                           f"read: {exc}") from exc
    run.partial.start(resumed.episode + 1 if resumed is not None else 0, buffer)


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
    api_link.send(create_table_artifact, key=artifact_key(cfg.runtime.exp_name, "outputs"), table=rows,
                  description=f"where the outputs of {cfg.runtime.exp_name} are")


def _parameter_counts(heads: dict[str, Any], trainers: list[str], timeout_s: float | None) -> dict[str, dict[str, int]]:
    """Trainable vs total parameters of each trainer (LoRA trains a small share), printed once."""
    infos = dict(zip(trainers, wait([heads[m].call.remote("info") for m in trainers], "setup", timeout_s),
                     strict=True))
    out = {}
    for name, info in infos.items():
        if "trainable_params" in info:
            t, n = int(info["trainable_params"]), int(info["total_params"])
            out[name] = {"trainable_params": t, "total_params": n}
            sys.stderr.write(f"{name}: {t:,} trainable of {n:,} parameters ({100.0 * t / max(1, n):.2f}%)\n")
    return out


def _show_placement(run: RunHandle) -> None:
    """The realised placement: a table on the terminal and a Prefect artifact (one row per worker process)."""
    n = len(run.placement)
    sys.stderr.write(f"placement ({n} worker process{'es' if n != 1 else ''}):\n{table_text(run.placement)}\n")
    api_link.send(create_table_artifact, key=artifact_key(run.exp_name, "placement"), table=run.placement,
                  description=f"where each model rank of {run.exp_name} runs")


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


def _released_bytes(groups: dict[str, ModelGroup], timeout_s: float | None) -> int:
    """Bytes the colocated models handed over so far (offloaded weights/optimizer states, freed grads)."""
    workers = {h.process: h.actor for g in groups.values() for h in g.actors}
    reports = wait([w.memory_report.remote() for w in workers.values()], "memory report", timeout_s)
    return sum(n for rep in reports for model in rep.values() for n in model["released"].values())


def _run_episodes(cfg: ChatLearnConfig, run: RunHandle, groups: dict[str, ModelGroup], run_dir: Path,
                  resumed: DataCheckpoint | None, startup_seconds: float = 0.0,
                  summary_extra: dict[str, Any] | None = None, progress: Progress | None = None) -> dict:
    """The episodes from the resume point on; `progress` says which episode is running and whether this run
    committed a checkpoint yet (what a restart after a lost process resumes from)."""
    progress = Progress() if progress is None else progress
    rt = cfg.runtime
    store = DataCheckpointStore(run.data_checkpoint_path)
    first = resumed.episode + 1 if resumed is not None else 0
    reporter = EpisodeReporter(cfg, run_dir, first_episode=first)
    trackers = Trackers.open(cfg, run_dir, first_episode=first)  # runtime.log_args_dict: tensorboard, wandb, mlflow
    ui = flow_run_url()
    if ui:  # Prefect's own "View at" line is in the log file (chatlearn.runtime.records.console)
        sys.stderr.write(f"Prefect flow run: {ui}\n")
    for name, link in trackers.links.items():
        sys.stderr.write(f"{name}: {link}\n")
    tracker_links = trackers.links  # for the run's summary
    artifacts = RunArtifacts(rt.exp_name, run_dir)  # metrics table + curve: one of each per run, kept current
    instruments = EpisodeInstruments.of(rt, groups, first)  # runtime.nsys ranges, runtime.profiler_dir traces
    progress_id = api_link.send(create_progress_artifact, progress=100.0 * first / max(1, rt.num_episode),
                                key=reporter.artifact_key("progress"), description=f"episodes of {rt.exp_name}")
    if resumed is not None:
        consumed, iteration = resumed.consumed_samples, resumed.train_iteration
    else:
        consumed, iteration = rt.consumed_samples, 0
    last: dict[str, Any] = reporter.rows[-1] if reporter.rows else {}
    initial_eval = None
    if resumed is None and rt.enable_eval_before_training and run.eval_dataset_size:
        # ChatLearn 1.0.3's enable_eval_before_training: the baseline the eval curve starts from
        initial_eval = evaluate(run, -1, trained={"iteration": 0})["metrics"]["eval_reward_mean"]
        reporter.write(f"eval before training: eval_reward_mean={initial_eval:.4g}")
    released_before = _released_bytes(groups, run.stage_timeout_s)
    hosts = [h for g in groups.values() for h in g.actors]  # every rank of every model: ChatLearn's episode hooks
    # each episode a subflow run of this flow run, its flow run created one episode ahead (the first: now)
    episodes = Subflows(episode_runner(run.plan))
    pipeline = None
    if run.versions is not None:  # pipelined: the next max_staleness episodes generate while this one trains
        def call(ep: int, params: dict[str, Any], next_ep: int | None) -> Any:
            return episodes(episode_name(ep), params, next_name=episode_name(next_ep) if next_ep is not None else None)
        pipeline = Pipeline(call, run, first, rt.num_episode, consumed,
                            prepare=lambda ep: episodes.prepare(episode_name(ep)))
    failed = True
    try:
        for episode in range(first, rt.num_episode):
            t0 = time.perf_counter()
            progress.episode = episode
            crash_point("episode_start", episode)
            wait([h.before_episode.remote() for h in hosts], "before_episode", run.stage_timeout_s)
            with instruments.episode(episode):
                # a subflow (records sent in the background); inside the train flow run while the Prefect API is
                # away (api_link)
                if pipeline is not None:
                    metrics = pipeline.run(episode, iteration)
                else:
                    metrics = episodes(episode_name(episode), {"run": run, "episode": episode,
                                                               "consumed_samples": consumed,
                                                               "start_iteration": iteration},
                                       next_name=episode_name(episode + 1) if episode + 1 < rt.num_episode else None)
            wait([h.after_episode.remote() for h in hosts], "after_episode", run.stage_timeout_s)
            consumed, iteration = metrics["consumed_samples"], metrics["iteration"]
            if initial_eval is not None and episode == 0:
                metrics["eval_reward_mean_before_training"] = initial_eval
            metrics["episode_seconds"] = time.perf_counter() - t0
            if episode == first:
                metrics["startup_seconds"] = startup_seconds
            released = _released_bytes(groups, run.stage_timeout_s)
            if released:
                metrics["handover_mb"] = (released - released_before) / 2**20
                released_before = released
            metrics["peak_memory_mb"] = max(wait([a.peak_memory.remote() for g in groups.values() for a in g.actors],
                                                 "memory report", run.stage_timeout_s))
            reporter.record(metrics)
            trackers.log(reporter.rows[-1])
            if metrics["checkpoint_paths"]:
                path = commit_data_checkpoint(cfg, store, metrics)
                record_progress(cfg, episode + 1)
                progress.committed = True
                api_link.post(
                    create_markdown_artifact, key=reporter.artifact_key("data-checkpoint"),
                    markdown=f"latest data checkpoint of **{rt.exp_name}**: episode {episode + 1}, trainer "
                             f"iteration {metrics['iteration']}, `{path}`",
                    description="where a re-run of this config resumes from",
                )
            if progress_id is not None:
                api_link.post(update_progress_artifact, progress_id, progress=100.0 * (episode + 1) / rt.num_episode)
            api_link.post(artifacts.update, list(reporter.rows))  # the curve is drawn there too
            last = user_row(metrics)
        failed = False
    finally:
        trackers.close(failed)
        if pipeline is not None:
            pipeline.close()
        episodes.close()
        # what the episodes posted is sent (or dropped) while Ray is still up: it holds Ray handles
        api_link.flush()
        reporter.close()
    if run.plan.export:
        path = run_dir / "final" / "policy"
        with writing("the final policy", path):  # a full disk, in the actor too: one RunError naming the path
            path.parent.mkdir(parents=True, exist_ok=True)
            wait(groups[run.plan.export].heads[0].call.remote("export_hf", str(path)), "export", run.stage_timeout_s)
        last["final_policy"] = str(path)
    last.update(summary_extra or {})  # e.g. the exported model's trainable/total parameters
    last.update(run_summary(reporter.rows, rt.num_episode, run_dir, tracker_links, ui))
    summary = run_dir / "summary.json"
    with writing("the run summary", summary, cleanup=summary.with_suffix(".json.tmp")):
        summary.with_suffix(".json.tmp").write_text(json.dumps(json_safe(last), default=str, indent=1,
                                                               allow_nan=False))
        summary.with_suffix(".json.tmp").replace(summary)  # never half a summary
    record_progress(cfg, rt.num_episode, final_policy=last.get("final_policy"), finished=True)
    return last
