"""Benchmark the embedded default end to end: wall time, per-stage seconds, Prefect overhead, reward curve.

Runs `chatlearn train` (the real command, with its own local Prefect server) and reads the run's
`metrics.jsonl`. Prints a table and writes `bench/results/default_run.json`. Timings on a shared machine are
noisy: the table reports medians over episodes 2..N (episode 1 includes Ray task-worker start-up).

    .venv/bin/python bench/default_run.py [key=value overrides]
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, run_train  # noqa: E402  (bench/ is a folder of scripts, not a package)


def main(overrides: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench-default-"))
    wall = run_train(out, overrides)
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
