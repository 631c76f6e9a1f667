"""GRPO/GSPO policy trainer: ChatLearn HEAD's token-level clipped loss over group-normalised advantages.

One `train_step` is one optimizer step over the micro-batches of a global batch (the shared trainer loop,
:mod:`chatlearn.models.hf.trainer`). Each micro-batch's loss is summed over its response tokens and divided by
the response tokens of the whole global batch (ChatLearn's per-token normalisation, the ``token-mean``
aggregation's total), so the micro-batch gradients simply add up to the global batch's.

Old log-probs (the ratio's denominator) are, by `old_logprobs`:
* ``generation``: the policy's own log-probs of what it sampled. They are the trainer's log-probs too when the
  policy holds the trainer's weights (synced every episode, same dtype and temperature), and cost no pass.
* ``trainer``: this module's `forward_step` in the score stage (ChatLearn HEAD's separate forward pass),
  exact whatever the sync frequency. ``tests/test_engines_unit.py`` (per token) and ``tests/test_engine_runs.py``
  (a whole episode) check the two agree.
* ``current``: the training forward's own log-probs, detached (TRL's on-policy shortcut). With one optimizer step
  per episode (the config check requires it) the trainer's weights at that step are the ones ``trainer`` would
  have scored with, so the ratio is exactly 1 and the gradient is ``trainer``'s, without its forward pass and
  whatever the policy's sync frequency, dtype or temperature (``tests/test_engines_unit.py``).

Samples another policy generated (stale ones in pipelined episodes, ``runtime.max_staleness``) make ``generation``
the behaviour policy's log-probs: the plain off-policy ratio. ``rollout_correction`` instead takes the ratio
against the proximal policy (``trainer``) and weighs each token by proximal / behaviour
(:mod:`chatlearn.algorithms.off_policy`).
"""

from typing import Literal

import torch
from pydantic import Field, field_validator

from chatlearn.algorithms import ROLLOUT_CORRECTIONS, get_policy_loss, get_rollout_correction, masked_sum
from chatlearn.algorithms.grpo import k3_kl
from chatlearn.data.batch import collate_samples
from chatlearn.models.hf.common import ResponseTokens, response_logprobs
from chatlearn.models.hf.trainer import CausalLMTrainer, OptimArgs


class GRPOPolicyArgs(OptimArgs):
    policy_loss: Literal["grpo", "gspo"] = Field(
        "grpo", description="grpo: token-level ratio; gspo: one ratio per sequence (mean token log-ratio)")
    pos_clip_ratio: float = Field(0.2, ge=0, description="upper clip of the ratio, 1 + this (clip-higher)")
    neg_clip_ratio: float = Field(0.2, ge=0, le=1, description="lower clip of the ratio, 1 - this")
    diff_clip_ratio: float = Field(10.0, gt=0, description="upper bound of the log-ratio before exp")
    final_clip_ratio: float = Field(3.0, gt=0, description="upper bound of the per-token loss (dual clip)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the k3 KL to the reference (needs models.reference)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    old_logprobs: Literal["generation", "trainer", "current"] = Field(
        "generation", description="old log-probs from the sampler (same weights), the trainer's own forward pass "
                                  "in the score stage, or the training forward's own, detached (current: one "
                                  "optimizer step per episode)")
    rollout_correction: str = Field(
        "none", description="off-policy correction of samples another policy generated (stale ones in pipelined "
                            "episodes): none, or a registered one (tis_token, tis_seq, mis_token, mis_seq, "
                            "decoupled; chatlearn.algorithms.off_policy); needs old_logprobs: trainer (the "
                            "proximal policy) and weighs each token by proximal / behaviour (the sampler's)")
    rollout_is_cap: float = Field(2.0, gt=1.0, description="the rollout correction's bound on the importance ratio")

    @field_validator("rollout_correction")
    @classmethod
    def _known_correction(cls, value: str) -> str:
        if value != "none" and value not in ROLLOUT_CORRECTIONS:
            known = ", ".join(sorted(ROLLOUT_CORRECTIONS))
            raise ValueError(f"unknown rollout correction {value!r}; known: none, {known}")
        return value

# the loss statistics, each a mean over the micro-batch's valid tokens, weighted by its share of the tokens
_CLIP_STATS = ("clipfrac", "pos_clipfrac", "neg_clipfrac", "final_clipfrac", "approx_kl")


class GRPOPolicyTrainer(CausalLMTrainer):
    """ppo_policy of the GRPO engine: the registered ``grpo``/``gspo`` loss, plus the optional k3 KL to the
    reference and entropy bonus, each summed over the tokens and divided by the global batch's tokens."""

    args_schema = GRPOPolicyArgs

    def setup(self) -> None:
        super().setup()
        self.loss_fn = get_policy_loss(self.args.policy_loss)
        a = self.args
        self.correction = None if a.rollout_correction == "none" else get_rollout_correction(a.rollout_correction)

    def correction_weights(self, data: dict) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The rollout correction's weights of a batch: the proximal log-probs (the trainer's, from the score
        stage) against the behaviour ones (the sampler's)."""
        if self.correction is None:
            return None, {}
        return self.correction(data["old_logprobs"], data["logprobs"], data["response_mask"],
                               cap=self.args.rollout_is_cap)

    def episode_stats(self, samples: list[dict]) -> dict[str, float]:
        """Over the episode's samples before training: the importance ratios of the rollout correction."""
        if self.correction is None or not samples:
            return {}
        return self.correction_weights(collate_samples(samples, 0))[1]

    @torch.no_grad()
    def forward_step(self, data, iteration):
        """Old log-probs from the trainer's weights (score stage, ``old_logprobs: trainer``)."""
        self.model.eval()
        try:
            lp = response_logprobs(self.infer_model, data, self.device, self.args.temperature, packed=self.packing,
                                   budget=self.packing_budget)
        finally:
            self.model.train()
        return {"old_logprobs": lp.cpu()}

    def stat_keys(self) -> tuple[str, ...]:
        a = self.args
        return ("policy_loss", *_CLIP_STATS, *(("kl_loss",) if a.kl_coef > 0 else ()),
                *(("entropy",) if a.entropy_coef > 0 else ()))

    def wants_entropy(self) -> bool:
        return self.args.entropy_coef > 0

    def loss(self, mb: dict, out: ResponseTokens, on: float, w: float) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.args
        total = self.batch_mean.total  # the loss divides by the global batch's tokens itself; w weighs the stats
        mask = mb["response_mask"].to(self.device)
        logprobs = out.logprobs
        if a.old_logprobs == "current":  # on-policy: the weights before this episode's only step
            old = logprobs.detach()
        else:
            old = (mb["old_logprobs"] if "old_logprobs" in mb else mb["logprobs"]).to(self.device)
        weights, _ = self.correction_weights(mb)
        loss, st = self.loss_fn(logprobs, old, mb["advantages"].to(self.device), mask,
                                pos_clip_ratio=a.pos_clip_ratio, neg_clip_ratio=a.neg_clip_ratio,
                                diff_clip_ratio=a.diff_clip_ratio, final_clip_ratio=a.final_clip_ratio,
                                total_tokens=total, token_weights=None if weights is None else weights.to(self.device))
        part = {"policy_loss": float(loss.detach()) * on}
        if a.kl_coef > 0:
            kl = masked_sum(k3_kl(logprobs, mb["ref_logprobs"].to(self.device)), mask) / total
            loss = loss + a.kl_coef * kl
            part["kl_loss"] = float(kl.detach()) * on
        if a.entropy_coef > 0:
            ent = masked_sum(out.entropy, mask) / total
            loss = loss - a.entropy_coef * ent
            part["entropy"] = float(ent.detach()) * on
        for k in _CLIP_STATS:
            part[k] = st[k] * w
        return (loss * on if on != 1.0 else loss), part
