"""A rule reward's batches as Prefect tasks on Ray: one `rule-reward` task run per batch, in parallel.

The score and eval stages fan a rule reward (``fan_out: true``, the default) out over their batches: each
batch is a task run in the UI (under the stage's own task run, with its state and logs), run in a Ray worker
with the rule's ``num_cpus_per_task`` on `WarmRayTaskRunner`. What scoring a batch means is
`chatlearn.models.rule`; the stage waits for the scores within its deadline (`StageClock`).
"""

import sys
from typing import Any

import ray
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect_ray.context import remote_options
from prefect_ray.task_runners import PrefectRayFuture

from chatlearn.data.batch import merge_batches
from chatlearn.models.rule import RuleSpec, score_key
from chatlearn.runtime.calls.handles import RefBox
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.prefect.ray_tasks import ray_task_runner

# the task travels to its Ray worker by value: by reference, the worker would import the `flows` package, whose
# flows import the run's machinery, transformers included (about 4 CPU-s in every new worker)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@task(name="rule-reward", cache_policy=NO_CACHE)
def rule_reward(batch: RefBox, rule: RuleSpec, episode_start: int | None = None,
                fetch_timeout_s: float | None = None) -> list[float]:
    """A rule reward on one batch (the merged outputs of the calls it reads, ``batch.refs``, made already: a
    fetch, within ``fetch_timeout_s``, the stage's limit, as a model process fetches its inputs; the rule's own
    ``timeout_s`` bounds each call of its hook, not a transfer on a busy machine), in a Ray worker. An error (a
    RewardError) names the hook and the sample, by its index in the episode when ``episode_start`` (the
    episode's first ``sample_id``) is given."""
    return rule.score(merge_batches(*ray.get(batch.refs, timeout=fetch_timeout_s)), episode_start)


class RuleFuture:
    """One batch's `rule-reward` task run; `result(clock)` waits for its scores within the stage's deadline
    and raises the task's error (its RewardError)."""

    def __init__(self, future: PrefectRayFuture, model: str):
        self.future, self.model = future, model

    @property
    def ref(self) -> Any:
        """The Ray ObjectRef of the task (its final Prefect state)."""
        return self.future.wrapped_future

    def result(self, clock: StageClock) -> list[float]:
        clock.get(self.ref, self.model)  # bounded by the stage's deadline, interrupted by a stop
        return self.future.result()  # done: the scores, or the task's error raised again

    def output(self, clock: StageClock) -> dict[str, torch.Tensor]:
        """The rule's scores as an input of its model's call: ``{"rewards/<model>": float32 tensor}`` (the
        reward module takes its own scores from there: `chatlearn.models.hf.reward`)."""
        return {score_key(self.model): torch.tensor(self.result(clock), dtype=torch.float32)}


def fan_out_rule(rule: RuleSpec, model: str, batches: list[list[Any]], episode_start: int | None = None,
                 fetch_timeout_s: float | None = None) -> list[RuleFuture]:
    """One `rule-reward` Prefect task per batch (the refs of the outputs it reads) of ``model``'s rule on Ray, all
    in parallel, each with the rule's CPUs (no Ray retries: a retried task would try to enter Running again);
    their futures in batch order. ``episode_start``, ``fetch_timeout_s``: see `rule_reward`."""
    runner = ray_task_runner()
    with remote_options(num_cpus=rule.num_cpus, max_retries=0):
        return [RuleFuture(runner.submit(rule_reward, {"batch": RefBox(list(refs)), "rule": rule,
                                                       "episode_start": episode_start,
                                                       "fetch_timeout_s": fetch_timeout_s}), model)
                for refs in batches]
