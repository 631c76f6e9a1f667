"""The trainer loop every built-in trainer shares: one optimizer step per global batch.

`TrainerModule.train_step` receives the micro-batches of one global batch and owns everything but the loss: zeroing
the gradients, each micro-batch's share of the global batch (:mod:`chatlearn.algorithms.aggregation`), this
rank's micro-batches (data parallel) or the pipeline's 1F1B schedule, the backward passes (gradients
accumulate), the statistics summed over the ranks, clipping and the optimizer and LR-schedule step. A trainer
(PPO policy and value, GRPO, DPO, online DPO) is a sibling that says what its loss is (`loss`), what it runs
the model on (`forward`) and which statistics it reports (`stat_keys`).

`CausalLMTrainer` is the base of the trainers of a causal LM (the policy trainers): the model, its
tokenizer, LoRA and the pipeline stages.
"""

import functools
import math
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from chatlearn.algorithms.aggregation import GlobalMean, global_mean, units
from chatlearn.config import RuntimeConfig
from chatlearn.models.hf.common import (
    HFModelArgs,
    HFModule,
    ensure_model_files,
    full_sequence,
    load_causal_lm,
    load_tokenizer,
    packed_tokens_from,
    response_span,
    response_tokens,
    tokens_of,
    widen,
)
from chatlearn.models.hf.lora import LoraTrainerMixin
from chatlearn.models.hf.packing import pack, regroup
from chatlearn.models.pipeline import pipeline_train
from chatlearn.utils.finite import require_finite

__all__ = ["CausalLMTrainer", "OptimArgs", "TrainerModule", "lr_factor", "optimizer_step", "total_optimizer_steps"]


class OptimArgs(HFModelArgs):
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    max_grad_norm: float = Field(1.0, gt=0, description="clip the global grad norm to this")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="learning-rate schedule over the run's optimizer steps (after warmup)"
    )
    warmup_steps: int = Field(0, ge=0, description="linear warmup from 0 over this many optimizer steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of linear/cosine decay, as a fraction of lr")


def adamw(model: torch.nn.Module, args: OptimArgs) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (all of them, or only the LoRA adapters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                             betas=(args.adam_beta1, args.adam_beta2))


def total_optimizer_steps(rt: RuntimeConfig) -> int:
    """Optimizer steps of the whole run under the fixed stream: episodes x epochs x ceil(spe / global)."""
    return max(1, rt.num_episode * rt.steps_per_episode)


def lr_factor(step: int, args: OptimArgs, total: int) -> float:
    """Multiplier of `lr` at optimizer step `step` (0-based): warmup, then constant/linear/cosine decay."""
    if args.warmup_steps and step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    decay = 1.0 - progress if args.lr_scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * decay


def lr_scheduler(optimizer: torch.optim.Optimizer, args: OptimArgs, rt: RuntimeConfig):
    total = total_optimizer_steps(rt)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, args=args, total=total))


def optimizer_step(module: HFModule, max_grad_norm: float, prefix: str, skip: bool = False,
                   losses: dict[str, float] | None = None) -> dict[str, float]:
    """The end of every trainer's step: clip the gradients, step the optimizer (not when `skip`: the batch had
    nothing to learn from) and the LR schedule. Returns `<prefix>_lr` (the rate this step used) and
    `<prefix>_grad_norm` (0 when skipped).

    Every `*loss` of ``losses`` (the step's statistics, already summed over the data-parallel ranks, so all
    ranks agree) must be finite, and so must the gradient norm (`clip_gradients` checks it): a NaN that reached
    the optimizer would make every weight NaN, so it is a RunError before the step, with the weights as they
    were."""
    for key, value in (losses or {}).items():
        if key.endswith("loss"):
            require_finite(value, f"{module.name}: {key}", "; the optimizer step was not taken")
    grad_norm = 0.0 if skip else module.clip_gradients(max_grad_norm)
    if not skip:
        module.optimizer.step()
    lr = module.scheduler.get_last_lr()[0]
    module.scheduler.step()
    return {f"{prefix}_lr": lr, f"{prefix}_grad_norm": grad_norm}


def _add(parts: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


class TrainerModule(HFModule):
    """One optimizer step over the micro-batches of a global batch, equal to one big batch's step whatever the
    micro-batch size (each micro-batch's loss weighted by its share of the global batch, see ``aggregation``).
    (The module a trainer model runs; ``chatlearn.Trainer`` is ChatLearn's compute-flow wrapper, another thing.)

    A subclass builds ``self.model``, ``self.optimizer`` and ``self.scheduler`` in ``setup`` and provides:

    * ``loss(mb, out, on, w)``: the loss to backward, already weighted by ``w`` (the micro-batch's share of the
      global batch times ``on``; ``on`` is 0.0 for a data-parallel stand-in that must add nothing), and the
      micro-batch's statistics, weighted the same way so that their sum is the global batch's;
    * ``stat_keys()``: the statistics it reports (summed over the micro-batches and the ranks);
    * optionally ``forward(mb)`` (what ``loss`` gets as ``out``; default: the response tokens' log-probs, and
      their entropies when ``wants_entropy``, as :class:`~chatlearn.models.hf.common.ResponseTokens` [B, R],
      padded or packed alike), ``prepare(data_list)`` (work over the whole global batch first), ``global_batch``
      (the shares, by another count than ``aggregation``'s), ``micro_batch`` (a step that may skip a
      micro-batch), ``step_stats`` and ``skip_step``.
    """

    args: OptimArgs
    prefix: ClassVar[str] = "policy"  # the step's `<prefix>_lr` and `<prefix>_grad_norm`
    aggregation: ClassVar[str] = "token-mean"  # a name of chatlearn.algorithms.aggregation.LOSS_AGGREGATIONS
    # the global batch of the step running now (its shares and units), for losses that need the whole count
    batch_mean: GlobalMean | None = None

    def make_optimizer(self) -> None:
        """AdamW and the LR schedule over what trains; call it in ``setup`` once the layout is applied."""
        self.optimizer = adamw(self.model, self.args)
        self.scheduler = lr_scheduler(self.optimizer, self.args, self.runtime_args)

    # -- what a trainer provides ---------------------------------------------------------------------------
    def stat_keys(self) -> tuple[str, ...]:
        raise NotImplementedError(f"{type(self).__name__}.stat_keys")

    def loss(self, mb: dict, out: Any, on: float, w: float) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError(f"{type(self).__name__}.loss")

    def forward(self, mb: dict) -> Any:
        return response_tokens(self.fwd, mb, self.device, self.args.temperature, self.wants_entropy(),
                               packed=self.packing)

    def wants_entropy(self) -> bool:
        """Whether ``loss`` reads the entropies of the response tokens (they cost a pass over the logits)."""
        return False

    def packed_views(self, mb: dict) -> list[dict]:
        """The sequences each sample puts into a packed row, as views of the micro-batch (its prompt and
        response; DPO: the chosen and the rejected side); they size the token-budget micro-batches."""
        return [mb]

    def micro_batches(self, data_list: list[dict]) -> list[dict]:
        """The micro-batches the step runs: as they came, or with ``packing`` re-cut by tokens (at most
        ``max_token_in_packing`` each, :func:`~chatlearn.models.hf.packing.regroup`; the same cut on every rank).
        Their pads are 0: packed, no pad is ever computed."""
        if not self.packing:
            return data_list
        return regroup(data_list, self.packing_budget, views=self.packed_views)

    def prepare(self, data_list: list[dict]) -> None:
        """Work over the whole global batch before its step (PPO whitens the advantages here)."""

    def global_batch(self, data_list: list[dict]) -> GlobalMean:
        """Each micro-batch's share of the global batch, by the units of ``aggregation``."""
        return global_mean(units(data_list, self.aggregation))

    def micro_batch(self, i: int, mb: dict, on: float, w: float) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Micro-batch ``i``'s weighted loss (None: nothing to backward) and statistics."""
        return self.loss(mb, self.forward(mb), on, w)

    def step_stats(self, mean: GlobalMean) -> dict[str, float]:
        """Statistics of the whole step, the same on every rank (not summed over the ranks)."""
        return {}

    def skip_step(self, mean: GlobalMean) -> bool:
        """Whether the batch has nothing to learn from (the optimizer does not step)."""
        return False

    # -- the loop ------------------------------------------------------------------------------------------
    def train_step(self, data_list, iteration):
        self.prepare(data_list)
        data_list = self.micro_batches(data_list)
        self.optimizer.zero_grad(set_to_none=True)
        self.batch_mean = mean = self.global_batch(data_list)
        stats: dict[str, float] = dict.fromkeys(self.stat_keys(), 0.0)
        stats.update(self.each_micro_batch(data_list, mean.weights))
        stats = self.sum_stats(stats, list(stats))
        stats.update(self.step_stats(mean))
        stats.update(optimizer_step(self, self.args.max_grad_norm, self.prefix, skip=self.skip_step(mean),
                                    losses=stats))
        return stats

    def each_micro_batch(self, data_list: list[dict], weights: list[float]) -> dict[str, float]:
        """Forward and backward of this rank's micro-batches (``weights[i]``: micro-batch ``i``'s share of the
        global batch), their statistics summed. Pipeline stages run them with the 1F1B schedule (``loss`` on
        the last stage, on micro-batches widened to one shape; the schedule's set-up calls the loss once on
        stand-in activations, whose statistics the real call replaces)."""
        parts: dict[int, dict[str, float]] = {}
        if not self.pipelined:
            # the shard is taken over the indices: a data-parallel stand-in is micro-batch 0 with on = 0.0
            for n, (i, on) in enumerate(self.data_shard(list(range(len(data_list))))):
                loss, parts[n] = self.micro_batch(i, data_list[i], on, weights[i] * on)
                if loss is not None:
                    loss.backward()
            return _add(parts.values())
        if self.packing:
            return self._packed_pipeline(data_list, weights)
        wide = widen(list(data_list), self.tokenizer.pad_token_id)
        rows = max(len(b["prompt_ids"]) for b in wide)
        inputs = []
        for b in wide:
            ids, attn, pos = full_sequence(b)
            short = rows - ids.shape[0]  # the schedule splits equal chunks: repeat a row, never read back
            ids, attn, pos = (torch.cat([t, t[:1].expand(short, -1)]) if short else t for t in (ids, attn, pos))
            inputs.append({"input_ids": ids.to(self.device), "attention_mask": attn.to(self.device),
                           "position_ids": pos.to(self.device)})

        def stage_loss(i: int, logits: torch.Tensor) -> torch.Tensor:
            b = wide[i]
            out = tokens_of(logits[: len(b["prompt_ids"]), response_span(b), :], b, self.device,
                            self.args.temperature, self.wants_entropy())
            loss, parts[i] = self.loss(b, out, 1.0, weights[i] * 1.0)
            return loss

        pipeline_train(self.parallel.stage, self.parallel, inputs, stage_loss)
        return _add(parts.values())

    def _packed_pipeline(self, data_list: list[dict], weights: list[float]) -> dict[str, float]:
        """The 1F1B schedule over packed micro-batches: each one row, filled up to the longest with pad tokens
        whose positions restart at 0 (a sequence of their own, which no real token attends to and no loss
        reads), as the schedule splits chunks of one shape. The last stage's logits cover the whole row; the
        loss gathers the response-predicting positions."""
        parts: dict[int, dict[str, float]] = {}
        packs = [pack([b], self.device) for b in data_list]
        width = max(p.input_ids.shape[1] for p in packs)
        inputs = []
        for p in packs:
            short = width - p.input_ids.shape[1]
            fill = torch.full((1, short), self.tokenizer.pad_token_id, dtype=p.input_ids.dtype, device=self.device)
            inputs.append({"input_ids": torch.cat([p.input_ids, fill], 1),
                           "position_ids": torch.cat([p.position_ids, torch.arange(short, device=self.device)[None]],
                                                     1)})

        def stage_loss(i: int, logits: torch.Tensor) -> torch.Tensor:
            (out,) = packed_tokens_from(logits[0, packs[i].keep], packs[i], self.args.temperature,
                                        self.wants_entropy())
            loss, parts[i] = self.loss(data_list[i], out, 1.0, weights[i] * 1.0)
            return loss

        pipeline_train(self.parallel.stage, self.parallel, inputs, stage_loss)
        return _add(parts.values())


class CausalLMTrainer(LoraTrainerMixin, TrainerModule):
    """A trainer of a Hugging Face causal LM (the policy trainers). With ``lora.enable_lora`` only adapters
    train: the sync sends merged weights, checkpoints keep adapters apart from the base, the export is merged."""

    supports_lora: ClassVar[bool] = True
    supports_pipeline: ClassVar[bool] = True  # one forward per micro-batch: the 1F1B schedule runs it
    supports_packing: ClassVar[bool] = True

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.tokenizer = load_tokenizer(self.args.model_path)
        self.model = load_causal_lm(self.args.model_path, self.args.dtype).to(self.device).train()
        self.maybe_apply_lora()  # before the optimizer: it only gets the adapters
        self.parallelize()  # so is the layout: FSDP2 and TP replace the parameters
        self.make_optimizer()
