"""ChatLearn's engines: an engine is its compute flows.

``Engine(Environment(env_flow), Trainer(trainer_flow), Evaluator(eval_flow))`` with
``set_parameter_sync(trainer, inference)`` and ``set_dataset(prompts)``; ``learn()`` runs the Prefect train flow
on Ray, where every model call of the flows is a task run (:mod:`chatlearn.runtime.compute_flow` traces them,
:mod:`chatlearn.runtime.plan` is what they compile into). The built-in engines (RLHF, GRPO, GRPOMath, DPO,
online DPO, Eval) are written the same way, a few lines of flow each, in :mod:`chatlearn.runtime.engines`.

This module is the one place under ``chatlearn/`` that reaches up into ``flows/``: ChatLearn's API starts a
run from the engine, and the flow that runs it sits above this package, so the flows are imported when
``learn()``/``eval()`` is called (never at import time, and nothing in ``flows/`` imports this module, so the
layers have no loop). ``tests/test_layers.py`` allows exactly this exception.
"""

from collections.abc import Mapping, Sequence
from typing import Any

from chatlearn.config import ChatLearnConfig, ConfigError, EngineChecks, load_config
from chatlearn.config.current import get_config
from chatlearn.config.engines import engine_class
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime import engines
from chatlearn.runtime.compute_flow import Evaluator
from chatlearn.runtime.engines import BUILT_IN, resolve_engine
from chatlearn.runtime.plan import EngineFlows, ResolvedEngine
from chatlearn.runtime.prepared import PreparedRun, prepare_run

__all__ = ["DPOEngine", "Engine", "EvalEngine", "GRPOEngine", "GRPOMathEngine", "OnlineDPOEngine", "RLHFEngine",
           "build_engine", "engine_of"]

ConfigSource = Any  # a path, a dict, a ChatLearnConfig, a PreparedRun or None (chatlearn.init's config)


class Engine(EngineFlows):
    """An engine: an environment flow (generate, score), a trainer flow (train) and an evaluator flow (eval),
    any of which may be None, plus the weight syncs between its models (`set_parameter_sync`). An engine of
    one's own subclasses it, its constructor taking its models (`EngineFlows` says what else it may declare)."""

    name = "engine"
    from_config = False  # set by build_engine: the flow rebuilds the same modules from the config

    # -- ChatLearn's API ------------------------------------------------------------------------------------
    def set_dataset(self, dataset: Any) -> "Engine":
        """The training prompt records (a list of dicts or strings); they replace ``runtime.data_path``."""
        self._dataset = list(dataset)
        return self

    def set_evaluator(self, evaluator: Evaluator) -> "Engine":
        self.evaluator = evaluator
        self.compile(None)
        return self

    # -- running --------------------------------------------------------------------------------------------
    def _given_modules(self) -> dict[str, BaseModule] | None:
        return None if self.from_config else self.modules

    def prepare(self, config: ConfigSource = None, overrides: Sequence[str] | None = None) -> Any:
        """The run of `config` with this engine: checked, its data read (`chatlearn.runtime.prepared`). A run
        prepared already is taken as it is."""
        if isinstance(config, PreparedRun):
            if overrides:
                raise ConfigError("overrides: a prepared run takes none (apply them to its config first)")
            return config
        source = get_config() if config is None else config
        checks = EngineChecks(self.name, self._given_modules() or {}, self.spec, self._dataset is not None)
        cfg = load_config(source, overrides or (), [checks])
        # a built-in engine given its models in code takes the models it was not given from the config, as
        # before; an engine of one's own is its flows as written
        own = not self.from_config and (self.name not in BUILT_IN or self.own_flows)
        return prepare_run(cfg, self._given_modules(), self.name, resolved=self.resolve(cfg) if own else None)

    def learn(self, config: ConfigSource = None, overrides: Sequence[str] | None = None) -> dict[str, Any]:
        """Train with `config` (a config object, a YAML path or dict, or the one given to `chatlearn.init`);
        returns the last episode's metrics.

        With no Prefect API configured the run goes to the shared local server `chatlearn train` uses (its UI
        address is printed on stderr), through the flow's own call (`chatlearn.runtime.prefect.prevalidated`),
        never to Prefect's ephemeral API, which would vanish with the call and breaks under Ray."""
        from flows.train_flow import train_flow  # the documented upward call (see the module docstring)

        return train_flow(self.prepare(config, overrides), modules=self._given_modules(), engine=self.name)

    def eval(self, config: ConfigSource = None, overrides: Sequence[str] | None = None) -> dict[str, Any]:
        """Score the eval set once with the evaluator flow; returns the eval metrics (Prefect API: as `learn`)."""
        from flows.eval_flow import eval_flow  # the documented upward call (see the module docstring)

        return eval_flow(self.prepare(config, overrides), modules=self._given_modules())


# ChatLearn's engine classes: the built-in engines (`chatlearn.runtime.engines`, where each is declared) with the
# API above to run them
class RLHFEngine(engines.RLHF, Engine):
    """PPO: `RLHFEngine(policy, reference, reward, value, ppo_policy, ppo_value)` (`chatlearn.runtime.engines.RLHF`)."""


class GRPOEngine(engines.GRPO, Engine):
    """GRPO: `GRPOEngine(policy, reference, reward, ppo_policy)`, ``reference`` may be None (no KL term)
    (`chatlearn.runtime.engines.GRPO`)."""


class GRPOMathEngine(engines.GRPOMath, Engine):
    """GRPO with a second reward: `GRPOMathEngine(policy, reference, reward, reward1, ppo_policy)`
    (`chatlearn.runtime.engines.GRPOMath`)."""


class DPOEngine(engines.DPO, Engine):
    """Offline DPO: `DPOEngine(reference, ppo_policy)` (`chatlearn.runtime.engines.DPO`)."""


class OnlineDPOEngine(engines.OnlineDPO, Engine):
    """Online DPO: `OnlineDPOEngine(policy, reference, reward, ppo_policy)` (`chatlearn.runtime.engines.OnlineDPO`)."""


class EvalEngine(engines.Evaluation, Engine):
    """Evaluation alone (ChatLearn's EvalEngine): ``EvalEngine(policy, reward)`` answers the eval set with the
    policy and scores it with the reward; ``EvalEngine(eval_flow)`` (or ``evaluator=``) runs a flow of one's own
    (`chatlearn.runtime.engines.Evaluation`)."""

    def learn(self, config: ConfigSource = None, overrides: Sequence[str] | None = None) -> dict[str, Any]:
        return self.eval(config, overrides)


_RUNNABLE: dict[str, type[Engine]] = {cls.name: cls for cls in (RLHFEngine, GRPOEngine, GRPOMathEngine, DPOEngine,
                                                                OnlineDPOEngine, EvalEngine)}


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
    cls = _RUNNABLE.get(resolved.name) or engine_class(resolved.name)
    eng = cls(**{r: resolved.modules.get(r) for r in cls.model_roles() or ()})
    eng.name = resolved.name
    eng.from_config = from_config
    return eng
