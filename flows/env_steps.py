"""A multi-turn rollout's environment steps as Prefect tasks on Ray: one ``env-step`` task run per batch and turn.

The conversation loop is the rollout's (`chatlearn.runtime.rollout.multi_turn`): after each policy turn, every
batch's environments step on the policy's answers here, with ``runtime.agent.num_cpus_per_task`` CPUs, its
timeout and retries, so every environment step is a task run in the UI.
"""

from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect_ray.context import remote_options

from chatlearn.envs.render import renderer_for
from chatlearn.envs.turns import StepResult, TurnSpec, step_conversations
from chatlearn.models.hf.common import load_tokenizer
from chatlearn.runtime.calls.handles import RefBox
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.prefect.ray_tasks import ray_task_runner


@task(name="env-step", task_run_name="env-step-turn-{turn}-batch-{index}", cache_policy=NO_CACHE)
def env_step(batch: Any, envs: list[Any] | None, turn: int, index: int, spec: TurnSpec,
             is_eval: bool = False) -> StepResult:
    """One batch's environments step on the policy's answers of ``turn``, in a Ray worker. ``batch`` is the
    policy's output (a RefBox of one ref, fetched here); ``envs`` those of the earlier turns (None: turn 1)."""
    data = ray.get(batch.refs[0], timeout=spec.timeout_s)
    # the task's function travels by value, what it calls by reference: a cache of this module's would make every
    # new worker import the `flows` package, and the run's machinery with it
    return step_conversations(data, envs, turn, spec, renderer_for(spec.model_path, load_tokenizer), is_eval)


def step_envs(spec: TurnSpec, refs: list[Any], envs: list[Any], turn: int, is_eval: bool,
              clock: StageClock) -> list[StepResult]:
    """Every batch's ``env-step`` task run at once; their results in batch order."""
    runner = ray_task_runner()
    task_fn = env_step.with_options(timeout_seconds=spec.timeout_s, retries=spec.retries)
    with remote_options(num_cpus=spec.num_cpus, max_retries=0):  # Prefect retries, from the same environments
        futures = [runner.submit(task_fn, {"batch": RefBox([ref]), "envs": envs[i], "turn": turn, "index": i,
                                           "spec": spec, "is_eval": is_eval})
                   for i, ref in enumerate(refs)]
    results = []
    for future in futures:
        clock.get(future.wrapped_future, "the environment")  # bounded by the stage's deadline, stops on a stop
        results.append(future.result())
    return results
