"""User-facing module classes (ChatLearn's API) and the built-in Hugging Face modules (`chatlearn.models.hf`).

Which built-in module serves a model name each engine declares (`chatlearn.runtime.plan.EngineFlows.module_classes`:
`ppo_policy` is the GRPO trainer under `grpo`); what a module reads and makes its class says (`BaseModule`).
"""

from typing import Any

__all__ = ["BaseModule", "TorchModule"]


def __getattr__(name: str) -> Any:
    # imported on first use: a Ray worker that runs a rule reward's task imports `chatlearn.models.rule` alone, and
    # the module classes bring transformers and torch.distributed (about 3 CPU-s a process)
    if name == "BaseModule":
        from chatlearn.models.base_module import BaseModule  # on first use: see above

        return BaseModule
    if name == "TorchModule":
        from chatlearn.models.torch_module import TorchModule  # on first use: see above

        return TorchModule
    raise AttributeError(f"module 'chatlearn.models' has no attribute {name!r}")
