"""Each engine's shipped config end to end: what it learned (before/after) and seconds per episode.

Runs `chatlearn train configs/<engine>.yaml` (the real command, its own local Prefect server) for the
default (PPO), grpo, dpo, online_dpo (LoRA on), rloo, reinforce_pp and dapo configs one after the other, reads
each run's `metrics.jsonl` and `summary.json`, prints a table and writes `bench/results/engines.json`. Timings on a
shared machine are noisy: seconds per episode are medians over episodes 2..N (episode 1 includes Ray
task-worker start-up).

    .venv/bin/python bench/engines.py [grpo dpo ...]
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, run_train  # noqa: E402  (bench/ is a folder of scripts, not a package)

CONFIGS = {"ppo": "default", "grpo": "grpo", "dpo": "dpo", "online_dpo": "online_dpo", "rloo": "rloo",
           "reinforce_pp": "reinforce_pp", "dapo": "dapo"}
# (metric, where): "before" is the eval before training, "after" the last eval of the run
QUALITY = {
    "ppo": ["eval_reward_mean", "eval_exact_match"],
    "grpo": ["eval_reward_mean", "eval_exact_match"],
    "online_dpo": ["eval_reward_mean", "eval_exact_match"],
    "rloo": ["eval_reward_mean", "eval_exact_match"],
    "reinforce_pp": ["eval_reward_mean", "eval_exact_match"],
    "dapo": ["eval_reward_mean", "eval_exact_match"],
    "dpo": ["eval_preference_accuracy", "eval_reward_margin"],
}


def run_engine(engine: str) -> dict:
    config = CONFIGS[engine]
    out = Path(tempfile.mkdtemp(prefix=f"bench-{engine}-"))
    wall = run_train(out, [f"configs/{config}.yaml"], what=f"chatlearn train configs/{config}.yaml")
    exp = config
    run_dir = out / exp
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [r for r in rows if any(r.get(k) is not None for k in QUALITY[engine])]
    last = evals[-1]
    result = {
        "config": f"configs/{config}.yaml",
        "episodes": len(rows),
        "wall_seconds": wall,
        "episode_seconds_median": statistics.median(r["episode_seconds"] for r in rows[1:] or rows),
        "reward_mean_first": rows[0].get("reward_mean"),
        "reward_mean_last": rows[-1].get("reward_mean"),
        "eval_reward_mean_before_training": rows[0].get("eval_reward_mean_before_training"),
        "after_episode": last["episode"],
        "trainable_params": summary.get("trainable_params"),
        "total_params": summary.get("total_params"),
    }
    for key in QUALITY[engine]:
        result[f"{key}_after"] = last.get(key)
    return result


def main(engines: list[str]) -> dict:
    results = {e: run_engine(e) for e in engines or list(CONFIGS)}
    keys = sorted({k for r in results.values() for k in r if k != "config"})
    print(f"{'':38s}" + "".join(f"{e:>14s}" for e in results))
    for k in keys:
        cells = []
        for r in results.values():
            v = r.get(k)
            cells.append(f"{v:14.4g}" if isinstance(v, float) else f"{'-' if v is None else v!s:>14s}")
        print(f"{k:38s}" + "".join(cells))
    dest = REPO / "bench" / "results" / "engines.json"
    previous = json.loads(dest.read_text()) if dest.exists() else {}
    previous.update(results)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(previous, indent=1))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
