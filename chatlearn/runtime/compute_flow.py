"""ChatLearn's compute flows: an engine is plain Python over model calls, and tracing it gives the episode's DAG.

`Environment(flow)`, `Trainer(flow)` and `Evaluator(flow)` hold a user function such as::

    def env_flow(batch):
        policy_out = policy.forward_step(batch)
        ref_out = reference.forward_step(policy_out)
        value_out = value.forward_step(policy_out)
        return reward.forward_step(policy_out, ref_out, value_out)

Tracing runs the function once with placeholders (:func:`trace`): the modules it uses (found in its closure
and the globals it names, as ChatLearn finds them) get recording stand-ins for their flow methods, each call
returns a placeholder, and what was called with what becomes a :class:`ComputeFlow`, its nodes in dependency
order. The flow's own Python runs only then; at run time the stage tasks run the nodes
(``flows/stage_tasks.py``), each one a Prefect task run named after the model and method. A :func:`step` (a
plain function over the batch, such as a filter) is a node too.

What a flow may do while traced: call flow methods of modules and steps, pass the batch, their outputs or None
(skipped: an optional model left out) to other calls, and return outputs. Anything else done to an output (an
attribute, a comparison, ``if out``) has no value yet and is an error naming the flow.
"""

import contextlib
import contextvars
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel, Field

from chatlearn.config.errors import ConfigError
from chatlearn.models.base_module import BaseModule

__all__ = ["BATCH", "FLOW_METHODS", "ComputeFlow", "Environment", "Evaluator", "FlowError", "FlowNode", "Step",
           "Trainer", "flow_args", "step", "trace"]

# The module methods a flow may call. forward_step/eval_step/eval_forward/score_step run on a batch; train_step
# trains on the episode's samples (a trainer flow's only method).
FLOW_METHODS = ("forward_step", "eval_step", "eval_forward", "score_step", "train_step")
BATCH = -1  # a node input that is the flow's own batch


class FlowError(ConfigError):
    """A compute flow that cannot run, named with the call: raised when the engine is built."""


class FlowNode(BaseModel):
    """One call of a flow: a model method or a step, and the earlier nodes (or the batch) it reads."""

    name: str = Field(description="the task run's name: 'model.method', or the step's name")
    model: str | None = Field(None, description="the model called; None for a step")
    method: str = Field(description="the module method, or 'step'")
    inputs: list[int] = Field(default_factory=list, description="indices of earlier nodes; -1 is the batch")
    level: int = Field(0, description="0 reads only the batch; otherwise 1 + the deepest input's level")


class ComputeFlow(BaseModel):
    """A traced flow: its nodes in dependency order (by level, then call order) and the nodes it returns."""

    name: str
    kind: str = Field(description="environment, trainer or evaluator")
    nodes: list[FlowNode]
    returns: list[int] = Field(default_factory=list)

    @property
    def models(self) -> list[str]:
        """The models the flow calls, in call order."""
        return list(dict.fromkeys(n.model for n in self.nodes if n.model is not None))

    @property
    def producer(self) -> FlowNode:
        """The first node: the model that reads the dataset (ChatLearn's first model)."""
        return self.nodes[0]

    def ancestors(self, index: int) -> set[int]:
        seen: set[int] = set()
        todo = [i for i in self.nodes[index].inputs if i != BATCH]
        while todo:
            i = todo.pop()
            if i not in seen:
                seen.add(i)
                todo += [j for j in self.nodes[i].inputs if j != BATCH]
        return seen

    def outputs(self) -> list[int]:
        """The returned nodes whose results make the flow's output per batch: a returned node upstream of
        another returned one is left out, as its result is already among that one's inputs."""
        upstream = set().union(*(self.ancestors(i) for i in self.returns)) if self.returns else set()
        return [i for i in self.returns if i not in upstream]


class Step:
    """A plain function over a batch (a dict of per-sample fields) that sits in a flow as a node of its own, e.g.
    a filter. Called while a flow is traced it records a node; called otherwise it is the function itself. At run
    time each batch goes through it in a Ray task with ``num_cpus`` CPUs."""

    def __init__(self, fn: Callable[..., dict], name: str | None = None, num_cpus: float = 0.0):
        self.fn, self.name, self.num_cpus = fn, name or fn.__name__, num_cpus
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any) -> Any:
        tracer = _TRACER.get()
        if tracer is None:
            return self.fn(*args)
        return tracer.record(None, self.name, "step", args, {}, step=self)

    def __repr__(self) -> str:
        return f"step({self.name})"


def step(fn: Callable[..., dict] | None = None, *, name: str | None = None, num_cpus: float = 0.0) -> Any:
    """Make ``fn(batch, ...) -> batch`` a flow step: ``@step`` or ``@step(num_cpus=1)``."""
    if fn is None:
        return lambda f: Step(f, name, num_cpus)
    return Step(fn, name, num_cpus)


class _Placeholder:
    """What a call returns while its flow is traced."""

    __slots__ = ("_flow", "_node")

    def __init__(self, flow: str, node: int):
        object.__setattr__(self, "_flow", flow)
        object.__setattr__(self, "_node", node)

    def _refuse(self, what: str) -> Any:
        raise FlowError(f"compute flow {self._flow}: {what} of a model call's output; while the flow is traced "
                        "an output has no value yet; only pass it to other model calls or steps, or return it")

    def __getattr__(self, name: str) -> Any:
        return self._refuse(f"attribute {name!r}")

    def __getitem__(self, key: Any) -> Any:
        return self._refuse(f"item {key!r}")

    def __bool__(self) -> bool:
        return self._refuse("the truth value")

    def __iter__(self) -> Any:
        return self._refuse("iterating")

    def __len__(self) -> int:
        return self._refuse("len()")

    def __setattr__(self, name: str, value: Any) -> None:
        self._refuse(f"setting {name!r}")


class _Tracer:
    def __init__(self, flow: str, args: Mapping[str, Mapping[str, Any]]):
        self.flow = flow
        self.args = args  # each model's args_dict in the run the flow is traced for (`flow_args`)
        self.nodes: list[FlowNode] = []
        self.steps: dict[str, Step] = {}

    def record(self, model: str | None, name: str, method: str, args: tuple, kwargs: dict,
               step: Step | None = None) -> _Placeholder:
        call = f"{name}.{method}" if model is not None else name
        if kwargs:
            raise FlowError(f"compute flow {self.flow}: {call} got keyword arguments {sorted(kwargs)}; a call in a "
                            "flow takes the batch and other calls' outputs only")
        inputs = []
        for arg in args:
            if arg is None:
                continue  # an optional model left out
            if not isinstance(arg, _Placeholder) or arg._flow != self.flow:
                raise FlowError(f"compute flow {self.flow}: {call} got {type(arg).__name__} {arg!r:.40}; a call in "
                                "a flow takes the batch and other calls' outputs only")
            inputs.append(arg._node)
        if not inputs:
            raise FlowError(f"compute flow {self.flow}: {call} reads nothing; pass it the batch or another call's "
                            "output")
        if any(n.name == call for n in self.nodes):
            raise FlowError(f"compute flow {self.flow}: {call} is called twice; a flow calls each model method once")
        if step is not None:
            if step.name in self.steps and self.steps[step.name] is not step:
                raise FlowError(f"compute flow {self.flow}: two different steps are named {step.name!r}")
            self.steps[step.name] = step
        level = max((self.nodes[i].level + 1 for i in inputs if i != BATCH), default=0)
        self.nodes.append(FlowNode(name=call, model=model, method=method, inputs=inputs, level=level))
        return _Placeholder(self.flow, len(self.nodes) - 1)


# Why a ContextVar: a flow is plain Python calling module methods and steps; while it is traced, those calls find
# the tracer recording them here (set only inside `trace`), since a user's flow function passes nothing along.
_TRACER: contextvars.ContextVar[_Tracer | None] = contextvars.ContextVar("chatlearn_flow_tracer", default=None)


def flow_args(module: BaseModule) -> dict[str, Any]:
    """``models.<name>.args_dict`` of the run a flow is being traced for ({} outside tracing, or while no config is
    known yet): a flow may branch on it, as GRPO's does on where its old log-probs come from."""
    tracer = _TRACER.get()
    return dict(tracer.args.get(module.name) or {}) if tracer is not None else {}


def _names_of(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names_of(const)


def modules_of(fn: Callable) -> list[BaseModule]:
    """The modules a flow function can reach: its closure, and the globals its code names (as ChatLearn's
    flow parser finds them)."""
    fn = getattr(fn, "__func__", fn)
    found: dict[int, BaseModule] = {}
    cells = [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]
    names = [fn.__globals__.get(n) for n in _names_of(fn.__code__)]
    for value in [*cells, *names]:
        if isinstance(value, BaseModule):
            found.setdefault(id(value), value)
    return list(found.values())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018  # an empty cell (a name assigned later) raises
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def _recording(tracer: _Tracer, modules: list[BaseModule]) -> Iterator[None]:
    patched: list[tuple[BaseModule, str]] = []
    token = _TRACER.set(tracer)
    try:
        for module in modules:
            for method in FLOW_METHODS:
                if method in vars(module):
                    continue  # the instance set its own: leave it
                setattr(module, method, _recorder(tracer, module, method))
                patched.append((module, method))
        yield
    finally:
        _TRACER.reset(token)
        for module, method in patched:
            delattr(module, method)


def _recorder(tracer: _Tracer, module: BaseModule, method: str) -> Callable[..., _Placeholder]:
    def record(*args: Any, **kwargs: Any) -> _Placeholder:
        return tracer.record(module.name, module.name, method, args, kwargs)

    return record


def trace(fn: Callable, kind: str, args: Mapping[str, Mapping[str, Any]] | None = None,
          ) -> tuple[ComputeFlow, dict[str, BaseModule], dict[str, Step]]:
    """Run ``fn`` once on a placeholder batch: its :class:`ComputeFlow`, the modules it calls by name and its
    steps by name. ``args``: each model's ``args_dict`` in the run it is traced for, which the flow may read
    (`flow_args`). A flow that does something other than calls on placeholders is a FlowError naming it."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    tracer = _Tracer(name, args or {})
    modules = modules_of(fn)
    by_name: dict[str, BaseModule] = {}
    for m in modules:
        if m.name in by_name and by_name[m.name] is not m:
            raise FlowError(f"compute flow {name}: two modules are named {m.name!r}; a model name is unique")
        by_name[m.name] = m
    with _recording(tracer, modules):
        batch = _Placeholder(name, BATCH)
        try:
            out = fn(batch)
        except FlowError:
            raise
        except Exception as exc:
            raise FlowError(f"compute flow {name} raised {type(exc).__name__}: {exc} while traced (a flow only calls "
                            "models and steps on the batch and their outputs)") from exc
    returned = out if isinstance(out, tuple | list) else [out]
    returns = []
    for value in returned:
        if value is None:
            continue
        if not isinstance(value, _Placeholder) or value._node == BATCH:
            raise FlowError(f"compute flow {name} returns {type(value).__name__}; a flow returns model calls' outputs "
                            "(or nothing)")
        returns.append(value._node)
    if not tracer.nodes:
        raise FlowError(f"compute flow {name} calls no model: it needs at least one model call (e.g. "
                        "policy.forward_step(batch))")
    flow = _ordered(ComputeFlow(name=name, kind=kind, nodes=tracer.nodes, returns=returns))
    return flow, {n.model: by_name[n.model] for n in flow.nodes if n.model is not None}, tracer.steps


def _ordered(flow: ComputeFlow) -> ComputeFlow:
    """The nodes by level, then call order (a stable topological order every dispatcher follows the same way,
    so the ranks of a multi-process replica get their calls in one order); inputs and returns renumbered."""
    order = sorted(range(len(flow.nodes)), key=lambda i: (flow.nodes[i].level, i))
    new = {old: k for k, old in enumerate(order)}
    new[BATCH] = BATCH
    nodes = [flow.nodes[i].model_copy(update={"inputs": [new[j] for j in flow.nodes[i].inputs]}) for i in order]
    return flow.model_copy(update={"nodes": nodes, "returns": [new[i] for i in flow.returns]})


class _Flow:
    kind = "flow"

    def __init__(self, compute_flow: Callable):
        if not callable(compute_flow):
            raise FlowError(f"{type(self).__name__}(compute_flow): expected a function of the batch, got "
                            f"{type(compute_flow).__name__}")
        self.compute_flow = compute_flow
        self.dataset: list[Any] | None = None

    def trace(self, args: Mapping[str, Mapping[str, Any]] | None = None,
              ) -> tuple[ComputeFlow, dict[str, BaseModule], dict[str, Step]]:
        return trace(self.compute_flow, self.kind, args)

    def set_dataset(self, dataset: Any) -> "_Flow":
        """The prompt records this flow reads (ChatLearn's ``set_dataset``); they replace the config's data file."""
        self.dataset = list(dataset)
        return self


class Environment(_Flow):
    """The inference side of an episode: its first model reads the prompts, the flow's return value is the
    experience the trainers train on."""

    kind = "environment"


class Trainer(_Flow):
    """The training side of an episode: ``train_step`` calls on the episode's samples."""

    kind = "trainer"


class Evaluator(_Flow):
    """Evaluation: its first model answers the eval set, the returned calls score the answers."""

    kind = "evaluator"
