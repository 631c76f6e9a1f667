"""Environments of multi-turn rollouts: the interface, loading one by name, checking what it returns.

The Gymnasium-style wrapper is `chatlearn.envs.gym.GymTextEnv`; the tool-calling one is
`chatlearn.envs.tool_env.ToolEnvironment`.
"""

import math
from typing import Any

from chatlearn.utils.errors import RunError
from chatlearn.utils.imports import import_class

__all__ = ["ENV_METHODS", "EnvError", "Environment", "check_reset", "check_step", "load_environment"]

ENV_METHODS = ("reset", "step")  # what an environment class has


class EnvError(RunError):
    """An environment that cannot be loaded, raised, or returned something unusable; the message names where (the
    class, and at run time the sample and the turn). A RuntimeError, shown by the run as one line."""


class Environment:
    """The interface a multi-turn task implements (``runtime.agent.env``). Subclassing it is optional: any class
    with these two methods works. One instance per sample, made as ``cls(**runtime.agent.env_args)``.

    ``reset(sample)`` is called once, before the first step, with the sample's record fields (``prompt``,
    ``answer``, ...), its ``sample_id`` and ``env_seed``: an int fixed by the run seed and the sample id. Seed any
    randomness from ``env_seed`` (e.g. ``random.Random(sample["env_seed"])``), so the same sample plays the same
    conversation in any batch, replica or re-run. The record's prompt opens the conversation, so reset returns
    None (or ""); any other text is an error (`check_reset`), since it would have nowhere to go.

    ``step(action)`` gets the text of the policy's answer this turn (decoded, special tokens left out) and returns
    ``(observation, reward, done, info)``: the observation is shown to the policy as the next tool turn (ignored
    once done); the rewards of all turns are summed into the sample's ``env_reward``; ``info`` is a dict whose
    optional int keys ``tool_calls`` and ``tool_errors`` the runtime counts.

    ``args_problems(env_args)`` (a classmethod, optional too) says what is wrong with the constructor's arguments
    before anything starts, one ``"key: message"`` line each (a name checked against its registry, say); the
    config check calls it besides matching ``runtime.agent.env_args`` to the constructor's parameters."""

    @classmethod
    def args_problems(cls, env_args: dict[str, Any]) -> list[str]:
        return []

    def reset(self, sample: dict[str, Any]) -> str | None:
        return None

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__}.step")


def load_environment(spec: str) -> type:
    """The environment class ``spec`` names (``package.module:Class`` or ``file.py:Class``, imported as every
    other config hook is). An import failure is a ValueError naming the spec; something that is not a class with
    ``reset`` and ``step`` an EnvError naming it."""
    try:
        return import_class(spec, ENV_METHODS, "an environment class")
    except TypeError as exc:
        raise EnvError(str(exc)) from None


def _short(value: Any) -> str:
    return repr(str(value)[:60])


def check_reset(value: Any, where: str) -> None:
    """An EnvError at ``where`` (which names the class) unless ``reset`` returned None or ""."""
    if value is None or value == "":
        return
    raise EnvError(f"{where}: reset returned {_short(value)}; the record's prompt opens the conversation, so reset "
                   "returns None (put the first observation in the prompt)")


def _done(value: Any, where: str) -> bool:
    """``done`` as a bool; a string or None is refused, since ``"False"`` is truthy and None is likely a bug."""
    if isinstance(value, str) or value is None:
        raise EnvError(f"{where}: step returned done {value!r}, not a bool")
    try:
        return bool(value)
    except Exception:  # noqa: BLE001 - e.g. an array of several values, whose truth is ambiguous
        raise EnvError(f"{where}: step returned done {_short(value)}, not a bool") from None


def check_step(result: Any, where: str) -> tuple[str, float, bool, dict[str, Any]]:
    """What ``step`` returned as ``(observation, reward, done, info)`` with a float reward and a bool done; an
    EnvError at ``where`` naming what is wrong otherwise."""
    if not isinstance(result, tuple) or len(result) != 4:
        raise EnvError(f"{where}: step returned {_short(result)}, not (observation, reward, done, info)")
    obs, reward, done, info = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvError(f"{where}: step returned reward {reward!r}, not a number") from None
    if not isinstance(obs, str):
        raise EnvError(f"{where}: step returned observation {_short(obs)}, not a string")
    if not math.isfinite(reward):
        raise EnvError(f"{where}: step returned reward {reward}, not a finite number")
    if not isinstance(info, dict):
        raise EnvError(f"{where}: step returned info {_short(info)}, not a dict")
    return obs, reward, _done(done, where), info
