"""PPO trainers: the policy (clipped surrogate) and the value model (clipped value loss).

`train_step` receives the micro-batches of one global batch and makes exactly one optimizer step, with the
gradients of the micro-batches accumulated (each weighted by its share of the global batch's tokens, so the
step equals one big batch's masked mean whatever the micro-batch size).
"""

import functools
import math
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from chatlearn.algorithms import get_policy_loss, get_value_loss, whiten_global_batch
from chatlearn.config import RuntimeConfig
from chatlearn.models.hf.common import (
    HFModelArgs,
    HFModule,
    ensure_model_files,
    full_sequence,
    load_causal_lm,
    load_tokenizer,
    logprobs_of,
    response_logits,
    response_span,
    widen,
)
from chatlearn.models.hf.lora import LoraTrainerMixin
from chatlearn.models.hf.value import ValueArgs, ValueNetwork
from chatlearn.models.pipeline import pipeline_train
from chatlearn.utils.finite import require_finite


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


class PPOPolicyArgs(OptimArgs):
    cliprange: float = Field(0.2, gt=0, description="PPO ratio clip")
    policy_loss: str = Field("ppo_clip", description="registered policy loss")
    whiten_advantages: bool = Field(True, description="whiten advantages over each global batch")


class PPOValueArgs(OptimArgs, ValueArgs):
    cliprange_value: float = Field(0.2, gt=0, description="clip of the new value around the old one")
    value_loss: str = Field("ppo_clip", description="registered value loss")


def _adamw(model: torch.nn.Module, args: OptimArgs) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (all of them, or only the LoRA adapters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                             betas=(args.adam_beta1, args.adam_beta2))


def total_optimizer_steps(rt: RuntimeConfig) -> int:
    """Optimizer steps of the whole run under the fixed stream: episodes x epochs x ceil(spe / global)."""
    per_epoch = math.ceil(rt.sample_per_episode / rt.train_global_batch_size)
    return max(1, rt.num_episode * rt.num_training_epoch * per_epoch)


def lr_factor(step: int, args: OptimArgs, total: int) -> float:
    """Multiplier of `lr` at optimizer step `step` (0-based): warmup, then constant/linear/cosine decay."""
    if args.warmup_steps and step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    decay = 1.0 - progress if args.lr_scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * decay


def _scheduler(optimizer: torch.optim.Optimizer, args: OptimArgs, rt: RuntimeConfig):
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


def _token_weights(data_list: list[dict]) -> list[float]:
    tokens = [float(mb["response_mask"].sum()) for mb in data_list]
    total = sum(tokens) or 1.0
    return [t / total for t in tokens]


class PPOPolicyTrainer(LoraTrainerMixin, HFModule):
    """The policy trainer (and base of the GRPO and DPO trainers). With ``lora.enable_lora`` only adapters
    train: the sync sends merged weights, checkpoints keep adapters apart from the base, the export is merged."""

    args_schema = PPOPolicyArgs
    supports_lora: ClassVar[bool] = True
    supports_pipeline: ClassVar[bool] = True  # one forward per micro-batch: the 1F1B schedule runs it

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.tokenizer = load_tokenizer(self.args.model_path)
        self.model = load_causal_lm(self.args.model_path, self.args.dtype).to(self.device).train()
        self.maybe_apply_lora()  # before the optimizer: it only gets the adapters
        self.parallelize()  # so is the layout: FSDP2 and TP replace the parameters
        self.optimizer = _adamw(self.model, self.args)
        self.scheduler = _scheduler(self.optimizer, self.args, self.runtime_args)
        # the DPO trainers (subclasses) have no registered policy loss
        self.loss_fn = get_policy_loss(self.args.policy_loss) if hasattr(self.args, "policy_loss") else None

    def train_step(self, data_list, iteration):
        if self.args.whiten_advantages:
            # one mean/std over the whole global batch, as ChatLearn whitens across data-parallel ranks
            whitened = whiten_global_batch([mb["advantages"] for mb in data_list],
                                           [mb["response_mask"] for mb in data_list])
            for mb, adv in zip(data_list, whitened, strict=True):
                mb["advantages"] = adv
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {"policy_loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0}
        for mb, w in zip(data_list, _token_weights(data_list), strict=True):
            mb["loss_weight"] = w

        def loss_of(mb: dict, on: float, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            w = mb["loss_weight"] * on
            mask = mb["response_mask"].to(self.device)
            logprobs = logprobs_of(logits, mb, self.device, self.args.temperature)
            loss, st = self.loss_fn(logprobs, mb["logprobs"].to(self.device), mb["advantages"].to(self.device),
                                    mask, cliprange=self.args.cliprange)
            return loss * w, {"policy_loss": float(loss.detach()) * w, "clipfrac": st["clipfrac"] * w,
                              "approx_kl": st["approx_kl"] * w}

        stats.update(self.each_micro_batch(data_list, loss_of))
        stats = self.sum_stats(stats, list(stats))
        stats.update(optimizer_step(self, self.args.max_grad_norm, "policy", losses=stats))
        return stats

    def each_micro_batch(self, data_list: list[dict], loss_of: Any) -> dict[str, float]:
        """Forward and backward of this rank's micro-batches: ``loss_of(mb, on, logits)`` gets the logits
        [B, R, V] that predict ``mb``'s response tokens and returns the weighted loss to backward and the
        micro-batch's (weighted) statistics, which are summed and returned. Pipeline stages run them with the
        1F1B schedule (``loss_of`` on the last stage, on micro-batches widened to one shape; the schedule's
        set-up calls the loss once on stand-in activations, whose statistics the real call replaces)."""
        parts: dict[int, dict[str, float]] = {}
        if not self.pipelined:
            for i, (mb, on) in enumerate(self.data_shard(data_list)):
                loss, parts[i] = loss_of(mb, on, response_logits(self.fwd, mb, self.device))
                loss.backward()
            return _add(parts.values())
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
            loss, parts[i] = loss_of(b, 1.0, logits[: len(b["prompt_ids"]), response_span(b), :])
            return loss

        pipeline_train(self.parallel.stage, self.parallel, inputs, stage_loss)
        return _add(parts.values())


def _add(parts: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


class PPOValueTrainer(HFModule):
    args_schema = PPOValueArgs

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.model = ValueNetwork(self.args.model_path, self.args.dtype, self.args.head_seed).to(self.device)
        self.model.train()
        self.parallelize()
        self.optimizer = _adamw(self.model, self.args)
        self.scheduler = _scheduler(self.optimizer, self.args, self.runtime_args)
        self.loss_fn = get_value_loss(self.args.value_loss)

    def train_step(self, data_list, iteration):
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {"value_loss": 0.0, "vf_clipfrac": 0.0}
        weights = {id(mb): w for mb, w in zip(data_list, _token_weights(data_list), strict=True)}
        for mb, on in self.data_shard(data_list):
            w = weights[id(mb)] * on
            mask = mb["response_mask"].to(self.device)
            values = self.fwd(mb, self.device)
            loss, st = self.loss_fn(values, mb["values"].to(self.device), mb["returns"].to(self.device), mask,
                                    cliprange_value=self.args.cliprange_value)
            (loss * w).backward()
            stats["value_loss"] += float(loss.detach()) * w
            stats["vf_clipfrac"] += st["vf_clipfrac"] * w
        stats = self.sum_stats(stats, list(stats))
        stats.update(optimizer_step(self, self.args.max_grad_norm, "value", losses=stats))
        return stats

