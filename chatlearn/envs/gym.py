"""A Gymnasium-style text environment as a multi-turn environment, without Gymnasium itself.

Anything with Gymnasium's ``reset(seed=...) -> (observation, info)`` and ``step(action) -> (observation, reward,
terminated, truncated, info)`` over text works: ``runtime.agent.env: chatlearn.envs.gym:GymTextEnv`` with
``env_args: {factory: package.module:make_env, kwargs: {...}}``. The inner environment is reset with the sample's
``env_seed``; its first observation is not shown (the record's prompt opens the conversation and must describe
the task); ``terminated`` or ``truncated`` ends it.
"""

from typing import Any

from chatlearn.envs.base import EnvError, Environment
from chatlearn.utils.imports import import_object

__all__ = ["GymTextEnv"]


class GymTextEnv(Environment):
    """Wraps the environment ``factory(**kwargs)`` makes (``package.module:callable``, e.g. a class)."""

    @classmethod
    def args_problems(cls, env_args: dict[str, Any]) -> list[str]:
        factory = env_args.get("factory")
        if factory is None:
            return []  # the config check names the missing argument
        try:
            make = import_object(factory, "callable")
        except ValueError as exc:
            return [f"factory: {exc}"]
        return [] if callable(make) else [f"factory: {factory} is not callable"]

    def __init__(self, factory: str, kwargs: dict[str, Any] | None = None) -> None:
        make = import_object(factory, "callable")
        if not callable(make):
            raise EnvError(f"GymTextEnv factory {factory} is not callable")
        self.env = make(**(kwargs or {}))

    def reset(self, sample: dict[str, Any]) -> None:
        self.env.reset(seed=int(sample["env_seed"]))

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return str(obs), float(reward), bool(terminated or truncated), dict(info or {})
