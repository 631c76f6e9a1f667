"""The orchestration share of an episode: the same episodes through Prefect + Ray and with no Prefect.

One process, one launch of the run's actors (the embedded default unless overrides say otherwise), one
bench flow around it (as `chatlearn train`'s train flow), a fresh local Prefect server
(`local_prefect_api`). Then rounds: in each round every variant runs one episode over the same actors, the
order rotating from round to round. The model state advances whatever runs it, which does not matter for
timing. Round r plays episode r of the config's schedule for every variant (eval every
`eval_episode_interval`, checkpoints every `save_episode_interval`): each call gets the next episode number
with that round's eval/checkpoint due, so all variants do the same work in a round, and over a multiple of
the schedule's period each variant sees the default's mix of eval and plain episodes.

Variants (`--variant NAME`, repeatable; default: all):

    direct        no Prefect: the stage tasks' bodies (`task.fn`) called from the driver in the episode
                  flow's order with the same RunHandle (its rule-reward batches are still Prefect tasks on
                  Ray, as in every variant)
    ray-only      no Prefect: each stage body a plain Ray task (num_cpus=0), chained as RayTaskRunner
                  chains them: what Ray's task dispatch costs without Prefect's engine
    prefect       `episode_flow` as the real subflow, as `chatlearn train` runs it: its stage tasks on
                  ThreadPoolTaskRunner (since e9b5c77), with no heartbeat thread of its own
                  (PREFECT_FLOWS_HEARTBEAT_FREQUENCY unset around the call, as flows/train_flow.py does since
                  3813c21; the bench flow keeps its heartbeat)
    with-heartbeat  as prefect, with the subflow's own heartbeat thread (Prefect's default; before 3813c21)
    no-api-logs   as prefect, with PREFECT_LOGGING_TO_API_ENABLED=false
    raytaskrunner as prefect, the stage tasks on RayTaskRunner (num_cpus=0): each a Prefect task in a Ray
                  worker, as before e9b5c77
    no-subflow    the six tasks submitted from the bench flow on its RayTaskRunner: no episode subflow

Medians per variant: seconds per episode (plain episodes, eval episodes, and the schedule's mix), the
median of the per-round difference to `direct` (same round, same work), the orchestration share
(prefect - direct) / prefect. For the subflow variants the Prefect API's task-run timestamps split the
overhead: subflow entry, per stage the wait before the task runs (Ray dispatch + Prefect's task engine
before Running), Prefect's time inside the Running window beyond the body, the body's own difference to
`direct`, and the subflow's exit. Then micro-measurements of the pieces
(a no-op task through each path, an empty subflow with and without heartbeats, what a Prefect task does in
a Ray worker before its body: SSL context, API client, context hydration). `--profile N` then runs N more
`prefect` episodes under py-spy (one sampler per process: the driver and this run's idle Ray task workers,
idle time included; the samplers slow the episode, so read shares, not seconds) and lists the functions
the time is spent in. Prints tables and writes `bench/results/overhead.json`.

Rule-reward tasks (`--rule-tasks N`, default 30; `--rule-tasks-only` runs just this, no actors, and writes
`bench/results/rule_tasks.json`): the median per-task cost of the `rule-reward` Prefect task
(`flows/rule_tasks.py`) on one 64-sample batch, submitted from inside a task as the score stage does, on
prefect-ray's `RayTaskRunner` (before) and on `WarmRayTaskRunner` (after, `flows/ray_tasks.py`), the two
interleaved round by round in one run: one task at a time (submit -> result), the driver's share of it
(submit), and N at once. Then where the `RayTaskRunner` time goes: the driver's settings serialization and
the worker's settings hydration, API clients and TLS contexts, measured one by one.

    .venv/bin/python bench/overhead.py [--rounds 10] [--variant prefect --variant direct ...]
                                       [--profile 6] [--rule-tasks 30] [key=value overrides]
    .venv/bin/python bench/overhead.py --rule-tasks-only [--rule-tasks 30]
"""

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO  # noqa: E402  (bench/ is a folder of scripts, not a package)

VARIANTS = {
    "direct": "stage bodies (task.fn) from the driver, no Prefect",
    "ray-only": "each stage body a plain Ray task, no Prefect",
    "prefect": "episode_flow subflow as chatlearn train runs it (no own heartbeat)",
    "with-heartbeat": "as prefect, with the subflow's own heartbeat thread",
    "no-api-logs": "as prefect, PREFECT_LOGGING_TO_API_ENABLED=false",
    "raytaskrunner": "as prefect, the stage tasks on RayTaskRunner (before e9b5c77)",
    "no-subflow": "the tasks on RayTaskRunner from the bench flow, no subflow",
}
SUBFLOW_VARIANTS = ("prefect", "with-heartbeat", "no-api-logs", "raytaskrunner")
STAGES = ("generate", "score", "train", "sync", "checkpoint", "eval")
# what each stage task waits for in episode_flow (generate: the subflow's start)
UPSTREAM = {"score": "generate", "train": "score", "sync": "train", "checkpoint": "train", "eval": "sync"}


# ---- the no-Prefect paths (module level: the ray-only variant ships them to Ray workers by value) ----

@contextlib.contextmanager
def _no_prefect() -> Any:
    """Within: the stage bodies create no Prefect artifact (their rule-reward tasks stay Prefect tasks)."""
    import flows.stage_tasks as st

    saved = st.create_table_artifact
    st.create_table_artifact = lambda **_: None
    try:
        yield st
    finally:
        st.create_table_artifact = saved


def _stage_in_worker(stage: str, *args: Any) -> Any:
    """One stage body in a Ray worker (ray-only variant)."""
    with _no_prefect() as st:
        fn = st.evaluate.fn if stage == "eval" else getattr(st, stage).fn
        return fn(*args)


def _episode_metrics(consumed: int, gen: Any, tr: dict, sy: dict, ck: dict, ev: dict | None) -> dict[str, Any]:
    """What episode_flow returns that the bench reads: samples consumed, trainer iteration, stage seconds."""
    timing = {"generate": gen.meta["seconds"], "score": None, "train": tr["seconds"], "sync": sy["seconds"],
              "checkpoint": ck["seconds"]}
    if ev is not None:
        timing["eval"] = ev["seconds"]
    return {"consumed_samples": consumed + gen.meta["num_samples"], "iteration": tr["iteration"],
            "stage_seconds": timing}


def direct_episode(run: Any, episode: int, consumed: int, iteration: int) -> dict[str, Any]:
    """episode_flow's body with the tasks' own functions, in its order, in this process."""
    from chatlearn.runtime.schedule import every

    with _no_prefect() as st:
        gen = st.generate.fn(run, episode, consumed)
        exp = st.score.fn(run, gen)
        tr = st.train.fn(run, exp, episode, iteration)
        sy = st.sync.fn(run, episode, tr)
        ck = st.checkpoint.fn(run, episode, tr)
        ev = st.evaluate.fn(run, episode, sy, tr) if every(run.eval_episode_interval, episode) else None
    metrics = _episode_metrics(consumed, gen, tr, sy, ck, ev)
    metrics["stage_seconds"]["score"] = exp.meta["seconds"]
    return metrics


def ray_only_episode(remote: Any, run: Any, episode: int, consumed: int, iteration: int) -> dict[str, Any]:
    """The stage bodies as plain Ray tasks, all submitted at once and chained by ObjectRefs (as RayTaskRunner
    chains its tasks: sync and checkpoint after train, eval after sync)."""
    import ray

    from chatlearn.runtime.schedule import every

    def submit(stage: str, *args: Any) -> Any:
        return remote.options(name=stage).remote(stage, *args)

    gen = submit("generate", run, episode, consumed)
    exp = submit("score", run, gen)
    tr = submit("train", run, exp, episode, iteration)
    sy = submit("sync", run, episode, tr)
    ck = submit("checkpoint", run, episode, tr)
    ev = submit("eval", run, episode, sy, tr) if every(run.eval_episode_interval, episode) else None
    gen, exp, tr, sy, ck = ray.get([gen, exp, tr, sy, ck])
    metrics = _episode_metrics(consumed, gen, tr, sy, ck, ray.get(ev) if ev is not None else None)
    metrics["stage_seconds"]["score"] = exp.meta["seconds"]
    return metrics


# ---- the measurement ----

def due_episode(after: int, want: tuple[bool, bool], eval_n: int | None, save_n: int | None) -> int:
    """The first episode number after `after` whose (eval due, checkpoint due) is `want`."""
    from chatlearn.runtime.schedule import every

    ep = after + 1
    while (every(eval_n, ep), every(save_n, ep)) != want:
        ep += 1
        if ep > after + 10_000:
            raise RuntimeError(f"no episode after {after} has eval/checkpoint due = {want}")
    return ep


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def task_split(client: Any, flow_run_id: Any, call: tuple[float, float], stages: dict[str, float]) -> dict:
    """One subflow's overhead split from the API's timestamps (client-side clocks of this machine)."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    fr = client.read_flow_run(flow_run_id)
    trs = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])))
    by_stage: dict[str, Any] = {}
    rule = []
    for t in trs:
        name = t.name.rsplit("-", 1)[0]
        if name == "rule-reward":
            rule.append(t)
        else:
            by_stage[name] = t
    if fr.start_time is None or any(t.start_time is None or t.end_time is None for t in by_stage.values()):
        return {}
    start, end = fr.start_time.timestamp(), (fr.end_time.timestamp() if fr.end_time else None)
    out: dict[str, Any] = {"enter": start - call[0], "tasks": {}}
    for stage, t in by_stage.items():
        up = by_stage.get(UPSTREAM.get(stage, ""))
        ready = up.end_time.timestamp() if up is not None else start
        run_s = t.end_time.timestamp() - t.start_time.timestamp()
        out["tasks"][stage] = {"wait": t.start_time.timestamp() - ready, "running": run_s,
                               "engine_inside": run_s - stages.get(stage, 0.0)}
    last = max(t.end_time.timestamp() for t in by_stage.values())
    out["exit"] = call[1] - last
    out["flow_end_to_return"] = call[1] - end if end else None
    out["rule_reward_tasks"] = len(rule)
    out["rule_reward_running"] = median([t.end_time.timestamp() - t.start_time.timestamp()
                                         for t in rule if t.start_time and t.end_time])
    return out


def summarize(samples: dict[str, list[dict]], eval_n: int | None) -> dict[str, Any]:
    share_eval = 1.0 / eval_n if eval_n else 0.0
    result: dict[str, Any] = {}
    by_round = {name: {s["round"]: s for s in rows} for name, rows in samples.items()}
    for name, rows in samples.items():
        plain = median([s["wall"] for s in rows if not s["eval"]])
        with_eval = median([s["wall"] for s in rows if s["eval"]])
        mix = plain if with_eval is None else (with_eval if plain is None else
                                               (1 - share_eval) * plain + share_eval * with_eval)
        r: dict[str, Any] = {"episodes": len(rows), "seconds_plain": plain, "seconds_eval": with_eval,
                             "seconds_schedule_mix": mix,
                             "stage_body_seconds": {st: median([s["stages"].get(st) for s in rows])
                                                    for st in STAGES},
                             "overhead_vs_bodies": median([s["wall"] - sum(v for v in s["stages"].values() if v)
                                                           for s in rows])}
        if "direct" in by_round and name != "direct":
            diffs = [s["wall"] - by_round["direct"][s["round"]]["wall"] for s in rows
                     if s["round"] in by_round["direct"]]
            r["minus_direct_per_round"] = median(diffs)
        result[name] = r
    if "direct" in result:
        d = result["direct"]["seconds_schedule_mix"]
        for r in result.values():
            r["share_vs_direct"] = (r["seconds_schedule_mix"] - d) / r["seconds_schedule_mix"]
    return result


def split_summary(splits: list[dict], samples: list[dict], direct: list[dict] | None) -> dict[str, Any]:
    """Medians of the per-episode splits of one subflow variant."""
    splits = [s for s in splits if s]
    if not splits:
        return {}
    out: dict[str, Any] = {"enter": median([s["enter"] for s in splits]),
                           "exit": median([s["exit"] for s in splits]),
                           "flow_end_to_return": median([s.get("flow_end_to_return") for s in splits]),
                           "rule_reward_tasks": median([s["rule_reward_tasks"] for s in splits]),
                           "rule_reward_running": median([s["rule_reward_running"] for s in splits]),
                           "tasks": {}}
    for stage in STAGES:
        rows = [s["tasks"][stage] for s in splits if stage in s["tasks"]]
        if not rows:
            continue
        body = median([s["stages"].get(stage) for s in samples])
        body_direct = median([s["stages"].get(stage) for s in direct]) if direct else None
        out["tasks"][stage] = {"wait": median([r["wait"] for r in rows]),
                               "engine_inside": median([r["engine_inside"] for r in rows]),
                               "body": body, "body_direct": body_direct,
                               "body_minus_direct": None if body_direct is None or body is None
                               else body - body_direct}
    return out


# ---- micro-measurements of the pieces ----

def _timed(fn: Any, reps: int) -> float:
    """Median seconds of `fn()` over `reps` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _micro_in_worker(ctx: dict, reps: int) -> dict[str, float]:
    """What a Prefect task on RayTaskRunner does in its Ray worker before the body, piece by piece."""
    import ssl

    import certifi
    from prefect.client.orchestration import get_client
    from prefect.context import SettingsContext, hydrated_context

    def hydrate() -> None:
        with hydrated_context(ctx):
            pass

    def settings() -> None:
        with SettingsContext(**ctx["settings_context"]):
            pass

    def client() -> None:
        with SettingsContext(**ctx["settings_context"]):
            get_client(sync_client=True)

    return {"ssl_context_certifi": _timed(lambda: ssl.create_default_context(cafile=certifi.where()), reps),
            "settings_context": _timed(settings, reps),
            "settings_context_and_get_client": _timed(client, reps),
            "hydrated_context": _timed(hydrate, reps)}


def micro(run: Any, reps: int) -> dict[str, float]:
    """Per-call costs, medians (seconds), measured inside the bench flow (a flow run context is current)."""
    import cloudpickle
    import ray
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.context import SettingsContext, serialize_context
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

    import flows.stage_tasks as st

    @task(name="noop", cache_policy=NO_CACHE)
    def noop(run: Any) -> int:
        return 0

    @flow(name="empty", task_runner=RayTaskRunner(), validate_parameters=False)
    def empty(run: Any) -> int:
        return 0

    def plain(run: Any) -> int:
        return 0

    plain_remote = ray.remote(num_cpus=0, max_retries=0)(plain)
    ctx = serialize_context()
    out = {"noop_plain_ray_task": _timed(lambda: ray.get(plain_remote.remote(run)), reps)}
    with remote_options(num_cpus=0, max_retries=0):
        out["noop_prefect_task_on_ray"] = _timed(lambda: noop.submit(run).result(), reps)
    out["noop_prefect_task_in_thread"] = _timed(lambda: noop(run), reps)
    out["empty_subflow"] = _timed(lambda: empty(run), max(3, reps // 2))
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        out["empty_subflow_no_heartbeat"] = _timed(lambda: empty(run), max(3, reps // 2))
    out["driver_serialize_context"] = _timed(serialize_context, reps)
    out["driver_serialize_settings_context"] = _timed(lambda: SettingsContext.get().serialize(), reps)
    out.update({f"serialized_{k}_pickle_bytes": len(cloudpickle.dumps(v)) for k, v in ctx.items() if v})
    out["driver_pickle_task_object"] = _timed(lambda: cloudpickle.dumps(st.generate), reps)
    out["task_object_pickle_bytes"] = len(cloudpickle.dumps(st.generate))
    out["serialized_context_pickle_bytes"] = len(cloudpickle.dumps(ctx))
    worker = ray.get(ray.remote(num_cpus=0, max_retries=0)(_micro_in_worker).remote(ctx, reps))
    out.update({f"worker_{k}": v for k, v in worker.items()})
    return out


# ---- rule-reward Prefect tasks on Ray: prefect-ray's runner against the warm one ----

RULE_BATCH = 64  # samples per batch: the default config's generation batch


def rule_task_costs(rule: Any, n: int, rounds: int = 3) -> dict[str, Any]:
    """Median ms per `rule-reward` task on each runner (interleaved over ``rounds``), and the pieces of
    prefect-ray's per-task cost. Call inside a flow run (the bench flow)."""
    import ray
    from prefect import task
    from prefect.cache_policies import NO_CACHE
    from prefect.context import SettingsContext, serialize_context
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

    from chatlearn.runtime.calls.handles import RefBox
    from flows.ray_tasks import WarmRayTaskRunner
    from flows.rule_tasks import rule_reward

    batch = RefBox([ray.put({"sample_id": list(range(RULE_BATCH)), "prompt": ["max 3 9 4 ?"] * RULE_BATCH,
                             "response": ["9"] * RULE_BATCH, "answer": ["9"] * RULE_BATCH})])
    params = {"batch": batch, "rule": rule, "episode_start": 0}
    runners = {"RayTaskRunner (prefect-ray)": RayTaskRunner, "WarmRayTaskRunner": WarmRayTaskRunner}

    @task(name="score", cache_policy=NO_CACHE)
    def measure() -> dict[str, Any]:  # inside a task run, as the score stage submits
        ms: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in runners}
        for _ in range(rounds):
            for label, cls in runners.items():
                with cls() as runner, remote_options(num_cpus=rule.num_cpus, max_retries=0):
                    for _ in range(3):  # warm: a Ray worker per CPU, imports
                        runner.submit(rule_reward, params).result()
                    for _ in range(n):
                        t0 = time.perf_counter()
                        future = runner.submit(rule_reward, params)
                        t1 = time.perf_counter()
                        future.result()
                        ms[label]["sequential"].append(1000 * (time.perf_counter() - t0))
                        ms[label]["submit"].append(1000 * (t1 - t0))
                    t0 = time.perf_counter()
                    futures = [runner.submit(rule_reward, params) for _ in range(n)]
                    scores = [f.result() for f in futures]
                    ms[label]["fan_out"].append(1000 * (time.perf_counter() - t0) / n)
                    assert scores[0] == [1.0] * RULE_BATCH
        ctx = serialize_context()
        kept = ray.remote(num_cpus=0)(_noop)
        pieces = {"driver_serialize_context": _timed(serialize_context, 10),
                  "driver_settings_serialize": _timed(lambda: SettingsContext.get().serialize(), 10),
                  "driver_ray_remote_wrap_and_export": _timed(
                      lambda: ray.get(ray.remote(num_cpus=0)(_noop).remote(), timeout=60), 10)
                  - _timed(lambda: ray.get(kept.remote(), timeout=60), 10)}
        worker = ray.get(ray.remote(num_cpus=0, max_retries=0)(_micro_in_worker).remote(ctx, 10), timeout=300)
        pieces.update({f"worker_{k}": v for k, v in worker.items()})
        return {"tasks_per_round": n, "rounds": rounds, "batch_samples": RULE_BATCH,
                "median_ms": {label: {k: median(v) for k, v in kinds.items()} for label, kinds in ms.items()},
                "pieces_ms": {k: 1000 * v for k, v in pieces.items()}}

    return measure()


def _noop() -> int:
    return 0


def rule_task_report(r: dict[str, Any]) -> None:
    print(f"\nrule-reward Prefect task on Ray ({r['batch_samples']}-sample batch), ms per task, medians over "
          f"{r['rounds']} x {r['tasks_per_round']} tasks, the runners interleaved")
    print(f"  {'runner':28s} {'one at a time':>13s} {'driver submit':>13s} {'fan-out':>8s}")
    for label, m in r["median_ms"].items():
        print(f"  {label:28s} {m['sequential']:13.1f} {m['submit']:13.1f} {m['fan_out']:8.1f}")
    p = r["pieces_ms"]
    print("  where prefect-ray's RayTaskRunner spends it (ms each; the warm runner does these once, not per task):")
    rows = [("driver: serialize_context per submit", p["driver_serialize_context"]),
            ("  of it, the settings' serialization", p["driver_settings_serialize"]),
            ("driver: ray.remote() anew, function exported", p["driver_ray_remote_wrap_and_export"]),
            ("worker: settings hydrated from the dump", p["worker_settings_context"]),
            ("worker: + one API client (done twice a task)", p["worker_settings_context_and_get_client"]
             - p["worker_settings_context"]),
            ("  of it, the TLS context (certifi CA bundle)", p["worker_ssl_context_certifi"]),
            ("worker: hydrated_context (settings + client + rest)", p["worker_hydrated_context"])]
    for what, v in rows:
        print(f"    {what:52s} {v:7.1f}")


def rule_tasks_only(n: int) -> dict[str, Any]:
    """The rule-task measurement alone: a local Ray and Prefect server, no actors."""
    import ray
    from prefect import flow

    from chatlearn.config import load_config
    from chatlearn.models.hf.reward import RuleRewardArgs
    from chatlearn.models.rule import RuleSpec
    from chatlearn.runtime.records.prefect_server import local_prefect_api

    rule = RuleSpec.of(RuleRewardArgs.model_validate(load_config(None, []).models["reward"].args_dict))  # default's

    @flow(name="bench-rule-tasks", validate_parameters=False)
    def bench() -> dict[str, Any]:
        return rule_task_costs(rule, n)

    with local_prefect_api(announce=lambda m: print(m, file=sys.stderr)):
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)  # a Ray of its own, never a `ray start` cluster left running
        try:
            return bench()
        finally:
            ray.shutdown()


# ---- py-spy: where the time goes ----

PROFILE_RATE = 50


def _ray_task_workers(root: int) -> list[int]:
    """This process's idle Ray task workers (`ray::IDLE` descendants), where the Prefect tasks will run."""
    parent, names = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            names[int(d.name)] = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue

    def under(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == root:
                return True
        return False

    return [pid for pid, name in names.items() if name.startswith("ray::IDLE") and under(pid)]


def start_samplers(out: Path) -> list[tuple[Any, Path, str]]:
    """One `py-spy record` per process (driver, idle task workers): non-blocking, idle time included."""
    spies = []
    for pid, kind in [(os.getpid(), "driver"), *((p, "worker") for p in _ray_task_workers(os.getpid()))]:
        path = out / f"pyspy-{kind}-{pid}.txt"
        proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "py-spy"), "record", "--pid", str(pid), "--idle",
                                 "--nonblocking", "-r", str(PROFILE_RATE), "-f", "raw", "-o", str(path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        spies.append((proc, path, kind))
    return spies


def stop_samplers(spies: list[tuple[Any, Path, str]]) -> list[tuple[Path, str]]:
    for proc, _, _ in spies:
        proc.send_signal(signal.SIGINT)
    for proc, _, _ in spies:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return [(path, kind) for _, path, kind in spies if path.exists()]


# Each sample goes to the first group whose pattern occurs in its stack (most specific first).
WORKER_GROUPS = [
    ("TLS context for a new API client (ssl.create_default_context)", ("create_default_context",)),
    ("API client objects (get_client, SyncClientContext)", ("get_client (", "SyncPrefectClient.__init__",
                                                            "SyncClientContext")),
    ("settings rebuilt from the serialized context (pydantic-settings)", ("BaseSettings", "SettingsContext")),
    ("rest of context hydration (hydrated_context)", ("hydrated_context",)),
    ("walking the parameters (visit_collection)", ("visit_collection",)),
    ("states and events (set_state, emit)", ("set_state", "emit_task_run_state_change_event", "EventsWorker")),
    ("Ray argument deserialization", ("deserializ",)),
]
DRIVER_GROUPS = [
    ("heartbeat thread join at subflow exit", ("_send_heartbeats",)),
    ("waiting on task results (ray.get: bodies and workers)", ("Worker.get_objects", "PrefectRayFuture.wait",
                                                               "PrefectRayFuture.result")),
    ("serialize_context per task submit", ("serialize_context",)),
    ("cloudpickle / Ray submit of each task", ("RemoteFunction._remote", "Pickler")),
    ("HTTP round trips to the API (flow run create, states)", ("httpcore", "httpx", "HTTP11Connection")),
    ("walking the parameters (visit_collection)", ("visit_collection",)),
]


def _group(frames: list[str], groups: list[tuple[str, tuple[str, ...]]]) -> str:
    for label, patterns in groups:
        if any(p in f for f in frames for p in patterns):
            return label
    return "other"


def profile_table(files: list[tuple[Path, str]], episodes: int, top: int = 30) -> dict[str, Any]:
    """Inclusive seconds per episode of Prefect/Ray-side functions, from py-spy's raw (collapsed) stacks:
    the driver's thread that called the subflow, and the Ray workers that ran the Prefect tasks (the stage
    bodies' own frames and what they call are left out)."""
    driver: dict[str, float] = defaultdict(float)
    worker: dict[str, float] = defaultdict(float)
    groups: dict[str, dict[str, float]] = {"driver": defaultdict(float), "worker": defaultdict(float)}
    totals = {"driver_in_subflow": 0.0, "worker_in_task": 0.0, "worker_in_body": 0.0}
    body_names = {"generate", "score", "train", "sync", "checkpoint", "evaluate", "rule_reward"}

    def is_body(frame: str) -> bool:
        name, _, where = frame.partition(" (")
        return name in body_names and ("flows/stage_tasks.py" in where or "flows/rule_tasks.py" in where)

    lines = [(line, kind) for path, kind in files for line in path.read_text().splitlines()]
    for line, kind in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        seconds = int(count) / PROFILE_RATE / episodes
        frames = stack.split(";")
        if kind == "worker" and any("_run_prefect_task" in f for f in frames):
            totals["worker_in_task"] += seconds
            cut = next((i for i, f in enumerate(frames) if is_body(f)), None)
            if cut is not None:
                totals["worker_in_body"] += seconds
                continue  # the body and what it calls: not orchestration
            groups["worker"][_group(frames, WORKER_GROUPS)] += seconds
            bucket = worker
        elif kind == "driver" and any("prefect_call (" in f for f in frames):
            totals["driver_in_subflow"] += seconds
            groups["driver"][_group(frames, DRIVER_GROUPS)] += seconds
            bucket = driver
        else:
            continue
        for f in set(frames):
            name = f.split(" (")[0]
            where = f.split(" (")[-1].rstrip(")")
            if "site-packages/" in where:
                where = where.split("site-packages/")[1]
            bucket[f"{name} ({where.split(':')[0]})"] += seconds
    return {"samplers": {kind: sum(1 for _, k in files if k == kind) for kind in ("driver", "worker")},
            "totals_seconds_per_episode": totals,
            "groups": {k: sorted(v.items(), key=lambda kv: -kv[1]) for k, v in groups.items()},
            "driver_top": sorted(driver.items(), key=lambda kv: -kv[1])[:top],
            "worker_top": sorted(worker.items(), key=lambda kv: -kv[1])[:top]}


# ---- main ----

def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds (default 10: the default "
                        "config's schedule period, eval every 2 and checkpoint every 10 episodes)")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS),
                        help="a variant to run (repeatable; default: all)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then N more `prefect` episodes under py-spy (0: none)")
    parser.add_argument("--micro-reps", type=int, default=10, help="repetitions of each micro-measurement "
                        "(0: skip them)")
    parser.add_argument("--rule-tasks", type=int, default=30, metavar="N", help="rule-reward tasks per runner and "
                        "round in the rule-task measurement (0: skip it)")
    parser.add_argument("--rule-tasks-only", action="store_true", help="only the rule-task measurement (no actors, "
                        "no episodes); writes bench/results/rule_tasks.json")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    names = args.variant or list(VARIANTS)
    if "direct" not in names:
        names.insert(0, "direct")

    os.chdir(REPO)
    out = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    os.environ["CHATLEARN_PREFECT_HOME"] = str(out / "prefect")  # a fresh server database
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(out / "result-storage")  # to see whether results persist
    os.environ.pop("PREFECT_API_URL", None)
    for k, v in (("PREFECT_SERVER_ANALYTICS_ENABLED", "false"), ("RAY_AUTH_MODE", "disabled"),
                 ("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")):  # as `chatlearn train` sets them
        os.environ.setdefault(k, v)

    if args.rule_tasks_only:
        rule = rule_tasks_only(args.rule_tasks or 30)
        rule_task_report(rule)
        path = REPO / "bench" / "results" / "rule_tasks.json"
        load = os.getloadavg()  # other work on the machine inflates every number here
        print(f"load average over 1/5/15 min: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
        path.write_text(json.dumps({"machine": f"{os.cpu_count()} CPUs", "load_average": load, **rule}, indent=1))
        print(f"wrote {path.relative_to(REPO)}")
        return rule

    import cloudpickle
    import ray
    from prefect import flow, get_client
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

    from chatlearn.checkpoint.resume import data_checkpoint_dir
    from chatlearn.config import load_config
    from chatlearn.runtime.cluster.launch import init_ray, launch
    from chatlearn.runtime.prepared import prepare_run
    from chatlearn.runtime.records.prefect_server import local_prefect_api
    from chatlearn.runtime.weights.sync import sync_routes
    from flows.episode_flow import episode_flow

    cfg = load_config(None, [f"runtime.output_dir={out}", "runtime.exp_name=overhead", *args.overrides])
    prepared = prepare_run(cfg)
    eng = prepared.engine
    rt = cfg.runtime
    on_ray = episode_flow.with_options(task_runner=RayTaskRunner())

    def prefect_call(name: str, run: Any, ep: int, consumed: int, it: int) -> tuple[dict, Any]:
        settings: dict[Any, Any] = {}
        if name != "with-heartbeat":  # as flows/train_flow.py calls the episode subflow
            settings[PREFECT_FLOWS_HEARTBEAT_FREQUENCY] = None
        if name == "no-api-logs":
            settings[PREFECT_LOGGING_TO_API_ENABLED] = False
        fl = on_ray if name == "raytaskrunner" else episode_flow
        with contextlib.ExitStack() as stack:
            if settings:
                stack.enter_context(temporary_settings(settings))
            if name == "raytaskrunner":  # as episode_flow submitted its tasks on RayTaskRunner
                stack.enter_context(remote_options(num_cpus=0, max_retries=0))
            state = fl(run, ep, consumed, it, return_state=True)
        return state.result(), state.state_details.flow_run_id

    def one(name: str, run: Any, remote: Any, ep: int, consumed: int, it: int) -> tuple[float, dict, Any]:
        t0 = time.time()
        flow_run_id = None
        if name == "direct":
            metrics = direct_episode(run, ep, consumed, it)
        elif name == "ray-only":
            metrics = ray_only_episode(remote, run, ep, consumed, it)
        elif name == "no-subflow":
            metrics = episode_flow.fn(run, ep, consumed, it)
        else:
            metrics, flow_run_id = prefect_call(name, run, ep, consumed, it)
        return time.time() - t0, metrics, (t0, time.time(), flow_run_id)

    @flow(name="bench-overhead", task_runner=RayTaskRunner(), validate_parameters=False)
    def bench_flow() -> dict:
        with launch(prepared, data_checkpoint_dir(cfg)) as (run, groups, stream):
            sync_routes(run.sync_routes, run.actor, concurrent=run.concurrent_comm,
                        max_workers=run.param_sync_max_workers)
            remote = ray.remote(num_cpus=0, max_retries=0)(_stage_in_worker)
            sizes = {"run_handle_json_bytes": len(run.model_dump_json()),
                     "run_handle_pickle_bytes": len(cloudpickle.dumps(run))}
            state = {"ep": -1, "consumed": rt.consumed_samples, "it": 0}
            samples: dict[str, list[dict]] = {n: [] for n in names}
            calls: dict[str, list[tuple]] = {n: [] for n in names}

            def play(name: str, rnd: int) -> dict:
                want = (bool(rt.eval_episode_interval) and (rnd + 1) % rt.eval_episode_interval == 0,
                        bool(rt.save_episode_interval) and (rnd + 1) % rt.save_episode_interval == 0)
                ep = due_episode(state["ep"], want, rt.eval_episode_interval, rt.save_episode_interval)
                wall, metrics, call = one(name, run, remote, ep, state["consumed"], state["it"])
                state.update(ep=ep, consumed=metrics["consumed_samples"], it=metrics["iteration"])
                return {"round": rnd, "episode": ep, "wall": wall, "eval": want[0], "checkpoint": want[1],
                        "stages": metrics["stage_seconds"], "call": call}

            for name in names:  # warm-up: Ray task workers, imports, first flow of each kind; not counted
                play(name, 0)
                print(f"warm-up {name} done", file=sys.stderr)
            for rnd in range(args.rounds):
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                for name in order:
                    s = play(name, rnd)
                    calls[name].append(s.pop("call"))
                    samples[name].append(s)
                line = " ".join(f"{n}={samples[n][-1]['wall']:.2f}" for n in names)
                print(f"round {rnd + 1}/{args.rounds}: {line}", file=sys.stderr)

            pieces = micro(run, args.micro_reps) if args.micro_reps else None
            rule = next((run.rule_rewards[n.model] for n in run.plan.scorers if n.model in run.rule_rewards), None)
            rule_tasks = rule_task_costs(rule, args.rule_tasks) if rule is not None and args.rule_tasks else None
            profile = None
            if args.profile:
                spies = start_samplers(out)
                time.sleep(2.0)  # py-spy attaches
                t0 = time.time()
                for i in range(args.profile):
                    play("prefect", i)
                prof_seconds = time.time() - t0
                files = stop_samplers(spies)
                profile = profile_table(files, args.profile) if files else {"error": "py-spy wrote nothing"}
                profile["episodes"] = args.profile
                profile["episode_seconds_under_profiler"] = prof_seconds / args.profile
                profile["raw"] = [str(p) for p, _ in files]
            return {"samples": samples, "calls": calls, "sizes": sizes, "profile": profile, "micro": pieces,
                    "rule_tasks": rule_tasks}

    namespace = f"chatlearn-{rt.exp_name}".replace(" ", "_")
    # the API first: Ray's workers inherit its URL (the ray-only variant's score stage, in a worker, submits
    # rule-reward Prefect tasks too); Ray before the bench flow: its RayTaskRunner reuses it
    with local_prefect_api(announce=lambda m: print(m, file=sys.stderr)):
        started = init_ray(cfg, namespace, list(eng.modules))
        try:
            data = bench_flow()
            time.sleep(3.0)  # the server records task runs from events
            splits: dict[str, list[dict]] = {}
            with get_client(sync_client=True) as client:
                for name in SUBFLOW_VARIANTS:
                    if name in names:
                        splits[name] = [task_split(client, c[2], (c[0], c[1]), s["stages"])
                                        for c, s in zip(data["calls"][name], data["samples"][name], strict=True)]
        finally:
            if started:
                ray.shutdown()

    samples = data["samples"]
    result = summarize(samples, rt.eval_episode_interval)
    split = {name: split_summary(splits[name], samples[name], samples.get("direct")) for name in splits}
    persisted = sum(1 for p in (out / "result-storage").rglob("*") if p.is_file()) \
        if (out / "result-storage").exists() else 0
    report(result, split, data, persisted, args)
    path = REPO / "bench" / "results" / "overhead.json"
    path.write_text(json.dumps({
        "rounds": args.rounds, "overrides": args.overrides, "machine": f"{os.cpu_count()} CPUs",
        "variants": {n: {"what": VARIANTS[n], **result[n]} for n in names}, "split": split,
        "sizes": data["sizes"], "result_files_persisted": persisted, "micro": data["micro"],
        "profile": data["profile"], "rule_tasks": data["rule_tasks"],
        "samples": samples}, indent=1, default=str))
    print(f"wrote {path.relative_to(REPO)}")
    return result


def _f(v: float | None, fmt: str = "7.3f") -> str:
    return format(v, fmt) if v is not None else " " * (int(fmt.split(".")[0]) - 1) + "-"


def report(result: dict, split: dict, data: dict, persisted: int, args: Any) -> None:
    print(f"\nseconds per episode, medians over {args.rounds} rounds (same actors, variants interleaved)")
    print(f"{'variant':24s} {'plain':>7s} {'eval':>7s} {'mix':>7s} {'-direct':>8s} {'share':>6s} "
          f"{'wall-bodies':>11s}  what")
    for name, r in result.items():
        print(f"{name:24s} {_f(r['seconds_plain'])} {_f(r['seconds_eval'])} {_f(r['seconds_schedule_mix'])} "
              f"{_f(r.get('minus_direct_per_round'), '8.3f')} {_f(r.get('share_vs_direct'), '6.2f')} "
              f"{_f(r['overhead_vs_bodies'], '11.3f')}  {VARIANTS[name]}")
    print("(mix: plain and eval medians weighted by the config's eval schedule; -direct: median of the per-round "
          "difference to direct; share: (mix - direct mix) / mix; wall-bodies: episode wall minus its stage "
          "bodies' seconds)")
    for name, s in split.items():
        if not s:
            continue
        print(f"\n{name}: where the subflow's time goes beyond the bodies (medians, seconds)")
        print(f"  subflow entry (call -> flow run Running)  {s['enter']:7.3f}")
        print(f"  {'task':11s} {'wait':>7s} {'inside':>7s} {'body':>7s} {'direct':>7s} {'body-dir':>8s}")
        for stage, t in s["tasks"].items():
            print(f"  {stage:11s} {_f(t['wait'])} {_f(t['engine_inside'])} {_f(t['body'])} {_f(t['body_direct'])} "
                  f"{_f(t['body_minus_direct'], '8.3f')}")
        print(f"  subflow exit (last task end -> call returns) {s['exit']:7.3f} "
              f"(flow run end -> return {_f(s['flow_end_to_return'])})")
        print(f"  rule-reward tasks per episode {s['rule_reward_tasks']:.0f}, "
              f"each Running {_f(s['rule_reward_running'])}")
    print("(wait: upstream task's end -> this task Running: Ray dispatch + Prefect's task engine start; inside: "
          "Running window minus the body; body-dir: the body's seconds minus direct's)")
    print(f"\nRunHandle: {data['sizes']['run_handle_json_bytes']} bytes as JSON, "
          f"{data['sizes']['run_handle_pickle_bytes']} pickled; result files persisted: {persisted}")
    if data.get("micro"):
        print("\nthe pieces, medians (ms): per call, inside the bench flow; worker_*: in an idle Ray task worker")
        for k, v in data["micro"].items():
            print(f"  {k:44s} {v if k.endswith('bytes') else 1000 * v:9.1f}")
    if data.get("rule_tasks"):
        rule_task_report(data["rule_tasks"])
    prof = data.get("profile")
    if prof and "totals_seconds_per_episode" in prof:
        print(f"\npy-spy over {prof['episodes']} prefect episodes ({prof['episode_seconds_under_profiler']:.2f} "
              f"s/episode under the profiler; samplers: {prof['samplers']}), inclusive seconds per episode, idle "
              f"included")
        for k, v in prof["totals_seconds_per_episode"].items():
            print(f"  {k:24s} {v:7.3f}")
        for kind, title in (("driver", "driver thread in the subflow call"),
                            ("worker", "Ray task workers, outside the stage bodies")):
            total = sum(v for _, v in prof["groups"][kind]) or 1.0
            print(f"  {title}: by group (seconds/episode under the profiler, share)")
            for label, v in prof["groups"][kind]:
                print(f"    {v:7.3f} {100 * v / total:5.1f}%  {label}")
        for title, key in (("driver (the subflow call)", "driver_top"),
                           ("Ray task workers (outside the stage bodies)", "worker_top")):
            print(f"  {title}:")
            for fn, sec in prof[key][:15]:
                print(f"    {sec:7.3f}  {fn}")


if __name__ == "__main__":
    main(sys.argv[1:])
