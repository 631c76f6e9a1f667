"""An engine's episode as a plan of model names, and the modules a config asks for.

As in ChatLearn, an engine is just its models plus the wiring; users write ``forward_step``/``train_step`` and
never see scheduling. Unlike ChatLearn, the wiring is an explicit :class:`EpisodePlan` (no parsing of a flow
function's source), and ``flows/episode_flow.py`` turns it into Prefect tasks. The flows build their run
from here (:func:`resolve_engine`); the user-facing engine classes are in :mod:`chatlearn.runtime.engine`.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel, Field

from chatlearn.config import ChatLearnConfig, EngineChecks, run_checks
from chatlearn.config.engine_checks import engine_name, module_class_path
from chatlearn.config.engines import ENGINES
from chatlearn.models.base_module import BaseModule
from chatlearn.utils.imports import import_object

__all__ = ["EpisodePlan", "ResolvedEngine", "episode_plan", "resolve_engine"]


class EpisodePlan(BaseModel):
    """The DAG of one episode, by model name."""

    producer: str = Field(description="generates rollouts from prompt batches (owns the dataset)")
    scorers: list[str] = Field(default_factory=list, description="run on the rollouts, in parallel")
    final: str | None = Field(None, description="gets rollouts + scorer outputs; its output is the experience")
    trainers: list[str] = Field(default_factory=list, description="train on the experience")
    sync: list[tuple[str, str]] = Field(default_factory=list, description="(trainer, inference) weight pairs")
    evaluator: str | None = Field(None, description="scores the producer's eval outputs")
    export: str | None = Field(None, description="trainable model saved as the final policy")


def _rlhf(n: Mapping[str, str]) -> EpisodePlan:
    """PPO: policy -> (reference, value) -> reward; ppo_policy and ppo_value train; both synced back."""
    return EpisodePlan(
        producer=n["policy"], scorers=[n["reference"], n["value"]], final=n["reward"],
        trainers=[n["ppo_policy"], n["ppo_value"]],
        sync=[(n[src], n[dst]) for src, dst in ENGINES["rlhf"].sync],
        evaluator=n["reward"], export=n["ppo_policy"],
    )


def _eval(n: Mapping[str, str]) -> EpisodePlan:
    """Evaluation alone: the policy answers the eval set, the reward scores it."""
    return EpisodePlan(producer=n["policy"], evaluator=n["reward"])


_PLANS: dict[str, Callable[[Mapping[str, str]], EpisodePlan]] = {"rlhf": _rlhf, "eval": _eval}


def episode_plan(engine: str, modules: Mapping[str, BaseModule]) -> EpisodePlan:
    """The plan of ``engine`` over ``modules`` given by role (the plan names each module by its ``name``)."""
    return _PLANS[engine]({role: module.name for role, module in modules.items()})


class ResolvedEngine(NamedTuple):
    name: str
    modules: dict[str, BaseModule]  # by model name, in the engine's role order
    plan: EpisodePlan


def resolve_engine(cfg: ChatLearnConfig, modules: Mapping[str, Any] | None = None,
                   engine: str | None = None) -> ResolvedEngine:
    """The engine a config asks for, its modules (those given in code, the rest built from the config) and
    its plan. Runs the engine's checks unless this config already passed them (ConfigError lists all)."""
    given = dict(modules or {})
    name = engine_name(cfg, engine)
    run_checks(cfg, [EngineChecks(name, given)])
    by_role = {role: given[role] if role in given else import_object(module_class_path(role, cfg), "Class")(role)
               for role in ENGINES[name].roles}
    return ResolvedEngine(name, {m.name: m for m in by_role.values()}, episode_plan(name, by_role))
