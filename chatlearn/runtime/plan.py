"""What an engine's compute flows compile into: the episode's plan, and a resolved engine ready to launch.

An engine is its compute flows (:class:`EngineFlows`; the user-facing `Engine` in :mod:`chatlearn.runtime.
engine` runs it, the built-in ones are :mod:`chatlearn.runtime.engines`); tracing them (:mod:`chatlearn.
runtime.compute_flow`) gives one :class:`~chatlearn.runtime.compute_flow.ComputeFlow` each. The plan holds the
three, the weight syncs and the model saved as the final policy, and answers what the runtime asks of it (the
producer that owns the dataset, the trainers, the models of every flow). The stage tasks run its nodes
(``flows/stage_tasks.py``).
"""

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple, Self

from pydantic import BaseModel, Field

from chatlearn.config import ChatLearnConfig
from chatlearn.config.engine_checks import module_class_path
from chatlearn.config.engines import DEFAULT_MODULES, EngineSpec
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.compute_flow import (
    BATCH,
    ComputeFlow,
    Environment,
    Evaluator,
    FlowError,
    FlowNode,
    Step,
    Trainer,
)
from chatlearn.utils.imports import import_object

__all__ = ["EngineFlows", "EpisodePlan", "ResolvedEngine"]


class EpisodePlan(BaseModel):
    """One episode of an engine: its traced flows, by model name."""

    environment: ComputeFlow | None = Field(None, description="generate (its first call) and score (the rest)")
    trainer: ComputeFlow | None = Field(None, description="train: train_step calls on the episode's samples")
    evaluator: ComputeFlow | None = Field(None, description="eval: its first call answers the eval set")
    sync: list[tuple[str, str]] = Field(default_factory=list, description="(trainer, inference) weight pairs")
    export: str | None = Field(None, description="trainable model saved as the final policy")

    @property
    def producer(self) -> str:
        """The model that reads the training prompts (the environment's first call; else the evaluator's)."""
        flow = self.environment or self.evaluator
        assert flow is not None and flow.producer.model is not None
        return flow.producer.model

    @property
    def eval_producer(self) -> str | None:
        """The model that answers the eval set (the evaluator's first call)."""
        return self.evaluator.producer.model if self.evaluator is not None else None

    @property
    def trainers(self) -> list[str]:
        return self.trainer.models if self.trainer is not None else []

    @property
    def scorers(self) -> list[FlowNode]:
        """The environment's calls after generation: the score stage."""
        return self.environment.nodes[1:] if self.environment is not None else []

    @property
    def models(self) -> list[str]:
        """Every model of the three flows, in call order."""
        flows = (self.environment, self.trainer, self.evaluator)
        return list(dict.fromkeys(m for f in flows if f is not None for m in f.models))

    def calls(self, model: str, *methods: str) -> bool:
        """Whether a flow calls ``model`` (with one of ``methods``, when given)."""
        flows = (self.environment, self.trainer, self.evaluator)
        return any(n.model == model and (not methods or n.method in methods)
                   for f in flows if f is not None for n in f.nodes)


class ResolvedEngine(NamedTuple):
    name: str
    modules: dict[str, BaseModule]  # by model name, in placement order (`EngineFlows.constructor_order`)
    plan: EpisodePlan
    steps: dict[str, Step] = {}  # the flows' steps by name (functions: they stay in the driver)
    dataset: Any = None  # prompt records given in code (``engine.set_dataset``), else None: the config's files
    eval_dataset: Any = None


_EVAL_METHODS = ("forward_step", "eval_step", "eval_forward")
class EngineFlows:
    """An engine: its flows, weight syncs and data, what they compile into, and its declaration (the user-facing
    `Engine` of :mod:`chatlearn.runtime.engine` adds running it). Compiling traces the flows and checks them: a
    FlowError names the flow and the call.

    An engine is declared once, in its class: its constructor takes its models (ChatLearn's engines do) and
    writes its flows and syncs; ``name``, ``module_classes`` and ``optional_models`` are the rest. What the config
    checks need of it (:class:`~chatlearn.config.engines.EngineSpec`) comes from there: `declared` traces the
    class on stand-in models, `spec` an engine object built in code."""

    name = "engine"
    # an engine of the flows it was given (not a built-in one's under its registered name; EvalEngine(eval_flow))
    own_flows = False
    # the module each model runs unless its args_dict.module names another: the defaults of ChatLearn's model
    # names, an engine overriding those it runs differently (GRPO's ppo_policy is the GRPO trainer)
    module_classes: ClassVar[dict[str, str]] = DEFAULT_MODULES
    # models a config may leave out: the constructor gets None and its flows do without them
    optional_models: ClassVar[tuple[str, ...]] = ()
    # placement takes the models in the constructor's order (ChatLearn's built-in engines), else in the flows'
    # call order
    constructor_order: ClassVar[bool] = False

    def __init__(self, environment: Environment | None = None, trainer: Trainer | None = None,
                 evaluator: Evaluator | None = None, name: str | None = None):
        for arg, kind in ((environment, Environment), (trainer, Trainer), (evaluator, Evaluator)):
            if arg is not None and not isinstance(arg, kind):
                raise FlowError(f"Engine: expected a {kind.__name__} or None, got {type(arg).__name__}")
        if name is not None:
            self.name = name
        self.environment, self.trainer, self.evaluator = environment, trainer, evaluator
        self._sync: list[tuple[BaseModule, BaseModule]] = []
        self._dataset: list[Any] | None = None
        self.modules: dict[str, BaseModule] = {}
        self.compile(None)  # a flow that cannot be traced fails here, at construction

    @classmethod
    def model_roles(cls) -> tuple[str, ...] | None:
        """The models the constructor takes, in order (placement follows it); None for an engine given its flows
        (``Engine(Environment(...), ...)``), whose models are those its flows call."""
        if cls.__init__ is EngineFlows.__init__:
            return None
        params = inspect.signature(cls.__init__).parameters.values()
        return tuple(p.name for p in params if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD)

    @classmethod
    def declared(cls, cfg: ChatLearnConfig | None = None, given: Mapping[str, BaseModule] | None = None) -> EngineSpec:
        """The spec of the engine this class builds for the run of ``cfg`` (its flows may read it) with the models
        ``given`` in code: what the config checks of an engine named by ``runtime.engine`` read. The other models
        are the modules the config names (a stand-in where one does not import: the checks name that)."""
        given = given or {}
        models = {r: given[r] if r in given else None if cls._left_out(r, cfg, given) else
                  _stand_in(r, cfg, cls.module_classes) for r in cls.model_roles() or ()}
        return cls(**models).spec(cfg)

    @classmethod
    def _left_out(cls, role: str, cfg: ChatLearnConfig | None, given: Mapping[str, BaseModule]) -> bool:
        """An optional model neither the config nor the code gives: the constructor gets None."""
        return role in cls.optional_models and role not in given and cfg is not None and role not in cfg.models

    # -- ChatLearn's API ------------------------------------------------------------------------------------
    def set_parameter_sync(self, src: BaseModule, dst: BaseModule) -> Self:
        """After each episode's training, copy ``src``'s weights (a trained model) into ``dst``."""
        self._sync.append((src, dst))
        self.compile(None)
        return self

    # -- compiling ------------------------------------------------------------------------------------------
    def compile(self, cfg: ChatLearnConfig | None) -> tuple[EpisodePlan, dict[str, Step]]:
        """Trace the flows (for the run of ``cfg``, which a flow may read: `flow_args`) into the plan; the
        modules they call become ``self.modules``, in placement order (`constructor_order`)."""
        flows: dict[str, ComputeFlow] = {}
        steps: dict[str, Step] = {}
        modules: dict[str, BaseModule] = {}
        args = {name: m.args_dict or {} for name, m in cfg.models.items()} if cfg is not None else {}
        for holder in (self.environment, self.trainer, self.evaluator):
            if holder is None:
                continue
            flow, used, own_steps = holder.trace(args)
            for name, module in used.items():
                if modules.setdefault(name, module) is not module:
                    raise FlowError(f"engine {self.name}: two different modules are named {name!r}")
            steps.update(own_steps)
            flows[holder.kind] = _checked(flow)
        if not flows:
            raise FlowError(f"engine {self.name}: it has no environment, trainer or evaluator flow")
        plan = EpisodePlan(**flows, sync=[(s.name, d.name) for s, d in self._sync])
        _check_sync(self.name, plan)
        if plan.environment is not None and plan.trainer is not None and not plan.environment.returns:
            raise FlowError(f"compute flow {plan.environment.name} returns nothing: the environment's return value "
                            "is the experience the trainer flow trains on")
        exported = [s for s, d in plan.sync if plan.environment is not None and d == plan.producer]
        plan.export = exported[0] if exported else (plan.trainers[0] if plan.trainers else None)
        order = [n for n in self.model_roles() or () if n in modules] if self.constructor_order else []
        self.modules = {n: modules[n] for n in [*order, *(n for n in modules if n not in order)]}
        return plan, steps

    def resolve(self, cfg: ChatLearnConfig) -> "ResolvedEngine":
        """This engine's plan for the run of ``cfg``, its modules, steps and given data. The rewards that make its
        experience learn the advantage estimator its trainer trains on (`default_estimator`): the one they run
        unless their ``args_dict`` names one."""
        plan, steps = self.compile(cfg)
        default = default_estimator(plan, self.modules)
        for node in plan.environment.nodes[1:] if plan.environment is not None else []:
            module = self.modules.get(node.model or "")
            if node.method == "forward_step" and hasattr(module, "engine_estimator"):
                module.engine_estimator = default  # type: ignore[union-attr]
        eval_data = self.evaluator.dataset if self.evaluator is not None else None
        return ResolvedEngine(self.name, dict(self.modules), plan, steps, self._dataset, eval_data)

    def spec(self, cfg: ChatLearnConfig | None = None) -> EngineSpec:
        """What the config checks need of this engine (for the run of ``cfg``): its declaration and what its
        traced flows do. Its models are its constructor's (an engine given its flows: those the flows call)."""
        plan, _ = self.compile(cfg)
        roles = None if self.own_flows else self.model_roles()
        roles = roles if roles is not None else tuple(plan.models)
        env = plan.environment
        first = env or plan.evaluator
        producer = first.producer.model if first is not None else None
        trained = [type(self.modules[t]) for t in plan.trainers]
        policy_trainer = next((s for s, d in plan.sync if d == producer), None)
        return EngineSpec(
            name=self.name, roles=roles, optional=self.optional_models,
            sync=tuple(plan.sync), producer=producer, trainers=tuple(plan.trainers),
            scorers=tuple((n.model, n.method) for n in env.nodes[1:] if n.model is not None) if env else (),
            evaluates=plan.evaluator is not None, needs_train_data=env is not None and self._dataset is None,
            advantage_estimator=default_estimator(plan, self.modules),
            groups=any(c.trains_on_groups for c in trained), pairs_in_groups=any(c.pairs_in_groups for c in trained),
            multi_turn=policy_trainer is not None and type(self.modules[policy_trainer]).trains_multi_turn)


def _stand_in(role: str, cfg: ChatLearnConfig | None, defaults: Mapping[str, str]) -> BaseModule:
    """The module the config names for ``role`` (or the engine's default), as resolving builds it; a bare one
    where none imports (the checks report that)."""
    path = module_class_path(role, cfg, defaults) if cfg is not None else defaults.get(role)
    try:
        cls = import_object(path, "Class") if path else BaseModule
        return cls(role) if isinstance(cls, type) and issubclass(cls, BaseModule) else BaseModule(role)
    except Exception:  # noqa: BLE001  # whatever a user's module does wrong, its own check names it
        return BaseModule(role)


def default_estimator(plan: EpisodePlan, modules: dict[str, BaseModule]) -> str | None:
    """The advantage estimator an engine's experience is made for: the first trained model's module that declares
    one (PPO's trainer GAE, GRPO's and online DPO's the group one); None where no trainer does."""
    return next((d for t in plan.trainers if (d := type(modules[t]).default_advantage_estimator) is not None), None)


def _checked(flow: ComputeFlow) -> ComputeFlow:
    """A traced flow the runtime can run, or a FlowError naming the flow and the call. Only the first call reads
    the batch (the dataset's prompts); a later call given the batch too reads the first call's output, which
    carries the batch's fields."""
    first = flow.nodes[0]
    if flow.kind == "trainer":
        for n in flow.nodes:
            if n.method != "train_step" or n.inputs != [BATCH]:
                raise FlowError(f"compute flow {flow.name}: {n.name}; a trainer flow calls train_step(batch) of "
                                "each trained model, nothing else")
        return flow
    if first.model is None or first.inputs != [BATCH]:
        raise FlowError(f"compute flow {flow.name}: its first call {first.name} must be a model reading the batch "
                        "alone (it answers the prompts)")
    allowed = ("forward_step",) if flow.kind == "environment" else _EVAL_METHODS
    if first.method not in allowed:
        raise FlowError(f"compute flow {flow.name}: its first call {first.name}; the {flow.kind} starts with "
                        f"{' or '.join(allowed)}")
    nodes = [first]
    for n in flow.nodes[1:]:
        if n.method == "train_step":
            raise FlowError(f"compute flow {flow.name}: {n.name}; train_step belongs in the trainer flow")
        inputs = list(dict.fromkeys(0 if i == BATCH else i for i in n.inputs))
        nodes.append(n.model_copy(update={"inputs": inputs, "level": max(n.level, 1)}))
    return flow.model_copy(update={"nodes": nodes})


def _check_sync(engine: str, plan: EpisodePlan) -> None:
    for src, dst in plan.sync:
        if src not in plan.trainers:
            raise FlowError(f"engine {engine}: set_parameter_sync({src}, {dst}): {src} is never trained (the trainer "
                            f"flow trains {plan.trainers or 'nothing'})")
        if src == dst or not plan.calls(dst) or dst in plan.trainers:
            raise FlowError(f"engine {engine}: set_parameter_sync({src}, {dst}): {dst} must be an inference model "
                            "an environment or evaluator flow calls")


