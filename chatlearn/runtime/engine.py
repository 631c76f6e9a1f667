"""ChatLearn's engines: ``RLHFEngine(policy, reference, reward, value, ppo_policy, ppo_value).learn()`` and
``EvalEngine(policy, reward).eval()``.

An engine is its models plus the episode's wiring (:mod:`chatlearn.runtime.plan`); ``learn()`` runs the
Prefect train flow on Ray. This module is the one place under ``chatlearn/`` that reaches up into ``flows/``:
ChatLearn's API starts a run from the engine, and the flow that runs it sits above this package, so the
flows are imported when ``learn()``/``eval()`` is called (never at import time, and nothing in ``flows/``
imports this module, so the layers have no loop). ``tests/test_layers.py`` allows exactly this exception.
"""

import os
from collections.abc import Mapping, Sequence
from typing import Any

from chatlearn.config import ChatLearnConfig, ConfigError, EngineChecks, load_config
from chatlearn.config.current import get_config
from chatlearn.config.engines import ENGINES
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.plan import EpisodePlan, ResolvedEngine, episode_plan, resolve_engine
from chatlearn.runtime.prepared import PreparedRun, prepare_run

__all__ = ["DPOEngine", "Engine", "EvalEngine", "GRPOEngine", "OnlineDPOEngine", "RLHFEngine", "build_engine",
           "engine_of"]

ConfigSource = str | os.PathLike | Mapping[str, Any] | ChatLearnConfig | PreparedRun | None


class Engine:
    """Models + plan; `learn()` runs the Prefect train flow on Ray."""

    name = "engine"

    def __init__(self, modules: dict[str, BaseModule], plan: EpisodePlan):
        self.modules = modules
        self.plan = plan
        self.from_config = False  # set by build_engine: the flow rebuilds the same modules from the config

    def _given_modules(self) -> dict[str, BaseModule] | None:
        return None if self.from_config else self.modules

    def prepare(self, config: ConfigSource = None,
                overrides: Sequence[str] | None = None) -> PreparedRun:
        """The run of `config` with this engine's modules: checked, its data read (`chatlearn.runtime.prepared`).
        A run prepared already is taken as it is."""
        if isinstance(config, PreparedRun):
            if overrides:
                raise ConfigError("overrides: a prepared run takes none (apply them to its config first)")
            return config
        source = get_config() if config is None else config
        cfg = load_config(source, overrides or (), [EngineChecks(self.name, self._given_modules() or {})])
        return prepare_run(cfg, self._given_modules(), self.name)

    def learn(self, config: ConfigSource = None, overrides: Sequence[str] | None = None) -> dict[str, Any]:
        """Train with `config` (a config object, a YAML path or dict, or the one given to `chatlearn.init`);
        returns the last episode's metrics.

        With no Prefect API configured the run goes to the shared local server `chatlearn train` uses (its UI
        address is printed on stderr), through the flow's own call (`flows.prevalidated`), never to Prefect's
        ephemeral API, which would vanish with the call and breaks under Ray."""
        from flows.train_flow import train_flow  # the documented upward call (see the module docstring)

        return train_flow(self.prepare(config, overrides), modules=self._given_modules(), engine=self.name)


class RLHFEngine(Engine):
    """PPO: policy → (reference, value) → reward; ppo_policy and ppo_value train; both synced back."""

    name = "rlhf"

    def __init__(self, policy: BaseModule, reference: BaseModule, reward: BaseModule, value: BaseModule,
                 ppo_policy: BaseModule, ppo_value: BaseModule):
        by_role = dict(zip(ENGINES["rlhf"].roles, (policy, reference, reward, value, ppo_policy, ppo_value),
                           strict=True))
        super().__init__({m.name: m for m in by_role.values()}, episode_plan("rlhf", by_role))


class GRPOEngine(Engine):
    """GRPO: policy samples ``num_inference_per_prompt`` responses per prompt -> reference (for the KL term;
    None when ppo_policy's kl_coef is 0) -> reward (scores, group-normalised advantages); ppo_policy trains
    with the token-level clipped loss and is synced back to the policy."""

    name = "grpo"

    def __init__(self, policy: BaseModule, reference: BaseModule | None, reward: BaseModule,
                 ppo_policy: BaseModule):
        by_role = {"policy": policy, "reference": reference, "reward": reward, "ppo_policy": ppo_policy}
        given = {m.name: m for m in by_role.values() if m is not None}
        super().__init__(given, episode_plan("grpo", by_role))


class DPOEngine(Engine):
    """Offline DPO: the reference reads (prompt, chosen, rejected) pairs; ppo_policy trains on them."""

    name = "dpo"

    def __init__(self, reference: BaseModule, ppo_policy: BaseModule):
        by_role = {"reference": reference, "ppo_policy": ppo_policy}
        super().__init__({m.name: m for m in by_role.values()}, episode_plan("dpo", by_role))


class OnlineDPOEngine(Engine):
    """Online DPO: policy samples prompt groups, the reward orders them, ppo_policy trains on the pairs."""

    name = "online_dpo"

    def __init__(self, policy: BaseModule, reference: BaseModule, reward: BaseModule, ppo_policy: BaseModule):
        by_role = {"policy": policy, "reference": reference, "reward": reward, "ppo_policy": ppo_policy}
        super().__init__({m.name: m for m in by_role.values()}, episode_plan("online_dpo", by_role))


class EvalEngine(Engine):
    """Evaluation alone: the policy answers the eval set, the reward scores it (ChatLearn's EvalEngine)."""

    name = "eval"

    def __init__(self, policy: BaseModule, reward: BaseModule):
        by_role = {"policy": policy, "reward": reward}
        super().__init__({m.name: m for m in by_role.values()}, episode_plan("eval", by_role))

    def learn(self, config: ConfigSource = None, overrides: Sequence[str] | None = None) -> dict[str, Any]:
        return self.eval(config, overrides)

    def eval(self, config: ConfigSource = None, overrides: Sequence[str] | None = None) -> dict[str, Any]:
        """Score the eval set once; returns the eval metrics (Prefect API: as `learn`)."""
        from flows.eval_flow import eval_flow  # the documented upward call (see the module docstring)

        return eval_flow(self.prepare(config, overrides), modules=self._given_modules())


_CLASSES: dict[str, type[Engine]] = {"rlhf": RLHFEngine, "grpo": GRPOEngine, "dpo": DPOEngine,
                                     "online_dpo": OnlineDPOEngine, "eval": EvalEngine}


def build_engine(cfg: ChatLearnConfig, modules: Mapping[str, BaseModule] | None = None,
                 engine: str | None = None) -> Engine:
    """The engine a config asks for (`runtime.engine`, or `engine`), with modules built from the config.

    Raises `ConfigError` listing every problem (unknown engine, missing models, bad module args, fields not
    supported yet), unless the config already passed these checks.
    """
    return engine_of(resolve_engine(cfg, modules, engine), from_config=not modules)


def engine_of(resolved: ResolvedEngine, from_config: bool = True) -> Engine:
    """The engine object of a resolved engine (`PreparedRun.engine`); ``from_config``: its modules were built
    from the config (not given in code)."""
    by_name = dict(resolved.modules)
    eng = _CLASSES[resolved.name](*[by_name.get(role) for role in ENGINES[resolved.name].roles])
    eng.from_config = from_config
    return eng
