"""Does GRPO learn as well with vLLM generating as with `continuous`? configs/grpo.yaml with
`runtime.rollout_engine: continuous` beside configs/grpo_vllm.yaml (the same config, vLLM's CPU build generating),
three seeds each, interleaved (continuous then vllm for each seed), the real command each time.

Prints each run's eval reward before training, at every eval and at the end, the mean and spread over the seeds,
and writes `bench/results/vllm_seeds.json` after every run. The two engines draw different samples from the same
seed (vLLM's sampler is not ours), so the curves are compared as distributions over seeds, not bit for bit.

    .venv/bin/python bench/vllm_seeds.py [--seeds 42 1 2] [--episodes N]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, run_train  # noqa: E402  (bench/ is a folder of scripts, not a package)

ENGINES = {"continuous": ["configs/grpo.yaml", "runtime.rollout_engine=continuous"],
           "vllm": ["configs/grpo_vllm.yaml"]}
DEST = REPO / "bench" / "results" / "vllm_seeds.json"


def one_run(engine: str, seed: int, episodes: int | None) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"bench-seeds-{engine}-{seed}-"))
    exp = f"{engine}-seed{seed}"
    overrides = [*ENGINES[engine], f"runtime.seed={seed}", f"runtime.exp_name={exp}"]
    if episodes:
        overrides.append(f"runtime.num_episode={episodes}")
    wall = run_train(out, overrides, what=f"{engine} seed {seed}")
    rows = [json.loads(line) for line in (out / exp / "metrics.jsonl").read_text().splitlines()]
    curve = {r["episode"]: r["eval_reward_mean"] for r in rows if r.get("eval_reward_mean") is not None}
    return {"engine": engine, "seed": seed, "overrides": overrides, "wall_seconds": wall, "episodes": len(rows),
            "eval_before_training": rows[0].get("eval_reward_mean_before_training"), "eval_curve": curve,
            "eval_after": curve[max(curve)], "reward_mean_last": rows[-1].get("reward_mean"),
            "episode_seconds_median": statistics.median(r["episode_seconds"] for r in rows[1:] or rows)}


def summary(runs: list[dict]) -> dict:
    out = {}
    for engine in ENGINES:
        finals = [r["eval_after"] for r in runs if r["engine"] == engine]
        if finals:
            out[engine] = {"eval_after_mean": statistics.mean(finals),
                           "eval_after_stdev": statistics.stdev(finals) if len(finals) > 1 else None,
                           "seeds": len(finals)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--episodes", type=int, default=None, help="runtime.num_episode (default: the config's)")
    args = parser.parse_args()
    runs: list[dict] = []
    for seed in args.seeds:
        for engine in ENGINES:
            runs.append(one_run(engine, seed, args.episodes))
            r = runs[-1]
            print(f"{engine:>10s} seed {seed:>3d}: eval {r['eval_before_training']:.3f} before, "
                  f"{r['eval_after']:.3f} after {r['episodes']} episodes ({r['wall_seconds']:.0f} s, "
                  f"{r['episode_seconds_median']:.2f} s/episode)", flush=True)
            DEST.write_text(json.dumps({"runs": runs, "summary": summary(runs)}, indent=1))
    print()
    print(f"{'engine':>10s} {'seeds':>5s} {'eval after, mean':>17s} {'stdev':>7s}   eval curve per seed")
    for engine, s in summary(runs).items():
        curves = "; ".join(" ".join(f"{v:.2f}" for v in r["eval_curve"].values())
                           for r in runs if r["engine"] == engine)
        stdev = f"{s['eval_after_stdev']:.3f}" if s["eval_after_stdev"] is not None else "-"
        print(f"{engine:>10s} {s['seeds']:>5d} {s['eval_after_mean']:>17.3f} {stdev:>7s}   {curves}")
    print(f"\nwrote {DEST.relative_to(REPO)}")


if __name__ == "__main__":
    main()
