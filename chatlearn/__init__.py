"""ChatLearn on Prefect + Ray: ChatLearn's models and config vocabulary, episodes as Prefect flows on Ray."""

import importlib
import sys
from typing import Any

from chatlearn import utils as _utils
from chatlearn.config import arguments as _arguments
from chatlearn.config.current import get_config, init

# ChatLearn's own path to the config classes, `chatlearn.utils.arguments`, is chatlearn.config.arguments (utils
# sits below the config, so the module lives with it); importing that path runs this package first
sys.modules.setdefault("chatlearn.utils.arguments", _arguments)
_utils.arguments = _arguments

__version__ = "0.1.0"

__all__ = ["BaseModule", "DPOEngine", "Engine", "Environment", "EvalEngine", "Evaluator", "GRPOEngine",
           "GRPOMathEngine", "OnlineDPOEngine", "RLHFEngine", "TorchModule", "Trainer", "get_config", "init", "step"]

_LAZY = {
    "Engine": "chatlearn.runtime.engine",
    "RLHFEngine": "chatlearn.runtime.engine",
    "EvalEngine": "chatlearn.runtime.engine",
    "GRPOEngine": "chatlearn.runtime.engine",
    "DPOEngine": "chatlearn.runtime.engine",
    "OnlineDPOEngine": "chatlearn.runtime.engine",
    "GRPOMathEngine": "chatlearn.runtime.engine",
    "Environment": "chatlearn.runtime.compute_flow",
    "Trainer": "chatlearn.runtime.compute_flow",
    "Evaluator": "chatlearn.runtime.compute_flow",
    "step": "chatlearn.runtime.compute_flow",
    "EpisodePlan": "chatlearn.runtime.plan",
    "BaseModule": "chatlearn.models",
    "TorchModule": "chatlearn.models",
}


def __getattr__(name: str) -> Any:
    # Lazy re-exports, so `import chatlearn` stays cheap: `chatlearn config` needs no torch, Ray or Prefect.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'chatlearn' has no attribute {name!r}")
