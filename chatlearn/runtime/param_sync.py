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
from chatlearn.utils.tied import without_aliases

__all__ = ["SyncError", "SyncGroup", "TensorSpec", "broadcast_tensors", "digest", "plan_buckets", "specs_of",
           "transfer"]

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


class SyncError(RuntimeError):
    """A collective of a sync group failed or timed out; the message names the group, the rank and the peers."""


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """(name, global shape, dtype) of each tensor, in the mapping's order (both sides must list the same).

    Tied names (one tensor under several names, e.g. tied input/output embeddings) are listed once, under
    the first: the tensor crosses the wire once, and a receiver's copy into it reaches every name it has."""
    return [(n, tuple(t.shape), t.dtype) for n, t in without_aliases(tensors)[0].items()]


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


def transfer(specs: list[TensorSpec], *, group: SyncGroup | None = None, sources: Mapping[str, Any] | None = None,
             targets: Mapping[str, torch.Tensor] | None = None, comm: str = "broadcast", coalesce: bool = True,
             max_bytes: int = 100 * 2**20, debug: bool = False,
             staging: dict[Any, torch.Tensor] | None = None) -> dict[str, Any]:
    """One process's part of a sync of the tensors ``specs``.

    ``sources``: this process hosts a trainer rank (its tensors, DTensors gathered here: every trainer rank
    calls with its sources in the same order). ``group``: its rank 0 sends the gathered tensors, other ranks
    receive into ``targets``. ``targets`` without a group: a receiver colocated with a trainer rank, loaded
    from the gathered tensors in-process. ``staging``: the bucket buffers, two of half ``max_bytes`` per
    dtype, kept by the caller from one sync to the next (a fresh buffer costs its page faults every sync);
    one is packed while the other is on the wire. Transfers that need no staging buffer stay in flight
    together (at most ``2 * max_bytes`` of temporary receive buffers). Returns the number of transfers, the bytes,
    the largest staging buffer and, with ``debug``, a digest of every tensor this process ended up with
    (trainer: sent).
    """
    if comm not in ("broadcast", "p2p"):
        raise ValueError(f"param_sync_comm_type must be broadcast or p2p, got {comm!r}")
    sending = group is not None and group.rank == 0
    receiving = group is not None and group.rank > 0
    if sending and sources is None:
        raise ValueError("the sync group's rank 0 must host the trainer")
    local = targets is not None and sources is not None  # colocated receiver: copy in-process
    # two staging slots of half a bucket each: packing (or unpacking) one overlaps the transfer of the other,
    # and together they stay within max_bytes
    plan = plan_buckets(specs, max(1, max_bytes // 2)) if coalesce else [[i] for i in range(len(specs))]
    staging = {} if staging is None else staging
    calls, largest, temp_bytes = 0, 0, 0
    digests: dict[str, str] = {}
    inflight: list[tuple[list, Any, Any]] = []  # (works, staging slot or None, what to do after)
    slot_of_bucket = 0

    def drain(slot: Any = None) -> None:
        """Wait for the transfers using staging ``slot`` (None: all), then run what follows each."""
        nonlocal temp_bytes
        keep = []
        for works, used, after in inflight:
            if slot is not None and used != slot:
                keep.append((works, used, after))
                continue
            group.wait(works, comm)
            if after is not None:
                after()
        inflight[:] = keep
        if slot is None:
            temp_bytes = 0

    for bucket in plan:
        names = [specs[i][0] for i in bucket]
        fulls = [full_tensor(sources[n]).detach() for n in names] if sources is not None else None
        if local:
            with torch.no_grad():
                for n, f in zip(names, fulls, strict=True):
                    load_full_tensor(targets[n], f)
        if group is None:
            continue
        calls += 1
        if len(bucket) == 1:
            name, shape, dtype = specs[bucket[0]]
            after = None
            if sending:
                buf = fulls[0].contiguous()
            else:
                t = targets[name]
                direct = not hasattr(t, "device_mesh") and t.is_contiguous() and tuple(t.shape) == shape
                buf = t if direct else torch.empty(shape, dtype=dtype, device=t.device)
                if not direct:
                    if temp_bytes + _nbytes(specs[bucket[0]]) > 2 * max_bytes:
                        drain()
                    temp_bytes += _nbytes(specs[bucket[0]])

                    def after(t=t, buf=buf) -> None:
                        with torch.no_grad():
                            load_full_tensor(t, buf)
            inflight.append((group.post(buf, comm), None, after))
            continue
        dtype = specs[bucket[0]][2]
        sizes = [_nbytes(specs[i]) // torch.empty((), dtype=dtype).element_size() for i in bucket]
        device = (fulls[0] if sending else targets[names[0]]).device
        slot = (dtype, slot_of_bucket % 2)
        slot_of_bucket += 1
        drain(slot)  # the bucket before last must be out of this buffer first
        flat = staging.get(slot)
        if flat is None or flat.numel() < sum(sizes) or flat.device != device:
            flat = staging[slot] = torch.empty(sum(sizes), dtype=dtype, device=device)
        view = flat[:sum(sizes)]
        largest = max(largest, sum(t.numel() * t.element_size() for t in staging.values()))
        if sending:
            offset = 0
            for f, n in zip(fulls, sizes, strict=True):
                view[offset: offset + n].copy_(f.reshape(-1))
                offset += n
        after = None
        if receiving:
            def after(view=view, bucket=bucket, sizes=sizes) -> None:
                offset = 0
                with torch.no_grad():
                    for i, n in zip(bucket, sizes, strict=True):
                        load_full_tensor(targets[specs[i][0]], view[offset: offset + n].view(specs[i][1]))
                        offset += n
        inflight.append((group.post(view, comm), slot, after))
    if group is not None:
        drain()
    if debug:
        if sources is not None and (sending or group is None):
            digests = {n: digest(full_tensor(sources[n])) for n, _, _ in specs}
        elif targets is not None:
            digests = {n: digest(full_tensor(targets[n])) for n, _, _ in specs}
    return {"collectives": calls, "bytes": sum(_nbytes(s) for s in specs),
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

