"""Where a run resumes from, and the record that makes an episode's checkpoints the restart point.

The train flow only says when: before the actors exist it asks :func:`resume_point` (so a missing or bad
``load_data_checkpoint_iteration`` fails before anything starts), after each checkpointed episode it calls
:func:`commit_data_checkpoint`. What is saved and restored, and in which order, lives here.
"""

import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

from chatlearn.checkpoint.data_checkpoint import DataCheckpoint, DataCheckpointStore
from chatlearn.checkpoint.model_checkpoint import CheckpointError, capture_rng_state
from chatlearn.config import ChatLearnConfig
from chatlearn.utils.faults import crash_point

__all__ = [
    "checkpoint_dirs",
    "commit_data_checkpoint",
    "data_checkpoint_dir",
    "models_to_checkpoint",
    "resume_point",
]

logger = logging.getLogger("chatlearn")


def data_checkpoint_dir(cfg: ChatLearnConfig) -> str:
    """`runtime.data_checkpoint_path`, by default `run_dir/data_checkpoints`."""
    rt = cfg.runtime
    return os.path.abspath(rt.data_checkpoint_path or os.path.join(rt.run_dir, "data_checkpoints"))


def checkpoint_dirs(cfg: ChatLearnConfig) -> list[tuple[str, str]]:
    """(directory, what) of every directory this config's checkpoints go to: the
    model checkpoints' `run_dir/checkpoints` (`BaseModule.checkpoint_dir` puts each model's under it) and the
    data checkpoint directory. The run checks them up front (`chatlearn.runtime.records.run_lock.lock_run_dir`), so a
    path that is a file or read-only fails before anything starts rather than at the first checkpoint. Every
    training run writes them: the last episode always checkpoints (`chatlearn.runtime.schedule.checkpoint_due`)."""
    rt = cfg.runtime
    return [(os.path.join(rt.run_dir, "checkpoints"), "model checkpoint directory"),
            (data_checkpoint_dir(cfg), "data checkpoint directory")]


def resume_point(cfg: ChatLearnConfig) -> DataCheckpoint | None:
    """The data checkpoint a run of this config resumes from; None for a fresh start.

    `enable_resume_training: false` starts fresh; `load_data_checkpoint_iteration` picks a record (an error
    listing the available ones if it is missing or bad); otherwise the newest record that passes its checks,
    bad ones reported and skipped.
    """
    rt = cfg.runtime
    if not rt.enable_resume_training:
        return None
    store = DataCheckpointStore(data_checkpoint_dir(cfg))
    it = rt.load_data_checkpoint_iteration
    if it is None:
        record = store.latest_good()
    else:
        try:
            record = store.read(it)
        except CheckpointError as exc:
            raise CheckpointError(f"runtime.load_data_checkpoint_iteration={it}: {exc}; "
                                  f"available: {store.iterations()}") from exc
    if record is not None and record.sample_per_episode != rt.sample_per_episode:
        logger.warning("resuming with sample_per_episode=%d, the checkpoint was written with %d",
                       rt.sample_per_episode, record.sample_per_episode)
    return record


def models_to_checkpoint(cfg: ChatLearnConfig, trainers: Sequence[str], sync: Iterable[tuple[str, str]]) -> list[str]:
    """Trainers, plus inference copies that may lag their trainer (sync_frequency != 1): those cannot be
    rebuilt from the trainer's weights on resume."""
    return list(trainers) + [dst for _, dst in sync if cfg.models[dst].sync_frequency != 1]


def commit_data_checkpoint(cfg: ChatLearnConfig, store: DataCheckpointStore, metrics: dict[str, Any]) -> str:
    """Write the record that makes this episode's model checkpoints the restart point; returns its path.

    Called after the episode's model checkpoints are complete, so a crash before it only costs the episode.
    """
    rt = cfg.runtime
    episode = metrics["episode"]
    crash_point("before_data_checkpoint", episode)  # model checkpoints written, record not yet
    record = DataCheckpoint(
        episode=episode, consumed_samples=metrics["consumed_samples"], train_iteration=metrics["iteration"],
        sample_per_episode=rt.sample_per_episode, seed=rt.seed, rng_state=capture_rng_state(),
        relay_path=metrics.get("relay_checkpoint"),
        model_checkpoints={k: v for k, v in metrics["checkpoint_paths"].items() if v},
        policy_versions=metrics.get("policy_versions", {}),
        partial_rollouts=metrics.get("partial_rollouts"),
    )
    path = store.write(record, crash_hook=lambda: crash_point("data_checkpoint_write", episode))
    if rt.max_data_ckpt_nums:
        store.prune(rt.max_data_ckpt_nums)
    return path
