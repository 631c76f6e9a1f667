"""RL algorithm math (pure tensor functions) and the registries the trainer resolves names through.

Importing this package registers the built-ins: the advantage estimators ``gae``, ``grpo``, ``dr_grpo``,
``rloo``, ``reinforce_pp`` and ``reinforce_pp_baseline`` (:mod:`chatlearn.algorithms.advantages`), PPO's
policy loss ``ppo_clip`` (with dual clip) and value loss ``ppo_clip``, the GRPO family's policy losses
``grpo``, ``gspo`` and ``cispo`` (:mod:`chatlearn.algorithms.grpo`), the KL estimators ``k1``, ``k2``, ``k3``
(:mod:`chatlearn.algorithms.kl`) and the off-policy rollout corrections
(:mod:`chatlearn.algorithms.off_policy`). How a trainer weighs its micro-batches, and the loss aggregation
modes, are :mod:`chatlearn.algorithms.aggregation`.
"""

import chatlearn.algorithms.advantages  # noqa: F401  (registers the advantage estimators)
import chatlearn.algorithms.grpo  # noqa: F401  (registers "grpo", "gspo" and "cispo")
import chatlearn.algorithms.kl  # noqa: F401  (registers the KL estimators k1, k2, k3)
import chatlearn.algorithms.off_policy  # noqa: F401  (registers the rollout corrections: tis_*, mis_*, decoupled)
from chatlearn.algorithms.off_policy import logprob_mismatch

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
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    VALUE_LOSSES,
    WHITENED_ESTIMATORS,
    advantage_estimator_inputs,
    advantage_estimator_settings,
    get_advantage_estimator,
    get_kl_estimator,
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
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "WHITENED_ESTIMATORS",
    "ROLLOUT_CORRECTIONS",
    "VALUE_LOSSES",
    "advantage_estimator_inputs",
    "advantage_estimator_settings",
    "gae_advantages_and_returns",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "get_rollout_correction",
    "get_value_loss",
    "kl_penalized_rewards",
    "logprob_mismatch",
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
