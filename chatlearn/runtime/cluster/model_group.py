"""Realise a placement plan on Ray: placement groups, worker processes, torch.distributed worlds, models.

Each placement unit (a colocation group, or a model alone) becomes one Ray placement group with one bundle
per worker process, every bundle pinned to the node the plan chose (``ray.io/node-id`` label), so the plan
printed by ``chatlearn plan`` is what runs. Workers are created once per run by the flow process (the Ray
driver), never inside a task: an actor created in a task dies with it.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from chatlearn.config import ChatLearnConfig
from chatlearn.models.base_module import BaseModule
from chatlearn.models.parallel import DIMS, ParallelDims
from chatlearn.runtime.calls.handles import ModelHandle, ReplicaHandle
from chatlearn.runtime.calls.waiting import wait
from chatlearn.runtime.cluster.placement import NodeSpec, PlacementError, PlacementPlan
from chatlearn.runtime.cluster.worker import Worker

logger = logging.getLogger("chatlearn")

# How long a placement group may stay pending before the run gives up (the plan said it fits).
PG_TIMEOUT_S = 120.0


@dataclass
class ModelGroup:
    """The ranks of one model; ``replicas[r][k]`` is rank k of replica r."""

    name: str
    replicas: list[list[ModelHandle]] = field(default_factory=list)

    @property
    def actors(self) -> list[ModelHandle]:
        return [a for rep in self.replicas for a in rep]

    @property
    def heads(self) -> list[ReplicaHandle]:
        """Each replica, called as one (every rank gets the call, rank 0's result is returned): where batches
        are dispatched."""
        return [ReplicaHandle(rep) for rep in self.replicas]

    @property
    def num_replica(self) -> int:
        return len(self.replicas)


def cluster_nodes() -> tuple[list[NodeSpec], list[str]]:
    """The live Ray nodes as the plan sees them (head first, then by address and id) and their node ids."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    alive.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeManagerAddress"], n["NodeID"]))
    specs = [NodeSpec(int(n["Resources"].get("GPU", 0)), float(n["Resources"].get("CPU", 0))) for n in alive]
    return specs, [n["NodeID"] for n in alive]


@dataclass
class Workers:
    """The live worker processes of a run, by plan process id, and their placement groups."""

    plan: PlacementPlan
    actors: dict[int, Any]
    names: dict[int, str]
    groups: dict[str, ModelGroup]
    placement_groups: list[Any]

    def kill(self) -> None:
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead: nothing to clean
                pass
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed
                pass
        self.actors, self.placement_groups = {}, []


def start_workers(plan: PlacementPlan, node_ids: list[str], cfg: ChatLearnConfig, modules: dict[str, BaseModule],
                  namespace: str | None = None, name_prefix: str = "") -> Workers:
    """Create the plan's placement groups and worker processes and join their torch.distributed worlds.

    Models are not set up here (see :func:`setup_models`), so a failure leaves nothing half-initialised.
    """
    workers = Workers(plan, {}, {}, {}, [])
    try:
        for unit in plan.units:
            procs = [plan.processes[i] for i in unit.processes]
            bundles = [{"GPU": p.gpus} if p.devices else {"CPU": p.cpus} for p in procs]
            pg = placement_group(bundles, strategy="PACK",
                                 bundle_label_selector=[{"ray.io/node-id": node_ids[p.node]} for p in procs])
            workers.placement_groups.append(pg)
            try:
                ray.get(pg.ready(), timeout=PG_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise PlacementError(f"placement: Ray could not reserve {bundles} for {','.join(unit.models)} "
                                     f"within {PG_TIMEOUT_S:.0f}s (other jobs on the cluster?)") from None
            for bundle, p in enumerate(procs):
                members = [(m, modules[m], cfg.models[m], replica, rank) for m, replica, rank in p.members]
                colocated = {m: bool(plan.colocated.get(m)) for m in p.models}
                opts: dict[str, Any] = dict(
                    num_gpus=p.gpus, num_cpus=p.cpus, max_concurrency=1, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))
                name = f"{name_prefix}w{p.id}"
                if name_prefix:
                    opts["name"] = name
                if namespace:
                    opts["namespace"] = namespace
                env = {k: v for m in p.models for k, v in modules[m].process_env(cfg.runtime).items()}
                if env:  # merged by Ray with the run's own env_vars; set before the process's interpreter starts
                    opts["runtime_env"] = {"env_vars": env}
                worker = ray.remote(Worker).options(**opts)
                workers.actors[p.id] = worker.remote(members, cfg.runtime, p.cpus, colocated)
                workers.names[p.id] = name
        _join_worlds(plan, workers, cfg)
        for name, reps in plan.models.items():
            workers.groups[name] = ModelGroup(name, [[ModelHandle(workers.actors[r.process], name,
                                                                  workers.names[r.process]) for r in rep]
                                                     for rep in reps])
        return workers
    except BaseException:
        workers.kill()
        raise


def _join_worlds(plan: PlacementPlan, workers: Workers, cfg: ChatLearnConfig) -> None:
    """Units of several processes form one torch.distributed world each. Every multi-process replica gets a
    group in it, and one group per parallel dimension of size > 1 (data, ZeRO shard, tensor, pipeline; see
    :mod:`chatlearn.models.parallel`). torch requires every rank of a world to create every group, in the same
    order, so the driver lists them once and hands each rank the indices of its own."""
    timeout_s = cfg.runtime.stage_timeout_s
    calls = []
    for unit in plan.units:
        if len(unit.processes) < 2:
            continue
        groups: list[tuple[int, ...]] = []
        layouts: dict[tuple[str, int], dict[str, Any]] = {}

        def index(g: tuple[int, ...], groups: list[tuple[int, ...]] = groups) -> int:
            if g not in groups:
                groups.append(g)
            return groups.index(g)

        for m in unit.models:
            mc = cfg.models[m]
            for i, rep in enumerate(plan.models[m]):
                if len(rep) < 2:
                    continue
                ranks = tuple(plan.processes[r.process].unit_rank for r in rep)
                dims = ParallelDims.of(len(rep), mc.tensor_model_parallel_size or 1, mc.zero_size or 1,
                                       mc.pipeline_model_parallel_size or 1)
                dim_groups = {}
                for d in DIMS:
                    if getattr(dims, d) > 1:
                        dim_groups[d] = [index(tuple(ranks[k] for k in g)) for g in dims.groups(d)]
                layouts[(m, i)] = {"ranks": list(ranks), "group": index(ranks), "dims": dims.__dict__,
                                   "dim_groups": dim_groups}
        addr, port = wait(workers.actors[unit.processes[0]].free_port.remote(), "setup", timeout_s)
        for pid in unit.processes:
            p = plan.processes[pid]
            mine = {m: layouts[(m, replica)] for m, replica, _ in p.members if (m, replica) in layouts}
            calls.append(workers.actors[pid].init_distributed.remote(addr, port, len(unit.processes), p.unit_rank,
                                                                     [list(g) for g in groups], mine))
    wait(calls, "setup", timeout_s)


def setup_models(workers: Workers, concurrent: bool, timeout_s: float | None) -> dict[str, list[dict[str, Any]]]:
    """Run every model rank's `setup`: all at once (``concurrent_setup``) or model by model, as ChatLearn.

    Returns each model's setup infos (node, GPU ids, seconds); a model whose ranks did not land on the devices
    the plan gave is an error, since everything after (sync pairs, shares) assumes the plan."""
    t0 = time.perf_counter()
    if concurrent:  # every rank of every model starts before any result is awaited
        calls = {name: [h.setup.remote() for h in g.actors] for name, g in workers.groups.items()}
        infos = {name: wait(refs, "setup", timeout_s, name) for name, refs in calls.items()}
    else:
        infos = {name: wait([h.setup.remote() for h in g.actors], "setup", timeout_s, name)
                 for name, g in workers.groups.items()}
    logger.info("set up %d models (%s) in %.1fs", len(infos), "concurrently" if concurrent else "one by one",
                time.perf_counter() - t0)
    for name, reps in workers.plan.models.items():
        planned = [list(r.devices) for rep in reps for r in rep]
        got = [[int(g) for g in i["gpu_ids"]] for i in infos[name]]
        if any(planned) and got != planned:
            raise PlacementError(f"placement: {name} ranks got GPUs {got}, the plan gave {planned}")
    return infos
