"""KL estimators between the policy and the reference, per token (Schulman, "Approximating KL divergence").

Each is a registered pure function ``fn(logprobs, ref_logprobs) -> [B, T]`` of the sampled tokens' log-probs,
chosen by name wherever a KL is taken:

* as a reward penalty (``models.reward.args_dict.kl_coef`` / ``kl_estimator``: PPO's ``gae``, ``reinforce_pp``
  and ``reinforce_pp_baseline``; verl's ``use_kl_in_reward`` / ``kl_penalty``);
* as a loss term (``models.ppo_policy.args_dict.kl_coef`` / ``kl_estimator`` of the GRPO-family trainer;
  verl's ``use_kl_loss`` / ``kl_loss_coef`` / ``kl_loss_type``).

With ``d = logprobs - ref_logprobs`` (the log-ratio policy / reference on a token the policy sampled):

* ``k1``: ``d``, unbiased, high variance, may be negative;
* ``k2``: ``d**2 / 2``, biased, low variance, its gradient is the exact KL gradient's estimate;
* ``k3``: ``exp(-d) + d - 1``, unbiased and >= 0 (low variance); clamped as ChatLearn and verl do
  (:func:`chatlearn.algorithms.grpo.k3_kl`).

Elementwise, no masking: the caller reduces over response tokens.
"""

import torch

from chatlearn.algorithms.grpo import k3_kl
from chatlearn.algorithms.registry import register_kl_estimator

__all__ = ["k1", "k2", "k3"]


@register_kl_estimator("k1")
def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``logprobs - ref_logprobs``."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``0.5 * (logprobs - ref_logprobs) ** 2``."""
    return 0.5 * (logprobs - ref_logprobs).square()


@register_kl_estimator("k3")
def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """``exp(ref - logprobs) - (ref - logprobs) - 1``, clamped to ``[-10, 10]``."""
    return k3_kl(logprobs, ref_logprobs)
