"""Where every process of every model runs: ChatLearn's placement rules as a plain, Ray-free plan.

The plan is computed from the config and a description of the cluster (nodes with GPUs and CPUs), so
``chatlearn plan`` can show it for a cluster that does not exist yet, and ``launch`` realises exactly this
plan with Ray placement groups (one bundle per process, pinned to the planned node). Rules
(``reference/chatlearn.md`` §1.5–1.7):

* Devices per replica = TP × PP × zero_size. An inference model has ``num_gpu / that`` replicas, a trainable
  model one replica holding all its devices. On CPU the same arithmetic holds with processes of
  ``cpu_per_process`` cores in place of devices.
* One *placement unit* (a Ray placement group and a torch.distributed world) per colocation group and one per
  model that is not colocated, in that order. A colocation group needs the largest member's devices.
* Inside a group, models are bin-packed ("packs"): models of one pack use disjoint devices, packs share
  devices, and each model on a device gets an equal share of it. Unlike ChatLearn, the colocated models on one
  device live in ONE worker process (as verl's hybrid workers), so torch is imported once per device and a
  colocated trainer → inference sync is an in-process copy.
* CPU-only models: ``cpu_schedule_strategy`` PACK fills nodes in order, SPREAD deals processes round-robin
  over the nodes. (ChatLearn 1.0.2 always reused the GPU bundles, so its strategy setting was dead; here it
  acts.)

ChatLearn's packing loop can crash (``IndexError``) when a pack is refilled and its old free-size key is left
behind as an empty list; :func:`find_packs` keeps the same choices without that bug.
"""

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chatlearn.config import ChatLearnConfig, ModelConfig
from chatlearn.utils.errors import UserError

__all__ = [
    "NodeSpec",
    "PlacementError",
    "PlacementPlan",
    "ProcessSpec",
    "RankPlacement",
    "UnitSpec",
    "find_packs",
    "plan_placement",
    "table_text",
    "uniform_cluster",
]


class PlacementError(UserError, ValueError):
    """The config does not fit the cluster; the message lists what is required and what is available."""


@dataclass(frozen=True)
class NodeSpec:
    """One node of a cluster: its GPUs, and its CPUs (None: not limited, e.g. a plan without --cpus-per-node)."""

    gpus: int = 0
    cpus: float | None = None


def uniform_cluster(nodes: int, gpus_per_node: int, cpus_per_node: float | None = None) -> list[NodeSpec]:
    return [NodeSpec(gpus_per_node, cpus_per_node) for _ in range(nodes)]


@dataclass(frozen=True)
class RankPlacement:
    """One rank (process) of one replica of one model."""

    node: int
    share: float  # the model's share of each of its devices (0 for a CPU model)
    process: int  # worker process id; colocated models sharing a process have the same id
    devices: tuple[int, ...] = ()  # the process's GPUs on its node; empty for a CPU model

    @property
    def device(self) -> int | None:
        """The process's first GPU on its node; None for a CPU model."""
        return self.devices[0] if self.devices else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "device": self.device, "share": round(self.share, 6),
                               "process": self.process}
        if len(self.devices) > 1:
            out["devices"] = list(self.devices)
        return out


@dataclass
class ProcessSpec:
    """One worker process: where it runs, what it asks Ray for, and the model ranks it hosts."""

    id: int
    unit: int
    unit_rank: int  # rank in its unit's torch.distributed world
    node: int
    devices: tuple[int, ...]
    cpus: float
    members: list[tuple[str, int, int]] = field(default_factory=list)  # (model, replica, rank in replica)

    @property
    def gpus(self) -> float:
        return float(len(self.devices))

    @property
    def models(self) -> list[str]:
        return [m for m, _, _ in self.members]


@dataclass
class UnitSpec:
    """A placement group: a colocation group or a lone model, and its processes (one bundle each)."""

    id: int
    models: list[str]
    kind: str  # "gpu" or "cpu"
    processes: list[int]
    packs: list[list[str]]


@dataclass
class PlacementPlan:
    models: dict[str, list[list[RankPlacement]]]  # model -> replicas -> ranks
    processes: list[ProcessSpec]
    units: list[UnitSpec]
    devices_required: int
    devices_available: int
    cpus_required: float
    cpus_available: float | None
    colocated: dict[str, list[str]]  # model -> the models it shares devices with (empty: not colocated)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "models": {name: {"num_replica": len(reps), "replicas": [[r.to_json() for r in rep] for rep in reps]}
                       for name, reps in self.models.items()},
            "devices_required": self.devices_required,
            "devices_available": self.devices_available,
            "cpus_required": self.cpus_required,
            "cpus_available": self.cpus_available,
            "warnings": self.warnings,
        }

    def rows(self) -> list[dict[str, Any]]:
        """One row per worker process, for the start-of-run table and the Prefect artifact."""
        rows = []
        for p in self.processes:
            hosted = ", ".join(f"{m} replica {r}" + (f" rank {k}" if len(self.models[m][r]) > 1 else "")
                               for m, r, k in p.members)
            rows.append({"process": p.id, "node": p.node,
                         "devices": ",".join(map(str, p.devices)) or "cpu",
                         "cpus": p.cpus, "models": hosted})
        return rows

    def table(self) -> str:
        lines = [table_text(self.rows())]
        summary = f"devices: {self.devices_required} required, {self.devices_available} available"
        if self.cpus_required:
            have = "unlimited" if self.cpus_available is None else f"{self.cpus_available:g}"
            summary += f"; CPUs: {self.cpus_required:g} required, {have} available"
        return "\n".join([*lines, summary])


def table_text(rows: list[dict[str, Any]]) -> str:
    """Rows of equal keys as an aligned plain-text table."""
    if not rows:
        return ""
    head = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in head]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(str(r[h]).ljust(w) for h, w in zip(head, widths, strict=True)) for r in rows]
    return "\n".join(lines)


# -- replica arithmetic ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """A model's resource shape: ``slots`` devices (GPU) or processes (CPU) in ``replicas`` replicas."""

    kind: str
    slots: int
    replicas: int
    procs_per_replica: int
    slots_per_process: int  # gpu_per_process for a GPU model, 1 for a CPU model
    cpus_per_process: float

    @property
    def processes(self) -> int:
        return self.replicas * self.procs_per_replica


def _shape(m: ModelConfig) -> _Shape:
    layout = m.layout
    if m.num_gpu > 0:
        gpp = int(layout.gpus)
        return _Shape("gpu", layout.replicas * layout.processes * gpp, layout.replicas, layout.processes, gpp, 0.0)
    return _Shape("cpu", layout.replicas * layout.processes, layout.replicas, layout.processes, 1, layout.cpus)


# -- packing -----------------------------------------------------------------------------------------------------


def find_packs(models: Sequence[tuple[str, bool, int]], total: int) -> list[list[str]]:
    """ChatLearn's packing of one colocation group: ``models`` are (name, trainable, slots) over ``total`` slots.

    Sorted by (trainable, slots) descending; a model using every slot is its own pack; otherwise it closes an
    open pack whose free room equals its size, else goes into the open pack with the least room that fits,
    else opens a pack. Models in one pack get disjoint slots; packs share slots. E.g. A:8, B:4, C:4 on 8 ->
    [[A], [B, C]].
    """
    ordered = sorted(models, key=lambda x: (x[1], x[2]), reverse=True)
    final: list[list[str]] = []
    open_packs: dict[int, list[list[str]]] = defaultdict(list)  # free slots -> packs with that much room
    for name, _, size in ordered:
        if size == total:
            final.append([name])
        elif open_packs.get(size):
            pack = open_packs[size].pop(0)
            pack.append(name)
            final.append(pack)
        else:
            roomier = sorted(free for free, packs in open_packs.items() if free > size and packs)
            if roomier:
                pack = open_packs[roomier[0]].pop(0)
                pack.append(name)
                open_packs[roomier[0] - size].append(pack)
            else:
                open_packs[total - size].append([name])
    for packs in open_packs.values():
        final.extend(p for p in packs if p)
    return final


# -- the plan ----------------------------------------------------------------------------------------------------


def _units(cfg: ChatLearnConfig, names: Sequence[str]) -> list[list[str]]:
    """Colocation groups (members the engine uses, in config order), then each other model alone."""
    units, seen = [], set()
    for group in cfg.runtime.colocation_groups:
        members = [n for n in group if n in names and n not in seen]
        if members:
            units.append(members)
            seen.update(members)
    units += [[n] for n in names if n not in seen]
    return units


def _problems_of_units(units: list[list[str]], shapes: Mapping[str, _Shape]) -> list[str]:
    problems = []
    for members in units:
        if len(members) < 2:
            continue
        kinds = {shapes[n].kind for n in members}
        label = ",".join(members)
        if len(kinds) > 1:
            gpu = [n for n in members if shapes[n].kind == "gpu"]
            cpu = [n for n in members if shapes[n].kind == "cpu"]
            problems.append(f"runtime.colocation: group '{label}' mixes GPU models ({', '.join(gpu)}) and CPU-only "
                            f"models ({', '.join(cpu)}); colocated models share devices, so all must be one kind")
        for n in members:
            if shapes[n].kind == "gpu" and shapes[n].slots_per_process != 1:
                problems.append(f"models.{n}.gpu_per_process: colocated GPU models need gpu_per_process=1 "
                                f"(group '{label}'), got {shapes[n].slots_per_process}")
    return problems


def _need_text(units: list[list[str]], shapes: Mapping[str, _Shape], kind: str) -> str:
    parts = []
    for members in units:
        if shapes[members[0]].kind != kind:
            continue
        if kind == "gpu":
            need = max(shapes[n].slots for n in members)
        else:
            need = sum(_slot_cpus(members, shapes))
        if len(members) == 1:
            parts.append(f"{members[0]} {need:g}")
        else:
            each = ", ".join(f"{n} {shapes[n].slots if kind == 'gpu' else shapes[n].processes}" for n in members)
            parts.append(f"colocation group '{','.join(members)}' {need:g} ({each})")
    return "; ".join(parts)


def _slot_cpus(members: Sequence[str], shapes: Mapping[str, _Shape]) -> list[float]:
    """CPUs of each slot (process) of a CPU unit: the most any member on that slot asks for."""
    total = max(shapes[n].slots for n in members)
    cpus = [0.0] * total
    for n in members:
        for i in range(shapes[n].slots):
            cpus[i] = max(cpus[i], shapes[n].cpus_per_process)
    return cpus


def plan_placement(cfg: ChatLearnConfig, names: Sequence[str], nodes: Sequence[NodeSpec]) -> PlacementPlan:
    """Place the models ``names`` (the engine's, in its order) on ``nodes``; raises PlacementError listing
    every problem, with required and available resources per kind and per model."""
    models = {n: cfg.models[n] for n in names}
    shapes = {n: _shape(m) for n, m in models.items()}
    units = _units(cfg, names)
    problems = _problems_of_units(units, shapes)
    if problems:
        raise PlacementError("placement: the config cannot be placed: " + ". ".join(problems))

    # totals first: one clear message instead of a fragmentation error
    gpu_units = [u for u in units if shapes[u[0]].kind == "gpu"]
    cpu_units = [u for u in units if shapes[u[0]].kind == "cpu"]
    gpus_required = sum(max(shapes[n].slots for n in u) for u in gpu_units)
    gpus_available = sum(node.gpus for node in nodes)
    cpus_required = sum(sum(_slot_cpus(u, shapes)) for u in cpu_units)
    limited = all(node.cpus is not None for node in nodes)
    cpus_available = sum(node.cpus or 0 for node in nodes) if limited else None
    lacking = []
    cluster = f"{len(nodes)} node(s)"
    if gpus_required > gpus_available:
        lacking.append(f"GPUs: {gpus_required} required, {gpus_available} available ({cluster}: "
                       f"{', '.join(str(n.gpus) for n in nodes)} GPUs); per model: "
                       f"{_need_text(units, shapes, 'gpu')}")
    if cpus_available is not None and cpus_required > cpus_available:
        lacking.append(f"CPUs: {cpus_required:g} required, {cpus_available:g} available ({cluster}: "
                       f"{', '.join(f'{n.cpus:g}' for n in nodes)} CPUs); per model: "
                       f"{_need_text(units, shapes, 'cpu')}")
    if lacking:
        # one line, each kind of device a sentence: what the terminal shows, before anything starts
        raise PlacementError("placement: the config needs more than the cluster has: " + ". ".join(lacking))
    warnings = []
    if gpus_available > gpus_required and gpus_required > 0:
        warnings.append(f"{gpus_available - gpus_required} of {gpus_available} GPUs are not used by any model "
                        f"(required: {_need_text(units, shapes, 'gpu')})")

    free_gpus = [list(range(node.gpus)) for node in nodes]
    free_cpus = [node.cpus for node in nodes]
    spread_next = 0
    plan_models: dict[str, list[list[RankPlacement | None]]] = {
        n: [[None] * shapes[n].procs_per_replica for _ in range(shapes[n].replicas)] for n in names}
    processes: list[ProcessSpec] = []
    unit_specs: list[UnitSpec] = []
    colocated: dict[str, list[str]] = {n: [] for n in names}
    for uid, members in enumerate(units):
        kind = shapes[members[0]].kind
        total = max(shapes[n].slots for n in members)
        packs = find_packs([(n, models[n].trainable, shapes[n].slots) for n in members], total)
        for pack in packs:
            for n in pack:
                colocated[n] = [m for m in members if m not in pack]
        # which model rank sits on each slot: packs share slots, models of one pack follow each other
        on_slot: list[list[tuple[str, int]]] = [[] for _ in range(total)]
        for pack in packs:
            offset = 0
            for n in pack:
                for i in range(shapes[n].slots):
                    on_slot[offset + i].append((n, i))
                offset += shapes[n].slots
        # where each slot goes: (node, device) for GPUs; (node, None) for CPU processes
        if kind == "gpu":
            where = _place_gpu_slots(total, free_gpus, [node.gpus for node in nodes], members, shapes)
            slot_cpus = [0.0] * total
        else:
            slot_cpus = _slot_cpus(members, shapes)
            where, spread_next = _place_cpu_slots(slot_cpus, free_cpus, cfg.runtime.cpu_schedule_strategy,
                                                  spread_next, members)
        # processes: one per slot, except a lone GPU model with gpu_per_process > 1 (one per gpp slots)
        step = shapes[members[0]].slots_per_process if len(members) == 1 else 1
        unit = UnitSpec(uid, list(members), kind, [], packs)
        for first in range(0, total, step):
            node = where[first][0]
            devices = tuple(where[s][1] for s in range(first, first + step)) if kind == "gpu" else ()
            if kind == "gpu" and any(where[s][0] != node for s in range(first, first + step)):
                raise PlacementError(f"placement: a process of {members[0]} would span two nodes; make "
                                     f"gpu_per_process divide the GPUs per node")
            proc = ProcessSpec(len(processes), uid, len(unit.processes), node, devices, slot_cpus[first])
            for n, rank in on_slot[first]:
                sh = shapes[n]
                replica, k = divmod(rank // step, sh.procs_per_replica)
                share = 1.0 / len(on_slot[first]) if kind == "gpu" else 0.0
                plan_models[n][replica][k] = RankPlacement(node, share, proc.id, devices)
                proc.members.append((n, replica, k))
            processes.append(proc)
            unit.processes.append(proc.id)
        unit_specs.append(unit)
    done = {n: [[r for r in rep if r is not None] for rep in reps] for n, reps in plan_models.items()}
    return PlacementPlan(done, processes, unit_specs, gpus_required, gpus_available, cpus_required, cpus_available,
                         colocated, warnings)


def _place_gpu_slots(total: int, free: list[list[int]], sizes: Sequence[int], members: Sequence[str],
                     shapes: Mapping[str, _Shape]) -> list[tuple[int, int]]:
    """A unit of ``total`` GPUs: on the first node with room, else on whole free nodes (ChatLearn's rule)."""
    for node, devs in enumerate(free):
        if len(devs) >= total:
            taken, free[node] = devs[:total], devs[total:]
            return [(node, d) for d in taken]
    whole = [node for node, devs in enumerate(free) if devs and len(devs) == sizes[node]]
    got, where = 0, []
    for node in whole:
        if got >= total:
            break
        where += [(node, d) for d in free[node]]
        got += len(free[node])
    if got == total:
        for node in {n for n, _ in where}:
            free[node] = []
        return where
    label = ",".join(members)
    need = ", ".join(f"{n} {shapes[n].slots}" for n in members)
    raise PlacementError(f"placement: '{label}' needs {total} GPUs on one node, or whole free nodes adding up to "
                         f"exactly {total} ({need}); free GPUs per node: {[len(d) for d in free]}")


def _place_cpu_slots(slot_cpus: list[float], free: list[float | None], strategy: str, start: int,
                     members: Sequence[str]) -> tuple[list[tuple[int, None]], int]:
    """CPU processes: PACK fills nodes in order; SPREAD deals them round-robin. Returns places and next start."""
    where: list[tuple[int, None]] = []
    n_nodes = len(free)
    for cpus in slot_cpus:
        order = range(n_nodes) if strategy == "PACK" else [(start + i) % n_nodes for i in range(n_nodes)]
        for node in order:
            room = free[node]
            if room is None or room >= cpus:
                if room is not None:
                    free[node] = room - cpus
                where.append((node, None))
                if strategy != "PACK":
                    start = (node + 1) % n_nodes
                break
        else:
            raise PlacementError(f"placement: no node has {cpus:g} free CPUs for a process of "
                                 f"'{','.join(members)}'; free CPUs per node: {free}")
    return where, start
