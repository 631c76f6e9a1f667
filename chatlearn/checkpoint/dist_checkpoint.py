"""Sharded checkpoints of a model replica of several processes (FSDP2, tensor parallel): torch distributed
checkpoint (DCP), with the same guarantees as :mod:`chatlearn.checkpoint.model_checkpoint`.

Every rank writes its shards into one temporary directory next to the target; after a barrier, rank 0 writes
the manifest (SHA-256 of every file, written last) and renames the directory into place, so a checkpoint
directory is complete or absent. DCP stores each tensor with its global shape and layout, so a checkpoint
loads into any world size and any sharding, a single process included (``tests/test_parallel.py``).
"""

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from chatlearn.checkpoint.model_checkpoint import (
    FORMAT_VERSION,
    MANIFEST,
    capture_rng_state,
    restore_rng_state,
    sha256_file,
    verify_model_checkpoint,
)
from chatlearn.utils.files import fsync_file

DCP_FORMAT = "torch-dcp"


def is_sharded_checkpoint(path: str) -> bool:
    """Whether the checkpoint at ``path`` was written by :func:`save_sharded`."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f).get("format") == DCP_FORMAT
    except (OSError, ValueError):
        return False


def _rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _barrier(group: Any) -> None:
    if group is not None and dist.is_initialized():
        dist.barrier(group=group)


def save_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
                 group: Any, meta: dict[str, Any] | None = None) -> str:
    """Write model and optimizer shards, scheduler and every rank's RNG state at ``path`` (all ranks call)."""
    rank = _rank(group)
    tmp = f"{path}.tmp-dcp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(group)
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=tmp, process_group=group)
    with open(os.path.join(tmp, f"rng_state_{rank}.json"), "w") as f:
        json.dump(capture_rng_state(), f)
    if rank == 0 and scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    _barrier(group)
    if rank == 0:
        files = sorted(n for n in os.listdir(tmp))
        for name in files:
            fsync_file(os.path.join(tmp, name))
        manifest = {"format_version": FORMAT_VERSION, "format": DCP_FORMAT,
                    "files": {n: sha256_file(os.path.join(tmp, n)) for n in files},
                    "world_size": dist.get_world_size(group) if group is not None else 1, "meta": meta or {}}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            old = f"{path}.old-{os.getpid()}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    _barrier(group)
    return path


def load_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
                 group: Any) -> dict[str, Any]:
    """Load a :func:`save_sharded` checkpoint into ``model`` (any layout) after verifying its checksums.

    Every rank restores its own RNG state when the checkpoint has one for its rank (same world size), else
    rank 0's. Returns the manifest's ``meta``.
    """
    manifest = verify_model_checkpoint(path)
    if manifest.get("format") != DCP_FORMAT:
        raise ValueError(f"{path}: not a sharded checkpoint")
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path, process_group=group)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    if scheduler is not None and "scheduler.pt" in manifest["files"]:
        scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=True))
    rank = _rank(group)
    rng = os.path.join(path, f"rng_state_{rank}.json")
    if manifest.get("world_size") != (dist.get_world_size(group) if group is not None else 1):
        rng = os.path.join(path, "rng_state_0.json")
    with open(rng) as f:
        restore_rng_state(json.load(f))
    return manifest.get("meta", {})
