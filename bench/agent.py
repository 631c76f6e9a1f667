"""Multi-turn GRPO (`runtime.task_type: agent`): what a shipped agent config learns, episode by episode.

Runs the real `chatlearn train CONFIG` (default `configs/agent_higher_lower.yaml`: the embedded tiny Llama
guesses the largest digit of the prompt and hears "higher" or "lower") and reads its `metrics.jsonl`: the eval
reward, the turns a conversation took and the tool calls, before training and after every eval; the time the
environment steps took against the episode's. Prints a table, writes `bench/results/agent-<config>.json` and
plots the curves in `bench/results/agent-<config>.png`.

    .venv/bin/python bench/agent.py [--config configs/agent_higher_lower.yaml] [--episodes 30] [--work DIR]
        [--extra key=value ...]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/agent_higher_lower.yaml")
    ap.add_argument("--episodes", type=int, default=30)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--extra", nargs="*", default=[])
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-agent-"))
    name = Path(args.config).stem
    wall = run_train(work, [args.config, f"runtime.num_episode={args.episodes}", f"runtime.exp_name={name}",
                            *args.extra])
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("eval_reward_mean") is not None]
    table = [{"episode": r["episode"], "eval_reward_mean": r["eval_reward_mean"],
              "eval_turns_mean": r.get("eval_turns_mean"), "eval_tool_calls_mean": r.get("eval_tool_calls_mean"),
              "reward_mean": r.get("reward_mean"), "turns_mean": r.get("turns_mean"),
              "tool_calls_mean": r.get("tool_calls_mean")} for r in evals]
    before = next((r["eval_reward_mean_before_training"] for r in rows if "eval_reward_mean_before_training" in r),
                  None)
    env_share = statistics.median(r["env_seconds"] / r["episode_seconds"] for r in rows if r.get("episode_seconds"))
    print(f"{args.config}: {args.episodes} episodes in {wall:.0f} s; environment steps: median "
          f"{100 * env_share:.1f} % of an episode")
    if before is not None:
        print(f"eval reward before training: {before:.3f}")
    print(f"{'episode':>7} {'eval reward':>11} {'eval turns':>10} {'eval tools':>10} {'reward':>7} {'turns':>6} "
          f"{'tools':>6}")
    for r in table:
        print(f"{r['episode']:>7} {r['eval_reward_mean']:>11.3f} {r['eval_turns_mean'] or 0:>10.2f} "
              f"{r['eval_tool_calls_mean'] or 0:>10.2f} {r['reward_mean'] or 0:>7.3f} {r['turns_mean'] or 0:>6.2f} "
              f"{r['tool_calls_mean'] or 0:>6.2f}")
    out = BENCH / "results" / f"agent-{name}.json"
    out.write_text(json.dumps({"config": args.config, "episodes": args.episodes, "wall_seconds": wall,
                               "env_share_median": env_share, "eval_before_training": before, "evals": table,
                               "rows": rows}, indent=1, default=str))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["episode"] for r in table], [r["eval_reward_mean"] for r in table], marker="o", label="eval reward")
    ax.set_xlabel("episode")
    ax.set_ylabel("eval reward")
    twin = ax.twinx()
    twin.plot([r["episode"] for r in table], [r["eval_turns_mean"] or 0 for r in table], color="gray",
              linestyle="--", label="eval turns")
    if any(r["eval_tool_calls_mean"] for r in table):
        twin.plot([r["episode"] for r in table], [r["eval_tool_calls_mean"] or 0 for r in table], color="green",
                  linestyle=":", label="eval tool calls")
    twin.set_ylabel("per conversation")
    ax.set_title(name)
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="center right", fontsize="small")
    fig.tight_layout()
    fig.savefig(BENCH / "results" / f"agent-{name}.png", dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
