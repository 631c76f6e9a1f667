"""The orchestration share of an episode: the same episodes through Prefect + Ray and with no Prefect.

One process, one launch of the run's actors (the embedded default unless overrides say otherwise), one
bench flow around it (as `chatlearn train`'s train flow), a fresh local Prefect server
(`local_prefect_api`). Then rounds: in each round every variant runs one episode over the same actors, the
order rotating from round to round. The model state advances whatever runs it, which does not matter for
timing. Round r plays episode r of the config's schedule for every variant (eval every
`eval_episode_interval`, checkpoints every `save_episode_interval`): each call gets the next episode number
with that round's eval/checkpoint due, so all variants do the same work in a round, and over a multiple of
the schedule's period each variant sees the default's mix of eval and plain episodes.

Variants:

    direct        no Prefect: episode_flow's body in the driver, each task's function in a thread of its own
                  and no task run (`api_link._inline`, as a run goes on while the Prefect API is away); its
                  rule-reward batches are still Prefect tasks on Ray, as in every variant
    prefect       the episode as `chatlearn train` runs it: a subflow run of the bench flow (as of the train
                  flow) with its stage and model-call task runs, its flow run created during the episode before
                  (once that one generated) and its states sent in the background
                  (`chatlearn/runtime/prefect/subflows.py`), its task runs recorded from state events
                  (`chatlearn/runtime/prefect/task_runs.py`)
    prefect-engine  the same subflow through Prefect's own subflow call (`api_link.call_flow`), as before (its task
                  runs recorded as in `prefect`)

Medians per variant: seconds per episode (plain episodes, eval episodes, and the schedule's mix), the
median of the per-round difference to `direct` (same round, same work), the orchestration share
(prefect - direct) / prefect, and the CPU seconds per episode of the driver, the Prefect server (with its
children) and the Ray processes (actors, task workers, raylet): on this 2-core machine CPU that Prefect
spends in the driver or the server is CPU the actors do not get. The Prefect API's task-run timestamps split
the subflow: its entry, per stage the wait before the task runs and the body's difference to `direct`, and
its exit. `--profile N` then runs N more `prefect` episodes under py-spy (on-CPU samples of the driver and
of the server) and lists the groups and functions the CPU goes to. Prints tables and writes
`bench/results/overhead.json`.

Rule-reward tasks (`--rule-tasks N`, default 30; `--rule-tasks-only` runs just this, no actors, and writes
`bench/results/rule_tasks.json`): the median per-task cost of the `rule-reward` Prefect task
(`flows/rule_tasks.py`) on one 64-sample batch, submitted from inside a task as the score stage does, on
prefect-ray's `RayTaskRunner` (before) and on `WarmRayTaskRunner` (after,
`chatlearn/runtime/prefect/ray_tasks.py`), the two interleaved round by round in one run: one task at a time
(submit -> result), the driver's share of it (submit), and N at once. Then where the `RayTaskRunner` time
goes: the driver's settings serialization and the worker's settings hydration, API clients and TLS contexts,
measured one by one.

    .venv/bin/python bench/overhead.py [--rounds 10] [--profile 6] [--rule-tasks 30] [key=value overrides]
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
    "direct": "episode_flow's body with no Prefect (no subflow, no task runs)",
    "prefect": "the episode subflow as chatlearn train runs it (records sent in the background)",
    "prefect-engine": "the episode through Prefect's own subflow call (task runs as in prefect)",
}
SUBFLOW_VARIANTS = ("prefect", "prefect-engine")
STAGES = ("generate", "score", "train", "sync", "checkpoint", "eval")
# what each stage task waits for in episode_flow (generate: the subflow's start)
UPSTREAM = {"score": "generate", "train": "score", "sync": "train", "checkpoint": "train", "eval": "sync"}


# ---- the no-Prefect path ----

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


def direct_episode(ctx: Any, episode: int, consumed: int, iteration: int) -> dict[str, Any]:
    """episode_flow's body in this process with no task runs: each task's function in a thread of its own, as
    the train flow runs an episode while the Prefect API is away (`api_link._inline`)."""
    from prefect.context import FlowRunContext

    from chatlearn.runtime.episodes import EpisodeGate
    from chatlearn.runtime.prefect import api_link
    from flows.episode_flow import episode_runner

    with _no_prefect():
        return api_link._inline(episode_runner(ctx.spec.plan), FlowRunContext.get(),
                                (ctx, episode, consumed, EpisodeGate(iteration)), {})


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


def task_split(client: Any, name: str, call: tuple[float, float], stages: dict[str, float]) -> dict:
    """One subflow's overhead split from the API's timestamps (client-side clocks of this machine)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterFlowRunId

    found = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    if len(found) != 1:
        return {}
    fr = found[0]
    flow_run_id = fr.id
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
                                                           for s in rows]),
                             "cpu": {k: median([s["cpu"][k] for s in rows]) for k in rows[0]["cpu"]}}
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


# ---- what a Prefect task costs in a Ray worker, piece by piece (the rule-task measurement) ----

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
    from chatlearn.runtime.prefect.ray_tasks import WarmRayTaskRunner
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


# ---- CPU: who spends it ----

def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = defaultdict(list)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                kids[int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])].append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return kids


def _tree(root: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def server_pid() -> int | None:
    """The local Prefect server's pid (`chatlearn.runtime.records.prefect_server`'s state file)."""
    from chatlearn.runtime.records.prefect_server import prefect_home

    try:
        return json.loads((prefect_home() / "server.json").read_text()).get("pid")
    except (OSError, ValueError):
        return None


def process_groups() -> dict[str, list[int]]:
    """The driver (this process), the Prefect server and its children, and the Ray processes under this one
    (actors, task workers, raylet, GCS)."""
    kids = _children()
    server = server_pid()
    served = _tree(server, kids) if server else []
    return {"driver": [os.getpid()], "prefect server": served,
            "ray (actors, workers, raylet)": [p for p in _tree(os.getpid(), kids) if p != os.getpid()
                                              and p not in served]}


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


# ---- py-spy: where the orchestration's CPU goes ----

PROFILE_RATE = 100


def start_samplers(out: Path) -> list[tuple[Any, Path, str]]:
    """`py-spy record` (on-CPU samples only) on the driver and on the Prefect server with its children."""
    spies = []
    server = server_pid()
    for pid, kind in [(os.getpid(), "driver"), *([(server, "server")] if server else [])]:
        path = out / f"pyspy-{kind}-{pid}.txt"
        extra = ["--subprocesses"] if kind == "server" else []
        proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "py-spy"), "record", "--pid", str(pid), *extra,
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


# Each on-CPU sample goes to the first group whose pattern occurs in its stack (most specific first).
GROUPS = [
    ("flow run API calls (create, read, name, states)", ("flow_engine.py", "create_flow_run", "set_flow_run_state")),
    ("task runs: Prefect's task engine", ("task_engine.py",)),
    ("task runs: submit and futures", ("task_runners.py", "futures.py")),
    ("events worker (task run states as events)", ("events/", "EventsWorker")),
    ("logs to the API", ("APILogWorker", "logging/handlers.py")),
    ("artifacts", ("artifacts.py",)),
    ("HTTP (httpx, httpcore)", ("httpx", "httpcore")),
    ("Ray calls and waits", ("ray/_private/worker.py", "ray/_raylet", "ray/remote_function.py", "actor.py")),
]


def _group(frames: list[str]) -> str:
    for label, patterns in GROUPS:
        if any(p in f for f in frames for p in patterns):
            return label
    return "other"


def profile_table(files: list[tuple[Path, str]], episodes: int, top: int = 25) -> dict[str, Any]:
    """On-CPU seconds per episode by process, by group and by function (inclusive), from py-spy's raw
    (collapsed) stacks."""
    totals: dict[str, float] = defaultdict(float)
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    funcs: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path, kind in files:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            seconds = int(count) / PROFILE_RATE / episodes
            frames = stack.split(";")
            totals[kind] += seconds
            groups[kind][_group(frames)] += seconds
            for f in set(frames):
                name, _, where = f.partition(" (")
                where = where.rstrip(")").split("site-packages/")[-1].split(":")[0]
                funcs[kind][f"{name} ({where})"] += seconds
    return {"cpu_seconds_per_episode": dict(totals),
            "groups": {k: sorted(v.items(), key=lambda kv: -kv[1]) for k, v in groups.items()},
            "top": {k: sorted(v.items(), key=lambda kv: -kv[1])[:top] for k, v in funcs.items()}}


# ---- main ----

def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds (default 10: the default "
                        "config's schedule period, eval every 2 and checkpoint every 10 episodes)")
    parser.add_argument("--variant", action="append", choices=list(VARIANTS),
                        help="a variant to run (repeatable; default: all)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then N more `prefect` episodes under py-spy (0: none)")
    parser.add_argument("--rule-tasks", type=int, default=30, metavar="N", help="rule-reward tasks per runner and "
                        "round in the rule-task measurement (0: skip it)")
    parser.add_argument("--rule-tasks-only", action="store_true", help="only the rule-task measurement (no actors, "
                        "no episodes); writes bench/results/rule_tasks.json")
    parser.add_argument("--nice-server", type=int, default=0, metavar="N",
                        help="run the local Prefect server at this niceness (0: as started)")
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
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from chatlearn.checkpoint.resume import data_checkpoint_dir
    from chatlearn.config import load_config
    from chatlearn.runtime.cluster.launch import init_ray
    from chatlearn.runtime.episodes import EpisodeGate
    from chatlearn.runtime.launch import launch
    from chatlearn.runtime.prefect import api_link
    from chatlearn.runtime.prefect.subflows import Subflows
    from chatlearn.runtime.prepared import prepare_run
    from chatlearn.runtime.records.prefect_server import local_prefect_api
    from chatlearn.runtime.weights.sync import sync_routes
    from flows.episode_flow import episode_name, episode_runner
    from flows.model_calls import PrefectCalls

    cfg = load_config(None, [f"runtime.output_dir={out}", "runtime.exp_name=overhead", *args.overrides])
    prepared = prepare_run(cfg)
    eng = prepared.engine
    rt = cfg.runtime

    def prefect_call(name: str, ctx: Any, ep: int, consumed: int, it: int, next_ep: int | None,
                     subflows: dict[str, Any]) -> dict:
        if name == "prefect-engine":  # Prefect's own subflow call, as flows/train_flow.py made it before
            with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                return api_link.call_flow(episode_runner(ctx.spec.plan), (ctx, ep, consumed, EpisodeGate(it)))
        episodes = subflows.setdefault(name, Subflows(episode_runner(ctx.spec.plan)))  # as flows/train_flow.py
        return episodes(episode_name(ep), {"ctx": ctx, "episode": ep, "consumed_samples": consumed,
                                           "gate": EpisodeGate(it)},
                        next_name=episode_name(next_ep) if next_ep is not None else None)

    def one(name: str, ctx: Any, ep: int, consumed: int, it: int, next_ep: int | None,
            subflows: dict[str, Any]) -> tuple[float, dict, Any, dict]:
        groups = process_groups()
        cpu0 = {k: cpu_seconds(v) for k, v in groups.items()}
        t0 = time.time()
        metrics = (direct_episode(ctx, ep, consumed, it) if name == "direct"
                   else prefect_call(name, ctx, ep, consumed, it, next_ep, subflows))
        t1 = time.time()
        cpu = {k: cpu_seconds(v) - cpu0[k] for k, v in groups.items()}
        return t1 - t0, metrics, (t0, t1, f"episode-{ep + 1}"), cpu

    @flow(name="bench-overhead", validate_parameters=False)
    def bench_flow() -> dict:
        with launch(prepared, PrefectCalls(), data_checkpoint_dir(cfg)) as ctx:
            sync_routes(ctx.sync_routes, ctx.actors.process, concurrent=rt.concurrent_comm,
                        max_workers=rt.param_sync_max_workers)
            sizes = {"run_spec_json_bytes": len(ctx.spec.model_dump_json()),
                     "run_context_pickle_bytes": len(cloudpickle.dumps(ctx))}
            state = {"consumed": rt.consumed_samples, "it": 0}
            # made here, not in a closure of this flow's: Ray pickles the flow by value with every rule task
            subflows: dict[str, Any] = {}
            samples: dict[str, list[dict]] = {n: [] for n in names}
            calls: dict[str, list[tuple]] = {n: [] for n in names}

            # the whole schedule first: which variant plays which episode (the next one a variant plays is
            # known in advance, as in a run: its subflow's flow run is created during the one before)
            schedule: list[tuple[str, int, str]] = [(n, 0, "warm-up") for n in names]
            for rnd in range(args.rounds):
                schedule += [(n, rnd, "round") for n in names[rnd % len(names):] + names[:rnd % len(names)]]
            schedule += [("prefect", i, "profile") for i in range(args.profile)]
            eps, last = [], -1
            for _, rnd, _ in schedule:
                want = (bool(rt.eval_episode_interval) and (rnd + 1) % rt.eval_episode_interval == 0,
                        bool(rt.save_episode_interval) and (rnd + 1) % rt.save_episode_interval == 0)
                last = due_episode(last, want, rt.eval_episode_interval, rt.save_episode_interval)
                eps.append((last, want))

            def play(i: int) -> dict:
                name, rnd, _ = schedule[i]
                ep, want = eps[i]
                next_ep = next((eps[j][0] for j in range(i + 1, len(schedule)) if schedule[j][0] == name), None)
                wall, metrics, call, cpu = one(name, ctx, ep, state["consumed"], state["it"], next_ep, subflows)
                state.update(consumed=metrics["consumed_samples"], it=metrics["iteration"])
                return {"round": rnd, "episode": ep, "wall": wall, "eval": want[0], "checkpoint": want[1],
                        "stages": metrics["stage_seconds"], "cpu": cpu, "call": call}

            profiled = [i for i, (_, _, kind) in enumerate(schedule) if kind == "profile"]
            for i, (name, rnd, kind) in enumerate(schedule):
                if kind == "warm-up":  # Ray task workers, imports, first flow of each kind; not counted
                    play(i)
                    print(f"warm-up {name} done", file=sys.stderr)
                elif kind == "round":
                    s = play(i)
                    calls[name].append(s.pop("call"))
                    samples[name].append(s)
                    if all(len(samples[n]) == rnd + 1 for n in names):
                        line = " ".join(f"{n}={samples[n][-1]['wall']:.2f}" for n in names)
                        print(f"round {rnd + 1}/{args.rounds}: {line}", file=sys.stderr)

            rules = ctx.spec.rule_rewards
            rule = next((rules[n.model] for n in ctx.spec.plan.scorers if n.model in rules), None)
            rule_tasks = rule_task_costs(rule, args.rule_tasks) if rule is not None and args.rule_tasks else None
            profile = None
            if args.profile:
                spies = start_samplers(out)
                time.sleep(2.0)  # py-spy attaches
                t0 = time.time()
                for i in profiled:
                    play(i)
                prof_seconds = time.time() - t0
                files = stop_samplers(spies)
                profile = profile_table(files, args.profile) if files else {"error": "py-spy wrote nothing"}
                profile["episodes"] = args.profile
                profile["episode_seconds_under_profiler"] = prof_seconds / args.profile
                profile["raw"] = [str(p) for p, _ in files]
            return {"samples": samples, "calls": calls, "sizes": sizes, "profile": profile, "rule_tasks": rule_tasks}

    namespace = f"chatlearn-{rt.exp_name}".replace(" ", "_")
    # the API first: Ray's workers inherit its URL (rule-reward Prefect tasks run in them)
    with local_prefect_api(announce=lambda m: print(m, file=sys.stderr)):
        if args.nice_server:
            for pid in process_groups()["prefect server"]:
                os.setpriority(os.PRIO_PROCESS, pid, args.nice_server)
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
        "sizes": data["sizes"], "result_files_persisted": persisted,
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
    print("\nCPU seconds per episode, medians (user + system, /proc)")
    kinds = list(next(iter(result.values()))["cpu"])
    print(f"{'variant':24s} " + " ".join(f"{k:>30s}" for k in kinds))
    for name, r in result.items():
        print(f"{name:24s} " + " ".join(f"{_f(r['cpu'][k], '30.3f')}" for k in kinds))
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
    print(f"\nRunSpec: {data['sizes']['run_spec_json_bytes']} bytes as JSON; RunContext "
          f"{data['sizes']['run_context_pickle_bytes']} pickled (its description); result files persisted: "
          f"{persisted}")
    if data.get("rule_tasks"):
        rule_task_report(data["rule_tasks"])
    prof = data.get("profile")
    if prof and "cpu_seconds_per_episode" in prof:
        print(f"\npy-spy over {prof['episodes']} prefect episodes ({prof['episode_seconds_under_profiler']:.2f} "
              f"s/episode under the profiler), on-CPU seconds per episode")
        for kind, total in prof["cpu_seconds_per_episode"].items():
            print(f"  {kind}: {total:.3f} s/episode, by group:")
            for label, v in prof["groups"][kind]:
                print(f"    {v:7.3f} {100 * v / (total or 1):5.1f}%  {label}")
            print(f"  {kind}: functions (inclusive):")
            for fn, sec in prof["top"][kind][:20]:
                print(f"    {sec:7.3f}  {fn}")


if __name__ == "__main__":
    main(sys.argv[1:])
