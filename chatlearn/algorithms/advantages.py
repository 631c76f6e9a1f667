"""Advantage estimators: how a scored batch becomes the experience a policy trainer learns from.

One contract for every algorithm, ``fn(batch, args) -> dict``, registered by name
(:func:`~chatlearn.algorithms.registry.register_advantage_estimator`):

* ``batch``: the upstream models' outputs of one batch plus ``scores`` ``[B]`` (the reward, clipped), with
  the fields the estimator declares as its inputs (a batch without them is an error naming them);
* ``args``: the reward's experience settings (``kl_coef``, ``gamma``, ``lam``, ...);
* returns the fields it adds to the experience, ``advantages`` among them.

The engine names the estimator it uses (``models.reward.args_dict.advantage_estimator``, default: the
engine's, :data:`chatlearn.config.engines.ENGINES`), so the choice is never guessed from which keys a batch
happens to carry.
"""

from typing import Any

import torch

from chatlearn.algorithms.grpo import group_advantages_by_id
from chatlearn.algorithms.ppo import gae_advantages_and_returns, kl_penalized_rewards
from chatlearn.algorithms.registry import register_advantage_estimator

__all__ = ["gae", "grpo"]


@register_advantage_estimator("gae", inputs=("logprobs", "ref_logprobs", "values", "response_mask"))
def gae(batch: dict[str, Any], args: Any) -> dict[str, torch.Tensor]:
    """PPO's experience: per-token rewards (the score at the last token, a KL penalty to the reference on
    every token, ``args.kl_coef``), then GAE (``args.gamma``, ``args.lam``) over the critic's values.

    Returns ``rewards``, ``kl``, ``advantages`` and ``returns``, each ``[B, T]`` and 0 at padding."""
    mask = batch["response_mask"]
    rewards, kl = kl_penalized_rewards(batch["scores"], batch["logprobs"], batch["ref_logprobs"], mask, args.kl_coef)
    adv, ret = gae_advantages_and_returns(rewards=rewards, values=batch["values"], mask=mask, gamma=args.gamma,
                                          lam=args.lam)
    return {"rewards": rewards, "kl": kl, "advantages": adv, "returns": ret}


@register_advantage_estimator("grpo", inputs=("group_id",))
def grpo(batch: dict[str, Any], args: Any) -> dict[str, torch.Tensor]:
    """GRPO's experience: no critic, each response judged against the other responses to its prompt
    (``advantages`` ``[B]``, group-normalised scores). With the policy's and reference's log-probs in the
    batch, ``kl`` ``[B, T]`` (their difference on response tokens) is reported too, not a reward penalty."""
    out = {"advantages": group_advantages_by_id(batch["scores"], batch["group_id"])}
    if "ref_logprobs" in batch and "logprobs" in batch:
        out["kl"] = (batch["logprobs"] - batch["ref_logprobs"]) * batch["response_mask"]
    return out
