"""bf16 against fp32 on the same run (issue 25, item 4): the embedded default (PPO on the tiny Llama, 20 episodes)
run twice, one after the other, the same seed and data: once in fp32, once with ``args_dict.bf16: true`` on every
HF model (the trainers keep fp32 weights and optimizer state and compute their decoder layers and LM head under
bf16 autocast; the inference copies hold bf16 weights). Reports the wall time, the median episode, the reward
and eval-reward curves (what precision does to learning), and each run's peak RSS per worker process.

    .venv/bin/python bench/precision.py                       # on this machine's CPU
    .venv/bin/python bench/precision.py --gpu                 # every model on one CUDA device, colocated

``--gpu`` adds ``num_gpu: 1`` to every model (the layout of ``bench/gpu_smoke.py``). Prints a table, writes
``bench/results/precision[-gpu].json`` and plots the curves in ``bench/results/precision[-gpu].png``.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, on_one_gpu, run_train  # noqa: E402  (bench/ is a folder of scripts, not a package)

HF_MODELS = ["policy", "reference", "value", "ppo_policy", "ppo_value"]  # the reward is the rule
ALL_MODELS = ["policy", "reference", "reward", "value", "ppo_policy", "ppo_value"]


def run(work: Path, bf16: bool, args: argparse.Namespace) -> dict:
    out = work / ("bf16" if bf16 else "fp32")
    overrides = [args.config, f"runtime.num_episode={args.episodes}", "runtime.eval_episode_interval=1",
                 "runtime.enable_eval_before_training=true", "runtime.save_episode_interval=1000"]
    if args.gpu:
        overrides += on_one_gpu(ALL_MODELS)
    if bf16:
        overrides += [f"models.{m}.args_dict.bf16=true" for m in HF_MODELS]
    wall = run_train(out, overrides, what=f"{'bf16' if bf16 else 'fp32'} run")
    rows = [json.loads(line) for line in next(out.glob("*/metrics.jsonl")).read_text().splitlines()]
    episode_s = [r["episode_seconds"] for r in rows if r.get("episode_seconds") is not None]
    return {"precision": "bf16 mixed (fp32 weights)" if bf16 else "fp32", "wall_s": wall,
            "episode_s_median": statistics.median(episode_s) if episode_s else None,
            "reward_curve": [r.get("reward_mean") for r in rows],
            "eval_curve": [rows[0].get("eval_reward_mean_before_training")] + [r.get("eval_reward_mean") for r in rows],
            "peak_rss_mb": max((r.get("peak_memory_mb") or 0) for r in rows)}


def plot(results: list[dict], path: Path, tag: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in results:
        left.plot(range(1, len(r["reward_curve"]) + 1), r["reward_curve"], marker=".", label=r["precision"])
        pts = [(i, y) for i, y in enumerate(r["eval_curve"]) if y is not None]
        right.plot(*zip(*pts, strict=True), marker=".", label=r["precision"])
    left.set(xlabel="episode", ylabel="reward (mean of the episode's samples)", title=f"train reward ({tag})")
    right.set(xlabel="episodes trained", ylabel="eval reward (mean)", title=f"eval reward ({tag})")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="default")
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--gpu", action="store_true", help="every model on one CUDA device")
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device")
        device = torch.cuda.get_device_name()
    else:
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        device = "CPU " + ("with AMX-BF16" if "amx_bf16" in flags else "with AVX512-BF16" if "avx512_bf16" in flags
                           else "without bf16 instructions (emulated)")
    work = Path(tempfile.mkdtemp(prefix="precision-"))
    results = [run(work, bf16, args) for bf16 in (False, True)]
    fp32, bf16 = results
    print(f"{'precision':28s} {'wall s':>7s} {'episode s':>10s} {'reward last':>12s} {'eval last':>10s} "
          f"{'peak MB':>8s}   ({device})")
    for r in results:
        print(f"{r['precision']:28s} {r['wall_s']:7.1f} {r['episode_s_median'] or 0:10.3f} "
              f"{r['reward_curve'][-1] or 0:12.4f} {r['eval_curve'][-1] or 0:10.4f} {r['peak_rss_mb']:8.1f}")
    ratio = fp32["episode_s_median"] / bf16["episode_s_median"] if bf16["episode_s_median"] else None
    print(f"bf16 episode speed-up over fp32: {ratio:.2f}x" if ratio else "no episode times")
    tag = "gpu" if args.gpu else "cpu"
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"precision-{tag}.json"
    out.write_text(json.dumps({"device": device, "config": args.config, "episodes": args.episodes,
                               "bf16_episode_speedup": ratio, "runs": results}, indent=1))
    plot(results, args.results / f"precision-{tag}.png", f"{args.config}, {device}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
