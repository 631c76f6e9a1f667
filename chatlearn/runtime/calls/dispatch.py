"""How one call of a compute flow reaches the model processes: its batches, sent to a model's replicas or run as
Ray tasks (a flow step), and the interface the episode's code runs a flow's calls through.

`send` is what a call does, whatever orchestrates it. `FlowCalls` is how the stages and the rollout run a set of a
flow's calls and wait for them: the flows layer implements it with one Prefect task run per call
(``flows/model_calls.py``), so the runtime never imports Prefect's tasks; the context of a run carries the
implementation (`chatlearn.runtime.context.RunContext.calls`).
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import ray

from chatlearn.data.batch import merge_batches
from chatlearn.runtime.calls.handles import Call, RefBox
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.compute_flow import ComputeFlow

if TYPE_CHECKING:  # only for the annotations
    from chatlearn.envs.turns import StepResult, TurnSpec

__all__ = ["Batches", "FlowCalls", "batch_refs", "send"]


@dataclass
class Batches:
    """What a stage's calls run on: the producer's prompt batches (``(replica, dataset indices, sample ids)``),
    or the number of batches its upstream calls made; ``first_iteration`` numbers them."""

    count: int
    first_iteration: int = 0
    prompts: list[tuple[int, list[int], list[int] | None]] = field(default_factory=list)
    is_eval: bool = False
    episode_start: int | None = None  # the first sample id of the episode (0 for the eval set), for errors
    train: dict[str, Any] | None = None  # a trainer flow's: what each train call gets besides the samples
    policy_version: int | None = None  # the weights version the producer generates on (pipelined, partial)
    rounds: list[dict[str, Any]] = field(default_factory=list)  # each prompt batch's extra producer arguments


class FlowCalls(Protocol):
    """Runs calls of a compute flow and environment steps for an episode (implemented by the flows layer)."""

    def run(self, ctx: Any, flow: ComputeFlow, nodes: list[int], done: dict[int, RefBox],
            batches: Batches, clock: StageClock) -> dict[int, RefBox]:
        """Run ``nodes`` of ``flow`` (in its order) for the run of ``ctx`` (its `RunContext`, which holds this
        object: annotated loosely to keep the two modules free of a loop); ``done`` holds the results of earlier
        stages' nodes they read. Returns every node's result."""
        ...

    def step_envs(self, spec: "TurnSpec", refs: list[Any], envs: list[Any], turn: int, is_eval: bool,
                  clock: StageClock) -> list["StepResult"]:
        """Each batch's environments step on the policy's answers of ``turn`` (multi-turn rollouts)."""
        ...


def _step_batch(fn: Any, *inputs: Any) -> tuple[bool, Any]:
    """A step on one batch, its result a return value of its own as a model call's (`Worker.run_batch`): owned by
    the driver, not fetched by it, and kept when this task's worker exits."""
    return True, fn(merge_batches(*inputs))


_STEP = ray.remote(max_retries=0, num_returns=2)(_step_batch)


def batch_refs(upstream: list[RefBox], i: int) -> list[Any]:
    """Batch ``i`` of every upstream call."""
    return [u.refs[i] for u in upstream]


def send(ctx: Any, flow: ComputeFlow, index: int, upstream: list[RefBox], batches: Batches,
         rules: list[Any] | None) -> list[Any]:
    """Send each batch of node ``index`` to its model's replicas (round robin) or to a step task, for the run of
    ``ctx`` (its `RunContext`: the actors, the steps, the group size); ``rules``: a rule reward's scores of each
    batch, an extra input of its model's call."""
    node = flow.nodes[index]
    # a call whose result is an output of the flow, or goes to a step, carries its inputs: the whole batch
    keep = index in flow.outputs() or any(n.model is None and index in n.inputs for n in flow.nodes)
    if node.model is None:  # a step: a Ray task per batch, on the merged inputs
        step = ctx.steps[node.name]
        remote = _STEP.options(num_cpus=step.num_cpus)
        sent = [remote.remote(step.fn, *batch_refs(upstream, i)) for i in range(batches.count)]
        return [Call(node.name, [done], batch=out) for done, out in sent]
    heads = ctx.actors.heads(node.model)
    if node.method == "train_step":  # a trainer: one call, on the episode's samples
        return [heads[0].train.remote(upstream[0].refs[0], **(batches.train or {}))]
    if index == 0:  # the producer reads the dataset
        group = ctx.spec.group_size if not batches.is_eval else 1
        return [heads[r].generate.remote(idx, batches.first_iteration + i, is_eval=batches.is_eval, sample_ids=ids,
                                         group_size=group, flow_method=node.method,
                                         policy_version=batches.policy_version,
                                         **(batches.rounds[i] if batches.rounds else {}))
                for i, (r, idx, ids) in enumerate(batches.prompts)]
    calls = []
    for i in range(batches.count):
        extra = [rules[i]] if rules is not None else []
        calls.append(heads[i % len(heads)].forward.remote(
            *batch_refs(upstream, i), *extra, iteration=batches.first_iteration + i, is_eval=batches.is_eval,
            keep_inputs=keep, flow_method=node.method))
    return calls
