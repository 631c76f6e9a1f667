"""Which models each engine uses, how weights flow between them, and the built-in module for each name.

This is config-level knowledge (the checks need it before anything runs); the runtime turns an engine's
roles into the episode's task graph (:mod:`chatlearn.runtime.plan`).
"""

from typing import NamedTuple

__all__ = ["DEFAULT_MODULES", "ENGINES", "EngineSpec"]


class EngineSpec(NamedTuple):
    """An engine's models by role (in the order its constructor takes them) and its weight syncs."""

    roles: tuple[str, ...]
    sync: tuple[tuple[str, str], ...] = ()  # (trainer role, inference role)
    trains: bool = True  # False: evaluation only, other models of a training config are left alone
    needs_train_data: bool = True


ENGINES: dict[str, EngineSpec] = {
    # ChatLearn's RLHFEngine(policy, reference, reward, value, ppo_policy, ppo_value)
    "rlhf": EngineSpec(
        roles=("policy", "reference", "reward", "value", "ppo_policy", "ppo_value"),
        sync=(("ppo_policy", "policy"), ("ppo_value", "value")),
    ),
    # ChatLearn's EvalEngine: the policy answers the eval set, the reward scores it
    "eval": EngineSpec(roles=("policy", "reward"), trains=False, needs_train_data=False),
}

# Built-in module for each model name, used when `args_dict.module` is not set.
DEFAULT_MODULES: dict[str, str] = {
    "policy": "chatlearn.models.hf.policy:PolicyInference",
    "reference": "chatlearn.models.hf.reference:ReferenceModel",
    "reward": "chatlearn.models.hf.reward:RuleReward",
    "value": "chatlearn.models.hf.value:ValueModel",
    "ppo_policy": "chatlearn.models.hf.ppo_trainer:PPOPolicyTrainer",
    "ppo_value": "chatlearn.models.hf.ppo_trainer:PPOValueTrainer",
}
