"""One episode as a Prefect subflow: generate → score → train → sync → checkpoint → eval, on Ray.

The six stage tasks only dispatch to the model actors, which hold the real resources and do the work on Ray;
so the tasks themselves run in threads of the train flow's process (the Ray driver), their task runs recorded
from state events rather than run by Prefect's task engine (`chatlearn.runtime.prefect.task_runs`). As
Prefect tasks on `RayTaskRunner` each one cost 0.10-0.18 s before its body ran (a Ray worker building
Prefect's API client and settings per task; an earlier `bench/overhead.py`), about 1 s an episode, against
about 5 ms in a thread under Prefect's task engine and under 1 ms recorded from events. Stateless work of an
episode (rule rewards) is fanned out as Prefect tasks on Ray with its own CPUs, on a runner that keeps Prefect's
settings and client per Ray worker (`chatlearn/runtime/prefect/ray_tasks.py`, about 12 ms a task).

The train flow runs it through `chatlearn.runtime.prefect.subflows.Subflows`: a subflow run whose records
(flow run, states) are sent in the background, so the episode never waits on the Prefect API.
"""

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from chatlearn.runtime.calls.handles import RefBox
from chatlearn.runtime.calls.recovery import kill_point
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.context import RunContext
from chatlearn.runtime.episodes import EpisodeGate
from chatlearn.runtime.plan import EpisodePlan
from chatlearn.runtime.prefect.subflows import started_hook
from chatlearn.runtime.prefect.task_runs import RecordedTaskRunner
from chatlearn.runtime.schedule import every
from chatlearn.utils.faults import crash_point
from flows.model_calls import unwalked
from flows.stage_tasks import checkpoint, evaluate, experience_parts, generate, score, sync, train


def episode_name(episode: int) -> str:
    """`episode-N` counted from 1, as the terminal and the errors count (`episode` is the 0-based index)."""
    return f"episode-{episode + 1}"


def _run_name() -> str:
    return episode_name(flow_run.parameters["episode"])


STAGES = 6


# the stage tasks wait at once (each blocks on its upstream future, then on its calls); `episode_runner` adds a
# thread for each call of the engine's flows
@flow(name="episode", flow_run_name=_run_name, task_runner=RecordedTaskRunner(max_workers=STAGES),
      validate_parameters=False)
def episode_flow(ctx: RunContext, episode: int, consumed_samples: int, gate: EpisodeGate) -> dict[str, Any]:
    """Run one episode; returns its metrics (small numbers only). The episode generates, then waits at its
    ``gate`` for the episode before it to be done, which gives it the trainer iteration to start from (open from
    the start in synchronous episodes; pipelined ones are started ahead: `chatlearn.runtime.episodes`)."""
    rollouts = generate.submit(*unwalked([ctx, episode, consumed_samples]))
    rollouts.add_done_callback(lambda _, started=started_hook(): started())  # the next subflow's records then
    rollouts.result()  # raises what generate raised
    gate.generated()
    start_iteration = gate.wait()
    experience = score.submit(*unwalked([ctx, rollouts]))
    if ctx.spec.sampling_rounds > 1:  # dynamic sampling: more rounds of prompts while too few groups teach anything
        rollouts, experience = more_rounds(ctx, episode, consumed_samples, rollouts.result(), experience.result())
    trained = train.submit(*unwalked([ctx, experience, episode, start_iteration]))
    synced = sync.submit(*unwalked([ctx, episode, trained]))
    # one stage at a time after train: a model replica of several processes runs collectives (FSDP gathers,
    # tensor-parallel forward), and two stages' calls reaching its ranks in different orders deadlock them
    saved = checkpoint.submit(*unwalked([ctx, episode, trained]), wait_for=[synced])
    eval_due = ctx.spec.plan.evaluator is not None and every(ctx.spec.runtime.eval_episode_interval, episode)
    evaluated = (evaluate.submit(*unwalked([ctx, episode, synced, trained]), wait_for=[saved]) if eval_due
                 else None)
    crash_point("after_generate", episode)  # for resume tests: dies while score/train are running
    kill_point("after_generate", episode, ctx.spec.runtime.run_dir)  # for recovery tests: a model process dies

    gen, exp = (rollouts, experience) if isinstance(rollouts, RefBox) else (rollouts.result(), experience.result())
    tr, sy, ck = trained.result(), synced.result(), saved.result()
    metrics: dict[str, Any] = {"episode": episode, "consumed_samples": consumed_samples + gen.meta["num_samples"]}
    metrics.update({k: v for k, v in tr.items() if k != "seconds"})
    metrics["checkpoint_paths"] = ck["paths"]
    if ck["policy_versions"]:  # what a resume reads, when this episode saved it
        metrics["policy_versions"] = ck["policy_versions"]
    if ck["relay_path"]:
        metrics["relay_checkpoint"] = ck["relay_path"]
    if ck["partial_rollouts"]:
        metrics["partial_rollouts"] = ck["partial_rollouts"]
    metrics.update(gen.meta["metrics"])  # the rollout's own: partial rollouts' counts, agent turns, ...
    if "sampling_rounds" in gen.meta:
        metrics["dynamic_sampling_rounds"] = gen.meta["sampling_rounds"]
    timing = {"generate": gen.meta["seconds"], "score": exp.meta["seconds"], "train": tr["seconds"],
              "sync": sy["seconds"], "checkpoint": ck["seconds"]}
    if evaluated is not None:
        ev = evaluated.result()
        metrics.update(ev["metrics"])
        metrics["eval_examples"] = ev["examples"]
        timing["eval"] = ev["seconds"]
    metrics["stage_seconds"] = timing
    return metrics


def more_rounds(ctx: RunContext, episode: int, consumed_samples: int, rollouts: RefBox,
                experience: RefBox) -> tuple[RefBox, RefBox]:
    """Dynamic sampling (`chatlearn.data.dynamic_sampling`): generate and score the stream's next prompts, each
    round a generate and a score task run of this episode, while fewer than ``sample_per_episode`` samples are
    in groups the reward tells apart, up to ``spec.sampling_rounds`` rounds. Returns every round's rollouts and
    experience as one of each (the stream dataset keeps the informative groups)."""
    gens, exps = [rollouts], [experience]
    spec = ctx.spec
    clock = StageClock("score", episode, spec.runtime.stage_timeout_s)

    def informative() -> int:
        parts = [p for e in exps for p in experience_parts(e)]
        return int(clock.get(ctx.stream.informative_samples.remote(parts), "the stream dataset"))

    while len(gens) < spec.sampling_rounds and informative() < spec.runtime.sample_per_episode:
        consumed = consumed_samples + sum(g.meta["num_samples"] for g in gens)
        more = generate.submit(*unwalked([ctx, episode, consumed, len(gens)]))
        exps.append(score.submit(*unwalked([ctx, more])).result())
        gens.append(more.result())
    first = gens[0].meta
    gen = RefBox([r for g in gens for r in g.refs], **{**first, "num_samples": sum(g.meta["num_samples"] for g in gens),
                                                      "seconds": sum(g.meta["seconds"] for g in gens),
                                                      "num_batches": sum(len(g.refs) for g in gens),
                                                      "sampling_rounds": len(gens)})
    exp = RefBox([r for e in exps for r in e.refs], **{**exps[0].meta, "seconds": sum(e.meta["seconds"] for e in exps)})
    return gen, exp


def episode_runner(plan: EpisodePlan) -> Any:
    """`episode_flow` with a thread for every stage task and every call of the engine's flows: a call's task run
    (``flows/model_calls.py``) runs on the episode's task runner while its stage task waits for it, so a pool
    any smaller could leave a stage waiting on calls with no thread to run them."""
    calls = sum(len(f.nodes) for f in (plan.environment, plan.trainer, plan.evaluator) if f is not None)
    return episode_flow.with_options(task_runner=RecordedTaskRunner(max_workers=STAGES + calls))
