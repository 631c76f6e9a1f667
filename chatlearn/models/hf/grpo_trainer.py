"""GRPO/GSPO policy trainer: ChatLearn HEAD's token-level clipped loss over group-normalised advantages.

One `train_step` is one optimizer step over the micro-batches of a global batch. Each micro-batch's loss is
summed over its response tokens and divided by the response tokens of the whole global batch (ChatLearn's
per-token normalisation), so the micro-batch gradients simply add up to the global batch's.

Old log-probs (the ratio's denominator) are, by `old_logprobs`:
* ``generation``: the policy's own log-probs of what it sampled. They are the trainer's log-probs too when the
  policy holds the trainer's weights (synced every episode, same dtype and temperature), and cost no pass.
* ``trainer``: this module's `forward_step` in the score stage (ChatLearn HEAD's separate forward pass),
  exact whatever the sync frequency. ``tests/test_engines_unit.py`` (per token) and ``tests/test_engine_runs.py``
  (a whole episode) check the two agree.
"""

from typing import Literal

import torch
from pydantic import Field

from chatlearn.algorithms import masked_sum
from chatlearn.algorithms.grpo import entropy_from_logits, k3_kl
from chatlearn.algorithms.ppo import logprobs_from_logits
from chatlearn.models.hf.common import response_logprobs
from chatlearn.models.hf.ppo_trainer import OptimArgs, PPOPolicyTrainer, optimizer_step


class GRPOPolicyArgs(OptimArgs):
    policy_loss: Literal["grpo", "gspo"] = Field(
        "grpo", description="grpo: token-level ratio; gspo: one ratio per sequence (mean token log-ratio)")
    pos_clip_ratio: float = Field(0.2, ge=0, description="upper clip of the ratio, 1 + this (clip-higher)")
    neg_clip_ratio: float = Field(0.2, ge=0, le=1, description="lower clip of the ratio, 1 - this")
    diff_clip_ratio: float = Field(10.0, gt=0, description="upper bound of the log-ratio before exp")
    final_clip_ratio: float = Field(3.0, gt=0, description="upper bound of the per-token loss (dual clip)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL to the reference (needs models.reference)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    old_logprobs: Literal["generation", "trainer"] = Field(
        "generation", description="old log-probs from the sampler (same weights) or the trainer's own forward pass")

class GRPOPolicyTrainer(PPOPolicyTrainer):
    """ppo_policy of the GRPO engine; setup, sync, checkpoints and export are the PPO trainer's."""

    args_schema = GRPOPolicyArgs

    @torch.no_grad()
    def forward_step(self, data, iteration):
        """Old log-probs from the trainer's weights (score stage, ``old_logprobs: trainer``)."""
        self.model.eval()
        try:
            lp = response_logprobs(self.infer_model, data, self.device, self.args.temperature)
        finally:
            self.model.train()
        return {"old_logprobs": lp.cpu()}

    def train_step(self, data_list, iteration):
        self.optimizer.zero_grad(set_to_none=True)
        total = float(sum(float(mb["response_mask"].sum()) for mb in data_list)) or 1.0
        a = self.args
        keys = ("policy_loss", "clipfrac", "pos_clipfrac", "neg_clipfrac", "final_clipfrac", "approx_kl")
        stats: dict[str, float] = dict.fromkeys(keys, 0.0)
        if a.kl_coef > 0:
            stats["kl_loss"] = 0.0
        if a.entropy_coef > 0:
            stats["entropy"] = 0.0

        def loss_of(mb: dict, on: float, response_logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            mask = mb["response_mask"].to(self.device)
            share = float(mask.sum()) / total * on
            logits = response_logits.float() / a.temperature
            logprobs = logprobs_from_logits(logits, mb["response_ids"].to(self.device)) * mask
            old = mb["old_logprobs"] if "old_logprobs" in mb else mb["logprobs"]
            loss, st = self.loss_fn(logprobs, old.to(self.device), mb["advantages"].to(self.device), mask,
                                    pos_clip_ratio=a.pos_clip_ratio, neg_clip_ratio=a.neg_clip_ratio,
                                    diff_clip_ratio=a.diff_clip_ratio, final_clip_ratio=a.final_clip_ratio,
                                    total_tokens=total)
            part = {"policy_loss": float(loss.detach()) * on}
            if a.kl_coef > 0:
                kl = masked_sum(k3_kl(logprobs, mb["ref_logprobs"].to(self.device)), mask) / total
                loss = loss + a.kl_coef * kl
                part["kl_loss"] = float(kl.detach()) * on
            if a.entropy_coef > 0:
                ent = masked_sum(entropy_from_logits(logits), mask) / total
                loss = loss - a.entropy_coef * ent
                part["entropy"] = float(ent.detach()) * on
            for k in keys[1:]:
                part[k] = st[k] * share
            return (loss * on if on != 1.0 else loss), part

        stats.update(self.each_micro_batch(data_list, loss_of))
        stats = self.sum_stats(stats, list(stats))
        stats.update(optimizer_step(self, a.max_grad_norm, "policy", losses=stats))
        return stats
