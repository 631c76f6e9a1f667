"""RL algorithm math (pure tensor functions) and the registries the trainer resolves names through.

Importing this package registers the built-ins: the advantage estimators ``"gae"`` and ``"grpo"``
(:mod:`chatlearn.algorithms.advantages`), PPO's policy loss ``"ppo_clip"`` and value loss ``"ppo_clip"``,
the GRPO family's policy losses ``"grpo"`` and ``"gspo"`` (:mod:`chatlearn.algorithms.grpo`) and the
off-policy rollout corrections (:mod:`chatlearn.algorithms.off_policy`). How a
trainer weighs its micro-batches is :mod:`chatlearn.algorithms.aggregation`.
"""

import chatlearn.algorithms.advantages  # noqa: F401  (registers the estimators "gae" and "grpo")
import chatlearn.algorithms.grpo  # noqa: F401  (registers "grpo" and "gspo")
import chatlearn.algorithms.off_policy  # noqa: F401  (registers the rollout corrections: tis_*, mis_*, decoupled)

# ppo.py imports the registry itself, so importing it here registers the built-ins.
from chatlearn.algorithms.ppo import (
    gae_advantages_and_returns,
    kl_penalized_rewards,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_clipped_policy_loss,
    ppo_clipped_value_loss,
    whiten_global_batch,
)
from chatlearn.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    VALUE_LOSSES,
    advantage_estimator_inputs,
    get_advantage_estimator,
    get_policy_loss,
    get_rollout_correction,
    get_value_loss,
    register_advantage_estimator,
    register_policy_loss,
    register_rollout_correction,
    register_value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "VALUE_LOSSES",
    "advantage_estimator_inputs",
    "gae_advantages_and_returns",
    "get_advantage_estimator",
    "get_policy_loss",
    "get_rollout_correction",
    "get_value_loss",
    "kl_penalized_rewards",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "whiten_global_batch",
    "ppo_clipped_policy_loss",
    "ppo_clipped_value_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "register_rollout_correction",
    "register_value_loss",
]
