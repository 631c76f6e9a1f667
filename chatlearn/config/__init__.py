"""The config: ChatLearn's five seed classes and the root, the YAML loader, and the checks.

* :mod:`~chatlearn.config.runtime`, :mod:`~chatlearn.config.model`, :mod:`~chatlearn.config.root`: the
  pydantic schema (``RuntimeEnvConfig``, ``RuntimeConfig``, ``ModelConfig``, ``LoraConfig``,
  ``BatchGenerationConfig``, ``ChatLearnConfig``);
* :mod:`~chatlearn.config.loader` and :mod:`~chatlearn.config.envvars`: YAML files, ``includes:``,
  ``${VAR:default}``, model config files, ``dotted.key=value`` overrides;
* :mod:`~chatlearn.config.checks`: the cross-field checks every config gets (ChatLearn's own);
* :mod:`~chatlearn.config.engine_checks`, :mod:`~chatlearn.config.engines`, :mod:`~chatlearn.config.support`:
  what an engine needs, passed to :func:`load_config` as explicit ``checks``.

:mod:`~chatlearn.config.arguments` re-exports the schema under ChatLearn's own module path,
``chatlearn.utils.arguments``.
"""

from chatlearn.config.engine_checks import EngineChecks
from chatlearn.config.errors import ConfigError, ConfigWarning
from chatlearn.config.loader import (
    configs_dir,
    default_config_path,
    load_config,
    load_config_dict,
    load_yaml_with_includes,
    packaged_configs,
)
from chatlearn.config.model import BatchGenerationConfig, LoraConfig, ModelConfig
from chatlearn.config.root import ChatLearnConfig, ConfigCheck, collect_problems, run_checks
from chatlearn.config.runtime import RuntimeConfig, RuntimeEnvConfig

__all__ = [
    "BatchGenerationConfig",
    "ChatLearnConfig",
    "ConfigCheck",
    "ConfigError",
    "ConfigWarning",
    "EngineChecks",
    "LoraConfig",
    "ModelConfig",
    "RuntimeConfig",
    "RuntimeEnvConfig",
    "collect_problems",
    "configs_dir",
    "default_config_path",
    "load_config",
    "load_config_dict",
    "load_yaml_with_includes",
    "packaged_configs",
    "run_checks",
]
