"""A run directory keeps its run: the resolved config it was started with, how far it got, and what changed.

``run_dir/run_config.json`` is written when a run starts and updated at each data checkpoint and at the end.
A later start in the same directory (`inspect_run_dir`, before anything starts) is one of:

- **complete**: the run already trained ``runtime.num_episode`` episodes (the last episode always leaves a
  resumable checkpoint): nothing to do; a larger ``num_episode`` continues it;
- **a continuation**: the config is the same in everything that changes results, or differs and the user
  said so (``runtime.resume_with_changes`` / ``--resume-with-changes``; the record notes the fields);
- **refused**: the config differs in something that changes results (data, models, algorithm, seed,
  optimizer, ...): a `RunDirConflict` naming the fields and the ways out. Nothing is overwritten;
- **a start over**, asked for by ``runtime.enable_resume_training: false`` (ChatLearn's switch), said on the
  terminal rather than done silently; or a start with another config where the run committed no episode yet
  (it stopped before its first checkpoint: there is nothing of it to keep).

What "changes results" means is everything but `FREE_FIELDS`: how long the run goes, how often it saves,
evaluates and logs, where it runs and on what resources, how fast it syncs. The data files count by their
contents too (SHA-256), not only their paths.
"""

import fnmatch
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from chatlearn.config import ChatLearnConfig
from chatlearn.config.model import PARALLEL_KEYS
from chatlearn.utils.errors import RunError
from chatlearn.utils.storage import writing

RECORD = "run_config.json"
FORMAT_VERSION = 1

# Fields a run may change between starts without changing what it trains (fnmatch patterns on dotted paths).
FREE_FIELDS = (
    "runtime_env.*", "deployment.*",
    # length of the run, saving, eval and logging
    "runtime.num_episode", "runtime.save_episode_interval", "runtime.max_data_ckpt_nums", "runtime.log_interval",
    "runtime.eval_episode_interval", "runtime.enable_eval_before_training", "runtime.eval_data_path",
    "runtime.eval_post_process_fn", "runtime.log_args_dict.*", "runtime.enable_resume_training",
    "runtime.load_data_checkpoint_iteration",
    "runtime.resume_with_changes", "runtime.data_checkpoint_path", "runtime.output_dir", "runtime.exp_name",
    # diagnostics, fault handling, speed of setup and sync
    "runtime.debug", "runtime.trace_samples", "runtime.stall_factor", "runtime.alerts", "runtime.nsys",
    "runtime.profiler_dir", "runtime.max_restarts", "runtime.stage_timeout_s",
    "runtime.concurrent_setup", "runtime.concurrent_comm", "runtime.param_sync_comm_type",
    "runtime.param_sync_max_workers", "runtime.coalesce_param", "runtime.coalesced_buffer_mb",
    "runtime.bucket_size_mb_in_memory_manager", "runtime.free_sync_collective_group",
    # where the models run and on what (a checkpoint loads into any layout), generation batching (per-sample
    # sampling seeds: a response does not depend on its batch)
    "runtime.cpu_schedule_strategy", "runtime.colocation", "runtime.generation_batch_size",
    "models.*.num_gpu", "models.*.num_device", "models.*.num_cpu", "models.*.gpu_per_process",
    "models.*.cpu_per_process", "models.*.num_replica", "models.*.tensor_model_parallel_size",
    "models.*.pipeline_model_parallel_size", "models.*.zero_size", "models.*.generation_batch_size",
    "models.*.offload_optimizer_states", "models.*.offload_weights", "models.*.free_grad_buffers",
    "models.*.free_memory", "models.*.config_dir", "models.*.model_config_file", "models.*.model_type",
    *(f"models.*.args_dict.{key}" for key in PARALLEL_KEYS),
)


class RunDirConflict(RunError):
    """A start that would overwrite or silently change an earlier run in its run directory."""


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value
    return out


def _free(path: str) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in FREE_FIELDS)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime only key the cache
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def data_digests(cfg: ChatLearnConfig) -> dict[str, str]:
    """SHA-256 of each training data file, by its absolute path."""
    paths = cfg.runtime.data_path
    out = {}
    for path in paths if isinstance(paths, list) else [paths] if paths else []:
        full = os.path.abspath(path)
        try:
            st = os.stat(full)
            out[full] = _sha256(full, st.st_size, st.st_mtime_ns)
        except OSError as exc:
            out[full] = f"unreadable: {exc.strerror}"
    return out


def results_view(cfg: ChatLearnConfig) -> dict[str, Any]:
    """Everything of the config that changes what the run trains, by dotted path, with the data contents."""
    flat = _flatten(cfg.model_dump(mode="json"), "", {})
    view = {k: v for k, v in flat.items() if not _free(k)}
    for path, digest in data_digests(cfg).items():
        view[f"runtime.data_path contents ({path})"] = digest
    return view


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """``{path: [before, after]}`` for every path whose value differs (missing: None)."""
    return {k: [before.get(k), after.get(k)] for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)}


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def read_record(run_dir: str) -> dict[str, Any] | None:
    """The run directory's record, None when there is none (a new run directory)."""
    path = os.path.join(run_dir, RECORD)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RunDirConflict(f"{path}: unreadable run record ({exc}); move it away to start a new run here") from exc
    if not isinstance(record, dict) or not isinstance(record.get("view"), dict):
        raise RunDirConflict(f"{path}: not a run record; move it away to start a new run here")
    return record


@dataclass
class RunDirState:
    """What a start finds in its run directory (see the module docstring)."""

    record: dict[str, Any] | None
    changes: dict[str, list[Any]] = field(default_factory=dict)
    complete: bool = False
    start_over: str | None = None  # why the run starts over, replacing the record (None: it does not)

    def complete_message(self, cfg: ChatLearnConfig) -> str:
        rec = self.record or {}
        done = rec.get("episodes_done", 0)
        final = f" (final policy: {rec['final_policy']})" if rec.get("final_policy") else ""
        return (f"{cfg.runtime.run_dir} is complete: it trained {done} episode{'s' if done != 1 else ''}, "
                f"runtime.num_episode is {cfg.runtime.num_episode}{final}; nothing to do. A larger "
                "runtime.num_episode continues it; another runtime.exp_name starts a new run")


def inspect_run_dir(cfg: ChatLearnConfig) -> RunDirState:
    """What starting `cfg` in its run directory would do; `RunDirConflict` when the config differs from the
    run's in something that changes results and the user did not say to go on with it."""
    rt = cfg.runtime
    record = read_record(rt.run_dir)
    if record is None:
        return RunDirState(None)
    if not rt.enable_resume_training:
        return RunDirState(record, start_over="runtime.enable_resume_training: false")
    changes = config_changes(record["view"], results_view(cfg))
    if changes and not rt.resume_with_changes and not record.get("episodes_done"):
        return RunDirState(record, changes, start_over="another config, and the run committed no episode")
    if changes and not rt.resume_with_changes:
        listed = "; ".join(f"{k}: {_shown(a)} in the run, {_shown(b)} now" for k, (a, b) in changes.items())
        raise RunDirConflict(
            f"{rt.run_dir} holds a run started with another config, which differs in {len(changes)} field"
            f"{'s' if len(changes) != 1 else ''} that change results: {listed}. To keep both, give this one "
            "another runtime.exp_name (or runtime.output_dir); to continue that run with the new values, add "
            "--resume-with-changes (runtime.resume_with_changes=true), and its run_config.json records the change")
    complete = rt.load_data_checkpoint_iteration is None and record.get("episodes_done", 0) >= rt.num_episode
    return RunDirState(record, changes, complete=complete)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _write(run_dir: str, record: dict[str, Any]) -> None:
    path = os.path.join(run_dir, RECORD)
    tmp = f"{path}.tmp-{os.getpid()}"
    with writing("the run record", path, cleanup=tmp):
        os.makedirs(run_dir, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, default=str)
        os.replace(tmp, path)  # never half a record


def record_start(cfg: ChatLearnConfig, state: RunDirState) -> dict[str, Any]:
    """Write the record of a start: a new run (or one started over) records its config; a continuation keeps
    the run's record and notes the fields it changed."""
    rt = cfg.runtime
    if state.record is None or state.start_over:
        history = (state.record or {}).get("history", [])
        if state.start_over:
            history = [*history, {"at": _now(), "event": f"started over ({state.start_over})",
                                  "replaced": {"episodes_done": state.record.get("episodes_done", 0),
                                               "changes": state.changes}}]
        record = {"format_version": FORMAT_VERSION, "started_at": _now(), "status": "running", "episodes_done": 0,
                  "num_episode": rt.num_episode, "final_policy": None,
                  "config": cfg.model_dump(mode="json"), "view": results_view(cfg),
                  "history": [*history, {"at": _now(), "event": "started"}]}
    else:
        record = dict(state.record)
        event: dict[str, Any] = {"at": _now(), "event": "resumed"}
        if state.changes:
            event = {"at": _now(), "event": "resumed with changes (runtime.resume_with_changes)",
                     "changes": state.changes}
            record["config"], record["view"] = cfg.model_dump(mode="json"), results_view(cfg)
        record.update(status="running", num_episode=rt.num_episode, history=[*record.get("history", []), event])
    _write(rt.run_dir, record)
    return record


def record_progress(cfg: ChatLearnConfig, episodes_done: int, final_policy: str | None = None,
                    finished: bool = False) -> None:
    """After a data checkpoint (``episodes_done`` committed) and at the end (``finished``)."""
    record = read_record(cfg.runtime.run_dir)
    if record is None:
        return
    record["episodes_done"] = episodes_done
    if finished:
        record.update(status="finished", final_policy=final_policy)
        record["history"] = [*record.get("history", []), {"at": _now(), "event": "finished",
                                                          "episodes_done": episodes_done}]
    _write(cfg.runtime.run_dir, record)
