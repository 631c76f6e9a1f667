"""ChatLearn's ``chatlearn.init()``: the run config that ``engine.learn()`` uses when it is given none."""

import os
from collections.abc import Mapping, Sequence
from typing import Any

from chatlearn.config.loader import load_config
from chatlearn.config.root import ChatLearnConfig

__all__ = ["get_config", "init"]

# Why a module global: ChatLearn's API is `chatlearn.init()` then `engine.learn()` with no config between them.
_CONFIG: ChatLearnConfig | None = None


def init(config: "str | os.PathLike | Mapping[str, Any] | ChatLearnConfig | None" = None,
         overrides: Sequence[str] = ()) -> ChatLearnConfig:
    """Load and validate the run config (a path, a dict or a `ChatLearnConfig`) for `engine.learn()`.

    ChatLearn's `chatlearn.init()` reads `-c CONFIG` from the command line; here the config is an argument,
    and with none the embedded default is used.
    """
    global _CONFIG
    _CONFIG = load_config(config, overrides)
    return _CONFIG


def get_config() -> ChatLearnConfig:
    """The config set by `init` (the embedded default if `init` was never called)."""
    return _CONFIG if _CONFIG is not None else init()
