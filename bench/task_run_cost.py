"""What one Prefect task run costs, apart from its body: the floor under the orchestration share.

An episode of the embedded default records about 15 task runs (its stages, its model calls, the rule-reward
batches). This measures, on a fresh local Prefect server (as `chatlearn train` starts it), the CPU one task
run of a no-op task costs the driver and the server, and its wall time, for the ways a task run can be
recorded:

    engine        Prefect's task engine in a thread (`task.submit(...).result()`), as the episode's stage and
                  call tasks ran before `recorded`: its states go to the server as events (Pending, Running,
                  Completed)
    engine-quiet  the same with Prefect's API logging off (no "Finished in state" log record sent)
    rest          the task run created over REST with a Running state, then set Completed (two orchestrated
                  state transitions, the way flow runs are recorded)
    rest-once     the task run created over REST already Completed (one request; no live state in the UI)
    recorded      how the episode's task runs are recorded now (`chatlearn/runtime/prefect/task_runs.py`): the
                  function in a thread, the run sent as state events with no task engine, a run shorter than
                  a second as its final state alone

Rounds interleave the ways; medians per way. The server's CPU is its process tree's, over the loop and until
its recorder has flushed, minus its idle CPU over as long. Prints a table, writes
`bench/results/task_run_cost.json`.

    .venv/bin/python bench/task_run_cost.py [--n 100] [--rounds 3]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO  # noqa: E402
from overhead import _children, _tree, cpu_seconds, server_pid  # noqa: E402

SETTLE_S = 3.0  # the server's task run recorder flushes every second (SERVER_TUNING); events trail the loop


def _server_cpu() -> float:
    pid = server_pid()
    return cpu_seconds(_tree(pid, _children())) if pid else 0.0


def measure(loop: Any, n: int) -> dict[str, float]:
    """Per task run: wall, driver CPU and server CPU (minus its idle rate) of ``loop(n)``."""
    time.sleep(SETTLE_S)
    idle0 = _server_cpu()
    time.sleep(SETTLE_S)
    idle_rate = (_server_cpu() - idle0) / SETTLE_S
    s0, d0, t0 = _server_cpu(), time.process_time(), time.perf_counter()
    loop(n)
    t1 = time.perf_counter()
    time.sleep(SETTLE_S)  # background senders (Prefect's events worker) finish on the driver's CPU too
    s1, d1 = _server_cpu(), time.process_time()
    server = (s1 - s0) - idle_rate * (t1 - t0 + SETTLE_S)
    return {"wall_ms": 1e3 * (t1 - t0) / n, "driver_cpu_ms": 1e3 * (d1 - d0) / n, "server_cpu_ms": 1e3 * server / n}


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100, help="task runs per way and round (default 100)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the ways interleaved (default 3)")
    args = parser.parse_args(argv)
    os.environ["CHATLEARN_PREFECT_HOME"] = tempfile.mkdtemp(prefix="task-run-cost-")  # a fresh database

    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings
    from prefect.states import Completed, Running
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect.utilities.annotations import quote

    from chatlearn.runtime.prefect.task_runs import RecordedTaskRunner
    from chatlearn.runtime.records.prefect_server import local_prefect_api

    @task(name="noop", cache_policy=NO_CACHE)
    def noop(x: int) -> int:
        return x

    @flow(name="bench-task-run-cost", task_runner=ThreadPoolTaskRunner(max_workers=4))
    def bench() -> dict[str, list[dict[str, float]]]:
        parent = FlowRunContext.get().flow_run.id
        client = get_client(sync_client=True)

        def engine(n: int) -> None:
            for i in range(n):
                noop.submit(quote(i)).result()

        def engine_quiet(n: int) -> None:
            with temporary_settings({PREFECT_LOGGING_TO_API_ENABLED: False}):
                engine(n)

        def rest(n: int) -> None:
            for _ in range(n):
                run = client.create_task_run(noop, flow_run_id=parent, dynamic_key=str(uuid.uuid4()),
                                             state=Running())
                client.set_task_run_state(run.id, Completed(), force=True)

        def recorded(n: int) -> None:
            with RecordedTaskRunner(max_workers=4) as runner:
                for i in range(n):
                    runner.submit(noop, {"x": quote(i)}).result()

        def rest_once(n: int) -> None:
            for _ in range(n):
                client.create_task_run(noop, flow_run_id=parent, dynamic_key=str(uuid.uuid4()), state=Completed())

        ways = {"engine": engine, "engine-quiet": engine_quiet, "rest": rest, "rest-once": rest_once,
                "recorded": recorded}
        engine(10)  # warm: imports, the client, the task's key
        samples: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
        for r in range(args.rounds):
            order = list(ways)[r % len(ways):] + list(ways)[:r % len(ways)]
            for way in order:
                samples[way].append(measure(ways[way], args.n))
                print(f"round {r + 1} {way}: {samples[way][-1]}", file=sys.stderr, flush=True)
        recorded = client._client.post("/task_runs/count", json={"task_runs": {"name": {"like_": "noop-"}}}).json()
        print("noop task runs recorded:", recorded, file=sys.stderr)
        return samples

    with local_prefect_api(announce=lambda m: print(m, file=sys.stderr)):
        samples = bench()
    result = {"n": args.n, "rounds": args.rounds, "machine": f"{os.cpu_count()} CPUs", "ways": {
        way: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for way, runs in samples.items()}}
    print(f"\none task run of a no-op task, medians of {args.rounds} rounds of {args.n}")
    print(f"{'way':14s} {'wall ms':>8s} {'driver CPU ms':>14s} {'server CPU ms':>14s}")
    for way, m in result["ways"].items():
        print(f"{way:14s} {m['wall_ms']:8.1f} {m['driver_cpu_ms']:14.1f} {m['server_cpu_ms']:14.1f}")
    out = REPO / "bench" / "results" / "task_run_cost.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
