"""Which models each engine uses, how weights flow between them, and the built-in module for each name.

This is config-level knowledge (the checks need it before anything runs); the runtime turns an engine's
roles into the episode's task graph (:mod:`chatlearn.runtime.plan`).
"""

from typing import NamedTuple

__all__ = ["DEFAULT_MODULES", "ENGINES", "EngineSpec", "default_module"]


class EngineSpec(NamedTuple):
    """An engine's models by role (in the order its constructor takes them) and its weight syncs."""

    roles: tuple[str, ...]
    sync: tuple[tuple[str, str], ...] = ()  # (trainer role, inference role)
    trains: bool = True  # False: evaluation only, other models of a training config are left alone
    needs_train_data: bool = True
    optional: tuple[str, ...] = ()  # roles a config may leave out (the engine says when it needs them)
    modules: tuple[tuple[str, str], ...] = ()  # built-in module per role where it differs from DEFAULT_MODULES
    groups: bool = False  # samples num_inference_per_prompt responses per prompt, kept together as a group
    # the registered advantage estimator the reward runs (chatlearn.algorithms.advantages) unless
    # models.reward.args_dict.advantage_estimator names another; None: the engine trains on no advantages
    advantage_estimator: str | None = None
    # an engine of one's own: the models whose forward_step makes the experience (the environment flow's
    # returned calls); with no engine default each names its estimator in its args_dict
    experience: tuple[str, ...] = ()


ENGINES: dict[str, EngineSpec] = {
    # ChatLearn's RLHFEngine(policy, reference, reward, value, ppo_policy, ppo_value)
    "rlhf": EngineSpec(
        roles=("policy", "reference", "reward", "value", "ppo_policy", "ppo_value"),
        sync=(("ppo_policy", "policy"), ("ppo_value", "value")),
        advantage_estimator="gae",
    ),
    # ChatLearn's GRPOEngine(policy, reference, reward, ppo_policy): no critic, group-normalised advantages;
    # the reference is only needed for the KL term (ppo_policy's kl_coef > 0)
    "grpo": EngineSpec(
        roles=("policy", "reference", "reward", "ppo_policy"),
        sync=(("ppo_policy", "policy"),),
        optional=("reference",),
        modules=(("ppo_policy", "chatlearn.models.hf.grpo_trainer:GRPOPolicyTrainer"),),
        groups=True,
        advantage_estimator="grpo",
    ),
    # ChatLearn's GRPOMathEngine(policy, reference, reward, reward1, ppo_policy): GRPO with a second reward
    # (reward1, a rule by default) whose scores the reward adds to its own before the group advantages
    "grpo_math": EngineSpec(
        roles=("policy", "reference", "reward", "reward1", "ppo_policy"),
        sync=(("ppo_policy", "policy"),),
        optional=("reference",),
        modules=(("ppo_policy", "chatlearn.models.hf.grpo_trainer:GRPOPolicyTrainer"),),
        groups=True,
        advantage_estimator="grpo",
    ),
    # ChatLearn's DPOEngine(reference, ppo_policy): offline (prompt, chosen, rejected) pairs
    "dpo": EngineSpec(
        roles=("reference", "ppo_policy"),
        modules=(("reference", "chatlearn.models.hf.dpo:PairReference"),
                 ("ppo_policy", "chatlearn.models.hf.dpo:DPOPolicyTrainer")),
    ),
    # ChatLearn's OnlineDPOEngine(policy, reference, reward, ppo_policy): pairs from each prompt's group
    "online_dpo": EngineSpec(
        roles=("policy", "reference", "reward", "ppo_policy"),
        sync=(("ppo_policy", "policy"),),
        modules=(("ppo_policy", "chatlearn.models.hf.dpo:OnlineDPOPolicyTrainer"),),
        groups=True,
        # the trainer learns from pairs, not advantages; the group advantages and the reported KL are GRPO's
        advantage_estimator="grpo",
    ),
    # ChatLearn's EvalEngine: the policy answers the eval set, the reward scores it
    "eval": EngineSpec(roles=("policy", "reward"), trains=False, needs_train_data=False),
}

# Built-in module for each model name, used when `args_dict.module` is not set.
DEFAULT_MODULES: dict[str, str] = {
    "policy": "chatlearn.models.hf.policy:PolicyInference",
    "reference": "chatlearn.models.hf.reference:ReferenceModel",
    "reward": "chatlearn.models.hf.reward:RuleReward",
    "reward1": "chatlearn.models.hf.reward:RuleReward",
    "value": "chatlearn.models.hf.value:ValueModel",
    "ppo_policy": "chatlearn.models.hf.ppo_trainer:PPOPolicyTrainer",
    "ppo_value": "chatlearn.models.hf.ppo_trainer:PPOValueTrainer",
}


def default_module(engine: str, name: str) -> str | None:
    """The built-in module of a model name under an engine (GRPO's ppo_policy is not PPO's)."""
    spec = ENGINES.get(engine)
    own = dict(spec.modules) if spec is not None else {}
    return own.get(name) or DEFAULT_MODULES.get(name)
