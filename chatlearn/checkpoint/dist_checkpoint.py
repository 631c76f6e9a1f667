"""Sharded checkpoints of a model replica of several processes (FSDP2, tensor parallel): torch distributed
checkpoint (DCP), with the same guarantees as :mod:`chatlearn.checkpoint.model_checkpoint`.

Every rank writes its shards into one temporary directory next to the target; after a barrier, rank 0 writes
the manifest (SHA-256 of every file, written last) and renames the directory into place, so a checkpoint
directory is complete or absent. DCP stores each tensor with its global shape and layout, so a checkpoint
loads into any world size and any sharding, a single process included (``tests/test_parallel.py``).

Tied weights (names that are one parameter, e.g. tied input/output embeddings) are saved once, under their first
name; the manifest lists the others as ``aliases`` and loading ties them again (``chatlearn.utils.tied``).

A NaN or an infinity in any rank's shard (weights or optimizer state) is a `RunError` on every rank, naming the
model, the tensor and the rank, before anything is written (the ranks agree on it first: `agree_finite`).

A write that fails is a `RunError` naming the checkpoint and the OS error (DCP's `CheckpointException`
carries each rank's error; the first OS error among them is reported). Rank 0 removes the temporary
directory. A rank that fails before a barrier leaves the others waiting there until the group's timeout, as
any failed collective does.
"""

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from chatlearn.checkpoint.model_checkpoint import (
    MANIFEST,
    capture_rng_state,
    checkpoint_iteration,
    replace_dir,
    restore_rng_state,
    torch_save,
    verify_model_checkpoint,
    write_manifest,
)
from chatlearn.utils.faults import fault_point
from chatlearn.utils.finite import agree_finite, first_nonfinite
from chatlearn.utils.storage import os_error_of, writing
from chatlearn.utils.tied import restore_aliases, tied_aliases

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


def _world_size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], dict[str, str]]:
    """What DCP saves and loads: the model's state dict (by parameter name, sharded where the model is), each
    tied parameter under its first name only, and the optimizer's, keyed by parameter name too (torch keys a
    tied parameter's state once already); with ``{alias: kept}`` of the names left out.

    The aliases come from the module's own parameter objects (``keep_vars``), the same on every rank whatever
    its shard holds, so all ranks save and load the same names."""
    aliases = tied_aliases(model.state_dict(keep_vars=True))
    if optimizer is None:
        msd, state = get_model_state_dict(model), {}
    else:
        msd, osd = get_state_dict(model, optimizer)
        state = {"optim": osd}
    state["model"] = {k: v for k, v in msd.items() if k not in aliases}
    return state, {k: v for k, v in aliases.items() if k in msd}


def _barrier(group: Any) -> None:
    if group is not None and dist.is_initialized():
        dist.barrier(group=group)


def save_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
                 group: Any, meta: dict[str, Any] | None = None) -> str:
    """Write model and optimizer shards, scheduler and every rank's RNG state at ``path`` (all ranks call)."""
    rank = _rank(group)
    tmp = f"{path}.tmp-dcp"
    state, aliases = _state(model, optimizer)
    # no non-finite tensor in any rank's shard, agreed by all ranks before anything is written: every rank raises
    # the same RunError, none waits in a barrier for one that raised alone
    what = f"checkpoint {path} not written: {(meta or {}).get('model', 'model')}"
    agree_finite(first_nonfinite(state["model"], f"{what} weight")
                 or first_nonfinite(state.get("optim"), f"{what} optimizer state"), group)
    with writing("checkpoint", path, cleanup=tmp if rank == 0 else None):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        _barrier(group)
        try:
            dcp.save(state, checkpoint_id=tmp, process_group=group)
        except CheckpointException as exc:
            found = _os_error_in(exc)
            if found is None:
                raise
            raise found from exc
        fault_point("checkpoint_write", checkpoint_iteration(path))  # tests: the disk fills up halfway
        with open(os.path.join(tmp, f"rng_state_{rank}.json"), "w") as f:
            json.dump(capture_rng_state(), f)
        if rank == 0 and scheduler is not None:
            torch_save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
        _barrier(group)
        if rank == 0:
            write_manifest(tmp, sorted(os.listdir(tmp)), format=DCP_FORMAT, world_size=_world_size(group),
                           aliases=aliases, meta=meta or {})
            replace_dir(tmp, path)
    _barrier(group)
    return path


def _os_error_in(exc: CheckpointException) -> OSError | None:
    """The first OS error among the ranks' failures DCP gathered (each a (exception, traceback) pair)."""
    for failure in exc.failures.values():
        found = os_error_of(failure[0] if isinstance(failure, tuple) else failure)
        if found is not None:
            return found
    return None


def load_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
                 group: Any) -> dict[str, Any]:
    """Load a :func:`save_sharded` checkpoint into ``model`` (any layout) after verifying its checksums.

    Every rank restores its own RNG state when the checkpoint has one for its rank (same world size), else
    rank 0's. Returns the manifest's ``meta``.
    """
    manifest = verify_model_checkpoint(path)
    if manifest.get("format") != DCP_FORMAT:
        raise ValueError(f"{path}: not a sharded checkpoint")
    state, aliases = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path, process_group=group)
    restore_aliases(state["model"], aliases)  # one tensor again: set_state_dict loads every name of the model
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    if scheduler is not None and "scheduler.pt" in manifest["files"]:
        scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=True))
    rank = _rank(group)
    rng = os.path.join(path, f"rng_state_{rank}.json")
    if manifest.get("world_size") != _world_size(group):
        rng = os.path.join(path, "rng_state_0.json")
    with open(rng) as f:
        restore_rng_state(json.load(f))
    return manifest.get("meta", {})
