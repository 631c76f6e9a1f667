"""One episode as a Prefect subflow: generate → score → train → sync → checkpoint → eval, on Ray.

The tasks run on `RayTaskRunner`, which reuses the Ray the train flow started or joined. They ask Ray for no
CPU of their own (`num_cpus=0`): they only dispatch to the model actors, which hold the real resources.
"""

from typing import Any

from prefect import flow
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from chatlearn.runtime.handles import RunHandle
from chatlearn.runtime.schedule import every
from chatlearn.utils.faults import crash_point
from flows.stage_tasks import checkpoint, evaluate, generate, score, sync, train


@flow(name="episode", flow_run_name="episode-{episode}", task_runner=RayTaskRunner(), validate_parameters=False)
def episode_flow(run: RunHandle, episode: int, consumed_samples: int, start_iteration: int) -> dict[str, Any]:
    """Run one episode; returns its metrics (small numbers only)."""
    with remote_options(num_cpus=0, max_retries=0):
        rollouts = generate.submit(run, episode, consumed_samples)
        experience = score.submit(run, rollouts)
        trained = train.submit(run, experience, episode, start_iteration)
        synced = sync.submit(run, episode, trained)
        saved = checkpoint.submit(run, episode, trained)
        eval_due = every(run.eval_episode_interval, episode)
        evaluated = evaluate.submit(run, episode, synced, trained) if eval_due else None
        rollouts.wait()
        crash_point("after_generate", episode)  # for resume tests: dies while score/train are running

    gen, exp, tr, sy, ck = rollouts.result(), experience.result(), trained.result(), synced.result(), saved.result()
    metrics: dict[str, Any] = {"episode": episode, "consumed_samples": consumed_samples + gen.meta["num_samples"]}
    metrics.update({k: v for k, v in tr.items() if k != "seconds"})
    metrics["checkpoint_paths"] = ck["paths"]
    if ck["relay_path"]:
        metrics["relay_checkpoint"] = ck["relay_path"]
    timing = {"generate": gen.meta["seconds"], "score": exp.meta["seconds"], "train": tr["seconds"],
              "sync": sy["seconds"], "checkpoint": ck["seconds"]}
    if evaluated is not None:
        ev = evaluated.result()
        metrics.update(ev["metrics"])
        metrics["eval_examples"] = ev["examples"]
        timing["eval"] = ev["seconds"]
    metrics["stage_seconds"] = timing
    return metrics
