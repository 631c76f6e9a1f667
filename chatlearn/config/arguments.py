"""ChatLearn's own path to the config classes (``from chatlearn.utils.arguments import ModelConfig``).

The config lives in :mod:`chatlearn.config`; this module only re-exports it so code written for ChatLearn
keeps importing from where it always did. It is that module: ``chatlearn/__init__.py`` registers it as
``chatlearn.utils.arguments``. It lives here, with what it re-exports, because ``chatlearn.utils`` sits below
the config in the layers (``tests/test_layers.py``).
"""

from chatlearn.config.errors import ConfigError, ConfigWarning
from chatlearn.config.model import PARALLEL_KEYS, BatchGenerationConfig, LoraConfig, ModelConfig
from chatlearn.config.root import ChatLearnConfig, collect_problems
from chatlearn.config.runtime import (
    CPU_SCHEDULE_STRATEGIES,
    PARAM_SYNC_COMM_TYPES,
    STREAM_DATA_LOADER_TYPES,
    RuntimeConfig,
    RuntimeEnvConfig,
)

__all__ = [
    "CPU_SCHEDULE_STRATEGIES",
    "PARALLEL_KEYS",
    "PARAM_SYNC_COMM_TYPES",
    "STREAM_DATA_LOADER_TYPES",
    "BatchGenerationConfig",
    "ChatLearnConfig",
    "ConfigError",
    "ConfigWarning",
    "LoraConfig",
    "ModelConfig",
    "RuntimeConfig",
    "RuntimeEnvConfig",
    "collect_problems",
]
