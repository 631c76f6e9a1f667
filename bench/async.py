"""Pipelined episodes (`runtime.max_staleness`) against synchronous ones, on the same layout, in one run.

The variable-length GRPO workload of `bench/vs_trl.py` (64 prompts x 8 samples an episode, prompts of 8-64
tokens, responses up to 256 new tokens ending where EOS is drawn, the parity rule reward, continuous batching
and packed training) with one generation process and one training process: the policy in a worker process
of one core, the trainer and the reward's actor in another of one core (`bench/configs/grpo_vs_trl.yaml`
with the layout overridden). Every `max_staleness` in `--staleness` (default 0, 1, 2) runs the real
`chatlearn train` for `--episodes` episodes, one after another, with an eval of 64 held-out prompts before
training and after every episode.

Per variant: samples per second (the median over the episodes after the first two, when the pipeline has filled,
of the samples an episode trained over its `episode_seconds`; with partial rollouts an episode trains the prompt
groups that finished, a varying number) and generated tokens per second (responses lengthen as
the policy learns, at each variant's own pace), the staleness the trainer saw, and the eval reward after
each episode against the samples trained. The speed-up is each variant's samples per second over
`max_staleness: 0`'s; the eval reward is compared at equal samples (after the last episode). Prints a table,
writes `bench/results/async.json` and plots the curves in `bench/results/async.png`.

    .venv/bin/python bench/async.py [--episodes 6] [--prompts 64] [--staleness 0 1 2] [--work DIR]
        [--extra key=value ... --tag NAME]   # e.g. a rollout correction, written to async-NAME.json
    # partial rollouts: --tag partial --extra runtime.use_partial_rollout=true runtime.stream_data_loader_type=dynamic
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from common import REPO, run_train  # noqa: E402  (bench/ is a folder of scripts, not a package)
from vs_trl import CONFIG, WORKLOADS, build_model, write_prompts  # noqa: E402

RESULT = BENCH / "results" / "async.json"
PLOT = BENCH / "results" / "async.png"
EVAL_PROMPTS = 64
# one process generates, the other trains (and runs the reward's actor): one core each
LAYOUT = ["models.policy.num_cpu=1", "models.policy.cpu_per_process=1", "models.reward.num_cpu=1",
          "models.reward.cpu_per_process=1", "models.ppo_policy.num_cpu=1", "models.ppo_policy.cpu_per_process=1",
          "runtime.colocation=['reward,ppo_policy']"]


def run_variant(work: Path, model: Path, data: Path, eval_data: Path, k: int, args: argparse.Namespace) -> dict:
    wl = WORKLOADS["variable"]
    samples = args.prompts * wl.per_prompt
    os.environ.update(VS_TRL_MODEL=str(model), VS_TRL_DATA=str(data),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")])))
    out = work / (f"staleness-{k}" + (f"-{args.tag}" if args.tag else ""))
    overrides = [str(CONFIG.relative_to(REPO)), f"runtime.num_episode={args.episodes}",
                 f"runtime.sample_per_episode={samples}", f"runtime.generation_batch_size={samples}",
                 f"runtime.train_global_batch_size={samples}",
                 f"runtime.train_micro_batch_size={samples // wl.micro_steps}",
                 f"models.policy.args_dict.max_new_tokens={wl.new_tokens}", "models.policy.args_dict.min_new_tokens=0",
                 f"models.policy.args_dict.num_inference_per_prompt={wl.per_prompt}",
                 f"runtime.eval_data_path={eval_data}", "runtime.eval_episode_interval=1",
                 "runtime.enable_eval_before_training=true", f"runtime.max_staleness={k}", *LAYOUT, *wl.ours,
                 *args.extra]
    metrics = out / "vs_trl" / "metrics.jsonl"
    if args.work and metrics.exists():  # --work: a finished variant of an earlier run is read, not run again
        wall = None
    else:
        wall = run_train(out, overrides, f"chatlearn train (max_staleness {k})")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = rows[2:] or rows
    seconds = statistics.median(r["episode_seconds"] for r in kept)
    # samples trained: an episode's sample_per_episode, but with partial rollouts the groups that finished
    trained = [r.get("num_samples", samples) for r in rows]
    per_second = statistics.median(n / r["episode_seconds"] for n, r in zip(trained[2:] or trained, kept, strict=True))
    # responses lengthen as the policy learns, and at a different pace per variant: tokens per second too
    tokens = statistics.median(n * r.get("response_length_mean", 0.0) / r["episode_seconds"]
                               for n, r in zip(trained[2:] or trained, kept, strict=True))
    curve = [(0, rows[0].get("eval_reward_mean_before_training"))]
    curve += [(sum(trained[:i + 1]), r.get("eval_reward_mean")) for i, r in enumerate(rows)]
    return {"max_staleness": k, "wall_seconds": wall, "episode_seconds": [r["episode_seconds"] for r in rows],
            "steady_episode_seconds": seconds, "samples_per_second": per_second, "samples_trained": trained,
            "partial": {key: [r.get(key) for r in rows] for key in ("round_0_samples", "round_1_samples",
                                                                    "partial_unfinished", "partial_waiting",
                                                                    "staleness_token_mean")},
            "generated_tokens_per_second": tokens,
            "response_length_mean_per_episode": [r.get("response_length_mean") for r in rows],
            "stage_seconds": [r.get("stage_seconds", {}) for r in rows],
            "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in rows),
            "staleness_max": max(r.get("staleness_max", 0.0) for r in rows),
            "dropped_stale": sum(r.get("dropped_stale", 0.0) for r in rows),
            "reward_mean": [r.get("reward_mean") for r in rows],
            "response_length_mean": statistics.mean(r.get("response_length_mean", 0.0) for r in rows),
            "eval_curve": curve}


def plot(variants: list[dict], path: Path, tag: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for v in variants:
        xs, ys = zip(*[(x, y) for x, y in v["eval_curve"] if y is not None], strict=True)
        left.plot(xs, ys, marker="o", label=f"max_staleness {v['max_staleness']}")
        right.plot(range(1, len(v["episode_seconds"]) + 1), v["episode_seconds"], marker="o",
                   label=f"max_staleness {v['max_staleness']}")
    left.set_xlabel("samples trained")
    left.set_ylabel("eval reward (mean)")
    left.set_title("eval reward against samples trained" + (f" ({tag})" if tag else ""))
    right.set_xlabel("episode")
    right.set_ylabel("seconds")
    right.set_title("seconds per episode")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=6)
    p.add_argument("--prompts", type=int, default=64, help="prompts an episode (8 samples each)")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--work", type=Path, help="the folder of an earlier run: its finished variants are read again")
    p.add_argument("--extra", nargs="*", default=[], help="key=value overrides for every variant (e.g. a "
                   "rollout correction); with --tag, their variants get folders of their own")
    p.add_argument("--tag", default="", help="suffix of the variants' folders (and of the result files)")
    args = p.parse_args(argv)
    wl = WORKLOADS["variable"]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-async-"))
    model, data, eval_data = work / "model", work / "prompts.jsonl", work / "eval.jsonl"
    built = build_model(model, wl)
    write_prompts(data, args.prompts * args.episodes, wl)
    write_prompts(eval_data, args.prompts * args.episodes + EVAL_PROMPTS, wl)  # the same seed: keep the tail
    lines = eval_data.read_text().splitlines()[-EVAL_PROMPTS:]
    eval_data.write_text("\n".join(lines) + "\n")
    variants = []
    for k in args.staleness:
        variants.append(run_variant(work, model, data, eval_data, k, args))
        v = variants[-1]
        print(f"max_staleness {k}: {v['samples_per_second']:.2f} samples/s, staleness {v['staleness_mean']:.2f}, "
              f"eval {v['eval_curve'][-1][1]}", file=sys.stderr)
    base = next(v for v in variants if v["max_staleness"] == 0) if 0 in args.staleness else variants[0]
    for v in variants:
        v["speedup"] = v["samples_per_second"] / base["samples_per_second"]
        v["tokens_speedup"] = v["generated_tokens_per_second"] / base["generated_tokens_per_second"]
        v["eval_reward_minus_sync"] = v["eval_curve"][-1][1] - base["eval_curve"][-1][1]
    result = {"settings": {"prompts": args.prompts, "samples_per_episode": args.prompts * wl.per_prompt,
                           "episodes": args.episodes, "new_tokens": wl.new_tokens,
                           "prompt_tokens": wl.prompt_tokens, "eos_alpha": built["eos_alpha"],
                           "eval_prompts": EVAL_PROMPTS, "layout": LAYOUT, "overrides": list(wl.ours),
                           "machine": f"{os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d")},
              "variants": variants}
    print(f"\n{args.prompts} prompts x {wl.per_prompt} samples an episode, {args.episodes} episodes, responses up to "
          f"{wl.new_tokens} tokens; one generation process, one training process")
    print(f"{'max_staleness':>13s} {'s/episode':>10s} {'samples/s':>10s} {'speed-up':>9s} {'tokens/s':>9s} "
          f"{'speed-up':>9s} {'staleness':>10s} {'eval after':>11s} {'vs sync':>8s}")
    for v in variants:
        print(f"{v['max_staleness']:13d} {v['steady_episode_seconds']:10.1f} {v['samples_per_second']:10.2f} "
              f"{v['speedup']:9.2f} {v['generated_tokens_per_second']:9.0f} {v['tokens_speedup']:9.2f} "
              f"{v['staleness_mean']:10.2f} {v['eval_curve'][-1][1]:11.4f} {v['eval_reward_minus_sync']:+8.4f}")
    result["settings"]["extra"] = list(args.extra)
    suffix = f"-{args.tag}" if args.tag else ""
    out, png = RESULT.with_stem(RESULT.stem + suffix), PLOT.with_stem(PLOT.stem + suffix)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(variants, png, args.tag)
    print(f"wrote {out.relative_to(REPO)} and {png.relative_to(REPO)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
