"""User-facing module classes (ChatLearn's API) and the built-in Hugging Face modules."""

from chatlearn.models.base_module import BaseModule
from chatlearn.models.torch_module import TorchModule

# Built-in module for each model name of the default RLHF config, used when `args_dict.module` is not set.
DEFAULT_MODULES: dict[str, str] = {
    "policy": "chatlearn.models.hf.policy:PolicyInference",
    "reference": "chatlearn.models.hf.reference:ReferenceModel",
    "reward": "chatlearn.models.hf.reward:RuleReward",
    "value": "chatlearn.models.hf.value:ValueModel",
    "ppo_policy": "chatlearn.models.hf.ppo_trainer:PPOPolicyTrainer",
    "ppo_value": "chatlearn.models.hf.ppo_trainer:PPOValueTrainer",
}

__all__ = ["BaseModule", "TorchModule", "DEFAULT_MODULES"]
