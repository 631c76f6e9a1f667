"""An engine's episode as a plan of model names, and the modules a config asks for.

As in ChatLearn, an engine is just its models plus the wiring; users write ``forward_step``/``train_step`` and
never see scheduling. Unlike ChatLearn, the wiring is an explicit :class:`EpisodePlan` (no parsing of a flow
function's source), and ``flows/episode_flow.py`` turns it into Prefect tasks. The flows build their run
from here (:func:`resolve_engine`); the user-facing engine classes are in :mod:`chatlearn.runtime.engine`.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel, Field

from chatlearn.config import ChatLearnConfig
from chatlearn.config.engine_checks import engine_name, module_class_path
from chatlearn.config.engines import ENGINES
from chatlearn.config.user_code import user_code
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


def _grpo(n: Mapping[str, str], trainer_args: Mapping[str, Any]) -> EpisodePlan:
    """GRPO: policy samples prompt groups -> reference (KL term, when present) -> reward (scores and group
    advantages); ppo_policy trains and is synced back. The old log-probs are the sampler's (same weights as
    the trainer when the policy syncs every episode), or the trainer's own forward pass in the score stage
    when ppo_policy's ``old_logprobs`` says ``trainer``."""
    scorers = [n["reference"]] if "reference" in n else []
    if trainer_args.get("old_logprobs", "generation") == "trainer":
        scorers.append(n["ppo_policy"])
    return EpisodePlan(producer=n["policy"], scorers=scorers, final=n["reward"], trainers=[n["ppo_policy"]],
                       sync=[(n["ppo_policy"], n["policy"])], evaluator=n["reward"], export=n["ppo_policy"])


def _online_dpo(n: Mapping[str, str], trainer_args: Mapping[str, Any]) -> EpisodePlan:
    """Online DPO: policy samples prompt groups -> reference log-probs -> reward scores; ppo_policy trains on
    the pairs inside each group and is synced back."""
    return EpisodePlan(producer=n["policy"], scorers=[n["reference"]], final=n["reward"],
                       trainers=[n["ppo_policy"]], sync=[(n["ppo_policy"], n["policy"])], evaluator=n["reward"],
                       export=n["ppo_policy"])


def _dpo(n: Mapping[str, str], trainer_args: Mapping[str, Any]) -> EpisodePlan:
    """Offline DPO: the reference reads the (prompt, chosen, rejected) pairs and adds its log-probs; ppo_policy
    trains on them. Eval: the trainer scores held-out pairs (preference accuracy and margin)."""
    return EpisodePlan(producer=n["reference"], trainers=[n["ppo_policy"]], evaluator=n["ppo_policy"],
                       export=n["ppo_policy"])


def _eval(n: Mapping[str, str], trainer_args: Mapping[str, Any]) -> EpisodePlan:
    """Evaluation alone: the policy answers the eval set, the reward scores it."""
    return EpisodePlan(producer=n["policy"], evaluator=n["reward"])


_PLANS: dict[str, Callable[[Mapping[str, str], Mapping[str, Any]], EpisodePlan]] = {
    "rlhf": lambda n, _: _rlhf(n), "grpo": _grpo, "dpo": _dpo, "online_dpo": _online_dpo, "eval": _eval,
}


def episode_plan(engine: str, modules: Mapping[str, BaseModule | None],
                 trainer_args: Mapping[str, Any] | None = None) -> EpisodePlan:
    """The plan of ``engine`` over ``modules`` given by role (the plan names each module by its ``name``;
    an optional role left out or given as None is not in the plan). ``trainer_args`` is ppo_policy's
    ``args_dict`` where the wiring depends on it (GRPO's source of old log-probs)."""
    names = {role: module.name for role, module in modules.items() if module is not None}
    return _PLANS[engine](names, trainer_args or {})


class ResolvedEngine(NamedTuple):
    name: str
    modules: dict[str, BaseModule]  # by model name, in the engine's role order
    plan: EpisodePlan


def resolve_engine(cfg: ChatLearnConfig, modules: Mapping[str, Any] | None = None,
                   engine: str | None = None) -> ResolvedEngine:
    """The engine a config asks for, its modules (those given in code, the rest built from the config) and
    its plan. The config passed the engine's checks already (`load_config(..., [EngineChecks(...)])`)."""
    given = dict(modules or {})
    name = engine_name(cfg, engine)
    spec = ENGINES[name]
    roles = [r for r in spec.roles if r not in spec.optional or r in given or r in cfg.models]
    with user_code(cfg):  # a module class may come from a file next to the config
        by_role = {role: given[role] if role in given else
                   import_object(module_class_path(role, cfg, name), "Class")(role) for role in roles}
    trainer_args = cfg.models["ppo_policy"].args_dict if "ppo_policy" in cfg.models else {}
    return ResolvedEngine(name, {m.name: m for m in by_role.values()}, episode_plan(name, by_role, trainer_args))
