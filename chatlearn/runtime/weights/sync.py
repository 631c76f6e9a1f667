"""Parameter sync, trainer -> inference copies: the one place weights move between models.

Each (trainer, inference model) pair of the engine is a :class:`SyncRoute`, planned once at launch:

* **collective** (the built-in torch modules): a sync group joins the trainer's rank 0 with every process of
  the inference copies outside the trainer's processes (:mod:`chatlearn.runtime.weights.param_sync`); every process
  of the pair takes part in one call, the trainer's ranks gathering sharded weights, receivers copying their
  slices in place, colocated receivers copying in-process. ``param_sync_comm_type``, ``coalesce_param``,
  ``coalesced_buffer_mb``, ``free_sync_collective_group`` and ``debug`` act here; ``concurrent_comm`` and
  ``param_sync_max_workers`` decide how many routes run at once (:func:`sync_routes`).
* **object store**, for modules with their own ``get_weights``/``set_weights``: the trainer's state dict is put
  in Ray's object store once and loaded by every receiver.

Every wait is bounded: a rank that dies or hangs turns into a :class:`~chatlearn.runtime.weights.param_sync.SyncError`
naming the route and the processes that did not finish, within the group's timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import ray
from pydantic import BaseModel, Field

from chatlearn.runtime.weights.param_sync import SyncError

# Collectives of sync groups (and of the worlds, see worker.DIST_TIMEOUT) fail after this many seconds.
SYNC_TIMEOUT_S = float(os.environ.get("CHATLEARN_DIST_TIMEOUT", "300"))


class SyncRoute(BaseModel):
    """How weights go from trainer ``src`` to inference model ``dst`` (processes named as Ray actors)."""

    key: str
    src: str
    dst: str
    src_ranks: list[str] = Field(description="processes of the trainer's ranks, rank 0 first")
    dst_ranks: list[list[str]] = Field(description="processes of each inference replica's ranks")
    members: list[str] = Field(default_factory=list,
                               description="the sync group: the trainer's rank 0, then the remote receivers")
    collective: bool = True
    comm: str = "broadcast"
    coalesce: bool = True
    bucket_bytes: int = 100 * 2**20
    free_group: bool = False
    debug: bool = False
    timeout_s: float = SYNC_TIMEOUT_S
    specs: list[tuple[str, list[int], str]] = Field(default_factory=list, description="name, shape, dtype")

    def describe(self) -> str:
        """The route in a line, for the run's log: how the weights travel and between how many processes."""
        if not self.collective:
            return f"{self.key}: through Ray's object store"
        if not self.members:
            return f"{self.key}: an in-process copy (every receiving rank is in a trainer process)"
        local = sum(p in self.src_ranks for rep in self.dst_ranks for p in rep)
        line = f"{self.key}: {self.comm} over a group of {len(self.members)} processes"
        if local:
            line += f", {local} receiving rank{'s' * (local > 1)} in a trainer process copying in-process"
        return line + (" (a group joined and left by each sync)" if self.free_group else "")

    @property
    def processes(self) -> list[str]:
        """Every process that takes part, each once, trainer first."""
        out: list[str] = []
        for p in self.src_ranks + [p for rep in self.dst_ranks for p in rep]:
            if p not in out:
                out.append(p)
        return out


def plan_route(src: str, dst: str, src_ranks: list[str], dst_ranks: list[list[str]], collective: bool,
               runtime: Any) -> SyncRoute:
    """The route for one pair: receivers in a trainer process copy in-process, the others join the group."""
    remote = [p for rep in dst_ranks for p in rep if p not in src_ranks]
    return SyncRoute(key=f"{src}->{dst}", src=src, dst=dst, src_ranks=src_ranks, dst_ranks=dst_ranks,
                     members=[src_ranks[0], *remote] if remote and collective else [], collective=collective,
                     comm=str(runtime.param_sync_comm_type).lower(), coalesce=bool(runtime.coalesce_param),
                     bucket_bytes=int(runtime.coalesced_buffer_mb) * 2**20,
                     free_group=bool(runtime.free_sync_collective_group), debug=bool(runtime.debug))


_FLOATS = ("float32", "float64", "bfloat16", "float16")


def check_specs(route: SyncRoute, src_specs: list, dst_specs: list) -> list[tuple[str, list[int], str]]:
    """The receiver's tensors (names, shapes, dtypes) must be the trainer's, but for floating dtypes: the sync
    sends what the receiver holds (a bf16 inference copy of an fp32 trainer gets bf16, cast on the trainer's
    side). The first difference is named; the route's specs are the receiver's."""
    src = {n: (list(s), d) for n, s, d in src_specs}
    for n, shape, dtype in dst_specs:
        if n not in src:
            raise SyncError(f"param sync {route.key}: {route.dst} has {n!r}, which {route.src} does not")
        cast = src[n][1] in _FLOATS and dtype in _FLOATS
        if src[n][0] != list(shape) or (src[n][1] != dtype and not cast):
            raise SyncError(f"param sync {route.key}: {n!r} is {src[n][0]} {src[n][1]} in {route.src} but "
                            f"{list(shape)} {dtype} in {route.dst}")
    extra = [n for n in src if n not in {d[0] for d in dst_specs}]
    if extra:
        raise SyncError(f"param sync {route.key}: {route.src} has tensors {route.dst} does not: {extra[:5]}")
    return [(n, list(s), d) for n, s, d in dst_specs]


def connect(route: SyncRoute, actor: Callable[[str], Any]) -> None:
    """Join the route's sync group: a free port on the trainer's rank 0 node, every member at once."""
    if not route.members:
        return
    addr, port = ray.get(actor(route.members[0]).free_port.remote(), timeout=route.timeout_s)
    refs = [actor(p).join_sync_group.remote(route.key, addr, port, i, route.members, route.timeout_s)
            for i, p in enumerate(route.members)]
    _wait(route, dict(zip(route.members, refs, strict=True)), "joining the sync group")


def disconnect(route: SyncRoute, actor: Callable[[str], Any]) -> None:
    if route.members:
        ray.get([actor(p).leave_sync_group.remote(route.key) for p in route.members], timeout=route.timeout_s)


def _wait(route: SyncRoute, refs: dict[str, Any], what: str, grace_s: float = 30.0) -> dict[str, Any]:
    """Results by process; the first failure, or the processes still running at the deadline, raise."""
    deadline = time.monotonic() + route.timeout_s + grace_s
    pending = dict(refs)
    results: dict[str, Any] = {}
    by_ref = {r: p for p, r in refs.items()}
    while pending:
        ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise SyncError(f"param sync {route.key}: {what}: processes {sorted(pending)} did not finish within "
                            f"{route.timeout_s + grace_s:.0f}s (finished: {sorted(results)})")
        for ref in ready:
            proc = by_ref[ref]
            pending.pop(proc)
            try:
                results[proc] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))  # ready: a fetch
            except SyncError:
                raise
            except Exception as exc:  # noqa: BLE001 - an actor that died or raised: name it
                cause = getattr(exc, "cause", None) or exc
                raise SyncError(f"param sync {route.key}: {what}: process {proc} failed: "
                                f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1][:400]}") from exc
    return results


def first_mismatch(route: SyncRoute, results: dict[str, dict]) -> str | None:
    """``debug``: every receiver's digests against the trainer's; the first tensor that differs, named."""
    sent = results[route.src_ranks[0]]["trainer_digests"]
    for r, rep in enumerate(route.dst_ranks):
        for k, proc in enumerate(rep):
            got = results[proc]["receiver_digests"]
            for name, _, _ in route.specs:
                if got.get(name) != sent.get(name):
                    return (f"param sync {route.key} (debug check): {route.dst} replica {r} rank {k} (process "
                            f"{proc}) has {name!r} different from {route.src}'s after the sync")
    return None


def start(route: SyncRoute, actor: Callable[[str], Any]) -> dict[str, Any]:
    """Submit the route's sync to every process of it; :func:`finish` waits."""
    if not route.collective:
        # every trainer rank gathers (a collective when sharded); rank 0's weights go to every receiver
        weights = actor(route.src_ranks[0]).run.remote(route.src, "get_weights")
        refs = {f"{route.src}:{p}": actor(p).run.remote(route.src, "get_weights") for p in route.src_ranks[1:]}
        refs |= {f"{route.dst}:{p}": actor(p).run.remote(route.dst, "set_weights", weights)
                 for rep in route.dst_ranks for p in rep}
        return {"route": route, "refs": refs}
    if route.free_group:
        connect(route, actor)
    body = route.model_dump()
    refs = {p: actor(p).sync_weights.remote(body, p) for p in route.processes}
    return {"route": route, "refs": refs}


def finish(pending: dict[str, Any], actor: Callable[[str], Any]) -> dict[str, Any]:
    route: SyncRoute = pending["route"]
    results = _wait(route, pending["refs"], "sync")
    if route.collective and route.free_group:
        disconnect(route, actor)
    if route.collective and route.debug:
        problem = first_mismatch(route, results)
        if problem:
            raise SyncError(problem)
    stats = results.get(route.src_ranks[0]) or {}
    return {"bytes": stats.get("bytes", 0), "collectives": stats.get("collectives", 0)}


def sync_routes(routes: list[SyncRoute], actor: Callable[[str], Any], concurrent: bool = True,
                max_workers: int | None = None) -> dict[str, dict[str, Any]]:
    """Run the routes: all at once with ``concurrent_comm`` (at most ``param_sync_max_workers`` in flight,
    None or -1: all), else one after another. Calls reach every process in the same route order, so routes
    that share processes cannot deadlock."""
    if not concurrent:
        width = 1
    elif max_workers is None or max_workers < 1:
        width = max(1, len(routes))
    else:
        width = max_workers
    out: dict[str, dict[str, Any]] = {}
    for i in range(0, len(routes), width):
        wave = [start(r, actor) for r in routes[i:i + width]]
        for pending in wave:
            out[pending["route"].key] = finish(pending, actor)
    return out
