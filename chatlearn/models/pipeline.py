"""Pipeline parallel for Hugging Face decoder-only LMs: stages, the 1F1B training step, stage-to-stage inference.

A replica with ``pp`` stages keeps the whole model in every process (so sync, export and checkpoints see
whole tensors after :func:`gather_stages`), but each stage runs and trains only its own layers: stage 0 the
embedding and the first layers, the last stage the last layers, the final norm and the LM head. Training runs
torch.distributed.pipelining's 1F1B schedule over the global batch's micro-batches; inference (log-probs,
generation) passes activations stage to stage with plain send/recv. The replica's groups and coordinates come
from :class:`chatlearn.models.parallel.ParallelContext` (``ctx`` below).
"""

import inspect
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

# the masks' KV-cache argument: `cache` from transformers 5.2x, `past_key_values` before (5.19, which vLLM 0.32 needs)
_NO_CACHE = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

__all__ = ["LMStage", "PipelinedLM", "gather_stages", "pipeline_train", "pipelined_logits", "shared_parameters",
           "stage_layers", "stage_parameters", "sum_shared_grads"]


def stage_layers(num_layers: int, stages: int, index: int) -> range:
    """The decoder layers of stage ``index``: contiguous, as even as possible, earlier stages one more."""
    per, extra = divmod(num_layers, stages)
    start = index * per + min(index, extra)
    return range(start, start + per + (1 if index < extra else 0))


class LMStage(torch.nn.Module):
    """One pipeline stage of a Hugging Face decoder-only LM (``model.model.{embed_tokens,layers,norm,
    rotary_emb}`` and ``model.lm_head``), computing what the whole model computes for its layers, with the
    model's own causal mask. Takes and returns plain tensors, as a pipeline stage must."""

    def __init__(self, lm: torch.nn.Module, index: int, stages: int):
        super().__init__()
        base = lm.model
        self.first, self.last = index == 0, index == stages - 1
        self.config = base.config
        self.embed_tokens = base.embed_tokens if self.first else None
        self.layers = torch.nn.ModuleList(base.layers[i] for i in stage_layers(len(base.layers), stages, index))
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if self.last else None
        self.lm_head = lm.lm_head if self.last else None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask`` None: a packed row (its sequences told apart by their restarting ``position_ids``,
        :mod:`chatlearn.models.hf.packing`)."""
        h = self.embed_tokens(x) if self.first else x
        masks: dict[str, Any] = {}  # by attention type: a sliding-window layer (Mistral's) sees only its window
        pe = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers:
            kind = getattr(layer, "attention_type", None) or (
                "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention")
            if kind not in masks:
                make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
                masks[kind] = make(config=self.config, inputs_embeds=h, attention_mask=attention_mask,
                                   position_ids=position_ids, **{_NO_CACHE: None})
            h = layer(h, attention_mask=masks[kind], position_embeddings=pe, position_ids=position_ids)
        if self.last:
            h = self.lm_head(self.norm(h))
        return h


def stage_parameters(model: torch.nn.Module, stage: LMStage) -> set[str]:
    """Names (in ``model``) of the parameters stage ``stage`` owns."""
    mine = {id(p) for p in stage.parameters()}
    if not stage.first:  # the rotary embedding has no parameters; embeddings belong to stage 0 only
        mine -= {id(p) for p in model.model.embed_tokens.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in mine}


def shared_parameters(model: torch.nn.Module, stages: int) -> set[str]:
    """Names (in ``model``) of the parameters that more than one of the ``stages`` computes with: tied
    input/output embeddings (the first stage's ``embed_tokens`` is the last stage's ``lm_head``)."""
    users: dict[int, int] = {}
    for index in range(stages):
        for p in LMStage(model, index, stages).parameters():
            users[id(p)] = users.get(id(p), 0) + 1
    return {n for n, p in model.named_parameters() if users.get(id(p), 0) > 1}


@torch.no_grad()
def sum_shared_grads(model: torch.nn.Module, ctx: Any, shared: set[str]) -> None:
    """Sum the gradients of the ``shared`` parameters over the stages (a stage without one adds zeros), so
    every stage holds the whole gradient; every stage calls it, after the backward and before clipping."""
    group = ctx.dim_groups["pp"]
    params = dict(model.named_parameters())
    for name in sorted(shared):
        p = params[name]
        if not p.requires_grad:  # frozen (LoRA): no gradient anywhere
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)


def _peer(ctx: Any, pp_index: int) -> int:
    """Global rank of the process at stage ``pp_index`` with this process's other coordinates."""
    mine = ctx.coords
    for r in range(ctx.dims.size):
        c = ctx.dims.coords(r)
        if c["pp"] == pp_index and all(c[d] == mine[d] for d in mine if d != "pp"):
            return ctx.ranks[r]
    raise ValueError(f"no rank at stage {pp_index}")


@torch.no_grad()
def gather_stages(model: torch.nn.Module, ctx: Any, owned: dict[int, set[str]]) -> None:
    """Make every stage's copy of the whole model current: each parameter is broadcast from its stage."""
    group = ctx.dim_groups["pp"]
    params = dict(model.named_parameters())
    for stage in range(ctx.dims.pp):
        src = _peer(ctx, stage)
        for name in sorted(owned[stage]):
            dist.broadcast(params[name].data, src=src, group=group)


@torch.no_grad()
def pipelined_logits(stage: LMStage, ctx: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor, hidden_size: int, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Inference through the stages (every stage calls it with the same inputs); every stage gets the logits."""
    index, group = ctx.coords["pp"], ctx.dim_groups["pp"]
    b, t = input_ids.shape
    if stage.first:
        h = input_ids
    else:
        h = torch.empty(b, t, hidden_size, dtype=dtype, device=input_ids.device)
        dist.recv(h, src=_peer(ctx, index - 1), group=group)
    out = stage(h, attention_mask, position_ids)
    if not stage.last:
        dist.send(out.contiguous(), dst=_peer(ctx, index + 1), group=group)
        out = torch.empty(b, t, vocab_size, dtype=dtype, device=input_ids.device)
    dist.broadcast(out, src=_peer(ctx, ctx.dims.pp - 1), group=group)
    return out


def pipeline_train(stage: LMStage, ctx: Any, micro_batches: list[dict[str, torch.Tensor]],
                   loss_of: Any) -> None:
    """Forward and backward of the micro-batches through the stages with the 1F1B schedule.

    ``micro_batches`` hold ``input_ids``, ``position_ids`` and (unless packed) ``attention_mask`` of one shape
    each (pad them first); ``loss_of(i, logits)`` gives the loss of micro-batch ``i`` to backward, already weighted (no
    schedule scaling). Runs on the last stage only."""
    device = micro_batches[0]["input_ids"].device
    pipe = PipelineStage(stage, stage_index=ctx.coords["pp"], num_stages=ctx.dims.pp, device=device,
                         group=ctx.dim_groups["pp"])
    schedule = Schedule1F1B(pipe, n_microbatches=len(micro_batches),
                            loss_fn=lambda logits, target: loss_of(int(target.reshape(-1)[0]), logits),
                            scale_grads=False)
    cat = {k: torch.cat([mb[k] for mb in micro_batches]) for k in micro_batches[0]}
    target = torch.arange(len(micro_batches)).repeat_interleave(micro_batches[0]["input_ids"].shape[0])
    args = (cat.pop("input_ids"),) if stage.first else ()
    cat.pop("input_ids", None)
    schedule.step(*args, **cat, target=target if stage.last else None, losses=[] if stage.last else None)


class PipelinedLM:
    """Called like the model for inference (``input_ids``, ``attention_mask``, ``position_ids``): runs the
    stages in turn and returns ``.logits`` on every stage."""

    def __init__(self, model: torch.nn.Module, ctx: Any):
        self.ctx, self.config = ctx, model.config
        self.dtype = next(model.parameters()).dtype

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, logits_to_keep: torch.Tensor | None = None,
                 use_cache: bool = False) -> Any:
        # use_cache: taken as the model takes it; the stages keep no cache
        logits = pipelined_logits(self.ctx.stage, self.ctx, input_ids, attention_mask, position_ids,
                                  self.config.hidden_size, self.config.vocab_size, self.dtype)
        return SimpleNamespace(logits=logits if logits_to_keep is None else logits[:, logits_to_keep])
