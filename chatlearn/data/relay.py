"""ChatLearn's relay buffer: a window over the last episodes whose hook decides what the trainers see.

Semantics (ChatLearn v1.0.x, `runtime.max_relay_episode` / `runtime.relay_episode_offset`):

* `max_relay_episode == 0` disables relay: every episode trains on its own samples ("stream mode") and the
  hook, if any, is ignored.
* Otherwise (N > 0 keeps the last N episodes, -1 or any negative keeps them all, as ChatLearn), an episode with
  `episode_id >= relay_episode_offset` is appended to the window, the oldest episodes are dropped while the
  window is too long, and `relay_sample_fn(window)` (oldest first) returns the whole training set of the
  episode. Earlier episodes train in stream mode and are never stored.

Users name hooks in configs as "package.module:function" (`load_hook`); `concat_all` and `latest_only` are
ready-made ones. The window is checkpointed without pickle (`RelayBuffer.save` / `load`): tensors go to
`relay.safetensors`, everything else to `relay.json`, both stamped with one checkpoint id so a torn save is
detected instead of loading a mix of two saves.
"""

import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from chatlearn.utils.errors import RunError
from chatlearn.utils.files import fsync_dir, fsync_file
from chatlearn.utils.finite import one_line
from chatlearn.utils.imports import import_callable

FORMAT_VERSION = 1

_JSON_SCALARS = (type(None), bool, int, float, str)


@dataclass
class EpisodeRelayBuffer:
    """One kept episode: its id and its per-sample dicts (what ChatLearn hands to relay hooks)."""

    episode_id: int
    buffer: list[dict] = field(default_factory=list)


RelayHook = Callable[[list[EpisodeRelayBuffer]], list[dict]]


class RelayCheckpointError(RuntimeError):
    """A relay checkpoint on disk is unreadable or torn (its two files come from different saves)."""


class RelayHookError(RunError, TypeError):
    """The relay hook raised or returned something that is not a list of sample dicts. A RunError (the CLI
    prints one line naming the hook; the stage adds the episode), and a TypeError as the wrong return type has
    always been."""


def _hook_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}:{name}" if module else str(name)


class RelayBuffer:
    """The episode window and its hook; `add_episode` returns the training set, None meaning stream mode."""

    def __init__(self, max_relay_episode: int, relay_episode_offset: int, relay_sample_fn: RelayHook | None) -> None:
        if isinstance(max_relay_episode, bool) or not isinstance(max_relay_episode, int):
            raise ValueError(
                f"runtime.max_relay_episode must be an int (negative: keep all, 0: off, N: the last N), "
                f"got {max_relay_episode!r}"
            )
        if isinstance(relay_episode_offset, bool) or not isinstance(relay_episode_offset, int):
            raise ValueError(f"runtime.relay_episode_offset must be an int, got {relay_episode_offset!r}")
        if max_relay_episode != 0 and relay_sample_fn is None:
            raise ValueError(
                f"runtime.max_relay_episode is set ({max_relay_episode}) but no relay_sample_fn was given; ChatLearn "
                "has no default relay function. Name one, e.g. 'chatlearn.data.relay:concat_all', or set "
                "max_relay_episode to 0."
            )
        if relay_sample_fn is not None and not callable(relay_sample_fn):
            raise ValueError(f"relay_sample_fn must be callable, got {relay_sample_fn!r}")
        self.max_relay_episode = max_relay_episode
        self.relay_episode_offset = relay_episode_offset
        self.relay_sample_fn = relay_sample_fn
        self._buffers: list[EpisodeRelayBuffer] = []

    @property
    def enabled(self) -> bool:
        """Relay is on for any non-zero max_relay_episode (-1 = unbounded window)."""
        return self.max_relay_episode != 0

    def takes(self, episode_id: int) -> bool:
        """Whether this episode goes through the relay (else it trains in stream mode on its own samples)."""
        return self.enabled and episode_id >= self.relay_episode_offset

    @property
    def episodes(self) -> list[int]:
        """Ids of the kept episodes, oldest first."""
        return [b.episode_id for b in self._buffers]

    @property
    def buffers(self) -> list[EpisodeRelayBuffer]:
        """The kept episodes, oldest first (a copy of the list; the buffers themselves are shared)."""
        return list(self._buffers)

    def _trim(self) -> None:
        if self.max_relay_episode == 0:
            self._buffers = []
        elif self.max_relay_episode > 0 and len(self._buffers) > self.max_relay_episode:
            self._buffers = self._buffers[-self.max_relay_episode :]

    def add_episode(self, episode_id: int, samples: list[dict]) -> list[dict] | None:
        """Store the episode and return the hook's training set, or None when the episode trains in stream mode."""
        if not self.takes(episode_id):
            return None
        for i, sample in enumerate(samples):
            if not isinstance(sample, dict):
                raise TypeError(f"episode {episode_id} sample {i} is a {type(sample).__name__}, expected a dict")
        self._buffers.append(EpisodeRelayBuffer(episode_id, list(samples)))
        self._trim()
        assert self.relay_sample_fn is not None  # guaranteed by __init__ when enabled
        name = _hook_name(self.relay_sample_fn)
        try:
            result = self.relay_sample_fn(list(self._buffers))
        except Exception as exc:  # user code: one line naming the hook; its traceback goes to the run's log
            raise RelayHookError(f"relay hook {name} raised {type(exc).__name__}: {one_line(exc)} (episodes "
                                 f"{self.episodes} in the window)") from exc
        if not isinstance(result, list):
            raise RelayHookError(f"relay hook {name} must return a list of sample dicts, got "
                                 f"{type(result).__name__}")
        for i, sample in enumerate(result):
            if not isinstance(sample, dict):
                raise RelayHookError(f"relay hook {name} must return a list of sample dicts; item {i} is a "
                                     f"{type(sample).__name__}")
        return result

    # ------------------------------------------------------------------ checkpointing

    def save(self, directory: str) -> None:
        """Write relay.safetensors + relay.json atomically (`save_sample_sets`); no pickle involved."""
        save_sample_sets(directory, [(b.episode_id, b.buffer) for b in self._buffers],
                         {"max_relay_episode": self.max_relay_episode,
                          "relay_episode_offset": self.relay_episode_offset})

    def load(self, directory: str) -> None:
        """Restore the window saved by `save`; the current config wins (window trimmed to it)."""
        sets, _ = load_sample_sets(directory)
        buffers = [EpisodeRelayBuffer(episode_id, samples) for episode_id, samples in sets]
        # Current config wins: the window only holds episodes the current settings would have stored.
        self._buffers = [b for b in buffers if b.episode_id >= self.relay_episode_offset]
        self._trim()


def save_sample_sets(directory: str, sets: list[tuple[int, list[dict]]], extra: dict[str, Any],
                     stem: str = "relay") -> None:
    """Write numbered lists of sample dicts to ``<stem>.safetensors`` (tensors) + ``<stem>.json`` (everything
    else, JSON values only, and ``extra``), atomically (temp names, then os.replace); no pickle involved."""
    ckpt_id = uuid.uuid4().hex
    tensors: dict[str, torch.Tensor] = {}
    sets_meta = []
    for set_id, samples in sets:
        samples_meta = []
        for s_idx, sample in enumerate(samples):
            fields_meta = []
            for name, value in sample.items():
                if not isinstance(name, str):
                    raise TypeError(f"{stem} checkpoint: episode {set_id} sample {s_idx} has a non-str key {name!r}")
                if isinstance(value, torch.Tensor):
                    key = f"e{set_id}/s{s_idx}/{name}"
                    if key in tensors:
                        raise ValueError(f"{stem} checkpoint: episode {set_id} is kept twice")
                    tensors[key] = value.detach().to("cpu").contiguous().clone()
                    fields_meta.append({"name": name, "tensor": key, "dtype": str(value.dtype).removeprefix("torch."),
                                        "scalar": value.dim() == 0})
                else:
                    _check_jsonable(value, f"episode {set_id} sample {s_idx} field {name!r}")
                    fields_meta.append({"name": name, "value": value})
            samples_meta.append(fields_meta)
        sets_meta.append({"episode_id": set_id, "samples": samples_meta})
    meta = {"format": FORMAT_VERSION, "checkpoint_id": ckpt_id, **extra, "episodes": sets_meta}

    tensors_file, meta_file = f"{stem}.safetensors", f"{stem}.json"
    os.makedirs(directory, exist_ok=True)
    final_tensors = os.path.join(directory, tensors_file)
    final_meta = os.path.join(directory, meta_file)
    tmp_tensors = os.path.join(directory, f".{tensors_file}.{ckpt_id}.tmp")
    tmp_meta = os.path.join(directory, f".{meta_file}.{ckpt_id}.tmp")
    try:
        save_file(tensors, tmp_tensors, metadata={"checkpoint_id": ckpt_id})
        fsync_file(tmp_tensors)
        with open(tmp_meta, "w", encoding="utf-8") as f:
            json.dump(meta, f, allow_nan=True)
            f.flush()
            os.fsync(f.fileno())
        # Tensors first, metadata last: the JSON file is the commit point; a torn save leaves two files whose
        # checkpoint ids differ, which `load_sample_sets` reports instead of mixing two saves.
        os.replace(tmp_tensors, final_tensors)
        os.replace(tmp_meta, final_meta)
        fsync_dir(directory)
    finally:
        for tmp in (tmp_tensors, tmp_meta):
            if os.path.exists(tmp):
                os.remove(tmp)


def load_sample_sets(directory: str, stem: str = "relay") -> tuple[list[tuple[int, list[dict]]], dict[str, Any]]:
    """What `save_sample_sets` wrote: the numbered sample lists and the JSON metadata."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{stem} checkpoint directory not found: {directory}")
    tensors_file, meta_file = f"{stem}.safetensors", f"{stem}.json"
    meta_path = os.path.join(directory, meta_file)
    tensors_path = os.path.join(directory, tensors_file)
    for path in (meta_path, tensors_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{stem} checkpoint file not found: {path}")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise RelayCheckpointError(f"{stem} checkpoint {meta_path} is unreadable: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise RelayCheckpointError(f"{stem} checkpoint {meta_path} has an unknown format")
    try:
        with safe_open(tensors_path, framework="pt") as f:
            tensor_id = (f.metadata() or {}).get("checkpoint_id")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise RelayCheckpointError(f"{stem} checkpoint {tensors_path} is unreadable: {exc}") from exc
    if tensor_id != meta.get("checkpoint_id"):
        raise RelayCheckpointError(
            f"{stem} checkpoint in {directory} is torn: {tensors_file} and {meta_file} come from different saves "
            "(a save was interrupted); refusing to load a mix"
        )
    sets = []
    try:
        for ep in meta["episodes"]:
            samples = []
            for fields_meta in ep["samples"]:
                sample: dict[str, Any] = {}
                for fm in fields_meta:
                    if "tensor" in fm:
                        t = tensors[fm["tensor"]]
                        dtype = getattr(torch, fm["dtype"], None)
                        if not isinstance(dtype, torch.dtype):
                            raise TypeError(f"unknown dtype {fm['dtype']!r}")
                        if t.dtype != dtype:
                            t = t.to(dtype)
                        if fm["scalar"] and t.dim() != 0:
                            t = t.reshape(())
                        sample[fm["name"]] = t
                    else:
                        sample[fm["name"]] = fm["value"]
                samples.append(sample)
            sets.append((int(ep["episode_id"]), samples))
    except (KeyError, TypeError, AttributeError, RuntimeError) as exc:
        raise RelayCheckpointError(f"{stem} checkpoint in {directory} is inconsistent: {exc!r}") from exc
    return sets, meta


def _check_jsonable(value: Any, where: str) -> None:
    """Only values that come back from JSON unchanged (no tuples, no non-str dict keys, no objects)."""
    if type(value) in _JSON_SCALARS:
        return
    if type(value) is list:
        for i, v in enumerate(value):
            _check_jsonable(v, f"{where}[{i}]")
        return
    if type(value) is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise TypeError(f"relay checkpoint: {where} has a non-str dict key {k!r}; only JSON values are saved")
            _check_jsonable(v, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"relay checkpoint: {where} is a {type(value).__name__}, which is neither a torch.Tensor nor a JSON value "
        "(None, bool, int, float, str, list, dict with str keys); convert it before it reaches the relay buffer"
    )


def load_hook(spec: str) -> Callable:
    """Import a hook named in a config as "package.module:function" (attribute path may be dotted)."""
    return import_callable(spec)


def concat_all(buffers: list[EpisodeRelayBuffer]) -> list[dict]:
    """Every sample of every kept episode, oldest first (ChatLearn's relay test hook)."""
    return [sample for buf in buffers for sample in buf.buffer]


def latest_only(buffers: list[EpisodeRelayBuffer]) -> list[dict]:
    """The newest episode's samples: relay used as a whole-episode post-processing step (ChatLearn's GRPO)."""
    return list(buffers[-1].buffer) if buffers else []


__all__ = [
    "EpisodeRelayBuffer",
    "RelayBuffer",
    "RelayCheckpointError",
    "RelayHookError",
    "RelayHook",
    "concat_all",
    "latest_only",
    "load_hook",
]
