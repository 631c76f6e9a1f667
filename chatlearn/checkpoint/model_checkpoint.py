"""A model checkpoint directory: safetensors weights, optimizer/scheduler/RNG state, and a checksummed manifest.

Written into `<dir>.tmp-<pid>` and renamed into place, so a checkpoint directory either is complete or does
not exist; the manifest (written last) lists every file with its SHA-256, and loading verifies them, so a
file damaged later is reported instead of silently loaded. Nothing is unpickled on load: tensors come from
safetensors, optimizer/scheduler state from `torch.load(weights_only=True)` (tensors and plain containers
only), RNG state from JSON.

Tied weights (names of the state dict that are one tensor, e.g. tied input/output embeddings) are written once,
the other names recorded as aliases in the safetensors header (the `{alias: kept}` metadata safetensors' own
`save_model` writes, so `safetensors.torch.load_model` reads these files too), and loading puts each alias back
as the same tensor (`chatlearn.utils.tied`).

A write that fails (disk full, read-only, a file in the way) is a `RunError` naming the checkpoint and the OS
error, and the temporary directory is removed: the previous checkpoint stays the resume point. torch state goes
through `torch_save`, so a full disk is an `OSError` with its errno rather than torch's bare "file write
failed"; safetensors' own error carries the errno in its text (`chatlearn.utils.storage`).
"""

import hashlib
import json
import os
import random
import re
import shutil
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from chatlearn.utils.errors import UserError
from chatlearn.utils.faults import fault_point
from chatlearn.utils.files import fsync_file
from chatlearn.utils.finite import check_finite_tensors
from chatlearn.utils.storage import writing
from chatlearn.utils.tied import restore_aliases, separate_storage, without_aliases

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the path."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def capture_rng_state() -> dict[str, Any]:
    """Python and torch (CPU, and CUDA when present) RNG states, JSON-able."""
    state: dict[str, Any] = {"python": _jsonable(random.getstate()), "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tuplify(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def _tuplify(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    return value


def save_model_checkpoint(path: str, weights: dict[str, torch.Tensor], *, optimizer: dict | None = None,
                          scheduler: dict | None = None, rng: dict | None = None,
                          meta: dict[str, Any] | None = None) -> str:
    """Write a complete checkpoint at `path` atomically (replacing an older one there).

    A failed write raises `RunError` ("cannot write checkpoint to <path>: [Errno 28] ...") and leaves no
    temporary directory; `path` itself is untouched unless the final rename succeeded."""
    # a NaN or infinite tensor is a RunError before anything is written: a diverged model must not become the
    # checkpoint a re-run resumes from (the trainers stop NaN before the optimizer steps; this catches any path)
    check_finite_tensors(weights, f"checkpoint {path} not written: weight")
    check_finite_tensors(optimizer, f"checkpoint {path} not written: optimizer state")
    tmp = f"{path}.tmp-{os.getpid()}"
    # aliases found on the weights as given (on a GPU each name's copy to the CPU would be a tensor of its own)
    unique, aliases = without_aliases(weights)
    cpu_weights = separate_storage({k: v.detach().to("cpu").contiguous() for k, v in unique.items()})
    with writing("checkpoint", path, cleanup=tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        files: list[str] = []
        save_file(cpu_weights, os.path.join(tmp, "model.safetensors"), metadata=aliases or None)
        files.append("model.safetensors")
        fault_point("checkpoint_write", checkpoint_iteration(path))  # tests: the disk fills up halfway
        for name, obj in (("optimizer.pt", optimizer), ("scheduler.pt", scheduler)):
            if obj is not None:
                torch_save(obj, os.path.join(tmp, name))
                files.append(name)
        if rng is not None:
            with open(os.path.join(tmp, "rng_state.json"), "w") as f:
                json.dump(rng, f)
            files.append("rng_state.json")
        write_manifest(tmp, files, meta=meta or {})
        replace_dir(tmp, path)
    return path


def torch_save(obj: Any, path: str) -> None:
    """`torch.save` that reports a failed write as the OSError it is.

    Given a path, torch writes in C++ and a full disk reads "file write failed" or "unexpected pos"; given our
    file object, the OSError is raised, but torch's cleanup then raises its "unexpected pos" RuntimeError with
    the OSError only as its context. That OSError is what is raised here."""
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as exc:
            cause = exc.__context__
            if isinstance(cause, OSError) and cause.errno is not None:
                raise OSError(cause.errno, cause.strerror) from exc
            raise


def checkpoint_iteration(path: str) -> int:
    """The trainer iteration in a checkpoint directory's name (`.../iter_0000004` -> 4), -1 for other names."""
    m = re.search(r"iter_(\d+)$", os.path.normpath(path))
    return int(m.group(1)) if m else -1


def write_manifest(tmp: str, files: list[str], **fields: Any) -> None:
    """fsync ``files`` of the directory ``tmp``, then write the manifest (their SHA-256 and ``fields``) last,
    synced: a directory with a manifest is complete."""
    for name in files:
        fsync_file(os.path.join(tmp, name))
    manifest = {"format_version": FORMAT_VERSION, **{k: v for k, v in fields.items() if k != "meta"},
                "files": {n: sha256_file(os.path.join(tmp, n)) for n in files}, "meta": fields.get("meta", {})}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def replace_dir(tmp: str, path: str) -> None:
    """Move the finished directory ``tmp`` to ``path``, replacing what is there, so ``path`` is never half
    written (the old one is renamed away first and removed after)."""
    if os.path.exists(path):
        old = f"{path}.old-{os.getpid()}"
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except OSError:
            os.replace(old, path)  # the previous one stays where it was
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def verify_model_checkpoint(path: str) -> dict[str, Any]:
    """The manifest of a complete, uncorrupted checkpoint; `CheckpointError` otherwise."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST})")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path}: unreadable manifest: {exc}") from exc
    for name, digest in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing (listed in the manifest)")
        if sha256_file(file) != digest:
            raise CheckpointError(f"{file}: checksum mismatch, the file is corrupt")
    return manifest


def load_model_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Verify and read a checkpoint: {'weights', 'optimizer', 'scheduler', 'rng', 'meta'} (absent parts None)."""
    manifest = verify_model_checkpoint(path)
    files = manifest["files"]
    out: dict[str, Any] = {"meta": manifest.get("meta", {})}
    out["weights"] = load_weights(os.path.join(path, "model.safetensors"), map_location)
    for key, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt")):
        out[key] = torch.load(os.path.join(path, name), map_location=map_location, weights_only=True) \
            if name in files else None
    if "rng_state.json" in files:
        with open(os.path.join(path, "rng_state.json")) as f:
            out["rng"] = json.load(f)
    else:
        out["rng"] = None
    return out


def load_weights(path: str, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, each alias of its header (see the module docstring) the very tensor of the
    name it aliases. Header entries that are not aliases (another writer's notes) are left alone."""
    weights = load_file(path, device=str(map_location))
    with safe_open(path, "pt") as f:
        header = f.metadata() or {}
    aliases = {k: v for k, v in header.items() if k not in weights and v in weights}
    return restore_aliases(weights, aliases)
