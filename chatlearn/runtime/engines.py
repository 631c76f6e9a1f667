"""The built-in engines as ChatLearn writes them: a few lines of compute flow each.

Each function takes the engine's models (in ChatLearn's constructor order) and returns its flows and weight
syncs; `chatlearn.RLHFEngine(...)` and the others (:mod:`chatlearn.runtime.engine`) are these, and a config's
``runtime.engine`` names one of them (or an Engine subclass of one's own, by import path). A flow only says
which model call reads which outputs; tracing turns it into the episode's task runs (:mod:`chatlearn.runtime.
compute_flow`).
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from chatlearn.config import ChatLearnConfig
from chatlearn.config.engine_checks import engine_name, module_class_path
from chatlearn.config.engines import ENGINES
from chatlearn.config.errors import ConfigError
from chatlearn.config.user_code import user_code
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.compute_flow import Environment, Evaluator, Trainer
from chatlearn.runtime.plan import EngineFlows, ResolvedEngine, flow_args
from chatlearn.utils.imports import import_object

__all__ = ["BUILT_IN", "EngineParts", "engine_roles", "resolve_engine"]


class EngineParts(NamedTuple):
    environment: Environment | None
    trainer: Trainer | None
    evaluator: Evaluator | None
    sync: list[tuple[BaseModule, BaseModule]]
    order: list[BaseModule | None]  # the models in constructor order (placement follows it)


def rlhf(policy: BaseModule, reference: BaseModule, reward: BaseModule, value: BaseModule, ppo_policy: BaseModule,
         ppo_value: BaseModule) -> EngineParts:
    """PPO: policy -> (reference, value) -> reward; ppo_policy and ppo_value train and are synced back."""

    def env_compute_flow(batch):
        policy_out = policy.forward_step(batch)
        ref_out = reference.forward_step(policy_out)
        value_out = value.forward_step(policy_out)
        reward_out = reward.forward_step(policy_out, ref_out, value_out)
        return value_out, reward_out

    def trainer_compute_flow(batch):
        ppo_policy.train_step(batch)
        ppo_value.train_step(batch)

    def evaluator_flow(batch):
        policy_out = policy.eval_forward(batch)
        return reward.eval_forward(policy_out)

    return EngineParts(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow),
                       [(ppo_policy, policy), (ppo_value, value)],
                       [policy, reference, reward, value, ppo_policy, ppo_value])


def grpo(policy: BaseModule, reference: BaseModule | None, reward: BaseModule, ppo_policy: BaseModule) -> EngineParts:
    """GRPO: policy samples ``num_inference_per_prompt`` responses per prompt -> reference (the KL term; None when
    ppo_policy's kl_coef is 0) -> reward (scores, group-normalised advantages); ppo_policy trains and is synced
    back. The old log-probs are the sampler's, or the trainer's own forward pass when ppo_policy's
    ``old_logprobs`` says ``trainer`` (ChatLearn HEAD's flow)."""

    def env_compute_flow(batch):
        policy_out = policy.forward_step(batch)
        ref_out = reference.forward_step(policy_out) if reference is not None else None
        old_out = ppo_policy.forward_step(policy_out) if _trainer_logprobs(ppo_policy) else None
        return reward.forward_step(policy_out, ref_out, old_out)

    def trainer_compute_flow(batch):
        ppo_policy.train_step(batch)

    def evaluator_flow(batch):
        policy_out = policy.eval_forward(batch)
        return reward.eval_forward(policy_out)

    return EngineParts(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow),
                       [(ppo_policy, policy)], [policy, reference, reward, ppo_policy])


def _trainer_logprobs(ppo_policy: BaseModule) -> bool:
    return flow_args(ppo_policy).get("old_logprobs", "generation") == "trainer"


def grpo_math(policy: BaseModule, reference: BaseModule | None, reward: BaseModule, reward1: BaseModule,
              ppo_policy: BaseModule) -> EngineParts:
    """GRPO with two rewards (ChatLearn's GRPOMathEngine): ``reward1`` (a rule, e.g. a math answer check) scores
    each response, and ``reward`` adds its own score to it (weights: reward's ``args_dict.reward_weights``)
    before the group advantages; each reward's scores are logged under its name."""

    def env_compute_flow(batch):
        policy_out = policy.forward_step(batch)
        ref_out = reference.forward_step(policy_out) if reference is not None else None
        reward1_out = reward1.score_step(policy_out)
        return reward.forward_step(policy_out, ref_out, reward1_out)

    def trainer_compute_flow(batch):
        ppo_policy.train_step(batch)

    def evaluator_flow(batch):
        policy_out = policy.eval_forward(batch)
        reward1_out = reward1.score_step(policy_out)
        return reward.eval_forward(policy_out, reward1_out)

    return EngineParts(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow),
                       [(ppo_policy, policy)], [policy, reference, reward, reward1, ppo_policy])


def dpo(reference: BaseModule, ppo_policy: BaseModule) -> EngineParts:
    """Offline DPO: the reference reads (prompt, chosen, rejected) pairs and adds its log-probs; ppo_policy trains
    on them. Eval: the trainer scores held-out pairs (preference accuracy and margin)."""

    def env_compute_flow(batch):
        return reference.forward_step(batch)

    def trainer_compute_flow(batch):
        ppo_policy.train_step(batch)

    def evaluator_flow(batch):
        ref_out = reference.eval_forward(batch)
        return ppo_policy.eval_forward(ref_out)

    return EngineParts(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow),
                       [], [reference, ppo_policy])


def online_dpo(policy: BaseModule, reference: BaseModule, reward: BaseModule, ppo_policy: BaseModule) -> EngineParts:
    """Online DPO: policy samples prompt groups -> reference log-probs -> reward scores; ppo_policy trains on the
    pairs inside each group and is synced back."""

    def env_compute_flow(batch):
        policy_out = policy.forward_step(batch)
        ref_out = reference.forward_step(policy_out)
        return reward.forward_step(policy_out, ref_out)

    def trainer_compute_flow(batch):
        ppo_policy.train_step(batch)

    def evaluator_flow(batch):
        policy_out = policy.eval_forward(batch)
        return reward.eval_forward(policy_out)

    return EngineParts(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow),
                       [(ppo_policy, policy)], [policy, reference, reward, ppo_policy])


def evaluation(policy: BaseModule, reward: BaseModule) -> EngineParts:
    """Evaluation alone (ChatLearn's EvalEngine): the policy answers the eval set, the reward scores it."""

    def evaluator_flow(batch):
        policy_out = policy.eval_forward(batch)
        return reward.eval_forward(policy_out)

    return EngineParts(None, None, Evaluator(evaluator_flow), [], [policy, reward])


BUILT_IN: dict[str, Callable[..., EngineParts]] = {"rlhf": rlhf, "grpo": grpo, "grpo_math": grpo_math, "dpo": dpo,
                                                   "online_dpo": online_dpo, "eval": evaluation}


def assemble(engine: EngineFlows, parts: EngineParts) -> None:
    """Give a built-in engine object its flows, syncs and model order."""
    engine._models_in_order(*parts.order)
    engine._sync = list(parts.sync)
    EngineFlows.__init__(engine, parts.environment, parts.trainer, parts.evaluator)


def _engine_class(name: str) -> Any:
    """An engine class of one's own by import path (``package.module:Class``, or ``file.py:Class`` next to the
    config); its constructor's parameters are model names, as ChatLearn's engines take them."""
    cls = import_object(name, "Class")
    if not (isinstance(cls, type) and issubclass(cls, EngineFlows)):
        raise ConfigError(f"runtime.engine: {name} is not a chatlearn.Engine subclass")
    return cls


def engine_roles(name: str) -> tuple[str, ...]:
    """The model names an engine takes, in its constructor's order."""
    if name in ENGINES:
        return ENGINES[name].roles
    return tuple(p for p in inspect.signature(_engine_class(name).__init__).parameters if p != "self")


def resolve_engine(cfg: ChatLearnConfig, modules: Mapping[str, Any] | None = None,
                   engine: str | None = None) -> ResolvedEngine:
    """The engine a config asks for, its modules (those given in code, the rest built from the config) and its
    plan. The config passed the engine's checks already (`load_config(..., [EngineChecks(...)])`)."""
    given = dict(modules or {})
    name = engine_name(cfg, engine)
    spec = ENGINES.get(name)
    with user_code(cfg):  # a module or engine class may come from a file next to the config
        optional = spec.optional if spec is not None else ()
        roles = [r for r in engine_roles(name) if r not in optional or r in given or r in cfg.models]
        by_role = {role: given[role] if role in given else
                   import_object(module_class_path(role, cfg, name), "Class")(role) for role in roles}
        args = {r: by_role.get(r) for r in engine_roles(name)}
        if name in BUILT_IN:
            flows = EngineFlows.__new__(EngineFlows)
            flows.name = name
            assemble(flows, BUILT_IN[name](**args))
        else:
            flows = _engine_class(name)(**args)
            flows.name = name
        return flows.resolve(cfg)
