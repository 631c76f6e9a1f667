"""What the config checks know of an engine: the :class:`EngineSpec` the engine itself makes, and the rule that
finds the engine class ``runtime.engine`` names.

An engine is declared once, where its flows are: a class of :mod:`chatlearn.runtime.engines` (a built-in) or of
one's own (an ``Engine`` subclass), whose constructor takes its models, whose flows say what calls what and
what syncs into what, and whose class attributes name the module each model runs and the models it may go
without. What its models read and make (the default advantage estimator, prompt groups, ...) is said by their
module classes. The checks need all this before anything runs, but this layer sits below the runtime, so it
never imports the engines: the engine's class makes its spec (`EngineFlows.declared`, an engine object built in
code its own `EngineFlows.spec`), and the class is found by import path, as every piece of code a config names
is. A built-in's name (``grpo``) is short for its class in the runtime's registry
(``chatlearn.runtime.engines.BUILT_IN``, keyed by each class's ``name``); anything else is
``package.module:Class`` (or ``file.py:Class`` next to the config). Built-in and own engines go through that
one path, so an engine of one's own gets the checks a built-in of its shape gets.
"""

from typing import Any, NamedTuple

from chatlearn.config.errors import ConfigError
from chatlearn.utils.imports import import_object

__all__ = ["BUILT_IN_REGISTRY", "DEFAULT_MODULES", "EngineSpec", "engine_class"]

# the runtime's registry of built-in engine classes by name, imported by path as any engine class a config names
BUILT_IN_REGISTRY = "chatlearn.runtime.engines:BUILT_IN"

# The built-in module each of ChatLearn's model names runs unless its args_dict.module names another: an engine's
# `module_classes` start from these and override those it runs differently (GRPO's ppo_policy is the GRPO
# trainer); an engine built in code under no importable name runs these for the models it was not given.
DEFAULT_MODULES: dict[str, str] = {
    "policy": "chatlearn.models.hf.policy:PolicyInference",
    "reference": "chatlearn.models.hf.reference:ReferenceModel",
    "reward": "chatlearn.models.hf.reward:RuleReward",
    "reward1": "chatlearn.models.hf.reward:RuleReward",
    "value": "chatlearn.models.hf.value:ValueModel",
    "ppo_policy": "chatlearn.models.hf.ppo_trainer:PPOPolicyTrainer",
    "ppo_value": "chatlearn.models.hf.ppo_trainer:PPOValueTrainer",
}


class EngineSpec(NamedTuple):
    """What an engine needs of a config, as its class declares it and its traced flows show it."""

    name: str
    roles: tuple[str, ...]  # the models it takes, in its constructor's order (placement follows it)
    optional: tuple[str, ...] = ()  # models a config may leave out (the engine says when it needs them)
    sync: tuple[tuple[str, str], ...] = ()  # (trained model, inference model) weight syncs
    producer: str | None = None  # the model that reads the prompts: the environment's first call (else the eval's)
    trainers: tuple[str, ...] = ()  # the models its trainer flow trains, in call order
    scorers: tuple[tuple[str, str], ...] = ()  # (model, method) of the environment's calls after the first
    evaluates: bool = False  # it has an evaluator flow (runtime.eval_episode_interval, enable_eval_before_training)
    needs_train_data: bool = True  # its environment reads the config's prompt files (none were given in code)
    # what its trainers read, as their module classes declare it (chatlearn.models.base_module.BaseModule):
    # the advantage estimator the rewards of its experience run unless their args_dict names one (None: none);
    advantage_estimator: str | None = None
    groups: bool = False  # it compares several responses to one prompt (num_inference_per_prompt >= 2)
    pairs_in_groups: bool = False  # its samples are made inside each prompt group of a micro-batch
    multi_turn: bool = False  # the trainer synced into the producer trains on multi-turn samples

    @property
    def trains(self) -> bool:
        """False: evaluation only, and the other models of a training config are left alone."""
        return bool(self.trainers)

    def synced_into(self, model: str | None) -> str | None:
        """The trained model whose weights ``model`` receives, if any (the producer's: it generates on them)."""
        return next((src for src, dst in self.sync if dst == model), None)


def _registry() -> dict[str, Any]:
    return import_object(BUILT_IN_REGISTRY, "registry")


def engine_class(name: str) -> Any:
    """The engine class ``runtime.engine`` names: a built-in's name, or an ``Engine`` subclass of one's own by
    import path, whose constructor takes its models. ConfigError (one line) when it names none."""
    registry = _registry()
    if name in registry:
        return registry[name]
    if ":" not in name:
        raise ConfigError(f"runtime.engine: unknown engine {name!r}; known: {sorted(registry)}, or an Engine "
                          "subclass as 'package.module:Class' (or 'file.py:Class' next to the config)")
    try:
        cls = import_object(name, "Class")
    except ValueError as exc:
        raise ConfigError(f"runtime.engine: {exc}") from None
    # the runtime's base class, known by name: this layer cannot import it
    if not isinstance(cls, type) or not any(b.__name__ == "EngineFlows" and b.__module__ == "chatlearn.runtime.plan"
                                            for b in cls.__mro__):
        raise ConfigError(f"runtime.engine: {name} is not a chatlearn.Engine subclass")
    if cls.model_roles() is None:
        raise ConfigError(f"runtime.engine: {name} takes its flows, not its models; a config names an Engine "
                          "subclass whose constructor takes the models (ChatLearn's engines do)")
    return cls
