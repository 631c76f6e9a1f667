"""User-facing module classes (ChatLearn's API) and the built-in Hugging Face modules (`chatlearn.models.hf`).

Which built-in module serves a model name each engine declares (`chatlearn.runtime.plan.EngineFlows.module_classes`:
`ppo_policy` is the GRPO trainer under `grpo`); what a module reads and makes its class says (`BaseModule`).
"""

from chatlearn.models.base_module import BaseModule
from chatlearn.models.torch_module import TorchModule

__all__ = ["BaseModule", "TorchModule"]
