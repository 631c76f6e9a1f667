"""One worker process (a Ray actor): the ranks of every model the placement plan put on it.

Colocated models on one device live in one process, as verl's hybrid workers do: torch and transformers are
imported once, a colocated trainer → inference sync is an in-process copy, and memory is handed over between
them: before a model runs, the other colocated models in the process offload what their flags allow and this
model onloads what the call needs (ChatLearn's onload/offload, done when the device changes hands rather than
twice per stage). Per-model calls go through :meth:`Worker.run`; :class:`~chatlearn.runtime.calls.handles.ModelHandle`
makes them look like calls on a per-model actor.

A worker belongs to one placement unit; when the unit has several processes they form one torch.distributed
world (gloo on CPU, NCCL on a real GPU), and each multi-process model replica gets its own group in it.
"""

import datetime
import os
import socket
from typing import Any

import ray
import torch
import torch.distributed as dist

from chatlearn.config import ModelConfig, RuntimeConfig
from chatlearn.models.base_module import BaseModule
from chatlearn.models.memory import PARTS, MemoryManager
from chatlearn.models.parallel import ParallelContext, ParallelDims
from chatlearn.runtime.cluster.host import ModelHost, resident_parts
from chatlearn.runtime.records.profiling import StageMarks
from chatlearn.runtime.weights.param_sync import Staging, SyncGroup, specs_of, transfer
from chatlearn.utils.devices import fake_gpus

# Collective operations fail after this instead of hanging for gloo's default 30 minutes.
DIST_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("CHATLEARN_DIST_TIMEOUT", "300")))


class CollectiveError(RuntimeError):
    """A collective of a multi-process replica failed: the message names the model, replica and rank."""


def _collective_failure(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(k in text for k in ("gloo", "Gloo", "NCCL", "Connection closed",
                                                                      "Connection reset", "Timed out"))


class Worker:
    """Hosts model ranks: ``members`` are (name, module, model config, replica id, rank in replica)."""

    def __init__(self, members: list[tuple[str, BaseModule, ModelConfig, int, int]], runtime_args: RuntimeConfig,
                 cpus: float, colocated: dict[str, bool]):
        self.slots: dict[str, ModelHost] = {}
        self.ranks: dict[str, tuple[int, int]] = {}
        for name, module, cfg, replica, rank in members:
            self.slots[name] = ModelHost(module, cfg, runtime_args, replica)
            self.ranks[name] = (replica, rank)
        if cpus >= 1:  # colocated models share the process's cores
            torch.set_num_threads(int(cpus))
        self.colocated = colocated
        self.bucket_mb = runtime_args.bucket_size_mb_in_memory_manager
        self.memory: dict[str, MemoryManager] = {}
        self.released: dict[str, dict[str, int]] = {name: dict.fromkeys(PARTS, 0) for name in self.slots}
        self.world_rank = 0
        self.sync_groups: dict[str, SyncGroup] = {}
        self.sync_staging: dict[str, Staging] = {}  # per route: its bucket buffers, kept from sync to sync
        self.marks = StageMarks(runtime_args.nsys, self.ranks)  # NVTX ranges and the torch profiler

    # -- torch.distributed ----------------------------------------------------------------------------------
    def free_port(self) -> tuple[str, int]:
        """An address and a free port on this worker's node, for its world's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_distributed(self, addr: str, port: int, world_size: int, rank: int, groups: list[list[int]],
                         mine: dict[str, dict[str, Any]]) -> str:
        """Join the unit's world and make every group (all ranks create all ``groups``, in the same order, as
        torch requires); model ``m`` here gets its replica's group and one per parallel dimension, as
        ``mine[m]`` lists them (see ``model_group._join_worlds``)."""
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                          LOCAL_RANK=str(rank))
        backend = "nccl" if torch.cuda.is_available() and not fake_gpus() and ray.get_gpu_ids() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", world_size=world_size, rank=rank,
                                timeout=DIST_TIMEOUT)
        self.world_rank = rank
        made = [dist.new_group(g, timeout=DIST_TIMEOUT) if len(g) < world_size else dist.group.WORLD
                for g in groups]
        for name, layout in mine.items():
            rank_in_replica = self.ranks[name][1]
            ctx = ParallelContext(ParallelDims(**layout["dims"]), rank_in_replica, layout["ranks"],
                                  made[layout["group"]])
            for dim, indices in layout["dim_groups"].items():
                ctx.dim_groups[dim] = next(made[i] for i in indices if rank in groups[i])
            module = self.slots[name].module
            module.bind_process_group(made[layout["group"]], rank_in_replica, len(layout["ranks"]))
            module.parallel = ctx
        return backend

    # -- per-model calls ------------------------------------------------------------------------------------
    def setup(self, name: str) -> dict[str, Any]:
        info = self.slots[name].setup()
        module = self.slots[name].module
        model = getattr(module, "model", None)
        if self.colocated.get(name) and isinstance(model, torch.nn.Module):
            cfg = module.module_args
            self.memory[name] = MemoryManager(
                model, getattr(module, "optimizer", None), offload_weights=cfg.offload_weights,
                offload_optimizer_states=cfg.offload_optimizer_states, free_grad_buffers=cfg.free_grad_buffers,
                bucket_size_mb=self.bucket_mb)
        info.update(replica=self.ranks[name][0], rank=self.ranks[name][1], world_rank=self.world_rank,
                    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
        return info

    def run(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` of model ``name``'s host, handing the process's memory to it first."""
        if method.startswith("_"):
            raise AttributeError(f"refusing to call private method {method!r}")
        if method == "setup":  # the worker's own: it also sets up the model's memory manager
            return self.setup(name)
        needs = resident_parts(method)  # declared on the method (`host.resident`); grads are made by backward
        if needs:
            self._hand_over([name], needs)
        try:
            with self.marks.stage(name, method, kwargs):
                return getattr(self.slots[name], method)(*args, **kwargs)
        except (RuntimeError, dist.DistError) as exc:
            ctx = self.slots[name].module.parallel
            if ctx is None or not _collective_failure(exc):
                raise
            replica, rank = self.ranks[name]
            raise CollectiveError(
                f"{name} replica {replica} rank {rank} of {ctx.dims.size} (world ranks {ctx.ranks}): a collective "
                f"of {method} failed: a peer process died or did not answer within {DIST_TIMEOUT.total_seconds():.0f}"
                f"s (CHATLEARN_DIST_TIMEOUT): {str(exc).strip().splitlines()[0][:300]}") from exc

    @ray.method(num_returns=2)
    def run_batch(self, name: str, method: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """`run` for a call whose result is a batch (`calls.handles.BATCH_METHODS`): ``(True, batch)`` as two
        return values, so the batch is an object of its own that the caller (the driver) owns and waits for
        through ``done`` without fetching it; it outlives this process (`calls.handles`). The other ranks of a
        multi-process replica computed the same batch with rank 0 (or helped it): only rank 0's is kept."""
        out = self.run(name, method, *args, **kwargs)
        return True, out if self.slots[name].module.rank == 0 else None

    # -- parameter sync (chatlearn.runtime.weights.sync) --------------------------------------------------------------
    def sync_specs(self, name: str, role: str) -> list[tuple[str, list[int], str]]:
        """(name, global shape, dtype) of what model ``name`` sends (``src``) or receives (``dst``) in a sync."""
        self._hand_over([name], ("weights",))
        module = self.slots[name].module
        tensors = module.sync_sources() if role == "src" else module.sync_targets()
        return [(n, list(shape), str(dtype).removeprefix("torch.")) for n, shape, dtype in specs_of(tensors)]

    def join_sync_group(self, key: str, addr: str, port: int, rank: int, names: list[str], timeout_s: float) -> bool:
        nccl = torch.cuda.is_available() and not fake_gpus() and bool(ray.get_gpu_ids())
        self.sync_groups[key] = SyncGroup.join(key, addr, port, rank, len(names), names, timeout_s, nccl=nccl)
        return True

    def leave_sync_group(self, key: str) -> bool:
        group = self.sync_groups.pop(key, None)
        self.sync_staging.pop(key, None)
        if group is not None:
            group.close()
        return True

    def sync_weights(self, route: dict[str, Any], process: str) -> dict[str, Any]:
        """This process's part of one route's sync (see ``chatlearn.runtime.weights.sync``): gather and send when it
        hosts the trainer, receive when it is a remote inference rank, copy in-process when both."""
        src, dst = route["src"], route["dst"]
        hosts_src = process in route["src_ranks"]
        hosts_dst = any(process in rep for rep in route["dst_ranks"])
        self._hand_over([m for m, here in ((src, hosts_src), (dst, hosts_dst)) if here], ("weights",))
        specs = [(n, tuple(shape), getattr(torch, dtype)) for n, shape, dtype in route["specs"]]
        if hosts_src:
            self.slots[src].module.gather_stages()  # pipeline stages: every stage's weights, current
        group = self.sync_groups.get(route["key"]) if process in route["members"] else None
        if process in route["members"] and group is None:
            raise RuntimeError(f"param sync {route['key']}: {process} is not in its sync group (not joined)")
        with self.marks.stage(f"{src}->{dst}", "sync_weights"):
            stats = transfer(specs, group=group,
                             sources=self.slots[src].module.sync_sources() if hosts_src else None,
                             targets=self.slots[dst].module.sync_targets() if hosts_dst else None,
                             comm=route["comm"], coalesce=route["coalesce"], max_bytes=route["bucket_bytes"],
                             debug=route["debug"], staging=self.sync_staging.setdefault(route["key"], Staging()))
            if hosts_dst:
                self.slots[dst].module.weights_synced()
            return stats

    def _hand_over(self, names: list[str], needs: tuple[str, ...]) -> None:
        for other, mm in self.memory.items():
            if other not in names:
                for part, n in mm.offload(PARTS).items():
                    self.released[other][part] += n
        for name in names:
            mm = self.memory.get(name)
            if mm is not None:
                for part, n in mm.offload([p for p in PARTS if p not in needs and p != "grads"]).items():
                    self.released[name][part] += n
                mm.onload(needs)

    # -- process-wide ---------------------------------------------------------------------------------------
    def begin_episode(self, episode: int, profiler_dir: str | None = None) -> dict[str, Any]:
        """Name `episode` in this process's NVTX ranges; with ``profiler_dir``, profile it (``runtime.nsys``,
        ``runtime.profiler_dir``: see ``chatlearn.runtime.records.profiling``)."""
        return self.marks.begin(episode, profiler_dir)

    def end_episode(self) -> list[str]:
        """Stop this process's profiler, if running; returns the trace files it wrote."""
        return self.marks.end()

    def ping(self) -> bool:
        return True

    def peak_memory(self) -> float:
        return max(slot.peak_memory() for slot in self.slots.values())

    def memory_report(self) -> dict[str, Any]:
        """Bytes each model released so far, per part, and what is resident now (for tests and benchmarks)."""
        return {name: {"released": dict(self.released[name]),
                       "resident": {p: mm.resident(p) for p in PARTS} if (mm := self.memory.get(name)) else None}
                for name in self.slots}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
