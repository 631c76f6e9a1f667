"""The six stage tasks of an episode (Prefect tasks). Each is a thin dispatcher to the model actors.

Tasks return small things (metrics, RefBoxes of ObjectRefs); rollouts and weights move actor to actor
through Ray's object store. They read what they need from the `RunHandle` (actor names and the few config
numbers that matter), never the whole config. Prefect's cache is off for all of them: they act on stateful
actors, and a cached `train` would silently skip an update.

A `RunError` from a stage's actors or Ray tasks (a user hook that raised, a NaN reward or loss) comes back
wrapped by Ray; the stage (`in_stage`) raises it again as one RunError that says where, ``episode 3, score:
reward hook mod:fn returned nan for sample 17 (prompt "...")``, which the CLI prints as one line.
"""

import functools
import inspect
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from chatlearn.data.batch import collate_samples, merge_batches, split_batch
from chatlearn.data.partial_rollout import continuation_batches
from chatlearn.data.sampler import episode_generation_batches, eval_prompt_batches
from chatlearn.runtime.calls.handles import RefBox, RunHandle
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.compute_flow import BATCH
from chatlearn.runtime.prefect import api_link
from chatlearn.runtime.records.evaluation import eval_metrics, eval_results
from chatlearn.runtime.records.reporting import artifact_key
from chatlearn.runtime.schedule import checkpoint_due, every
from chatlearn.runtime.weights.sync import sync_routes
from chatlearn.runtime.weights.versions import generation_version, policy_turn
from chatlearn.utils.errors import RunError, find_run_error
from chatlearn.utils.storage import writing
from flows.agent_turns import run_conversations
from flows.model_calls import Batches, run_calls

F = TypeVar("F", bound=Callable[..., Any])


def stage_error(exc: BaseException, stage: str, episode: int | None) -> RunError | None:
    """What a stage raises for ``exc``: the RunError inside it (itself, or under Ray's RayTaskError and
    exception chains) with ``episode N, <stage>: `` in front (just ``<stage>: `` outside an episode: the eval
    before training, `chatlearn eval`), unless its message says where already; None when ``exc`` holds no
    RunError (a bug of ours keeps its own traceback)."""
    err = find_run_error(exc)
    if err is None:
        return None
    if err.message.startswith(("episode ", f"{stage}:")):
        return err if exc is err else RunError(err.message)
    where = f"episode {episode + 1}, {stage}" if episode is not None and episode >= 0 else stage  # counted from 1
    return RunError(f"{where}: {err.message}")


def _episode_of(params: dict[str, Any]) -> int | None:
    """The episode of a stage call: its ``episode`` argument, or the one its rollouts were generated in."""
    if isinstance(params.get("episode"), int):
        return params["episode"]
    for value in params.values():
        if isinstance(value, RefBox) and isinstance(value.meta.get("episode"), int):
            return value.meta["episode"]
    return None


def in_stage(stage: str) -> Callable[[F], F]:
    """Decorate a stage task's function (under ``@task``) so a RunError leaves it as `stage_error` says; the
    original exception stays its cause, so the log file gets the whole traceback."""

    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                bound = signature.bind_partial(*args, **kwargs)
                err = stage_error(exc, stage, _episode_of(bound.arguments))
                if err is None or err is exc:
                    raise
                raise err from exc

        run.__prefect_task_source__ = fn  # type: ignore[attr-defined]  # Prefect's task key: the stage's own code
        return run  # type: ignore[return-value]

    return wrap


@task(name="generate", cache_policy=NO_CACHE)
@in_stage("generate")
def generate(run: RunHandle, episode: int, consumed_samples: int, sampling_round: int = 0) -> RefBox:
    """The environment's first call (the producer) answers this episode's prompts, batches dealt over its
    replicas. ``sampling_round`` > 0: dynamic sampling's next round of the episode, the stream's next prompts."""
    clock = StageClock("generate", episode, run.stage_timeout_s)
    flow = run.plan.environment
    replicas = len(run.actors[flow.producer.model])
    prompts = episode_generation_batches(run.dataset_size, consumed_samples, run.sample_per_episode,
                                         run.generation_batch_size, replicas, run.shuffle_seed, run.group_size)
    num_samples = sum(len(idx) for _, idx, _ in prompts)
    first_iteration = (episode * run.sampling_rounds + sampling_round) * len(prompts)
    # stream positions identify samples: per-sample seeds make responses independent of the batching
    # pipelined: on the weights of max_staleness episodes before, whatever trains meanwhile
    version = (generation_version(episode, run.max_staleness)
               if run.versions is not None or run.partial is not None else None)
    rounds: list[dict[str, Any]] = []
    if run.partial is not None:  # partial rollouts: the responses begun earlier go on first, then round 0
        continued = continuation_batches(run.partial.before(episode).unfinished, run.partial.budgets,
                                         run.generation_batch_size)
        rounds = [{"continued": ray.put(samples), "max_new_tokens": budget} for budget, samples in continued]
        prompts = [(i % replicas, [], [s["sample_id"] for s in samples])
                   for i, (_, samples) in enumerate(continued)] + prompts
        rounds += [{"max_new_tokens": run.partial.budgets[0]}] * (len(prompts) - len(rounds))
    batches = Batches(len(prompts), first_iteration, prompts, episode_start=consumed_samples, policy_version=version,
                      rounds=rounds)
    with policy_turn(run.versions, flow.producer.model, version, clock):
        done = run_calls(run, flow, [0], {}, batches, clock)
    refs, partial, agent = done[0].refs, {}, {}
    if run.agent is not None:  # multi-turn: the environments answer, the policy goes on, until each conversation ends
        refs, agent = run_conversations(run, flow, refs, batches, clock)
    if run.partial is not None:  # what finished goes on to scoring, by whole prompt groups; the rest waits
        produced = [s for batch in clock.get(refs, flow.producer.model) for s in split_batch(batch)]
        released, partial = run.partial.settle(episode, produced)
        refs = [ray.put(collate_samples(b, run.pad_token_id)) for b in released]
    return RefBox(refs, seconds=clock.seconds(), num_batches=len(refs), num_samples=num_samples,
                  first_iteration=first_iteration, episode=episode, first_sample_id=consumed_samples, partial=partial,
                  agent=agent)


@task(name="score", cache_policy=NO_CACHE)
@in_stage("score")
def score(run: RunHandle, rollouts: RefBox) -> RefBox:
    """The rest of the environment flow on the rollouts: each call a task run, calls that do not read each other
    at once; the returned calls' outputs are the experience. A rule reward's batches are Prefect tasks on Ray
    (`flows.rule_tasks`)."""
    flow = run.plan.environment
    clock = StageClock("score", rollouts.meta.get("episode", -1), run.stage_timeout_s)
    batches = Batches(len(rollouts.refs), rollouts.meta["first_iteration"],
                      episode_start=rollouts.meta.get("first_sample_id"))
    done = run_calls(run, flow, list(range(1, len(flow.nodes))), {0: RefBox(rollouts.refs)}, batches, clock)
    outputs = [done[i].refs for i in flow.outputs()]  # the producer's own for offline DPO: nothing to score
    # several returned calls: the stream dataset merges them per batch
    return RefBox([list(parts) for parts in zip(*outputs, strict=True)] if len(outputs) > 1 else outputs[0],
                  seconds=clock.seconds(), merged=len(outputs) > 1)


def experience_parts(experience: RefBox) -> list[list[Any]]:
    """The score stage's output as each batch's parts (one per returned call), as the stream dataset reads it."""
    return experience.refs if experience.meta.get("merged") else [[r] for r in experience.refs]


@task(name="train", cache_policy=NO_CACHE)
@in_stage("train")
def train(run: RunHandle, experience: RefBox, episode: int, start_iteration: int) -> dict[str, Any]:
    """The StreamDataset shapes the episode's samples (loader type, relay); the trainer flow's train_step calls
    train on them, each a task run, at once."""
    clock = StageClock("train", episode, run.stage_timeout_s)
    parts = experience_parts(experience)
    stats, samples_ref = run.stream().episode_samples.remote(parts, episode=episode)  # the driver owns the samples
    metrics = clock.get(stats, "the stream dataset")
    flow = run.plan.trainer
    batches = Batches(1, start_iteration, train={"episode": episode, "start_iteration": start_iteration,
                                                 "group_size": run.group_size})
    done = run_calls(run, flow, list(range(len(flow.nodes))), {BATCH: RefBox([samples_ref])}, batches, clock)
    results = [done[i].refs[0] for i in range(len(flow.nodes))]
    for res in results:
        metrics.update({k: v for k, v in res.items() if k not in ("iteration", "num_steps", "num_samples")})
    first = results[0] if results else {}
    metrics["iteration"] = first.get("iteration", start_iteration)
    metrics["train_steps"] = first.get("num_steps", 0)
    metrics["seconds"] = clock.seconds()
    return metrics


@task(name="sync", cache_policy=NO_CACHE)
@in_stage("sync")
def sync(run: RunHandle, episode: int, trained: dict | None = None) -> dict[str, Any]:
    """Copy each trainer's weights into its inference model (every `sync_frequency` episodes).

    Weights go over the routes planned at launch (collective groups, or the object store for modules with
    their own get/set_weights; see `chatlearn.runtime.weights.sync`); nothing passes through Prefect. `trained` is
    only there to order sync after train in the task graph.
    """
    t0 = time.perf_counter()
    due = [r for r in run.sync_routes if every(run.sync_frequency[r.dst], episode)]
    versions = run.versions
    if versions is not None:  # pipelined: the policy's weights are published as a version, loaded when due
        due = [r for r in due if r.key != versions.route.key]
    stats = sync_routes(due, run.actor, concurrent=run.concurrent_comm, max_workers=run.param_sync_max_workers)
    synced = list(stats)
    if versions is not None:
        versions.publish(episode + 1, StageClock("sync", episode, run.stage_timeout_s))
        versions.release_below(generation_version(episode + 1, run.max_staleness))
        synced.append(f"{versions.route.key} (version {episode + 1})")
    return {"synced": synced, "bytes": sum(s["bytes"] for s in stats.values()),
            "seconds": time.perf_counter() - t0}


@task(name="checkpoint", cache_policy=NO_CACHE)
@in_stage("checkpoint")
def checkpoint(run: RunHandle, episode: int, trained: dict) -> dict[str, Any]:
    """Every `save_episode_interval` episodes and after the last one, the model actors save their state and the
    relay its window.

    The data checkpoint record that makes these the run's restart point is written by the train flow after
    the episode (it is the commit), so a crash in between only wastes this episode's work.
    """
    clock = StageClock("checkpoint", episode, run.stage_timeout_s)
    paths: dict[str, str | None] = {}
    relay_path = partial = None
    versions: dict[int, str] = {}
    if checkpoint_due(run.save_episode_interval, episode, run.num_episode):
        iteration = trained["iteration"]
        calls = {name: run.heads(name)[0].save_checkpoint.remote(iteration) for name in run.checkpoint_models}
        paths = dict(zip(calls, clock.get(list(calls.values())), strict=True))
        relay_dir = os.path.join(run.data_checkpoint_path, "relay", f"iter_{iteration:07d}")
        with writing("the relay checkpoint", relay_dir):  # a full disk: one RunError naming the path
            relay_path = clock.get(run.stream().save_relay.remote(relay_dir), "the stream dataset")
        if run.versions is not None:  # pipelined: the older weights the next episodes generate on
            version_dir = os.path.join(run.data_checkpoint_path, "policy_versions", f"iter_{iteration:07d}")
            with writing("the policy versions", version_dir):
                versions = run.versions.save(list(range(generation_version(episode + 1, run.max_staleness),
                                                        episode + 1)), version_dir, clock)
        if run.partial is not None:  # the responses in flight, as this episode's generation left them
            partial_dir = os.path.join(run.data_checkpoint_path, "partial_rollouts", f"iter_{iteration:07d}")
            with writing("the partial rollouts", partial_dir):
                partial = run.partial.after(episode).save(partial_dir, episode)
    return {"paths": paths, "relay_path": relay_path, "policy_versions": versions, "partial_rollouts": partial,
            "seconds": clock.seconds()}


@task(name="eval", cache_policy=NO_CACHE)
@in_stage("eval")
def evaluate(run: RunHandle, episode: int, synced: dict | None = None, trained: dict | None = None) -> dict[str, Any]:
    """The evaluator flow on the eval set: its first call answers (greedy by default), the returned calls score
    the answers; then `runtime.eval_post_process_fn(results, {"episode_iteration", "train_iteration"})` turns the
    per-sample results into metrics (ChatLearn's post_process_func); the default is the mean score."""
    clock = StageClock("eval", episode, run.stage_timeout_s)
    flow = run.plan.evaluator
    replicas = len(run.actors[flow.producer.model])
    prompts = [(r, idx, None) for r, idx in eval_prompt_batches(run.eval_dataset_size, run.generation_batch_size,
                                                               replicas)]
    batches = Batches(len(prompts), 0, prompts, is_eval=True, episode_start=0)
    # pipelined: on the weights this episode trained, while the next episodes generate on older ones
    with policy_turn(run.versions, flow.producer.model, episode + 1, clock):
        if run.agent is None:
            done = run_calls(run, flow, list(range(len(flow.nodes))), {}, batches, clock)
        else:  # multi-turn: the conversations end before the evaluator's other calls score them
            refs, agent = run_conversations(run, flow, run_calls(run, flow, [0], {}, batches, clock)[0].refs,
                                            batches, clock, is_eval=True)
            done = run_calls(run, flow, list(range(1, len(flow.nodes))), {0: RefBox(refs)},
                             Batches(len(refs), 0, is_eval=True, episode_start=0), clock)
    outputs = [clock.get(done[i].refs, flow.nodes[i].name) for i in flow.outputs()]
    results = eval_results([merge_batches(*parts) for parts in zip(*outputs, strict=True)])
    context = {"episode_iteration": episode, "train_iteration": (trained or {}).get("iteration")}
    metrics = eval_metrics(results, context, run.eval_post_process_fn)
    if run.agent is not None:  # how the eval conversations went
        metrics.update({f"eval_{k}": agent[k] for k in ("turns_mean", "tool_calls_mean", "tool_errors")})
    examples = [{"prompt": r.get("prompt"), "response": r.get("response"), "score": r.get("scores")}
                for r in results[:8]]
    api_link.post(create_table_artifact, key=artifact_key(run.exp_name, "eval-examples"), table=examples,
                  description=f"eval responses after episode {episode + 1}" if episode >= 0
                  else "eval responses before training")
    return {"metrics": metrics, "examples": examples, "seconds": clock.seconds()}
