"""Environments of multi-turn rollouts: the interface, loading one by name, checking what it returns."""

import math
from typing import Any

from chatlearn.utils.errors import RunError
from chatlearn.utils.imports import import_object


class EnvError(RunError):
    """An environment that raised or returned something unusable, naming the sample, the turn and the class."""


class Environment:
    """The interface a multi-turn task implements (``runtime.agent.env``); subclassing it is optional, any class
    with these two methods works. One instance per sample, made with ``runtime.agent.env_args`` as keywords.

    ``reset(sample)`` is called once, before the first step, with the sample's record fields (``prompt``,
    ``answer``, ...), its ``sample_id`` and ``env_seed`` (fixed by the run seed and the sample id: seed any
    randomness from it, so the same sample plays the same game in any batch or re-run). The record's prompt opens
    the conversation, so it returns None.

    ``step(action)`` gets the text of the policy's answer (special tokens left out) and returns the observation
    (shown to the policy as the next tool turn), a reward (summed over the conversation as ``env_reward``),
    whether the conversation is done, and an info dict (``tool_calls`` and ``tool_errors`` are counted)."""

    def reset(self, sample: dict[str, Any]) -> str | None:
        return None

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        raise NotImplementedError


def load_environment(spec: str) -> type:
    """The environment class ``spec`` names (``package.module:Class`` or ``file.py:Class``)."""
    cls = import_object(spec, "Class")
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise EnvError(f"{spec} is not an environment class (reset(sample) and step(action))")
    return cls


def check_reset(value: Any, where: str) -> None:
    """An EnvError at ``where`` unless ``reset`` returned None (or "")."""
    if value not in (None, ""):
        raise EnvError(f"{where}: reset returned {str(value)[:60]!r}; the record's prompt opens the conversation, "
                       "so reset returns None")


def check_step(result: Any, where: str) -> tuple[str, float, bool, dict[str, Any]]:
    """What ``step`` returned as (observation, reward, done, info); an EnvError at ``where`` naming what is
    wrong otherwise."""
    if not isinstance(result, tuple) or len(result) != 4:
        raise EnvError(f"{where}: step returned {str(result)[:60]!r}, not (observation, reward, done, info)")
    obs, reward, done, info = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvError(f"{where}: step returned reward {reward!r}, not a number") from None
    if not isinstance(obs, str):
        raise EnvError(f"{where}: step returned observation {str(obs)[:60]!r}, not a string")
    if not math.isfinite(reward):
        raise EnvError(f"{where}: step returned reward {reward}, not a finite number")
    if not isinstance(info, dict):
        raise EnvError(f"{where}: step returned info {str(info)[:60]!r}, not a dict")
    return obs, reward, bool(done), info
