"""The train flow: validate, start or join Ray, create the model actors once, run one subflow per episode.

The flow process is the Ray driver. Actors are created here (never in a task: an actor made inside a task
dies with it) and killed in `finally`, failures included. Per-episode metrics go to the terminal (progress
bar + a metrics line every `log_interval` episodes), to `run_dir/metrics.jsonl`, and to Prefect artifacts.
"""

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import ray
from prefect import Flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from pydantic import BeforeValidator

from chatlearn.checkpoint.data_checkpoint import DataCheckpoint, DataCheckpointStore
from chatlearn.checkpoint.model_checkpoint import CheckpointError, capture_rng_state, restore_rng_state
from chatlearn.runtime.engine import build_engine, load_run_config
from chatlearn.runtime.faults import crash_point
from chatlearn.runtime.handles import RunHandle
from chatlearn.runtime.launch import launch
from chatlearn.runtime.model_group import ModelGroup
from chatlearn.runtime.reporting import EpisodeReporter
from chatlearn.runtime.sync import copy_weights
from chatlearn.utils.arguments import ChatLearnConfig
from chatlearn.utils.config_loader import load_config


def _load_if_path(value: Any) -> Any:
    if isinstance(value, str | os.PathLike):
        return load_config(str(value))
    return value


ConfigParam = Annotated[ChatLearnConfig, BeforeValidator(_load_if_path)]


def _train(config: ConfigParam, modules: dict[str, Any] | None = None, engine: str | None = None) -> dict:
    """Train with a ChatLearn config (object or YAML path); returns the last episode's metrics."""
    cfg: ChatLearnConfig = config
    eng = build_engine(cfg, modules, engine)  # raises ConfigError before any actor exists
    rt = cfg.runtime
    run_dir = Path(rt.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed = int(rt.get("seed") or 42)

    if rt.enable_resume_training and rt.load_data_checkpoint_iteration is not None:
        chosen_checkpoint(cfg)  # a missing or bad record fails here, before any actor starts
    with launch(cfg, eng, seed, data_checkpoint_dir(cfg), with_train_data=True) as (run, groups, stream):
        resumed = restore(cfg, run, groups, stream)
        # ChatLearn syncs all parameters once before the first episode: inference copies start as the trainers.
        # (On resume, inference copies that may lag their trainer were restored from their own checkpoint.)
        for src, dst in eng.plan.sync:
            copy_weights(groups[src].heads[0], groups[dst].actors)
        if resumed is not None:
            from flows.tasks import models_to_checkpoint

            lagging = [m for m in models_to_checkpoint(run, cfg) if m not in eng.plan.trainers]
            ray.get([groups[m].heads[0].load_checkpoint.remote(resumed.train_iteration) for m in lagging])
        return _run_episodes(cfg, run, groups, eng.plan.export, run_dir, resumed)


def data_checkpoint_dir(cfg: ChatLearnConfig) -> str:
    """`runtime.data_checkpoint_path`, by default `run_dir/data_checkpoints`."""
    return os.path.abspath(cfg.runtime.data_checkpoint_path or os.path.join(cfg.runtime.run_dir, "data_checkpoints"))


def chosen_checkpoint(cfg: ChatLearnConfig) -> DataCheckpoint:
    """The record `runtime.load_data_checkpoint_iteration` names; an error listing the available ones if bad."""
    store = DataCheckpointStore(data_checkpoint_dir(cfg))
    it = cfg.runtime.load_data_checkpoint_iteration
    try:
        return store.read(it)
    except CheckpointError as exc:
        raise CheckpointError(f"runtime.load_data_checkpoint_iteration={it}: {exc}; "
                              f"available: {store.iterations()}") from exc


def restore(cfg: ChatLearnConfig, run: RunHandle, groups: dict[str, ModelGroup], stream: Any) -> DataCheckpoint | None:
    """Load the data checkpoint to resume from (if any) into the actors; None for a fresh start.

    `enable_resume_training: false` starts fresh; `load_data_checkpoint_iteration` picks a record (an error if
    it is missing or bad); otherwise the newest record that passes its checks, bad ones reported and skipped.
    """
    rt = cfg.runtime
    store = DataCheckpointStore(run.data_checkpoint_path)
    if not rt.enable_resume_training:
        return None
    if rt.load_data_checkpoint_iteration is not None:
        record = chosen_checkpoint(cfg)
    else:
        record = store.latest_good()
    if record is None:
        return None
    if record.sample_per_episode != rt.sample_per_episode:
        logging.getLogger("chatlearn").warning(
            "resuming with sample_per_episode=%d, the checkpoint was written with %d",
            rt.sample_per_episode, record.sample_per_episode)
    ray.get([groups[name].heads[0].load_checkpoint.remote(record.train_iteration)
             for name in run.plan.trainers])
    if record.relay_path:
        ray.get(stream.load_relay.remote(record.relay_path))
    restore_rng_state(record.rng_state)
    msg = (f"resuming after episode {record.episode + 1} (trainer iteration {record.train_iteration}, "
           f"{record.consumed_samples} samples consumed) from {store.path}")
    get_run_logger().info(msg)
    sys.stderr.write(msg + "\n")  # the terminal shows it whatever the Prefect log level
    return record


class PrevalidatedFlow(Flow):
    """A flow whose direct calls validate the config (all problems at once) before a flow run exists.

    Deployment runs skip `__call__`; there Prefect validates the parameters against the config's schema
    (server side, then in the flow run), and `build_engine` checks the module args before any actor exists.
    """

    def __call__(self, config: Any, modules: dict[str, Any] | None = None, engine: str | None = None,
                 **kwargs: Any) -> Any:
        cfg = load_run_config(config, None, modules)
        build_engine(cfg, modules, engine)
        return super().__call__(cfg, modules=modules, engine=engine, **kwargs)


train_flow = PrevalidatedFlow(fn=_train, name="chatlearn-train", log_prints=True)


def _run_episodes(cfg: ChatLearnConfig, run: RunHandle, groups: dict[str, ModelGroup], export: str | None,
                  run_dir: Path, resumed: DataCheckpoint | None) -> dict:
    from flows.episode import episode_flow
    from flows.tasks import evaluate

    rt = cfg.runtime
    store = DataCheckpointStore(run.data_checkpoint_path)
    first = resumed.episode + 1 if resumed is not None else 0
    reporter = EpisodeReporter(cfg, run_dir, first_episode=first)
    progress_id = create_progress_artifact(progress=100.0 * first / max(1, rt.num_episode),
                                           key=reporter.artifact_key("progress"),
                                           description=f"episodes of {rt.exp_name}")
    if resumed is not None:
        consumed, iteration = resumed.consumed_samples, resumed.train_iteration
    else:
        consumed, iteration = rt.consumed_samples, 0
    last: dict[str, Any] = reporter.rows[-1] if reporter.rows else {}
    initial_eval = None
    if resumed is None and rt.get("enable_eval_before_training") and run.eval_dataset_size:
        # ChatLearn v1.2's enable_eval_before_training: the baseline the eval curve starts from
        initial_eval = evaluate(run, cfg, -1, trained={"iteration": 0})["metrics"]["eval_reward_mean"]
        print(f"eval before training: eval_reward_mean={initial_eval:.4g}")
    try:
        for episode in range(first, rt.num_episode):
            t0 = time.perf_counter()
            crash_point("episode_start", episode)
            metrics = episode_flow(run, cfg, episode, consumed, iteration)
            consumed, iteration = metrics["consumed_samples"], metrics["iteration"]
            if initial_eval is not None and episode == 0:
                metrics["eval_reward_mean_before_training"] = initial_eval
            metrics["episode_seconds"] = time.perf_counter() - t0
            metrics["peak_memory_mb"] = max(ray.get([a.peak_memory.remote() for g in groups.values()
                                                     for a in g.actors]))
            reporter.record(metrics)
            if metrics["checkpoint_paths"]:
                commit_data_checkpoint(cfg, store, metrics, reporter)
            update_progress_artifact(progress_id, progress=100.0 * (episode + 1) / rt.num_episode)
            create_table_artifact(key=reporter.artifact_key("metrics"), table=reporter.table(),
                                  description=f"per-episode metrics of {rt.exp_name}")
            last = metrics
    finally:
        reporter.close()
    if export:
        path = run_dir / "final" / "policy"
        path.parent.mkdir(parents=True, exist_ok=True)
        ray.get(groups[export].heads[0].call.remote("export_hf", str(path)))
        last["final_policy"] = str(path)
    (run_dir / "summary.json").write_text(json.dumps(last, default=str, indent=1))
    return last


def commit_data_checkpoint(cfg: ChatLearnConfig, store: DataCheckpointStore, metrics: dict[str, Any],
                           reporter: EpisodeReporter) -> None:
    """Write the data checkpoint record that makes this episode's model checkpoints the restart point."""
    rt = cfg.runtime
    episode = metrics["episode"]
    crash_point("before_data_checkpoint", episode)  # model checkpoints written, record not yet
    record = DataCheckpoint(
        episode=episode, consumed_samples=metrics["consumed_samples"], train_iteration=metrics["iteration"],
        sample_per_episode=rt.sample_per_episode, seed=int(rt.get("seed") or 42), rng_state=capture_rng_state(),
        relay_path=metrics.get("relay_checkpoint"),
        model_checkpoints={k: v for k, v in metrics["checkpoint_paths"].items() if v},
    )
    path = store.write(record, crash_hook=lambda: crash_point("data_checkpoint_write", episode))
    if rt.max_data_ckpt_nums:
        store.prune(rt.max_data_ckpt_nums)
    create_markdown_artifact(
        key=reporter.artifact_key("data-checkpoint"),
        markdown=f"latest data checkpoint of **{rt.exp_name}**: episode {episode + 1}, trainer iteration "
                 f"{record.train_iteration}, `{path}`",
        description="where a re-run of this config resumes from",
    )
