"""The critic-free policy trainer (GRPO, GSPO, CISPO; over the advantages of grpo, dr_grpo, rloo, REINFORCE++).

One `train_step` is one optimizer step over the micro-batches of a global batch (the shared trainer loop,
:mod:`chatlearn.models.hf.trainer`). Each micro-batch's loss is aggregated as ``loss_agg_mode`` over the units of
the whole global batch (``token-mean``, the default and ChatLearn's: summed over its response tokens and divided
by the global batch's; the sequence-mean modes: by its sequences, :func:`~chatlearn.algorithms.aggregation.
aggregate_loss`), so the micro-batch gradients simply add up to the global batch's. The KL loss term
(``kl_coef``, ``kl_estimator``) and the entropy bonus are aggregated the same way.

Old log-probs (the ratio's denominator) are, by `old_logprobs`:
* ``generation``: the policy's own log-probs of what it sampled. They are the trainer's log-probs too when the
  policy holds the trainer's weights (synced every episode, same dtype and temperature), and cost no pass.
* ``trainer``: this module's `forward_step` in the score stage (ChatLearn HEAD's separate forward pass),
  exact whatever the sync frequency. ``tests/test_engines_unit.py`` (per token) and ``tests/test_engine_runs.py``
  (a whole episode) check the two agree.
* ``current``: the training forward's own log-probs, detached (TRL's on-policy shortcut). With one optimizer step
  per episode (the config check requires it) the trainer's weights at that step are the ones ``trainer`` would
  have scored with, so the ratio is exactly 1 and the gradient is ``trainer``'s, without its forward pass and
  whatever the policy's sync frequency, dtype or temperature (``tests/test_engines_unit.py``). For the same
  reason they are the proximal log-probs of a rollout correction in pipelined episodes.

Samples another policy generated (stale ones in pipelined episodes, ``runtime.max_staleness``) make ``generation``
the behaviour policy's log-probs: the plain off-policy ratio. ``rollout_correction`` instead takes the ratio
against the proximal policy (``trainer``) and weighs each token by proximal / behaviour
(:mod:`chatlearn.algorithms.off_policy`).
"""

from typing import Any, Literal

import torch
from pydantic import Field, field_validator, model_validator

from chatlearn.algorithms import (
    KL_ESTIMATORS,
    ROLLOUT_CORRECTIONS,
    get_kl_estimator,
    get_policy_loss,
    get_rollout_correction,
    logprob_mismatch,
    whiten_global_batch,
)
from chatlearn.algorithms.aggregation import aggregate_loss, policy_aggregation_problem
from chatlearn.algorithms.registry import name_problem, policy_loss_problem
from chatlearn.data.batch import collate_samples, loss_mask
from chatlearn.models.hf.common import ResponseTokens, response_logprobs
from chatlearn.models.hf.trainer import CausalLMTrainer, OptimArgs


class GRPOPolicyArgs(OptimArgs):
    policy_loss: str = Field(
        "grpo", description="a registered policy loss of the grpo family: grpo: token-level ratio; gspo: one ratio "
        "per sequence (mean token log-ratio); cispo: the clipped ratio as a constant weight of the REINFORCE term "
        "(no token's gradient is zeroed)")
    loss_agg_mode: str = Field(
        "token-mean", description="how the per-token loss becomes the batch's (chatlearn.algorithms.aggregation): "
        "token-mean, over all response tokens (ChatLearn's, DAPO's); seq-mean-token-sum or seq-mean-token-mean, "
        "each sequence's token sum or token mean averaged over sequences; seq-mean-token-sum-norm, the token sum "
        "over sequences divided by the constant loss_scale_factor (Dr.GRPO)")
    loss_scale_factor: float | None = Field(
        None, gt=0, description="the constant normaliser of seq-mean-token-sum-norm (Dr.GRPO: the generation "
        "budget, max_new_tokens); only with that mode")
    pos_clip_ratio: float = Field(0.2, ge=0, description="upper clip of the ratio, 1 + this (clip-higher)")
    neg_clip_ratio: float = Field(0.2, ge=0, le=1, description="lower clip of the ratio, 1 - this")
    diff_clip_ratio: float = Field(10.0, gt=0, description="upper bound of the log-ratio before exp")
    final_clip_ratio: float = Field(3.0, gt=0, description="upper bound of the per-token loss (dual clip)")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL loss term to the reference (needs "
                           "models.reference; verl's use_kl_loss / kl_loss_coef)")
    kl_estimator: str = Field(
        "k3", description="the KL loss term's per-token estimator, a registered one: k1, k2, k3 "
        "(chatlearn.algorithms.kl; verl's kl_loss_type)")
    whiten_advantages: bool = Field(
        False, description="whiten the advantages over each global batch (REINFORCE++'s estimators need it)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    old_logprobs: Literal["generation", "trainer", "current"] = Field(
        "generation", description="old log-probs from the sampler (same weights), the trainer's own forward pass "
                                  "in the score stage, or the training forward's own, detached (current: one "
                                  "optimizer step per episode)")
    rollout_correction: str = Field(
        "none", description="off-policy correction of samples another policy generated (stale ones in pipelined "
                            "episodes): none, or a registered one (tis_token, tis_seq, mis_token, mis_seq, "
                            "decoupled; chatlearn.algorithms.off_policy); needs old_logprobs: trainer or "
                            "current (the proximal policy) and weighs each token by proximal / behaviour (the "
                            "sampler's)")
    rollout_is_cap: float = Field(2.0, gt=1.0, description="the rollout correction's bound on the importance ratio")

    # every name is checked with the config, against its registry: an unknown one would fail in the actor
    @field_validator("policy_loss")
    @classmethod
    def _grpo_family(cls, name: str) -> str:
        if (problem := policy_loss_problem(name, "grpo", "the GRPO policy trainer")) is not None:
            raise ValueError(problem)
        return name

    @field_validator("loss_agg_mode")
    @classmethod
    def _per_token_mode(cls, mode: str) -> str:
        if (problem := policy_aggregation_problem(mode)) is not None:
            raise ValueError(problem)
        return mode

    @field_validator("kl_estimator")
    @classmethod
    def _known_kl(cls, name: str) -> str:
        if (problem := name_problem("KL estimator", name, KL_ESTIMATORS)) is not None:
            raise ValueError(problem)
        return name

    @field_validator("rollout_correction")
    @classmethod
    def _known_correction(cls, value: str) -> str:
        if (problem := name_problem("rollout correction", value, ["none", *ROLLOUT_CORRECTIONS])) is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "GRPOPolicyArgs":
        # a setting that would do nothing is refused, never ignored
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            raise ValueError("loss_agg_mode: seq-mean-token-sum-norm divides by a constant: set loss_scale_factor "
                             "(Dr.GRPO uses the generation budget, the policy's max_new_tokens)")
        if self.loss_agg_mode != "seq-mean-token-sum-norm" and self.loss_scale_factor is not None:
            raise ValueError(f"loss_scale_factor is only used by loss_agg_mode: seq-mean-token-sum-norm (it is "
                             f"{self.loss_agg_mode})")
        # by value, not by which keys were given: a deployment's run form may send the defaults too
        fields = type(self).model_fields
        if self.policy_loss == "cispo":
            unused = [k for k in ("diff_clip_ratio", "final_clip_ratio") if getattr(self, k) != fields[k].default]
            if unused:
                raise ValueError(f"{', '.join(unused)}: not used by policy_loss: cispo (it weighs every token by its "
                                 "ratio clipped to [1 - neg_clip_ratio, 1 + pos_clip_ratio]); remove it")
        if self.kl_estimator != fields["kl_estimator"].default and self.kl_coef == 0:
            raise ValueError("kl_estimator: the KL loss term is off (kl_coef is 0); set kl_coef or remove it")
        return self

# the loss statistics, each a mean over the micro-batch's valid tokens, weighted by its share of the tokens
_CLIP_STATS = ("clipfrac", "pos_clipfrac", "neg_clipfrac", "final_clipfrac", "approx_kl")


class GRPOPolicyTrainer(CausalLMTrainer):
    """ppo_policy of the GRPO engine: the registered ``grpo``/``gspo``/``cispo`` loss, plus the optional KL to
    the reference and entropy bonus, each aggregated as ``loss_agg_mode`` over the global batch."""

    args_schema = GRPOPolicyArgs
    # the advantages it takes (chatlearn.algorithms.registry.ADVANTAGE_SHAPES): a per-sequence one is broadcast
    advantage_shapes = ("token", "sequence")

    def run_notes(self, plan: Any) -> list[str]:
        """Where the ratio's old log-probs come from (the engine's flow decides: `chatlearn.runtime.engines`)."""
        src = ("the trainer's forward pass in the score stage" if plan.calls(self.name, "forward_step")
               else "generation (the policy holds the trainer's weights, synced every episode)")
        return [f"old log-probs: {src}"]
    default_advantage_estimator = "grpo"  # group-normalised: no critic
    trains_on_groups = True
    trains_multi_turn = True

    def setup(self) -> None:
        super().setup()
        self.loss_fn = get_policy_loss(self.args.policy_loss)
        a = self.args
        self.correction = None if a.rollout_correction == "none" else get_rollout_correction(a.rollout_correction)
        self.kl_fn = get_kl_estimator(a.kl_estimator)
        clips = {"pos_clip_ratio": a.pos_clip_ratio, "neg_clip_ratio": a.neg_clip_ratio}
        if a.policy_loss != "cispo":
            clips.update(diff_clip_ratio=a.diff_clip_ratio, final_clip_ratio=a.final_clip_ratio)
        self.loss_kwargs = {**clips, "loss_agg_mode": a.loss_agg_mode, "loss_scale_factor": a.loss_scale_factor}

    @property
    def aggregation(self) -> str:  # the units of the global batch the loss is averaged over
        return self.args.loss_agg_mode

    def prepare(self, data_list: list[dict]) -> None:
        if not self.args.whiten_advantages:
            return
        # one mean/std over the whole global batch's response tokens (REINFORCE++), per-sequence ones broadcast
        masks = [loss_mask(mb) for mb in data_list]
        advs = [mb["advantages"] if mb["advantages"].dim() == 2 else mb["advantages"][:, None] * m
                for mb, m in zip(data_list, masks, strict=True)]
        for mb, adv in zip(data_list, whiten_global_batch(advs, masks), strict=True):
            mb["advantages"] = adv

    def correction_weights(self, data: dict, proximal: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The rollout correction's weights of a batch: the proximal log-probs (the trainer's from the score stage,
        or ``proximal``: the training forward's own, detached, with ``old_logprobs: current``) against the
        behaviour ones (the sampler's)."""
        if self.correction is None:
            return None, {}
        proximal = data["old_logprobs"] if proximal is None else proximal
        return self.correction(proximal, data["logprobs"].to(proximal.device), loss_mask(data).to(proximal.device),
                               cap=self.args.rollout_is_cap)

    def episode_stats(self, samples: list[dict]) -> dict[str, float]:
        """Over the episode's samples before training, where the score stage gave the trainer's log-probs
        (``old_logprobs: trainer``): the sampler's mismatch with them and the rollout correction's importance
        ratios. With ``current`` the trainer's log-probs come with the training forward (the loss reports
        them); with ``generation`` there are none to compare."""
        if not samples or "old_logprobs" not in samples[0]:
            return {}
        data = collate_samples(samples, 0)
        stats = logprob_mismatch(data["old_logprobs"], data["logprobs"], loss_mask(data))
        if self.correction is not None:
            stats.update(self.correction_weights(data)[1])
        return stats

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
                *(("entropy",) if a.entropy_coef > 0 else ()), *self._current_is_stats(),
                *self._current_mismatch_stats())

    def _current_is_stats(self) -> tuple[str, ...]:
        """The correction's statistics the loss reports (``old_logprobs: current``): means weighted like the clip
        statistics; a maximum does not add up over micro-batches, so ``rollout_is_ratio_max`` is not among them."""
        if self.correction is None or self.args.old_logprobs != "current":
            return ()
        return ("rollout_is_ratio_mean", "rollout_is_clipped_frac")

    def _current_mismatch_stats(self) -> tuple[str, ...]:
        """With ``old_logprobs: current`` the loss compares the sampler's log-probs with the training forward's
        (means only, as above)."""
        return ("rollout_logprob_diff_mean", "rollout_kl") if self.args.old_logprobs == "current" else ()

    def wants_entropy(self) -> bool:
        return self.args.entropy_coef > 0

    def loss(self, mb: dict, out: ResponseTokens, on: float, w: float) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.args
        total = self.batch_mean.total  # the loss divides by the global batch's units itself; w weighs the stats
        mask = loss_mask(mb).to(self.device)
        logprobs = out.logprobs
        if a.old_logprobs == "current":  # the weights before this episode's only step: the proximal policy too
            old = logprobs.detach()
            weights, is_stats = self.correction_weights(mb, proximal=old)
        else:
            old = (mb["old_logprobs"] if "old_logprobs" in mb else mb["logprobs"]).to(self.device)
            weights, is_stats = self.correction_weights(mb)
        loss, st = self.loss_fn(logprobs, old, mb["advantages"].to(self.device), mask, total=total,
                                token_weights=None if weights is None else weights.to(self.device),
                                **self.loss_kwargs)
        part = {"policy_loss": float(loss.detach()) * on}

        def aggregated(per_token: torch.Tensor) -> torch.Tensor:
            return aggregate_loss(per_token, mask, a.loss_agg_mode, total, a.loss_scale_factor)

        if a.kl_coef > 0:
            kl = aggregated(self.kl_fn(logprobs, mb["ref_logprobs"].to(self.device)))
            loss = loss + a.kl_coef * kl
            part["kl_loss"] = float(kl.detach()) * on
        if a.entropy_coef > 0:
            ent = aggregated(out.entropy)
            loss = loss - a.entropy_coef * ent
            part["entropy"] = float(ent.detach()) * on
        for k in _CLIP_STATS:
            part[k] = st[k] * w
        for k in self._current_is_stats():
            part[k] = is_stats[k] * w
        mismatch_keys = self._current_mismatch_stats()
        if mismatch_keys:
            mismatch = logprob_mismatch(old, mb["logprobs"].to(self.device), mask)
            for k in mismatch_keys:
                part[k] = mismatch[k] * w
        return (loss * on if on != 1.0 else loss), part
