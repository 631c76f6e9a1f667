"""PPO trainers: the policy (clipped surrogate) and the value model (clipped value loss).

Both are siblings on the shared trainer loop (:mod:`chatlearn.models.hf.trainer`): one optimizer step per global
batch, each micro-batch's loss weighted by its share of the global batch's response tokens (``token-mean``),
so the step equals one big batch's masked mean whatever the micro-batch size.
"""

from typing import Any

import torch
from pydantic import Field, field_validator

from chatlearn.algorithms import VALUE_LOSSES, get_policy_loss, get_value_loss, whiten_global_batch
from chatlearn.algorithms.registry import name_problem, policy_loss_problem
from chatlearn.data.batch import loss_mask
from chatlearn.models.hf.common import ResponseTokens, ensure_model_files
from chatlearn.models.hf.trainer import CausalLMTrainer, OptimArgs, TrainerModule
from chatlearn.models.hf.value import ValueArgs, ValueNetwork


class PPOPolicyArgs(OptimArgs):
    cliprange: float = Field(0.2, gt=0, description="PPO ratio clip")
    clip_ratio_c: float | None = Field(
        None, gt=1, description="dual clip: for a negative advantage the per-token loss is at most -A * this "
        "(verl's clip_ratio_c, 3.0 there); None: plain PPO clip")
    policy_loss: str = Field("ppo_clip", description="registered policy loss of the ppo family (called with "
                             "cliprange and clip_ratio_c; chatlearn.algorithms.registry)")
    whiten_advantages: bool = Field(True, description="whiten advantages over each global batch")

    @field_validator("policy_loss")
    @classmethod
    def _ppo_family(cls, name: str) -> str:
        # checked with the config: an unknown loss would fail at setup, another family's at the first step
        if (problem := policy_loss_problem(name, "ppo", "the PPO policy trainer")) is not None:
            raise ValueError(problem)
        return name


class PPOValueArgs(OptimArgs, ValueArgs):
    cliprange_value: float = Field(0.2, gt=0, description="clip of the new value around the old one")
    value_loss: str = Field("ppo_clip", description="registered value loss")

    @field_validator("value_loss")
    @classmethod
    def _registered(cls, name: str) -> str:
        if (problem := name_problem("value loss", name, VALUE_LOSSES)) is not None:
            raise ValueError(problem)
        return name


class PPOPolicyTrainer(CausalLMTrainer):
    """ppo_policy of the RLHF engine: the registered policy loss (``ppo_clip``) on whitened advantages."""

    args_schema = PPOPolicyArgs
    # the advantages it takes (chatlearn.algorithms.registry.ADVANTAGE_SHAPES): its loss and whitening are per token
    advantage_shapes = ("token",)
    default_advantage_estimator = "gae"  # PPO's: the critic's values
    trains_multi_turn = True

    def setup(self) -> None:
        super().setup()
        self.loss_fn = get_policy_loss(self.args.policy_loss)

    def prepare(self, data_list: list[dict]) -> None:
        if self.args.whiten_advantages:
            # one mean/std over the whole global batch, as ChatLearn whitens across data-parallel ranks
            whitened = whiten_global_batch([mb["advantages"] for mb in data_list],
                                           [loss_mask(mb) for mb in data_list])
            for mb, adv in zip(data_list, whitened, strict=True):
                mb["advantages"] = adv

    def stat_keys(self) -> tuple[str, ...]:
        return ("policy_loss", "clipfrac", "approx_kl", *(("dual_clipfrac",) if self.args.clip_ratio_c else ()))

    def loss(self, mb: dict, out: ResponseTokens, on: float, w: float) -> tuple[torch.Tensor, dict[str, float]]:
        mask = loss_mask(mb).to(self.device)
        dual = {} if self.args.clip_ratio_c is None else {"clip_ratio_c": self.args.clip_ratio_c}
        loss, st = self.loss_fn(out.logprobs, mb["logprobs"].to(self.device), mb["advantages"].to(self.device),
                                mask, cliprange=self.args.cliprange, **dual)
        return loss * w, {k: v * w for k, v in {"policy_loss": float(loss.detach()), **st}.items()
                          if k in self.stat_keys()}


class PPOValueTrainer(TrainerModule):
    """ppo_value of the RLHF engine: the registered value loss (``ppo_clip``) against the GAE returns."""

    args_schema = PPOValueArgs
    prefix = "value"
    supports_packing = True

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.model = ValueNetwork(self.args.model_path, self.args.dtype, self.args.head_seed).to(self.device)
        self.model.train()
        self.parallelize()
        self.make_optimizer()
        self.loss_fn = get_value_loss(self.args.value_loss)

    def stat_keys(self) -> tuple[str, ...]:
        return ("value_loss", "vf_clipfrac")

    def forward(self, mb: dict) -> Any:
        return self.fwd(mb, self.device, packed=self.packing)

    def loss(self, mb: dict, out: torch.Tensor, on: float, w: float) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["response_mask"].to(self.device)  # the critic is fit at every position GAE reads
        loss, st = self.loss_fn(out, mb["values"].to(self.device), mb["returns"].to(self.device), mask,
                                cliprange_value=self.args.cliprange_value)
        return loss * w, {"value_loss": float(loss.detach()) * w, "vf_clipfrac": st["vf_clipfrac"] * w}
