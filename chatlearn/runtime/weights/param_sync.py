"""Parameter sync over a collective group: a trainer's weights to its inference copies, bit for bit.

One sync group joins the trainer's rank 0 (group rank 0) with every process of the inference copies that is
outside the trainer's processes; the trainer's other ranks take part through their own torch world (they gather
sharded weights with rank 0). Every member walks the same bucket plan (:func:`plan_buckets`, computed from the
tensors' names, global shapes and dtypes), so nothing but the data crosses the wire:

* the :class:`Sender` (every trainer process) gathers each tensor whole (``DTensor.full_tensor()`` for FSDP2/TP
  shards: a collective of its ranks); on the group's rank 0 it packs a bucket of at most half ``max_bytes``
  into one of two :class:`Staging` buffers (kept from sync to sync; one is packed while the other is on the
  wire; a tensor larger than a bucket travels alone, unstaged) and sends it by ``broadcast`` or ``p2p`` (one
  ``send`` per receiver, all in flight at once);
* a :class:`Receiver` (a group rank > 0) receives the same buckets into its own staging buffers and copies each
  tensor into its own: in place, whole for a plain tensor, its slice for a DTensor (a differently sharded
  inference model: TP of another degree), so a model's storage never changes;
* a receiver in a trainer process (colocated) is not in the group: the sender there copies each gathered
  tensor into it, no communication.

With ``debug`` every process digests what it holds afterwards (the trainer's tensors, a receiver's, or both),
so a caller can compare every receiver with the trainer.

Groups between separate torch worlds are *stateless* (a TCPStore plus a raw ``ProcessGroupGloo``/``NCCL``, see
``../shared/reference/torch_dist_cpu.md`` §1), created with a timeout: a dead or stuck peer becomes an error
naming the group and the rank within it, never a hang.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from chatlearn.models.parallel import full_tensor, load_full_tensor
from chatlearn.utils.tied import without_aliases

__all__ = ["Receiver", "Sender", "Staging", "SyncError", "SyncGroup", "TensorSpec", "broadcast_tensors", "digest",
           "plan_buckets", "specs_of", "transfer"]

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


class SyncError(RuntimeError):
    """A collective of a sync group failed or timed out; the message names the group, the rank and the peers."""


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """(name, global shape, dtype) of each tensor, in the mapping's order (both sides must list the same).

    Tied names (one tensor under several names, e.g. tied input/output embeddings) are listed once, under
    the first: the tensor crosses the wire once, and a receiver's copy into it reaches every name it has."""
    return [(n, tuple(t.shape), t.dtype) for n, t in without_aliases(tensors)[0].items()]


def _numel(spec: TensorSpec) -> int:
    numel = 1
    for d in spec[1]:
        numel *= d
    return numel


def _nbytes(spec: TensorSpec) -> int:
    return _numel(spec) * torch.empty((), dtype=spec[2]).element_size()


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

    def post(self, t: torch.Tensor, comm: str) -> list[tuple[int, Any]]:
        """Start moving ``t`` (rank 0 sends, the others receive into it) and return the pending works, each
        with the peer it waits on (-1: the whole group)."""
        try:
            if comm == "broadcast":
                if self.raw:
                    opts = dist.BroadcastOptions()
                    opts.rootRank = 0
                    return [(-1, self.pg.broadcast([t], opts))]
                src = dist.get_global_rank(self.pg, 0) if self.pg is not None else 0
                return [(-1, dist.broadcast(t, src=src, group=self.pg, async_op=True))]
            if self.rank == 0:
                if self.raw:
                    return [(peer, self.pg.send([t], peer, 0)) for peer in range(1, self.size)]
                return [(peer, dist.isend(t, dst=dist.get_global_rank(self.pg, peer), group=self.pg))
                        for peer in range(1, self.size)]
            if self.raw:
                return [(0, self.pg.recv([t], 0, 0))]
            return [(0, dist.irecv(t, src=dist.get_global_rank(self.pg, 0), group=self.pg))]
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError/DistError subclasses
            raise self._fail(comm, exc) from exc

    def wait(self, works: list[tuple[int, Any]], what: str) -> None:
        for peer, work in works:
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001
                raise self._fail(what, exc, None if peer < 0 else peer) from exc

    def broadcast(self, t: torch.Tensor) -> None:
        self.wait(self.post(t, "broadcast"), "broadcast")

    def send_all(self, t: torch.Tensor) -> None:
        """p2p: one send to every other rank, all in flight at once, then wait."""
        self.wait(self.post(t, "p2p"), "send")

    def recv(self, t: torch.Tensor) -> None:
        self.wait(self.post(t, "p2p"), "recv")

    def close(self) -> None:
        """Drop the group (``free_sync_collective_group``); a new one is joined for the next sync."""
        self.pg = None
        self._store = None


class Staging:
    """The bucket buffers of one route, kept by the caller from sync to sync (a fresh buffer costs its page
    faults every sync). A slot is ``(dtype, 0 or 1)``: two buffers per dtype, each holding one bucket of at
    most half ``max_bytes``, so one is packed (or unpacked) while the other is on the wire, and together they
    stay within ``max_bytes``. A tensor larger than a bucket never enters one: it travels alone, unstaged."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def buffer(self, slot: tuple[torch.dtype, int], numel: int, device: torch.device) -> torch.Tensor:
        """The first ``numel`` elements of ``slot``'s buffer, grown (or moved) when it does not fit."""
        flat = self.buffers.get(slot)
        if flat is None or flat.numel() < numel or flat.device != device:
            flat = self.buffers[slot] = torch.empty(numel, dtype=slot[0], device=device)
        return flat[:numel]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())


class _Wire:
    """One sync's transfers on ``group``: posted at once, waited for only when their buffer is needed again
    (or at the end), each followed by what the receiver does with it (unpacking, a sliced copy)."""

    def __init__(self, group: SyncGroup, comm: str, staging: Staging):
        self.group, self.comm, self.staging = group, comm, staging
        self.pending: list[tuple[list, Any, Callable[[], None] | None]] = []  # (works, staging slot, then)
        self.buckets = 0  # staged buckets so far: they take the two slots in turn
        self.largest = 0  # the staging buffers' bytes at their largest

    def post(self, buf: torch.Tensor, slot: Any = None, then: Callable[[], None] | None = None) -> None:
        self.pending.append((self.group.post(buf, self.comm), slot, then))

    def settle(self, slot: Any = None) -> None:
        """Wait for the transfers through staging ``slot`` (None: all of them) and run what follows each."""
        keep = []
        for works, used, then in self.pending:
            if slot is not None and used != slot:
                keep.append((works, used, then))
                continue
            self.group.wait(works, self.comm)
            if then is not None:
                then()
        self.pending = keep

    def stage(self, specs: list[TensorSpec], device: torch.device) -> tuple[Any, torch.Tensor, list[int]]:
        """(slot, buffer, each tensor's numel) for the next bucket, of the tensors ``specs``: the slot the
        bucket before last used, once that has left it."""
        sizes = [_numel(s) for s in specs]
        slot = (specs[0][2], self.buckets % 2)
        self.buckets += 1
        self.settle(slot)
        flat = self.staging.buffer(slot, sum(sizes), device)
        self.largest = max(self.largest, self.staging.nbytes)
        return slot, flat, sizes


class Sender:
    """The trainer's side, in each of its processes: gather each tensor whole (``full_tensor``, a collective of
    the trainer's ranks for a DTensor, so every rank walks the plan), copy it into a ``colocated`` receiver's
    tensors in-process, and on the sync group's rank 0 send it: a bucket packed into a staging buffer, a
    tensor alone as it is."""

    def __init__(self, sources: Mapping[str, Any], group: SyncGroup | None = None,
                 colocated: Mapping[str, torch.Tensor] | None = None, comm: str = "broadcast",
                 staging: Staging | None = None):
        self.sources, self.group, self.colocated, self.comm = sources, group, colocated, comm
        self.staging = Staging() if staging is None else staging

    def run(self, specs: list[TensorSpec], plan: list[list[int]]) -> tuple[int, int]:
        """Send ``plan``'s buckets; returns (collectives posted, largest staging bytes)."""
        wire = _Wire(self.group, self.comm, self.staging) if self.group is not None else None
        for bucket in plan:
            # cast to what the receivers hold (a bf16 inference copy of an fp32 trainer: see sync.check_specs)
            fulls = [full_tensor(self.sources[specs[i][0]]).detach().to(specs[i][2]) for i in bucket]
            if self.colocated is not None:
                with torch.no_grad():
                    for i, full in zip(bucket, fulls, strict=True):
                        load_full_tensor(self.colocated[specs[i][0]], full)
            if wire is None:
                continue
            if len(bucket) == 1:
                wire.post(fulls[0].contiguous())
                continue
            slot, flat, sizes = wire.stage([specs[i] for i in bucket], fulls[0].device)
            offset = 0
            for full, n in zip(fulls, sizes, strict=True):
                flat[offset: offset + n].copy_(full.reshape(-1))
                offset += n
            wire.post(flat, slot)
        if wire is None:
            return 0, 0
        wire.settle()
        return len(plan), wire.largest


class Receiver:
    """A receiver outside the trainer's processes (the sync group's rank > 0): receive each bucket and copy
    every tensor into its own ``targets`` in place: whole for a plain tensor, its slice for a DTensor."""

    def __init__(self, targets: Mapping[str, torch.Tensor], group: SyncGroup, comm: str = "broadcast",
                 staging: Staging | None = None):
        self.targets, self.group, self.comm = targets, group, comm
        self.staging = Staging() if staging is None else staging

    def run(self, specs: list[TensorSpec], plan: list[list[int]], max_bytes: int) -> tuple[int, int]:
        """Receive ``plan``'s buckets; returns (collectives posted, largest staging bytes). A lone tensor goes
        straight into its target when that is one plain contiguous tensor, else into a temporary buffer; those
        stay in flight together up to ``2 * max_bytes``."""
        wire = _Wire(self.group, self.comm, self.staging)
        unstaged = 0  # bytes of temporary receive buffers in flight
        for bucket in plan:
            if len(bucket) > 1:
                staged = [specs[i] for i in bucket]
                slot, flat, sizes = wire.stage(staged, self.targets[staged[0][0]].device)
                wire.post(flat, slot, partial(self._unpack, flat, staged, sizes))
                continue
            spec = specs[bucket[0]]
            name, shape, dtype = spec
            target = self.targets[name]
            if not hasattr(target, "device_mesh") and target.is_contiguous() and tuple(target.shape) == shape:
                wire.post(target)
                continue
            if unstaged + _nbytes(spec) > 2 * max_bytes:
                wire.settle()
                unstaged = 0
            unstaged += _nbytes(spec)
            buf = torch.empty(shape, dtype=dtype, device=target.device)
            wire.post(buf, then=partial(self._load, target, buf))
        wire.settle()
        return len(plan), wire.largest

    @staticmethod
    def _load(target: torch.Tensor, full: torch.Tensor) -> None:
        with torch.no_grad():
            load_full_tensor(target, full)

    def _unpack(self, flat: torch.Tensor, specs: list[TensorSpec], sizes: list[int]) -> None:
        offset = 0
        for (name, shape, _), n in zip(specs, sizes, strict=True):
            self._load(self.targets[name], flat[offset: offset + n].view(shape))
            offset += n


def transfer(specs: list[TensorSpec], *, group: SyncGroup | None = None, sources: Mapping[str, Any] | None = None,
             targets: Mapping[str, torch.Tensor] | None = None, comm: str = "broadcast", coalesce: bool = True,
             max_bytes: int = 100 * 2**20, debug: bool = False, staging: Staging | None = None) -> dict[str, Any]:
    """One process's part of a sync of the tensors ``specs``: a :class:`Sender` where it hosts a trainer rank
    (``sources``; every trainer rank calls, with its sources in the same order), with ``targets`` copied
    in-process (a colocated receiver); else a :class:`Receiver` into ``targets`` when it is in ``group``.

    ``coalesce``: buckets of at most half ``max_bytes`` (the two staging slots together stay within it), else
    one transfer per tensor. ``staging``: the route's buffers, kept by the caller from sync to sync. Returns
    the number of transfers, the bytes, the largest staging bytes and, with ``debug``, a digest of every tensor
    the trainer holds (``trainer_digests``, in its processes) and every tensor a receiver holds after the sync
    (``receiver_digests``, in its processes, colocated ones too). Every process computes its digests after its
    part of the sync, the trainer's before the receiver's: for DTensors both are collectives of that model's
    ranks, which thus meet in the same order.
    """
    if comm not in ("broadcast", "p2p"):
        raise ValueError(f"param_sync_comm_type must be broadcast or p2p, got {comm!r}")
    if group is not None and (group.rank == 0) != (sources is not None):
        raise ValueError("the sync group's rank 0, and no other, must host the trainer")
    plan = plan_buckets(specs, max(1, max_bytes // 2)) if coalesce else [[i] for i in range(len(specs))]
    collectives, largest = 0, 0
    if sources is not None:
        collectives, largest = Sender(sources, group, targets, comm, staging).run(specs, plan)
    elif group is not None:
        collectives, largest = Receiver(targets, group, comm, staging).run(specs, plan, max_bytes)
    stats: dict[str, Any] = {"collectives": collectives, "bytes": sum(_nbytes(s) for s in specs),
                             "staging_bytes": largest, "trainer_digests": {}, "receiver_digests": {}}
    if debug:
        for key, tensors in (("trainer_digests", sources), ("receiver_digests", targets)):
            if tensors is not None:
                stats[key] = {n: digest(full_tensor(tensors[n]).to(dtype)) for n, _, dtype in specs}
    return stats


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

