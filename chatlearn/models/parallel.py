"""How one model replica of several processes splits its work: data, ZeRO, tensor and pipeline parallel.

ChatLearn gets these from Megatron and DeepSpeed; here they come from PyTorch itself, so the same code runs on
gloo (CPU, and CI) and NCCL (GPU). A replica of ``P`` processes is laid out as ``pp × dp × shard × tp``
(ranks numbered with ``tp`` fastest, as Megatron does): ``tp = tensor_model_parallel_size``, ``shard =
zero_size``, ``pp = pipeline_model_parallel_size`` and ``dp`` what is left. The framework creates one
process group per dimension (``Worker.init_distributed``) and hands the module a :class:`ParallelContext`;
:func:`parallelize` then applies

* tensor parallel: DTensor ``parallelize_module`` with transformers' ``base_model_tp_plan`` where the model has
  one, the Llama-style plan otherwise (q/k/v/gate/up column-wise, o/down row-wise);
* ZeRO (``shard > 1``): FSDP2 ``fully_shard`` of every decoder layer and the whole model (HSDP when ``dp > 1``);
* data parallel alone: ``DistributedDataParallel``; data parallel next to TP: one all-reduce of the local
  gradients over the ``dp`` group after the micro-batches.

Gradients are *summed* over data-parallel ranks (not averaged): every rank gets the whole global batch, runs
only its share of the micro-batches (:meth:`ParallelContext.data_shard`) with the same per-micro-batch weights
one process would use, so the summed gradient is exactly one process's.

Pipeline parallel (``pipeline_model_parallel_size``, alone for now) splits the decoder layers into stages
(:mod:`chatlearn.models.pipeline`).
"""

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from chatlearn.models.pipeline import LMStage, shared_parameters, stage_parameters, sum_shared_grads
from chatlearn.utils.tied import restore_aliases, without_aliases

__all__ = ["DIMS", "ParallelContext", "ParallelDims", "full_tensor", "full_tensors", "load_full_tensor", "parallelize",
           "tp_plan"]

DIMS = ("pp", "dp", "shard", "tp")

# The Llama-style plan, for models whose config has no `base_model_tp_plan`.
DEFAULT_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of a replica's dimensions; ``size`` processes, numbered with ``tp`` fastest:
    rank = ((pp_i * dp + dp_i) * shard + shard_i) * tp + tp_i."""

    pp: int = 1
    dp: int = 1
    shard: int = 1
    tp: int = 1

    @classmethod
    def of(cls, processes: int, tp: int = 1, zero: int = 1, pp: int = 1) -> "ParallelDims":
        per = tp * zero * pp
        if processes % per:
            raise ValueError(f"{processes} processes are not a multiple of TP*PP*zero_size = {per}")
        return cls(pp=pp, dp=processes // per, shard=zero, tp=tp)

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.shard * self.tp

    @property
    def data_ranks(self) -> int:
        """Ranks that see different data: data parallel × ZeRO shards."""
        return self.dp * self.shard

    def coords(self, rank: int) -> dict[str, int]:
        return {"pp": rank // (self.dp * self.shard * self.tp), "dp": rank // (self.shard * self.tp) % self.dp,
                "shard": rank // self.tp % self.shard, "tp": rank % self.tp}

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """The rank groups (replica-local ranks) along ``dim``: ranks that differ only in that coordinate."""
        out: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            out.setdefault(tuple(v for k, v in c.items() if k != dim), []).append(r)
        return [tuple(g) for g in out.values()]


@dataclass
class ParallelContext:
    """What a module of a multi-process replica needs: its dims, rank, and the process group of each dim
    (None for a dim of size 1). ``ranks`` are the replica's ranks in the torch.distributed world."""

    dims: ParallelDims
    rank: int
    ranks: list[int]
    group: Any
    dim_groups: dict[str, Any] = field(default_factory=dict)
    # pipeline parallel: this process's stage module, the parameter names each stage owns, and those several
    # stages compute with (tied embeddings; owned by the first of them)
    stage: Any = None
    owned: dict[int, set[str]] = field(default_factory=dict)
    shared: set[str] = field(default_factory=set)
    # tensor parallel: replicated parameters whose gradient each rank computes from its own heads only (Qwen3's
    # per-head q_norm/k_norm, transformers' "replicated_with_grad_allreduce"): summed over the tp group
    tp_partial: set[str] = field(default_factory=set)

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.rank)

    @property
    def data_rank(self) -> int:
        c = self.coords
        return c["dp"] * self.dims.shard + c["shard"]

    def mesh(self, *dims: str) -> Any:
        """A DeviceMesh over ``dims`` of this replica (built from the existing groups: no new collectives)."""
        device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        groups = [self.dim_groups[d] for d in dims]
        if len(dims) == 1:
            return DeviceMesh.from_group(groups[0], device, mesh_dim_names=dims)
        shape = [getattr(self.dims, d) for d in dims]
        # the replica's ranks that share this rank's coordinates on the dims not in the mesh
        mine = self.coords
        members = [r for r in range(self.dims.size)
                   if all(self.dims.coords(r)[d] == mine[d] for d in DIMS if d not in dims)]
        mesh = torch.tensor([self.ranks[r] for r in members]).view(*shape)
        return DeviceMesh.from_group(groups, device, mesh=mesh, mesh_dim_names=dims)

    # -- training helpers --------------------------------------------------------------------------------------
    def data_shard(self, model: torch.nn.Module, data_list: list[Any]) -> Iterator[tuple[Any, float]]:
        """This rank's micro-batches of a global batch, as ``(micro_batch, on)``, round robin over the data
        ranks. ``on`` is 1.0, or 0.0 for a stand-in: every rank runs the same number of forward and backward
        passes (FSDP gathers parameters in each, DDP reduces in each rank's last backward), so a rank with
        fewer micro-batches than another runs zero-weight ones. Gradient sync is on in the last backward only."""
        n = self.dims.data_ranks
        if n == 1:
            items = [(mb, 1.0) for mb in data_list]
        else:
            mine = data_list[self.data_rank::n]
            count = -(-len(data_list) // n)
            items = [(mb, 1.0) for mb in mine] + [(data_list[0], 0.0)] * (count - len(mine))
        for i, item in enumerate(items):
            _set_grad_sync(model, i == len(items) - 1)
            yield item

    def sum_stats(self, stats: dict[str, float], keys: list[str] | tuple[str, ...]) -> dict[str, float]:
        """Sum ``keys`` of the per-rank statistics over the data ranks (each rank weighed its share) and the
        pipeline stages."""
        if (self.dims.data_ranks == 1 and self.dims.pp == 1) or not keys:
            return stats
        t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
        for d in ("dp", "shard", "pp"):  # pipeline: only the last stage computed the loss, the others add 0
            if self.dim_groups.get(d) is not None:
                dist.all_reduce(t, group=self.dim_groups[d])
        return {**stats, **dict(zip(keys, t.tolist(), strict=True))}

    def finish_grads(self, model: torch.nn.Module) -> None:
        """Data parallel next to tensor parallel: sum the local gradients over the ``dp`` group (DDP and FSDP
        have reduced them in the backward already). Pipeline parallel: sum the gradients of parameters several
        stages use over the stages (:func:`~chatlearn.models.pipeline.sum_shared_grads`). Tensor parallel: sum
        the partial gradients of the replicated per-head parameters (:func:`tp_partial_parameters`) over the
        ``tp`` group."""
        if self.dims.pp > 1 and self.shared:
            sum_shared_grads(model, self, self.shared)
        if self.tp_partial:
            partial = [p for n, p in model.named_parameters() if n in self.tp_partial and p.grad is not None]
            if partial:
                grads = [_local(p.grad) for p in partial]
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=self.dim_groups["tp"])
                for g, s in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                    g.copy_(s)
        if self.dims.dp == 1 or getattr(model, "_chatlearn_reduces_grads", False):
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # this rank's micro-batches did not touch it: it adds zero
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dim_groups["dp"])
        for g, s in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(s)


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _set_grad_sync(model: torch.nn.Module, on: bool) -> None:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model.require_backward_grad_sync = on
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(on)


def _sum_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: sum (not average) the bucket over the group."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def tp_plan(model: torch.nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan for ``model``'s module names: transformers' ``base_model_tp_plan`` (its
    ``colwise``/``rowwise`` entries) or the Llama-style default, matched under any prefix."""
    config = getattr(model, "config", None) or getattr(getattr(model, "backbone", None), "config", None)
    plan = dict(getattr(config, "base_model_tp_plan", None) or DEFAULT_TP_PLAN)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    patterns = [(re.compile(r"(^|\.)" + re.escape(k).replace(r"\*", r"\d+") + "$"), styles[v])
                for k, v in plan.items() if v in styles]
    out: dict[str, Any] = {}
    for name, _ in model.named_modules():
        for pattern, style in patterns:
            if pattern.search(name):
                out[name] = style()
                break
    if not out:
        raise ValueError(f"tensor parallel: no module of {type(model).__name__} matches the plan {sorted(plan)}")
    return out


def tp_partial_parameters(model: torch.nn.Module) -> set[str]:
    """Names of the parameters that the plan keeps whole on every tensor-parallel rank but whose gradient each
    rank only has a part of: those of modules planned ``replicated_with_grad_allreduce`` (Qwen3's
    ``q_norm``/``k_norm`` normalize each head, and a rank holds only its own heads)."""
    config = getattr(model, "config", None) or getattr(getattr(model, "backbone", None), "config", None)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    patterns = [re.compile(r"(^|\.)" + re.escape(k).replace(r"\*", r"\d+") + "$")
                for k, v in plan.items() if v == "replicated_with_grad_allreduce"]
    return {f"{name}.{p}" if name else p for name, module in model.named_modules()
            if any(pattern.search(name) for pattern in patterns) for p, _ in module.named_parameters(recurse=False)}


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if re.search(r"(^|\.)layers\.\d+$", name)]


def parallelize(model: torch.nn.Module, ctx: "ParallelContext | None", trainable: bool) -> torch.nn.Module:
    """Apply the replica's layout to ``model`` (in place where torch does; returns the module to call for
    training, a DDP wrapper for plain data parallel). Build the optimizer after this: FSDP2 and TP replace the
    parameters with DTensors."""
    if ctx is None or ctx.dims.size == 1:
        return model
    dims = ctx.dims
    if dims.pp > 1:
        if dims.size != dims.pp:
            raise ValueError("pipeline parallel next to tensor/data parallel or ZeRO is not supported yet")
        ctx.owned = {i: stage_parameters(model, LMStage(model, i, dims.pp)) for i in range(dims.pp)}
        ctx.shared = shared_parameters(model, dims.pp)
        ctx.stage = LMStage(model, ctx.coords["pp"], dims.pp)
        return model
    if dims.tp > 1:
        parallelize_module(model, ctx.mesh("tp"), tp_plan(model))
        if trainable:
            ctx.tp_partial = tp_partial_parameters(model)
    if not trainable:
        if dims.data_ranks > 1:
            raise ValueError("an inference replica has no data-parallel ranks (zero_size is for trainers)")
        return model
    if dims.shard > 1:
        mesh = ctx.mesh("dp", "shard") if dims.dp > 1 else ctx.mesh("shard")
        layers = _decoder_layers(model)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in [*layers, model]:  # each FSDP unit reduces its own gradients
            m.set_gradient_divide_factor(1.0)  # sum over ranks: each weighted its micro-batches already
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
        model._chatlearn_reduces_grads = True
        return model
    if dims.dp > 1 and dims.tp == 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=ctx.dim_groups["dp"],
                                                      broadcast_buffers=False)
        ddp.register_comm_hook(ctx.dim_groups["dp"], _sum_hook)
        model._chatlearn_reduces_grads = True  # finish_grads looks at the module, not the wrapper
        return ddp
    return model


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, pp_group: Any = None,
                   counted_elsewhere: Iterable[torch.nn.Parameter] = ()) -> float:
    """Clip the global gradient norm (DTensor gradients of sharded parameters included; with ``pp_group``,
    each stage's own gradients) as ``torch.nn.utils.clip_grad_norm_`` does; returns the norm before clipping.
    ``counted_elsewhere``: parameters whose gradient another stage counts (a tied weight's, which every stage
    that uses it holds whole): clipped here, counted once."""
    elsewhere = {id(p) for p in counted_elsewhere}
    grads = [p.grad for p in params if p.grad is not None]
    plain = torch.zeros((), dtype=torch.float32)
    sharded = None
    for g in (p.grad for p in params if p.grad is not None and id(p) not in elsewhere):
        sq = g.detach().float().pow(2).sum()
        if isinstance(sq, DTensor):
            sharded = sq if sharded is None else sharded + sq
        else:
            plain = plain + sq.to(plain.device)
    total = plain + (sharded.full_tensor().to(plain.device) if sharded is not None else 0.0)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        _local(g).mul_(coef.to(_local(g).device))
    return float(norm)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from its shards for a DTensor (a collective: every rank of its mesh calls
    it in the same order), the tensor itself otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_tensors(tensors: Mapping[str, torch.Tensor],
                 device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """Every tensor whole and detached (on ``device`` when given), by name: a collective of the shards' ranks
    for DTensors, as :func:`full_tensor`. Tied names are gathered (and copied) once and stay one tensor."""
    unique, aliases = without_aliases(tensors)
    out = {}
    for k, v in unique.items():
        t = full_tensor(v).detach()
        out[k] = t.to(device) if device is not None else t
    return restore_aliases(out, aliases)


def load_full_tensor(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor ``full`` into ``target``: this rank's slice when ``target`` is a DTensor (no
    communication), all of it otherwise."""
    if isinstance(target, DTensor):
        piece = distribute_tensor(full.to(target.device), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(piece)
    else:
        target.copy_(full)
