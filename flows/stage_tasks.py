"""The six stage tasks of an episode (Prefect tasks). Each is a thin dispatcher to the model actors.

Tasks return small things (metrics, RefBoxes of ObjectRefs); rollouts and weights move actor to actor
through Ray's object store. Each gets the run's context (`chatlearn.runtime.context.RunContext`: the spec, the
actors, the rollout strategy), never the config. What generation does in this run (single-turn, multi-turn,
partial rollouts, pipelined on weight versions) is the rollout strategy's: the stages call it and never branch
on the mode. Prefect's cache is off for all of them: they act on stateful actors, and a cached `train` would
silently skip an update.

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

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from chatlearn.data.batch import merge_batches
from chatlearn.runtime.calls.dispatch import Batches
from chatlearn.runtime.calls.handles import RefBox
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.compute_flow import BATCH
from chatlearn.runtime.context import RunContext
from chatlearn.runtime.prefect import api_link
from chatlearn.runtime.records.evaluation import eval_metrics, eval_results
from chatlearn.runtime.records.reporting import artifact_key
from chatlearn.runtime.records.traces import explaining
from chatlearn.runtime.schedule import checkpoint_due, every
from chatlearn.runtime.weights.sync import sync_routes
from chatlearn.utils.errors import RunError, find_run_error
from chatlearn.utils.storage import writing

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
def generate(ctx: RunContext, episode: int, consumed_samples: int, sampling_round: int = 0) -> RefBox:
    """The run's rollout strategy answers this episode's prompts (the environment's first call, the producer,
    batches dealt over its replicas). ``sampling_round`` > 0: dynamic sampling's next round of the episode, the
    stream's next prompts."""
    return ctx.rollout.generate(ctx, episode, consumed_samples, sampling_round)


@task(name="score", cache_policy=NO_CACHE)
@in_stage("score")
def score(ctx: RunContext, rollouts: RefBox) -> RefBox:
    """The rest of the environment flow on the rollouts: each call a task run, calls that do not read each other
    at once; the returned calls' outputs are the experience. A rule reward's batches are Prefect tasks on Ray
    (`flows.rule_tasks`)."""
    flow = ctx.spec.plan.environment
    clock = StageClock("score", rollouts.meta.get("episode", -1), ctx.spec.runtime.stage_timeout_s)
    batches = Batches(len(rollouts.refs), rollouts.meta["first_iteration"],
                      episode_start=rollouts.meta.get("first_sample_id"))
    done = ctx.calls.run(ctx, flow, list(range(1, len(flow.nodes))), {0: RefBox(rollouts.refs)}, batches, clock)
    outputs = [done[i].refs for i in flow.outputs()]  # the producer's own for offline DPO: nothing to score
    # several returned calls: the stream dataset merges them per batch
    return RefBox([list(parts) for parts in zip(*outputs, strict=True)] if len(outputs) > 1 else outputs[0],
                  seconds=clock.seconds(), merged=len(outputs) > 1)


def experience_parts(experience: RefBox) -> list[list[Any]]:
    """The score stage's output as each batch's parts (one per returned call), as the stream dataset reads it."""
    return experience.refs if experience.meta.get("merged") else [[r] for r in experience.refs]


@task(name="train", cache_policy=NO_CACHE)
@in_stage("train")
def train(ctx: RunContext, experience: RefBox, episode: int, start_iteration: int) -> dict[str, Any]:
    """The StreamDataset shapes the episode's samples (loader type, relay); the trainer flow's train_step calls
    train on them, each a task run, at once."""
    clock = StageClock("train", episode, ctx.spec.runtime.stage_timeout_s)
    parts = experience_parts(experience)
    # the driver owns the samples; the trace rows go to the run's recorder (`RunRecorder.record`)
    stats, samples_ref, trace = ctx.stream.episode_samples.remote(parts, episode=episode)
    metrics = clock.get(stats, "the stream dataset")
    metrics["trace"] = clock.get(trace, "the stream dataset")
    if metrics["trace"]:  # on the episode's page in the UI: the samples that explain it (all: run_dir/traces)
        api_link.post(create_table_artifact, key=artifact_key(ctx.spec.runtime.exp_name, "samples"),
                      table=explaining(metrics["trace"], ctx.spec.runtime.seed),
                      description=f"episode {episode + 1}: the samples of highest and lowest advantage, and a few "
                                  f"at random (every one: `chatlearn trace "
                                  f"{os.path.abspath(ctx.spec.runtime.run_dir)} --episode {episode + 1}`)")
    flow = ctx.spec.plan.trainer
    batches = Batches(1, start_iteration, train={"episode": episode, "start_iteration": start_iteration,
                                                 "group_size": ctx.spec.group_size})
    done = ctx.calls.run(ctx, flow, list(range(len(flow.nodes))), {BATCH: RefBox([samples_ref])}, batches, clock)
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
def sync(ctx: RunContext, episode: int, trained: dict | None = None) -> dict[str, Any]:
    """Copy each trainer's weights into its inference model (every `sync_frequency` episodes).

    Weights go over the routes planned at launch (collective groups, or the object store for modules with
    their own get/set_weights; see `chatlearn.runtime.weights.sync`); nothing passes through Prefect. Pipelined
    episodes publish the policy's as a version instead (the rollout's weights). `trained` is only there to order
    sync after train in the task graph.
    """
    t0 = time.perf_counter()
    rt = ctx.spec.runtime
    due = ctx.rollout.routes_to_sync([r for r in ctx.sync_routes if every(ctx.spec.sync_frequency[r.dst], episode)])
    stats = sync_routes(due, ctx.actors.process, concurrent=rt.concurrent_comm,
                        max_workers=rt.param_sync_max_workers)
    synced = list(stats) + ctx.rollout.publish(episode, StageClock("sync", episode, rt.stage_timeout_s))
    return {"synced": synced, "bytes": sum(s["bytes"] for s in stats.values()),
            "seconds": time.perf_counter() - t0}


@task(name="checkpoint", cache_policy=NO_CACHE)
@in_stage("checkpoint")
def checkpoint(ctx: RunContext, episode: int, trained: dict) -> dict[str, Any]:
    """Every `save_episode_interval` episodes and after the last one, the model actors save their state, the
    relay its window and the rollout what it carries to the next episodes.

    The data checkpoint record that makes these the run's restart point is written by the train flow after
    the episode (it is the commit), so a crash in between only wastes this episode's work.
    """
    rt = ctx.spec.runtime
    clock = StageClock("checkpoint", episode, rt.stage_timeout_s)
    saved: dict[str, Any] = {"paths": {}, "relay_path": None, "policy_versions": {}, "partial_rollouts": None}
    if checkpoint_due(rt.save_episode_interval, episode, rt.num_episode):
        iteration = trained["iteration"]
        heads = {name: ctx.actors.heads(name)[0] for name in ctx.spec.checkpoint_models}
        calls = {name: head.save_checkpoint.remote(iteration) for name, head in heads.items()}
        saved["paths"] = dict(zip(calls, clock.get(list(calls.values())), strict=True))
        relay_dir = os.path.join(ctx.spec.data_checkpoint_path, "relay", f"iter_{iteration:07d}")
        with writing("the relay checkpoint", relay_dir):  # a full disk: one RunError naming the path
            saved["relay_path"] = clock.get(ctx.stream.save_relay.remote(relay_dir), "the stream dataset")
        saved.update(ctx.rollout.save(ctx, episode, iteration, clock))
    saved["seconds"] = clock.seconds()
    return saved


@task(name="eval", cache_policy=NO_CACHE)
@in_stage("eval")
def evaluate(ctx: RunContext, episode: int, synced: dict | None = None, trained: dict | None = None
             ) -> dict[str, Any]:
    """The evaluator flow on the eval set: its first call answers (greedy by default; the rollout strategy's
    way, e.g. whole conversations), the returned calls score the answers; then `runtime.eval_post_process_fn(
    results, {"episode_iteration", "train_iteration"})` turns the per-sample results into metrics (ChatLearn's
    post_process_func); the default is the mean score."""
    clock = StageClock("eval", episode, ctx.spec.runtime.stage_timeout_s)
    flow = ctx.spec.plan.evaluator
    done, extra = ctx.rollout.evaluate(ctx, episode, clock)
    outputs = [clock.get(done[i].refs, flow.nodes[i].name) for i in flow.outputs()]
    results = eval_results([merge_batches(*parts) for parts in zip(*outputs, strict=True)])
    context = {"episode_iteration": episode, "train_iteration": (trained or {}).get("iteration")}
    metrics = eval_metrics(results, context, ctx.spec.runtime.eval_post_process_fn)
    metrics.update(extra)  # the rollout's own, e.g. how the eval conversations went
    examples = [{"prompt": r.get("prompt"), "response": r.get("response"), "score": r.get("scores")}
                for r in results[:8]]
    api_link.post(create_table_artifact, key=artifact_key(ctx.spec.runtime.exp_name, "eval-examples"),
                  table=examples, description=f"eval responses after episode {episode + 1}" if episode >= 0
                  else "eval responses before training")
    return {"metrics": metrics, "examples": examples, "seconds": clock.seconds()}
