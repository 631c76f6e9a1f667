"""Environments of multi-turn rollouts: the interface, loading one by name, checking what it returns."""

import math
from typing import Any

from chatlearn.utils.errors import RunError
from chatlearn.utils.imports import import_object


class EnvError(RunError):
    """An environment that raised or returned something unusable, naming the sample, the turn and the class."""


class Environment:
    """One instance per sample: ``reset(sample)`` once, then ``step(action)`` after each policy answer."""

    def reset(self, sample: dict[str, Any]) -> str | None:
        return None

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        raise NotImplementedError


def load_environment(spec: str) -> type:
    cls = import_object(spec, "Class")
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise EnvError(f"{spec} is not an environment class (reset(sample) and step(action))")
    return cls


def check_reset(value: Any, where: str) -> None:
    if value not in (None, ""):
        raise EnvError(f"{where}: reset returned {str(value)[:60]!r}; the record's prompt opens the conversation, "
                       "so reset returns None")


def check_step(result: Any, where: str) -> tuple[str, float, bool, dict[str, Any]]:
    if not isinstance(result, tuple) or len(result) != 4:
        raise EnvError(f"{where}: step returned {str(result)[:60]!r}, not (observation, reward, done, info)")
    obs, reward, done, info = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvError(f"{where}: step returned reward {reward!r}, not a number") from None
    if not isinstance(obs, str) or not math.isfinite(reward) or not isinstance(info, dict):
        raise EnvError(f"{where}: step returned an unusable (observation, reward, done, info)")
    return obs, reward, bool(done), info
