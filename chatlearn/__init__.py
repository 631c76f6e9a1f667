"""ChatLearn on Prefect + Ray: ChatLearn's models and config vocabulary, episodes as Prefect flows on Ray."""

from typing import Any

__version__ = "0.1.0"

_CONFIG: Any = None


def init(config: Any = None, overrides: list[str] | None = None) -> Any:
    """Load and validate the run config (a path, a dict or a `ChatLearnConfig`) for `engine.learn()`.

    ChatLearn's `chatlearn.init()` reads `-c CONFIG` from the command line; here the config is an argument,
    and with none the embedded default is used.
    """
    global _CONFIG
    from chatlearn.utils.arguments import ChatLearnConfig
    from chatlearn.utils.config_loader import load_config, load_config_dict

    if config is None:
        from chatlearn.cli import default_config_path

        config = str(default_config_path())
    if isinstance(config, ChatLearnConfig):
        _CONFIG = config
    elif isinstance(config, dict):
        _CONFIG = load_config_dict(config, None, overrides or [])
    else:
        _CONFIG = load_config(config, overrides or [])
    return _CONFIG


def get_config() -> Any:
    """The config set by `init` (the embedded default if `init` was never called)."""
    return _CONFIG if _CONFIG is not None else init()


def __getattr__(name: str) -> Any:
    # Lazy re-exports, so `import chatlearn` stays cheap (no torch/ray import for `chatlearn config`).
    if name in ("RLHFEngine", "Engine", "EpisodePlan"):
        from chatlearn.runtime import engine

        return getattr(engine, name)
    if name in ("BaseModule", "TorchModule"):
        from chatlearn import models

        return getattr(models, name)
    raise AttributeError(f"module 'chatlearn' has no attribute {name!r}")
