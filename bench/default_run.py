"""Benchmark the embedded default end to end: wall time, per-stage seconds, Prefect overhead, reward curve.

Runs `chatlearn train` (the real command, with its own local Prefect server) and reads the run's
`metrics.jsonl`. Prints a table and writes `bench/results/default_run.json`. Timings on a shared machine are
noisy: the table reports medians over episodes 2..N (episode 1 includes Ray task-worker start-up).

    .venv/bin/python bench/default_run.py [key=value overrides]
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(overrides: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench-default-"))
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(out / "prefect"))
    env.pop("PREFECT_API_URL", None)
    cmd = [str(REPO / ".venv" / "bin" / "chatlearn"), "train", f"runtime.output_dir={out}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"chatlearn train failed with {proc.returncode}")
    rows = [json.loads(line) for line in (out / "default" / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    stages = sorted({k for r in rows for k in r["stage_seconds"]})
    med = {k: statistics.median(r["stage_seconds"].get(k, 0.0) for r in steady) for k in stages}
    episode_med = statistics.median(r["episode_seconds"] for r in steady)
    evals = [(r["episode"], r["eval_reward_mean"]) for r in rows if r.get("eval_reward_mean") is not None]
    result = {
        "episodes": len(rows),
        "wall_seconds": wall,
        "time_to_first_episode_seconds": wall - sum(r["episode_seconds"] for r in rows),
        "first_episode_seconds": rows[0]["episode_seconds"],
        "episode_seconds_median": episode_med,
        "stage_seconds_median": med,
        "orchestration_overhead_median": episode_med - sum(med.values()),
        "reward_mean_first": rows[0]["reward_mean"],
        "reward_mean_last": rows[-1]["reward_mean"],
        "eval_reward_mean_before_training": rows[0].get("eval_reward_mean_before_training"),
        "eval_reward_mean_first": evals[0] if evals else None,
        "eval_reward_mean_last": evals[-1] if evals else None,
        "peak_memory_mb": max(r["peak_memory_mb"] for r in rows),
        "overrides": overrides,
    }
    print(f"{'metric':40s} value")
    for key, value in result.items():
        if isinstance(value, dict):
            for k, v in value.items():
                print(f"  {key + '.' + k:38s} {v:.3f}")
        elif isinstance(value, float):
            print(f"{key:40s} {value:.3f}")
        else:
            print(f"{key:40s} {value}")
    dest = REPO / "bench" / "results" / "default_run.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
