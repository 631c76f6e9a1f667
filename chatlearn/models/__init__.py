"""User-facing module classes (ChatLearn's API) and the built-in Hugging Face modules (`chatlearn.models.hf`).

Which built-in module serves a model name is config-level knowledge: `chatlearn.config.engines.default_module`
(per engine: `ppo_policy` is the GRPO trainer under `grpo`).
"""

from chatlearn.models.base_module import BaseModule
from chatlearn.models.torch_module import TorchModule

__all__ = ["BaseModule", "TorchModule"]
