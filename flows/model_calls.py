"""A compute flow's calls as Prefect task runs: one task run per call of the flow (over all the stage's batches),
named after the model and method (``reference.forward_step``) or the step, with the calls it reads as its
upstream inputs, under the stage task that runs them. The UI's run graph so shows the user's flow.

Calls that do not read each other run at once, each in its own thread of the episode's task runner, as
ChatLearn runs them. What a replica of several processes needs is one order of calls on all its ranks (their
collectives pair up in that order), so the calls of a stage are *sent* in the flow's node order (`Turns`):
a call takes its turn once the calls it reads are done, sends its batches, and waits for them outside its turn.
A rule reward's batches are Prefect tasks on Ray (``flows/rule_tasks.py``) whose scores join the call's
inputs; a step's batches are Ray tasks. Every wait is bounded by the stage's deadline and stops on a stop.
"""

from dataclasses import dataclass, field
from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.utilities.annotations import opaque, quote

from chatlearn.data.batch import merge_batches
from chatlearn.runtime.calls.handles import Call, RefBox, RunHandle
from chatlearn.runtime.calls.turns import Turns
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.compute_flow import ComputeFlow, FlowNode
from flows.rule_tasks import fan_out_rule


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
    policy_version: int | None = None  # pipelined episodes: the weights version the producer generates on
    rounds: list[dict[str, Any]] = field(default_factory=list)  # partial rollouts: each prompt batch's round


def _step_batch(fn: Any, *inputs: Any) -> tuple[bool, Any]:
    """A step on one batch, its result a return value of its own as a model call's (`Worker.run_batch`): owned by
    the driver, not fetched by it, and kept when this task's worker exits."""
    return True, fn(merge_batches(*inputs))


_STEP = ray.remote(max_retries=0, num_returns=2)(_step_batch)


def _send(run: RunHandle, flow: ComputeFlow, index: int, upstream: list[RefBox], batches: Batches,
          rules: list[Any] | None) -> list[Any]:
    """Send each batch of node ``index`` to its model's replicas (round robin) or to a step task."""
    node = flow.nodes[index]
    # a call whose result is an output of the flow, or goes to a step, carries its inputs: the whole batch
    keep = index in flow.outputs() or any(n.model is None and index in n.inputs for n in flow.nodes)
    if node.model is None:  # a step: a Ray task per batch, on the merged inputs
        step = run.steps[node.name]
        remote = _STEP.options(num_cpus=step.num_cpus)
        sent = [remote.remote(step.fn, *batch_refs(upstream, i)) for i in range(batches.count)]
        return [Call(node.name, [done], batch=out) for done, out in sent]
    heads = run.heads(node.model)
    if node.method == "train_step":  # a trainer: one call, on the episode's samples
        return [heads[0].train.remote(upstream[0].refs[0], **(batches.train or {}))]
    if index == 0:  # the producer reads the dataset
        return [heads[r].generate.remote(idx, batches.first_iteration + i, is_eval=batches.is_eval, sample_ids=ids,
                                         group_size=run.group_size if not batches.is_eval else 1,
                                         flow_method=node.method, policy_version=batches.policy_version,
                                         **(batches.rounds[i] if batches.rounds else {}))
                for i, (r, idx, ids) in enumerate(batches.prompts)]
    calls = []
    for i in range(batches.count):
        extra = [rules[i]] if rules is not None else []
        calls.append(heads[i % len(heads)].forward.remote(
            *batch_refs(upstream, i), *extra, iteration=batches.first_iteration + i, is_eval=batches.is_eval,
            keep_inputs=keep, flow_method=node.method))
    return calls


@task(name="model-call", task_run_name="{node.name}", cache_policy=NO_CACHE)
def model_call(run: RunHandle, flow: ComputeFlow, node: FlowNode, index: int, upstream: list[RefBox],
               batches: Batches, stage: str) -> RefBox:
    """One call of a compute flow over the stage's batches; its result per batch: the batch's ref (rank 0's,
    owned by the driver, left where it was made), or the call's value (a trainer's metrics)."""
    turns, clock = Turns.of(stage)
    try:
        rules = None
        if node.model in run.rule_rewards:  # scored by Prefect tasks on Ray first, off the turn
            futures = fan_out_rule(run, node.model, [batch_refs(upstream, i) for i in range(batches.count)],
                                   batches.episode_start)
            rules = [f.output(clock) for f in futures]
        turns.wait(index, clock)
        calls = _send(run, flow, index, upstream, batches, rules)
    finally:
        turns.release(index)
    values = clock.get(calls, node.name)  # every rank's done (or result): errors and deadlines seen here
    return RefBox([c.batch if isinstance(c, Call) and c.batch is not None else v
                   for c, v in zip(calls, values, strict=True)], node=index)


def unwalked(value: Any) -> Any:
    """A task argument Prefect does not walk: a future is waited for and its result passed as is (`opaque`),
    anything else passed as is (`quote`); a list is taken item by item. Prefect otherwise walks every argument
    of a task run twice (its inputs, then its futures), through the RunHandle's and the batches' every field:
    most of its task engine's CPU in the driver (`bench/overhead.py`)."""
    if isinstance(value, list):
        return [unwalked(v) for v in value]
    return opaque(value) if isinstance(value, PrefectFuture) else quote(value)


def batch_refs(upstream: list[RefBox], i: int) -> list[Any]:
    """Batch ``i`` of every upstream call."""
    return [u.refs[i] for u in upstream]


def run_calls(run: RunHandle, flow: ComputeFlow, nodes: list[int], done: dict[int, RefBox], batches: Batches,
              clock: StageClock) -> dict[int, RefBox]:
    """Run ``nodes`` of ``flow`` (in its order) as task runs; ``done`` holds the results of the earlier
    stages' nodes they read. Returns every node's result."""
    turns = Turns(nodes)
    stage = turns.register(clock)
    futures: dict[int, Any] = {}
    results = dict(done)
    try:
        for i in nodes:
            # the producer reads the dataset (its prompt batches), not an upstream result
            upstream = [futures[j] if j in futures else done[j] for j in flow.nodes[i].inputs
                        if j in futures or j in done]
            futures[i] = model_call.submit(*unwalked([run, flow, flow.nodes[i], i, upstream, batches, stage]))
        for i, future in futures.items():
            results[i] = future.result()
    except BaseException:
        turns.abort()
        for future in futures.values():  # the others end soon (aborted turns, the clock): then the stage fails
            future.wait()
        raise
    finally:
        Turns.unregister(stage)
    return results
