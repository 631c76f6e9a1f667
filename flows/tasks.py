"""The six stage tasks of an episode. Each is a thin dispatcher to the model actors.

Tasks return small things (metrics, RefBoxes of ObjectRefs); rollouts and weights move actor to actor
through Ray's object store. Prefect's cache is off for all of them: they act on stateful actors, and a cached
`train` would silently skip an update.
"""

import os
import time
from typing import Any

import ray
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from chatlearn.data.sampler import episode_prompt_batches, eval_prompt_batches
from chatlearn.runtime.handles import RefBox, RunHandle
from chatlearn.runtime.sync import copy_weights
from chatlearn.utils.arguments import ChatLearnConfig


def _batch_size(cfg: ChatLearnConfig, model: str) -> int:
    gbs = cfg.models[model].generation_batch_size
    return gbs if gbs and gbs > 0 else cfg.runtime.generation_batch_size


@task(name="generate", cache_policy=NO_CACHE)
def generate(run: RunHandle, cfg: ChatLearnConfig, episode: int, consumed_samples: int) -> RefBox:
    """The producer samples responses for this episode's prompts, batches dealt over its replicas."""
    t0 = time.perf_counter()
    producer = run.plan.producer
    heads = run.heads(producer)
    shuffle_seed = int(cfg.runtime.get("seed") or 42) if cfg.runtime.get("data_shuffle") else None
    batches = episode_prompt_batches(run.dataset_size, consumed_samples, cfg.runtime.sample_per_episode,
                                     _batch_size(cfg, producer), len(heads), shuffle_seed)
    first_iteration = episode * len(batches)
    outer, position = [], consumed_samples
    for i, (r, idx) in enumerate(batches):
        # stream positions identify samples: per-sample seeds make responses independent of the batching
        outer.append(heads[r].generate.remote(idx, first_iteration + i,
                                              sample_ids=list(range(position, position + len(idx)))))
        position += len(idx)
    refs = ray.get(outer)  # waits for generation; only the small refs owned by the actors come back
    return RefBox(refs, seconds=time.perf_counter() - t0, num_batches=len(batches),
                  num_samples=sum(len(idx) for _, idx in batches), first_iteration=first_iteration)


@task(name="score", cache_policy=NO_CACHE)
def score(run: RunHandle, rollouts: RefBox) -> RefBox:
    """Scorers (reference, value) run on each rollout batch in parallel; the final model (reward) merges."""
    t0 = time.perf_counter()
    plan = run.plan
    if not plan.final:
        raise ValueError("the episode plan has no final model to merge the rollouts and the scores into")
    scorer_heads = {name: run.heads(name) for name in plan.scorers}
    final_heads = run.heads(plan.final)
    outs = []
    for i, g in enumerate(rollouts.refs):
        it = rollouts.meta["first_iteration"] + i
        parts = [heads[i % len(heads)].forward.remote(g, iteration=it) for heads in scorer_heads.values()]
        outs.append(final_heads[i % len(final_heads)].forward.remote(g, *parts, iteration=it, keep_inputs=True))
    refs = ray.get(outs)
    return RefBox(refs, seconds=time.perf_counter() - t0)


@task(name="train", cache_policy=NO_CACHE)
def train(run: RunHandle, experience: RefBox, episode: int, start_iteration: int) -> dict[str, Any]:
    """The StreamDataset shapes the episode's samples (loader type, relay); every trainer trains on them."""
    t0 = time.perf_counter()
    samples_ref, metrics = ray.get(run.stream().episode_samples.remote(*experience.refs, episode=episode))
    calls = {name: run.heads(name)[0].train.remote(samples_ref, episode=episode, start_iteration=start_iteration)
             for name in run.plan.trainers}
    results = dict(zip(calls, ray.get(list(calls.values())), strict=True))
    for res in results.values():
        metrics.update({k: v for k, v in res.items() if k not in ("iteration", "num_steps", "num_samples")})
    first = results[run.plan.trainers[0]] if results else {}
    metrics["iteration"] = first.get("iteration", start_iteration)
    metrics["train_steps"] = first.get("num_steps", 0)
    metrics["seconds"] = time.perf_counter() - t0
    return metrics


@task(name="sync", cache_policy=NO_CACHE)
def sync(run: RunHandle, cfg: ChatLearnConfig, episode: int, trained: dict | None = None) -> dict[str, Any]:
    """Copy each trainer's weights into its inference model (every `sync_frequency` episodes).

    Weights go trainer → object store → every actor of the inference model; nothing passes through Prefect.
    `trained` is only there to order sync after train in the task graph.
    """
    t0 = time.perf_counter()
    synced = []
    for src, dst in run.plan.sync:
        freq = cfg.models[dst].sync_frequency
        if not freq or (episode + 1) % freq != 0:
            continue
        copy_weights(run.heads(src)[0], run.all_actors(dst))
        synced.append(f"{src}->{dst}")
    return {"synced": synced, "seconds": time.perf_counter() - t0}


def checkpoint_due(cfg: ChatLearnConfig, episode: int) -> bool:
    interval = cfg.runtime.save_episode_interval
    return bool(interval) and interval > 0 and (episode + 1) % interval == 0


def models_to_checkpoint(run: RunHandle, cfg: ChatLearnConfig) -> list[str]:
    """Trainers, plus inference copies that may lag their trainer (sync_frequency != 1)."""
    lagging = [dst for _, dst in run.plan.sync if cfg.models[dst].sync_frequency != 1]
    return list(run.plan.trainers) + lagging


@task(name="checkpoint", cache_policy=NO_CACHE)
def checkpoint(run: RunHandle, cfg: ChatLearnConfig, episode: int, trained: dict) -> dict[str, Any]:
    """Every `save_episode_interval` episodes, the model actors save their state and the relay its window.

    The data checkpoint record that makes these the run's restart point is written by the train flow after
    the episode (it is the commit), so a crash in between only wastes this episode's work.
    """
    t0 = time.perf_counter()
    paths: dict[str, str | None] = {}
    relay_path = None
    if checkpoint_due(cfg, episode):
        iteration = trained["iteration"]
        calls = {name: run.heads(name)[0].save_checkpoint.remote(iteration) for name in models_to_checkpoint(run, cfg)}
        paths = dict(zip(calls, ray.get(list(calls.values())), strict=True))
        relay_dir = os.path.join(run.data_checkpoint_path, "relay", f"iter_{iteration:07d}")
        relay_path = ray.get(run.stream().save_relay.remote(relay_dir))
    return {"paths": paths, "relay_path": relay_path, "seconds": time.perf_counter() - t0}


def default_eval_metrics(results: list[dict[str, Any]], context: dict[str, Any]) -> dict[str, Any]:
    """Mean score over the eval set (the post-processing used when no hook is configured)."""
    scores = [float(r["scores"]) for r in results if "scores" in r]
    return {"eval_reward_mean": sum(scores) / len(scores) if scores else None}


@task(name="eval", cache_policy=NO_CACHE)
def evaluate(run: RunHandle, cfg: ChatLearnConfig, episode: int, synced: dict | None = None,
             trained: dict | None = None) -> dict[str, Any]:
    """The producer's eval responses (greedy by default) on the eval set, scored by the evaluator model, then
    `runtime.eval_post_process_fn(results, {"episode_iteration", "train_iteration"})` turns the per-sample
    results into metrics (ChatLearn's post_process_func); the default is the mean score."""
    from prefect.artifacts import create_table_artifact

    from chatlearn.data.batch import split_batch
    from chatlearn.data.relay import load_hook
    from chatlearn.runtime.reporting import artifact_key

    t0 = time.perf_counter()
    plan = run.plan
    heads = run.heads(plan.producer)
    scorer = run.heads(plan.evaluator) if plan.evaluator else []
    batches = eval_prompt_batches(run.eval_dataset_size, _batch_size(cfg, plan.producer), len(heads))
    outs = []
    for i, (r, idx) in enumerate(batches):
        g = heads[r].generate.remote(idx, i, is_eval=True)
        if scorer:
            g = scorer[i % len(scorer)].forward.remote(g, is_eval=True, keep_inputs=True)
        outs.append(g)
    results = []
    for batch in ray.get(ray.get(outs)):
        for sample in split_batch(batch):
            results.append({k: (v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v)
                            for k, v in sample.items() if not isinstance(v, torch.Tensor) or v.dim() == 0})
    context = {"episode_iteration": episode, "train_iteration": (trained or {}).get("iteration")}
    metrics = default_eval_metrics(results, context)
    hook = cfg.runtime.get("eval_post_process_fn")
    if hook:
        metrics.update(load_hook(hook)(results, context))
    examples = [{"prompt": r.get("prompt"), "response": r.get("response"), "score": r.get("scores")}
                for r in results[:8]]
    create_table_artifact(key=artifact_key(cfg.runtime.exp_name, "eval-examples"), table=examples,
                          description=f"eval responses after episode {episode + 1}" if episode >= 0
                          else "eval responses before training")
    return {"metrics": metrics, "examples": examples, "seconds": time.perf_counter() - t0}
