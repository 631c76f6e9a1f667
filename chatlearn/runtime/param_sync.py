"""Parameter sync over a collective group: a trainer's tensors to its inference copies, bucketed or per tensor.

The first piece of issue 9 (collective sync): the transfer itself, independent of how the groups are built.
The sender and every receiver agree on one bucket plan from the tensors' names, shapes and dtypes
(:func:`plan_buckets`), so nothing but the data crosses the wire. With ``coalesce`` each bucket is one flat
buffer of at most ``max_bytes`` (one tensor larger than that travels alone), allocated once per sync and
reused for every bucket of its dtype, so the peak extra memory is one bucket (``../shared/reference/
torch_dist_cpu.md``: freshly allocated buckets were the slowest choice on CPU; persistent ones near the
link's limit). Receivers copy into their own tensors in place, so a model's storage never changes.
"""

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TensorSpec", "broadcast_tensors", "plan_buckets", "specs_of"]

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """(name, shape, dtype) of each tensor, in the mapping's order (both sides must list the same)."""
    return [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


def _nbytes(spec: TensorSpec) -> int:
    numel = 1
    for d in spec[1]:
        numel *= d
    return numel * torch.empty((), dtype=spec[2]).element_size()


def plan_buckets(specs: list[TensorSpec], max_bytes: int) -> list[list[int]]:
    """Consecutive runs of same-dtype tensors of at most ``max_bytes`` each, as indices into ``specs``.

    A tensor larger than ``max_bytes`` is a bucket of its own (it is sent as it is, without a copy). The plan
    depends only on ``specs``, so every rank computes the same one.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, spec in enumerate(specs):
        n = _nbytes(spec)
        if current and (size + n > max_bytes or specs[current[0]][2] != spec[2]):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def broadcast_tensors(tensors: Mapping[str, torch.Tensor], src: int, group: Any = None, *, coalesce: bool = True,
                      max_bytes: int = 100 * 2**20) -> dict[str, Any]:
    """Broadcast ``tensors`` from global rank ``src`` to every rank of ``group``, in place on the receivers.

    Every rank passes its own tensors of the same names, shapes and dtypes (the sender its weights, the
    receivers the tensors to overwrite). Returns what was sent: number of collectives, bytes, and the largest
    staging buffer in bytes (0 without coalescing).
    """
    specs = specs_of(tensors)
    values = list(tensors.values())
    sender = dist.get_rank() == src
    calls, largest = 0, 0
    plan = plan_buckets(specs, max_bytes) if coalesce else [[i] for i in range(len(specs))]
    staging: dict[torch.dtype, torch.Tensor] = {}
    for bucket in plan:
        if len(bucket) == 1:  # alone (or not coalescing): straight from and into the tensor
            t = values[bucket[0]]
            buf = t if t.is_contiguous() else t.contiguous()
            dist.broadcast(buf, src=src, group=group)
            if buf is not t and not sender:
                t.copy_(buf)
            calls += 1
            continue
        dtype = specs[bucket[0]][2]
        numel = sum(values[i].numel() for i in bucket)
        flat = staging.get(dtype)
        if flat is None or flat.numel() < numel:
            flat = staging[dtype] = torch.empty(numel, dtype=dtype, device=values[bucket[0]].device)
        view = flat[:numel]
        largest = max(largest, view.numel() * view.element_size())
        if sender:
            offset = 0
            for i in bucket:
                n = values[i].numel()
                view[offset : offset + n].copy_(values[i].reshape(-1))
                offset += n
        dist.broadcast(view, src=src, group=group)
        if not sender:
            offset = 0
            for i in bucket:
                n = values[i].numel()
                values[i].copy_(view[offset : offset + n].view_as(values[i]))
                offset += n
        calls += 1
    return {"collectives": calls, "bytes": sum(_nbytes(s) for s in specs), "staging_bytes": largest}
