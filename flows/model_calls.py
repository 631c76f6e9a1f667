"""A compute flow's calls as Prefect task runs: one task run per call of the flow (over all the stage's batches),
named after the model and method (``reference.forward_step``) or the step, with the calls it reads as its
upstream inputs, under the stage task that runs them. The UI's run graph so shows the user's flow.

Calls that do not read each other run at once, each in its own thread of the episode's task runner, as
ChatLearn runs them. What a replica of several processes needs is one order of calls on all its ranks (their
collectives pair up in that order), so the calls of a stage are *sent* in the flow's node order (`Turns`):
a call takes its turn once the calls it reads are done, sends its batches (`chatlearn.runtime.calls.dispatch.
send`), and waits for them outside its turn. A rule reward's batches are Prefect tasks on Ray
(``flows/rule_tasks.py``) whose scores join the call's inputs; a step's batches are Ray tasks. Every wait is
bounded by the stage's deadline and stops on a stop.

`PrefectCalls` is the episode's `FlowCalls` (what the stages and the rollout run their calls through): these
task runs, and a multi-turn rollout's environment steps as task runs on Ray (``flows/env_steps.py``).
"""

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.utilities.annotations import opaque, quote

from chatlearn.envs.turns import StepResult, TurnSpec
from chatlearn.runtime.calls.dispatch import Batches, batch_refs, send
from chatlearn.runtime.calls.handles import Call, RefBox
from chatlearn.runtime.calls.turns import Turns
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.compute_flow import ComputeFlow, FlowNode
from chatlearn.runtime.context import RunContext
from flows.env_steps import step_envs
from flows.rule_tasks import fan_out_rule


@task(name="model-call", task_run_name="{node.name}", cache_policy=NO_CACHE)
def model_call(ctx: RunContext, flow: ComputeFlow, node: FlowNode, index: int, upstream: list[RefBox],
               batches: Batches, turns: Turns, clock: StageClock) -> RefBox:
    """One call of a compute flow over the stage's batches; its result per batch: the batch's ref (rank 0's,
    owned by the driver, left where it was made), or the call's value (a trainer's metrics)."""
    try:
        rules = None
        if node.model in ctx.spec.rule_rewards:  # scored by Prefect tasks on Ray first, off the turn
            futures = fan_out_rule(ctx.spec.rule_rewards[node.model], node.model,
                                   [batch_refs(upstream, i) for i in range(batches.count)], batches.episode_start,
                                   clock.timeout_s)
            rules = [f.output(clock) for f in futures]
        turns.wait(index, clock)
        calls = send(ctx, flow, index, upstream, batches, rules)
    finally:
        turns.release(index)
    values = clock.get(calls, node.name)  # every rank's done (or result): errors and deadlines seen here
    return RefBox([c.batch if isinstance(c, Call) and c.batch is not None else v
                   for c, v in zip(calls, values, strict=True)], node=index)


def unwalked(value: Any) -> Any:
    """A task argument Prefect does not walk: a future is waited for and its result passed as is (`opaque`),
    anything else passed as is (`quote`); a list is taken item by item. Prefect otherwise walks every argument
    of a task run twice (its inputs, then its futures), through the context's and the batches' every field:
    most of its task engine's CPU in the driver (`bench/overhead.py`)."""
    if isinstance(value, list):
        return [unwalked(v) for v in value]
    return opaque(value) if isinstance(value, PrefectFuture) else quote(value)


def run_calls(ctx: RunContext, flow: ComputeFlow, nodes: list[int], done: dict[int, RefBox], batches: Batches,
              clock: StageClock) -> dict[int, RefBox]:
    """Run ``nodes`` of ``flow`` (in its order) as task runs; ``done`` holds the results of the earlier
    stages' nodes they read. Returns every node's result."""
    turns = Turns(nodes)
    futures: dict[int, Any] = {}
    results = dict(done)
    try:
        for i in nodes:
            # the producer reads the dataset (its prompt batches), not an upstream result
            upstream = [futures[j] if j in futures else done[j] for j in flow.nodes[i].inputs
                        if j in futures or j in done]
            futures[i] = model_call.submit(*unwalked([ctx, flow, flow.nodes[i], i, upstream, batches, turns,
                                                      clock]))
        for i, future in futures.items():
            results[i] = future.result()
    except BaseException:
        turns.abort()
        for future in futures.values():  # the others end soon (aborted turns, the clock): then the stage fails
            future.wait()
        raise
    return results


class PrefectCalls:
    """The episode's `FlowCalls`: a flow's calls as task runs (`run_calls`), environment steps as task runs on
    Ray (`flows.env_steps.step_envs`)."""

    def __repr__(self) -> str:
        return "PrefectCalls()"

    def run(self, ctx: RunContext, flow: ComputeFlow, nodes: list[int], done: dict[int, RefBox], batches: Batches,
            clock: StageClock) -> dict[int, RefBox]:
        return run_calls(ctx, flow, nodes, done, batches, clock)

    def step_envs(self, spec: TurnSpec, refs: list[Any], envs: list[Any], turn: int, is_eval: bool,
                  clock: StageClock) -> list[StepResult]:
        return step_envs(spec, refs, envs, turn, is_eval, clock)
