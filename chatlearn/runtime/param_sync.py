"""Parameter sync over a collective group: a trainer's weights to its inference copies, bit for bit.

One sync group joins the trainer's rank 0 (group rank 0) with every process of the inference copies that is
not the trainer's own process; the trainer's other ranks take part through their own torch world (they gather
sharded weights with rank 0). Every member walks the same bucket plan (:func:`plan_buckets`, computed from the
tensors' names, global shapes and dtypes), so nothing but the data crosses the wire:

* the trainer gathers each tensor whole (``DTensor.full_tensor()`` for FSDP2/TP shards: a collective of its
  ranks), packs a bucket of at most ``max_bytes`` into a staging buffer allocated once per sync and reused (the
  peak extra memory is one bucket; a tensor larger than that travels alone, unstaged) and sends it by
  ``broadcast`` or ``p2p`` (one ``send`` per receiver, all in flight at once);
* a receiver copies each tensor into its own: in place, whole for a plain tensor, its slice for a DTensor (a
  differently sharded inference model: TP of another degree), so a model's storage never changes;
* a receiver in the trainer's own process (colocated) copies from the gathered tensor, no communication.

Groups between separate torch worlds are *stateless* (a TCPStore plus a raw ``ProcessGroupGloo``/``NCCL``, see
``../shared/reference/torch_dist_cpu.md`` §1), created with a timeout: a dead or stuck peer becomes an error
naming the group and the rank within it, never a hang.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from chatlearn.models.parallel import full_tensor, load_full_tensor

__all__ = ["SyncError", "SyncGroup", "TensorSpec", "broadcast_tensors", "digest", "plan_buckets", "specs_of",
           "transfer"]

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


class SyncError(RuntimeError):
    """A collective of a sync group failed or timed out; the message names the group, the rank and the peers."""


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """(name, global shape, dtype) of each tensor, in the mapping's order (both sides must list the same)."""
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


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (the debug check compares the trainer's and every receiver's)."""
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class SyncGroup:
    """A sync group: ``rank`` of ``size``, rank 0 sends. ``pg`` is a raw ProcessGroup (a stateless group between
    torch worlds) or a ``torch.distributed`` group (``raw=False``); ``names`` label the ranks in errors."""

    def __init__(self, key: str, pg: Any, rank: int, size: int, names: list[str] | None = None, raw: bool = True,
                 timeout_s: float = 300.0):
        self.key, self.pg, self.rank, self.size, self.raw = key, pg, rank, size, raw
        self.names = names or [str(r) for r in range(size)]
        self.timeout_s = timeout_s

    @classmethod
    def join(cls, key: str, addr: str, port: int, rank: int, size: int, names: list[str], timeout_s: float,
             nccl: bool = False) -> SyncGroup:
        """Create the stateless group (rank 0 hosts the store); every member calls this at the same time."""
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(addr, port, size, is_master=rank == 0, timeout=timeout)
            prefixed = dist.PrefixStore(f"sync/{key}", store)
            pg = dist.ProcessGroupNCCL(prefixed, rank, size) if nccl else \
                dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised with the group named
            raise SyncError(f"param sync group {key}: rank {rank} ({names[rank]}) could not join "
                            f"{size} members {names} within {timeout_s:.0f}s: {exc}") from exc
        group = cls(key, pg, rank, size, names, raw=True, timeout_s=timeout_s)
        group._store = store  # the store must outlive the group
        return group

    def _fail(self, what: str, exc: Exception, peer: int | None = None) -> SyncError:
        who = f" with rank {peer} ({self.names[peer]})" if peer is not None else ""
        return SyncError(f"param sync group {self.key}: {what} failed on rank {self.rank} ({self.names[self.rank]})"
                         f"{who}; members {dict(enumerate(self.names))}: {exc}")

    def broadcast(self, t: torch.Tensor) -> None:
        try:
            if self.raw:
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                self.pg.broadcast([t], opts).wait()
            else:
                dist.broadcast(t, src=dist.get_global_rank(self.pg, 0) if self.pg is not None else 0, group=self.pg)
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError/DistError subclasses
            raise self._fail("broadcast", exc) from exc

    def send_all(self, t: torch.Tensor) -> None:
        """p2p: one send to every other rank, all in flight at once, then wait."""
        works = []
        peer = None
        try:
            for peer in range(1, self.size):
                if self.raw:
                    works.append((peer, self.pg.send([t], peer, 0)))
                else:
                    works.append((peer, dist.isend(t, dst=dist.get_global_rank(self.pg, peer), group=self.pg)))
            for waiting, w in works:
                peer = waiting  # named in the error if this one fails
                w.wait()
        except Exception as exc:  # noqa: BLE001
            raise self._fail("send", exc, peer) from exc

    def recv(self, t: torch.Tensor) -> None:
        try:
            if self.raw:
                self.pg.recv([t], 0, 0).wait()
            else:
                dist.recv(t, src=dist.get_global_rank(self.pg, 0), group=self.pg)
        except Exception as exc:  # noqa: BLE001
            raise self._fail("recv", exc, 0) from exc

    def close(self) -> None:
        """Drop the group (``free_sync_collective_group``); a new one is joined for the next sync."""
        self.pg = None
        self._store = None


def transfer(specs: list[TensorSpec], *, group: SyncGroup | None = None, sources: Mapping[str, Any] | None = None,
             targets: Mapping[str, torch.Tensor] | None = None, comm: str = "broadcast", coalesce: bool = True,
             max_bytes: int = 100 * 2**20, debug: bool = False) -> dict[str, Any]:
    """One process's part of a sync of the tensors ``specs``.

    ``sources``: this process hosts a trainer rank (its tensors, DTensors gathered here: every trainer rank
    calls with its sources in the same order). ``group``: its rank 0 sends the gathered tensors, other ranks
    receive into ``targets``. ``targets`` without a group: a receiver colocated with a trainer rank, loaded
    from the gathered tensors in-process. Returns the number of transfers, the bytes, the largest staging
    buffer and, with ``debug``, a digest of every tensor this process ended up with (trainer: sent).
    """
    if comm not in ("broadcast", "p2p"):
        raise ValueError(f"param_sync_comm_type must be broadcast or p2p, got {comm!r}")
    sending = group is not None and group.rank == 0
    receiving = group is not None and group.rank > 0
    if sending and sources is None:
        raise ValueError("the sync group's rank 0 must host the trainer")
    local = targets is not None and sources is not None  # colocated receiver: copy in-process
    plan = plan_buckets(specs, max_bytes) if coalesce else [[i] for i in range(len(specs))]
    staging: dict[torch.dtype, torch.Tensor] = {}
    calls, largest = 0, 0
    digests: dict[str, str] = {}

    def move(buf: torch.Tensor) -> None:
        if sending:
            group.send_all(buf) if comm == "p2p" else group.broadcast(buf)
        elif receiving:
            group.recv(buf) if comm == "p2p" else group.broadcast(buf)

    def stage(dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        flat = staging.get(dtype)
        if flat is None or flat.numel() < numel:
            flat = staging[dtype] = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel]

    for bucket in plan:
        names = [specs[i][0] for i in bucket]
        fulls = [full_tensor(sources[n]).detach() for n in names] if sources is not None else None
        if local:
            with torch.no_grad():
                for n, f in zip(names, fulls, strict=True):
                    load_full_tensor(targets[n], f)
        if group is None:
            continue
        if len(bucket) == 1:
            name, shape, dtype = specs[bucket[0]]
            if sending:
                buf = fulls[0].contiguous()
            else:
                t = targets[name]
                direct = not hasattr(t, "device_mesh") and t.is_contiguous() and tuple(t.shape) == shape
                buf = t if direct else torch.empty(shape, dtype=dtype, device=t.device)
            move(buf)
            if receiving and buf is not targets[name]:
                with torch.no_grad():
                    load_full_tensor(targets[name], buf)
        else:
            dtype = specs[bucket[0]][2]
            sizes = [_nbytes(specs[i]) // torch.empty((), dtype=dtype).element_size() for i in bucket]
            device = (fulls[0] if sending else targets[names[0]]).device
            view = stage(dtype, sum(sizes), device)
            largest = max(largest, view.numel() * view.element_size())
            if sending:
                offset = 0
                for f, n in zip(fulls, sizes, strict=True):
                    view[offset: offset + n].copy_(f.reshape(-1))
                    offset += n
            move(view)
            if receiving:
                offset = 0
                with torch.no_grad():
                    for i, n in zip(bucket, sizes, strict=True):
                        load_full_tensor(targets[specs[i][0]], view[offset: offset + n].view(specs[i][1]))
                        offset += n
        calls += 1
    if debug:
        if sources is not None and (sending or group is None):
            digests = {n: digest(full_tensor(sources[n])) for n, _, _ in specs}
        elif targets is not None:
            digests = {n: digest(full_tensor(targets[n])) for n, _, _ in specs}
    return {"collectives": calls if group is not None else 0, "bytes": sum(_nbytes(s) for s in specs),
            "staging_bytes": largest, "digests": digests}


def broadcast_tensors(tensors: Mapping[str, torch.Tensor], src: int, group: Any = None, *, coalesce: bool = True,
                      max_bytes: int = 100 * 2**20, comm: str = "broadcast") -> dict[str, Any]:
    """:func:`transfer` over a ``torch.distributed`` group whose rank ``src`` (global) sends ``tensors`` and
    whose other ranks receive into theirs (same names, shapes, dtypes), in place."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    order = [src] + [r for r in ranks if r != src]
    if order != ranks:
        raise ValueError(f"the sending rank must be the group's first; group {ranks}, src {src}")
    me = ranks.index(dist.get_rank())
    sync = SyncGroup("torch-group", group, me, len(ranks), raw=False)
    sending = me == 0
    return transfer(specs_of(tensors), group=sync, sources=tensors if sending else None,
                    targets=None if sending else tensors, comm=comm, coalesce=coalesce, max_bytes=max_bytes)

