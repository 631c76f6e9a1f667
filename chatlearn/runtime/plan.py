"""What an engine's compute flows compile into: the episode's plan, and a resolved engine ready to launch.

An engine is its compute flows (:class:`EngineFlows`; the user-facing `Engine` in :mod:`chatlearn.runtime.
engine` runs it, the built-in ones are :mod:`chatlearn.runtime.engines`); tracing them (:mod:`chatlearn.
runtime.compute_flow`) gives one :class:`~chatlearn.runtime.compute_flow.ComputeFlow` each. The plan holds the
three, the weight syncs and the model saved as the final policy, and answers what the runtime asks of it (the
producer that owns the dataset, the trainers, the models of every flow). The stage tasks run its nodes
(``flows/stage_tasks.py``).
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

from pydantic import BaseModel, Field

from chatlearn.config import ChatLearnConfig
from chatlearn.config.engines import ENGINES, EngineSpec
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

__all__ = ["EngineFlows", "EpisodePlan", "ResolvedEngine", "flow_args"]


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
    modules: dict[str, BaseModule]  # by model name, in the flows' call order
    plan: EpisodePlan
    steps: dict[str, Step] = {}  # the flows' steps by name (functions: they stay in the driver)
    dataset: Any = None  # prompt records given in code (``engine.set_dataset``), else None: the config's files
    eval_dataset: Any = None


_EVAL_METHODS = ("forward_step", "eval_step", "eval_forward")
_TRACING_CONFIG: contextvars.ContextVar[ChatLearnConfig | None] = contextvars.ContextVar("chatlearn_flow_config",
                                                                                         default=None)


def flow_args(module: BaseModule) -> dict[str, Any]:
    """``models.<name>.args_dict`` of the run a flow is traced for ({} while no config is known yet): a flow may
    branch on it, as GRPO's does on where its old log-probs come from."""
    cfg = _TRACING_CONFIG.get()
    return dict((cfg.models[module.name].args_dict or {}) if cfg is not None and module.name in cfg.models else {})


@contextlib.contextmanager
def _tracing_for(cfg: ChatLearnConfig | None) -> Iterator[None]:
    token = _TRACING_CONFIG.set(cfg)
    try:
        yield
    finally:
        _TRACING_CONFIG.reset(token)


class EngineFlows:
    """An engine's flows, weight syncs and data, and what they compile into (the user-facing `Engine` of
    :mod:`chatlearn.runtime.engine` adds running it). Compiling traces the flows and checks them: a FlowError
    names the flow and the call."""

    name = "engine"
    # an engine of the flows it was given (not a built-in one's under its registered name; EvalEngine(eval_flow))
    own_flows = False

    def __init__(self, environment: Environment | None = None, trainer: Trainer | None = None,
                 evaluator: Evaluator | None = None, name: str | None = None):
        for arg, kind in ((environment, Environment), (trainer, Trainer), (evaluator, Evaluator)):
            if arg is not None and not isinstance(arg, kind):
                raise FlowError(f"Engine: expected a {kind.__name__} or None, got {type(arg).__name__}")
        if name is not None:
            self.name = name
        self.environment, self.trainer, self.evaluator = environment, trainer, evaluator
        self._sync: list[tuple[BaseModule, BaseModule]] = getattr(self, "_sync", [])
        self._dataset: list[Any] | None = None
        self._order: list[str] = getattr(self, "_order", [])
        self.modules: dict[str, BaseModule] = {}
        self.compile(None)  # a flow that cannot be traced fails here, at construction

    def _models_in_order(self, *modules: BaseModule | None) -> None:
        """The order of the models where it matters (placement): a built-in engine's constructor order."""
        self._order = [m.name for m in modules if m is not None]

    def compile(self, cfg: ChatLearnConfig | None) -> tuple[EpisodePlan, dict[str, Step]]:
        """Trace the flows (for the run of ``cfg``, which a flow may read: `flow_args`) into the plan; the
        modules they call become ``self.modules``."""
        flows: dict[str, ComputeFlow] = {}
        steps: dict[str, Step] = {}
        modules: dict[str, BaseModule] = {}
        with _tracing_for(cfg):
            for holder in (self.environment, self.trainer, self.evaluator):
                if holder is None:
                    continue
                flow, used, own_steps = holder.trace()
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
        order = [n for n in self._order if n in modules] + [n for n in modules if n not in self._order]
        self.modules = {n: modules[n] for n in order}
        return plan, steps

    def resolve(self, cfg: ChatLearnConfig) -> "ResolvedEngine":
        """This engine's plan for the run of ``cfg``, its modules, steps and given data."""
        plan, steps = self.compile(cfg)
        eval_data = self.evaluator.dataset if self.evaluator is not None else None
        return ResolvedEngine(self.name, dict(self.modules), plan, steps, self._dataset, eval_data)

    def spec(self) -> EngineSpec:
        """What the config checks need of this engine: a built-in's registered spec, else the one its flows give
        (the models it calls, its syncs)."""
        if self.name in ENGINES and not self.own_flows:
            return ENGINES[self.name]
        plan, _ = self.compile(None)
        env = plan.environment
        makers = tuple(env.nodes[i].model for i in env.outputs()
                       if env.nodes[i].model is not None and env.nodes[i].method == "forward_step") if env else ()
        return EngineSpec(roles=tuple(plan.models), sync=tuple(plan.sync), trains=plan.trainer is not None,
                          needs_train_data=plan.environment is not None and self._dataset is None,
                          experience=makers)


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


