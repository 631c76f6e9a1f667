"""The built-in engines as ChatLearn writes them, each declared once: one class whose constructor takes its models
and writes its flows and weight syncs, a few lines each, with the module each model runs where it differs from
the default of its name (`EngineFlows.module_classes`) and the models it may go without.

A config's ``runtime.engine`` names one of them by its ``name`` (:data:`BUILT_IN`), or an Engine subclass of
one's own by import path (`chatlearn.config.engines.engine_class`, one rule for both); `resolve_engine` builds
either the same way, and the config checks read either's `EngineFlows.declared` spec. `chatlearn.RLHFEngine(...)`
and the others (:mod:`chatlearn.runtime.engine`) are these classes with ChatLearn's API to run them. A flow only
says which model call reads which outputs; tracing turns it into the episode's task runs
(:mod:`chatlearn.runtime.compute_flow`). What the models read and make (a trainer's default advantage estimator,
its prompt groups) their module classes say.
"""

from collections.abc import Mapping
from typing import Any

from chatlearn.config import ChatLearnConfig
from chatlearn.config.engine_checks import engine_name, module_class_path
from chatlearn.config.engines import engine_class
from chatlearn.config.user_code import user_code
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.compute_flow import Environment, Evaluator, Trainer, flow_args
from chatlearn.runtime.plan import EngineFlows, ResolvedEngine
from chatlearn.utils.imports import import_object

__all__ = ["BUILT_IN", "DPO", "GRPO", "RLHF", "Evaluation", "GRPOMath", "OnlineDPO", "resolve_engine"]

_GRPO_TRAINER = "chatlearn.models.hf.grpo_trainer:GRPOPolicyTrainer"


class RLHF(EngineFlows):
    """PPO (ChatLearn's RLHFEngine): policy -> (reference, value) -> reward; ppo_policy and ppo_value train and
    are synced back."""

    name = "rlhf"
    constructor_order = True

    def __init__(self, policy: BaseModule, reference: BaseModule, reward: BaseModule, value: BaseModule,
                 ppo_policy: BaseModule, ppo_value: BaseModule):
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

        super().__init__(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow))
        self.set_parameter_sync(ppo_policy, policy)
        self.set_parameter_sync(ppo_value, value)


class GRPO(EngineFlows):
    """GRPO (ChatLearn's GRPOEngine): policy samples ``num_inference_per_prompt`` responses per prompt ->
    reference (the KL term; None when ppo_policy's kl_coef is 0) -> reward (scores, group-normalised
    advantages); ppo_policy trains and is synced back. The old log-probs are the sampler's, or the trainer's own
    forward pass when ppo_policy's ``old_logprobs`` says ``trainer`` (ChatLearn HEAD's flow)."""

    name = "grpo"
    constructor_order = True
    module_classes = {**EngineFlows.module_classes, "ppo_policy": _GRPO_TRAINER}
    optional_models = ("reference",)

    def __init__(self, policy: BaseModule, reference: BaseModule | None, reward: BaseModule,
                 ppo_policy: BaseModule):
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

        super().__init__(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow))
        self.set_parameter_sync(ppo_policy, policy)


def _trainer_logprobs(ppo_policy: BaseModule) -> bool:
    return flow_args(ppo_policy).get("old_logprobs", "generation") == "trainer"


class GRPOMath(EngineFlows):
    """GRPO with two rewards (ChatLearn's GRPOMathEngine): ``reward1`` (a rule, e.g. a math answer check) scores
    each response, and ``reward`` adds its own score to it (weights: reward's ``args_dict.reward_weights``)
    before the group advantages; each reward's scores are logged under its name."""

    name = "grpo_math"
    constructor_order = True
    module_classes = {**EngineFlows.module_classes, "ppo_policy": _GRPO_TRAINER}
    optional_models = ("reference",)

    def __init__(self, policy: BaseModule, reference: BaseModule | None, reward: BaseModule, reward1: BaseModule,
                 ppo_policy: BaseModule):
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

        super().__init__(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow))
        self.set_parameter_sync(ppo_policy, policy)


class DPO(EngineFlows):
    """Offline DPO (ChatLearn's DPOEngine): the reference reads (prompt, chosen, rejected) pairs and adds its
    log-probs; ppo_policy trains on them. Eval: the trainer scores held-out pairs (preference accuracy and
    margin)."""

    name = "dpo"
    constructor_order = True
    module_classes = {**EngineFlows.module_classes, "reference": "chatlearn.models.hf.dpo:PairReference",
                      "ppo_policy": "chatlearn.models.hf.dpo:DPOPolicyTrainer"}

    def __init__(self, reference: BaseModule, ppo_policy: BaseModule):
        def env_compute_flow(batch):
            return reference.forward_step(batch)

        def trainer_compute_flow(batch):
            ppo_policy.train_step(batch)

        def evaluator_flow(batch):
            ref_out = reference.eval_forward(batch)
            return ppo_policy.eval_forward(ref_out)

        super().__init__(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow))


class OnlineDPO(EngineFlows):
    """Online DPO (ChatLearn's OnlineDPOEngine): policy samples prompt groups -> reference log-probs -> reward
    scores; ppo_policy trains on the pairs inside each group and is synced back."""

    name = "online_dpo"
    constructor_order = True
    module_classes = {**EngineFlows.module_classes, "ppo_policy": "chatlearn.models.hf.dpo:OnlineDPOPolicyTrainer"}

    def __init__(self, policy: BaseModule, reference: BaseModule, reward: BaseModule, ppo_policy: BaseModule):
        def env_compute_flow(batch):
            policy_out = policy.forward_step(batch)
            ref_out = reference.forward_step(policy_out)
            return reward.forward_step(policy_out, ref_out)

        def trainer_compute_flow(batch):
            ppo_policy.train_step(batch)

        def evaluator_flow(batch):
            policy_out = policy.eval_forward(batch)
            return reward.eval_forward(policy_out)

        super().__init__(Environment(env_compute_flow), Trainer(trainer_compute_flow), Evaluator(evaluator_flow))
        self.set_parameter_sync(ppo_policy, policy)


class Evaluation(EngineFlows):
    """Evaluation alone (ChatLearn's EvalEngine): ``Evaluation(policy, reward)`` answers the eval set with the
    policy and scores it with the reward; given ``eval_flow`` (a function of the batch, ChatLearn's
    ``EvalEngine(eval_flow)``) or ``evaluator``, it runs that flow of one's own instead."""

    name = "eval"
    constructor_order = True

    def __init__(self, policy: Any = None, reward: BaseModule | None = None, *, eval_flow: Any = None,
                 evaluator: Evaluator | None = None):
        if callable(policy) and not isinstance(policy, BaseModule):  # ChatLearn's EvalEngine(eval_flow)
            policy, eval_flow = None, policy
        if evaluator is None and eval_flow is not None:
            evaluator = Evaluator(eval_flow)
        if evaluator is not None:
            self.own_flows = True  # its own eval flow, not the built-in policy -> reward one
            super().__init__(evaluator=evaluator)
            return

        def evaluator_flow(batch):
            policy_out = policy.eval_forward(batch)
            return reward.eval_forward(policy_out)

        super().__init__(evaluator=Evaluator(evaluator_flow))


# the built-in engines by the name a config gives (`chatlearn.config.engines.engine_class` imports it)
BUILT_IN: dict[str, type[EngineFlows]] = {cls.name: cls for cls in (RLHF, GRPO, GRPOMath, DPO, OnlineDPO, Evaluation)}


def resolve_engine(cfg: ChatLearnConfig, modules: Mapping[str, Any] | None = None,
                   engine: str | None = None) -> ResolvedEngine:
    """The engine a config asks for (a built-in by name or one's own by import path, the same way), its modules
    (those given in code, the rest built from the config) and its plan. The config passed the engine's checks
    already (`load_config(..., [EngineChecks(...)])`)."""
    given = dict(modules or {})
    name = engine_name(cfg, engine)
    with user_code(cfg):  # a module or engine class may come from a file next to the config
        cls = engine_class(name)
        models = {r: given[r] if r in given else None if cls._left_out(r, cfg, given) else
                  import_object(module_class_path(r, cfg, cls.module_classes), "Class")(r)
                  for r in cls.model_roles()}
        flows = cls(**models)
        flows.name = name
        return flows.resolve(cfg)
