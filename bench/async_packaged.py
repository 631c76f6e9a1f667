"""The packaged pipelined config against itself run synchronously: what `configs/grpo_async.yaml` buys.

The real `chatlearn train configs/grpo_async.yaml` (`runtime.max_staleness: 1`, the policy generating in a
process of its own) and the same command with `runtime.max_staleness=0`, in interleaved rounds (k=1, k=0, k=1,
k=0, ...: the machine's drift falls on both), each for `--episodes` episodes with the config's eval every
other episode. Per variant: the median of its episodes' seconds after the first two (the pipeline fills in the
first; the first episode also pays the processes' warm-up), each round's, the stages' seconds, and the eval
reward after the last episode. The speed-up is the synchronous median over the pipelined one. Prints a table
and writes `bench/results/async_packaged.json`.

    .venv/bin/python bench/async_packaged.py [--episodes 12] [--rounds 2] [--extra key=value ...]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from common import run_train  # noqa: E402  (bench/ is a folder of scripts, not a package)

RESULT = BENCH / "results" / "async_packaged.json"
CONFIG = "configs/grpo_async.yaml"


def one_run(out: Path, k: int, args: argparse.Namespace) -> dict:
    wall = run_train(out, [CONFIG, f"runtime.num_episode={args.episodes}", f"runtime.max_staleness={k}",
                           "runtime.save_episode_interval=1000", *args.extra],
                     f"chatlearn train {CONFIG} (max_staleness {k})")
    rows = [json.loads(line) for line in (out / "grpo_async" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_reward_mean"] for r in rows if r.get("eval_reward_mean") is not None]
    return {"wall_seconds": wall, "episode_seconds": [r["episode_seconds"] for r in rows],
            "steady_episode_seconds": statistics.median(r["episode_seconds"] for r in rows[2:]),
            "stage_seconds": {stage: statistics.median(r["stage_seconds"].get(stage, 0.0) for r in rows[2:])
                              for stage in rows[-1]["stage_seconds"]},
            "response_length_mean": statistics.mean(r.get("response_length_mean", 0.0) for r in rows),
            "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in rows),
            "eval_reward_first": rows[0].get("eval_reward_mean_before_training"),
            "eval_reward_last": evals[-1] if evals else None,
            "eval_exact_match_last": next((r["eval_exact_match"] for r in reversed(rows)
                                           if r.get("eval_exact_match") is not None), None),
            "reward_mean_first_last": [rows[0]["reward_mean"], rows[-1]["reward_mean"]]}


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2, help="runs of each variant, interleaved")
    p.add_argument("--extra", nargs="*", default=[], help="key=value overrides for both variants")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-async-packaged-"))
    runs: dict[int, list[dict]] = {1: [], 0: []}
    for r in range(args.rounds):
        for k in (1, 0):
            runs[k].append(one_run(work / f"k{k}-round{r}", k, args))
            print(f"round {r + 1}, max_staleness {k}: {runs[k][-1]['steady_episode_seconds']:.2f} s / episode",
                  flush=True)
    summary = {k: {"steady_episode_seconds": statistics.median(x["steady_episode_seconds"] for x in v),
                   "per_round": [x["steady_episode_seconds"] for x in v],
                   "stage_seconds": {s: statistics.median(x["stage_seconds"][s] for x in v)
                                     for s in v[0]["stage_seconds"]},
                   "response_length_mean": statistics.mean(x["response_length_mean"] for x in v),
                   "eval_reward_last": [x["eval_reward_last"] for x in v]} for k, v in runs.items()}
    speedup = summary[0]["steady_episode_seconds"] / summary[1]["steady_episode_seconds"]
    print(f"\n{CONFIG}, {args.episodes} episodes, {args.rounds} interleaved rounds each "
          f"(median s / episode after the first two)\n")
    print("| `max_staleness` | s / episode | per round | speed-up | generate s | score s | train s | response "
          "tokens | eval reward, last |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in (0, 1):
        s = summary[k]
        st = s["stage_seconds"]
        print(f"| {k} | {s['steady_episode_seconds']:.2f} | {', '.join(f'{x:.2f}' for x in s['per_round'])} | "
              f"{(speedup if k else 1.0):.2f}x | {st.get('generate', 0):.2f} | {st.get('score', 0):.2f} | "
              f"{st.get('train', 0):.2f} | {s['response_length_mean']:.1f} | "
              f"{', '.join(f'{x:.3f}' for x in s['eval_reward_last'] if x is not None)} |")
    result = {"config": CONFIG, "episodes": args.episodes, "rounds": args.rounds, "extra": args.extra,
              "speedup": speedup, "variants": {str(k): {**summary[k], "runs": runs[k]} for k in runs}}
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {RESULT.relative_to(BENCH.parent)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
