"""Multi-turn rollouts (``runtime.task_type: agent``): the policy's turns and the environment's steps, alternating.

After the policy's first answers (the producer's call, as in a single-turn episode), each batch's environments
step on them as a Prefect task on Ray (``env-step``, one task run per batch and turn, with
``runtime.agent.num_cpus_per_task`` CPUs, its timeout and retries), so every environment step is a task run in
the UI. The conversations that go on are continued by the policy from their exact token ids (the producer's
call again, on the batch of those samples), and so on until each ended (`chatlearn.envs.turns`). A batch keeps
its conversations together from turn to turn, so it stays on one replica and its environments travel with it.
The ended conversations, in sample order, are the rollouts the score stage reads.
"""

import functools
import time
from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect_ray.context import remote_options

from chatlearn.data.batch import collate_samples
from chatlearn.envs.render import ObservationRenderer
from chatlearn.envs.turns import StepResult, TurnSpec, step_conversations
from chatlearn.models.hf.common import load_tokenizer
from chatlearn.runtime.calls.handles import RefBox, RunHandle
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.prefect.ray_tasks import ray_task_runner
from chatlearn.utils.faults import crash_point
from flows.model_calls import Batches, run_calls


@functools.lru_cache(maxsize=4)
def _renderer(model_path: str) -> ObservationRenderer:
    """The policy's tokenizer, loaded once per Ray worker."""
    return ObservationRenderer(load_tokenizer(model_path))


@task(name="env-step", task_run_name="env-step-turn-{turn}-batch-{index}", cache_policy=NO_CACHE)
def env_step(batch: Any, envs: list[Any] | None, turn: int, index: int, spec: TurnSpec,
             is_eval: bool = False) -> StepResult:
    """One batch's environments step on the policy's answers of ``turn``, in a Ray worker. ``batch`` is the
    policy's output (a RefBox of one ref, fetched here); ``envs`` those of the earlier turns (None: turn 1)."""
    data = ray.get(batch.refs[0], timeout=spec.timeout_s)
    return step_conversations(data, envs, turn, spec, _renderer(spec.model_path), is_eval)


def _step_all(run: RunHandle, spec: TurnSpec, refs: list[Any], envs: list[Any], turn: int, is_eval: bool,
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


def run_conversations(run: RunHandle, flow: Any, first: list[Any], batches: Batches, clock: StageClock,
                      is_eval: bool = False) -> tuple[list[Any], dict[str, float]]:
    """Go on from the producer's first answers (``first``, one ref per batch of ``batches``) until every
    conversation ended. Returns the ended conversations as batches (refs, in sample order, batches of the
    generation batch size) and the episode's agent metrics."""
    spec: TurnSpec = run.agent
    t0 = time.perf_counter()
    refs, envs, replicas = list(first), [None] * len(first), [r for r, _, _ in batches.prompts]
    ended: list[dict[str, Any]] = []
    env_seconds = 0.0
    for turn in range(1, spec.max_turns + 1):
        s0 = time.perf_counter()
        results = _step_all(run, spec, refs, envs, turn, is_eval, clock)
        env_seconds += time.perf_counter() - s0
        ended += [s for r in results for s in r.ended]
        if not is_eval:  # for resume tests: dies between two turns of the episode's conversations
            crash_point(f"agent_turn_{turn}", clock.episode)
        live = [(replicas[i], r) for i, r in enumerate(results) if r.going]
        if not live:
            break
        # the policy continues each batch's live conversations on the replica that began them
        prompts = [(replica, [], [s["sample_id"] for s in r.going]) for replica, r in live]
        rounds = [{"continued": ray.put(r.going)} for _, r in live]
        iteration = batches.first_iteration + turn * max(1, batches.count)
        more = Batches(len(prompts), iteration, prompts, is_eval=is_eval, episode_start=batches.episode_start,
                       rounds=rounds)
        refs = run_calls(run, flow, [0], {}, more, clock)[0].refs
        envs = [r.envs for _, r in live]
        replicas = [replica for replica, _ in live]
    ended.sort(key=lambda s: s["sample_id"])
    size = max(1, run.generation_batch_size)
    out = [ray.put(collate_samples(ended[i:i + size], run.pad_token_id)) for i in range(0, len(ended), size)]
    n = max(1, len(ended))
    metrics = {"turns_mean": sum(s["turns"] for s in ended) / n,
               "tool_calls_mean": sum(s["tool_calls"] for s in ended) / n,
               "tool_errors": float(sum(s["tool_errors"] for s in ended)),
               "env_reward_mean": sum(s["env_reward"] for s in ended) / n,
               "env_seconds": env_seconds,  # the environment steps' wall time, the policy's turns apart
               "agent_seconds": time.perf_counter() - t0}
    return out, metrics
