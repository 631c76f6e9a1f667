"""GRPO on a model of real size, per rollout engine: episode, generation, training and sync seconds, memory.

`chatlearn train configs/grpo.yaml` (the real command, its own local Prefect server) with the policy, reference
and trainer replaced by a random-init model of Qwen2.5-0.5B's shapes (`bench/rollout.py`'s, 24 layers, hidden 896,
14 heads over 2 KV heads, tied, 151,936 vocabulary rows), bf16 where the CPU has it (float32 otherwise: emulated
bf16 would measure the emulation), colocated in one process as the config has them. An episode: 4 prompts x 8
samples, each response exactly 32 tokens (`min_new_tokens`), one optimizer step on the 32 in micro-batches of 8
(`--micro-batch`: with it the vllm run's process peaked at 19.3 GB of this machine's 24 in float32; 16, the
earlier default, was not tried again after the sync fix of 25de7a7); no eval, no checkpoint but the last.

Engines: `hf`, `continuous` (32 slots), `vllm` (the CPU build, Intel's OpenMP preloaded as a run does it) and
`vllm-gomp` (vllm in a process on torch's own OpenMP: what the preload is worth). Rounds interleave the engines;
each row is the median over the episodes after the first of every round. Generation tokens/s is the episode's
generated tokens over its generate stage's seconds (the stage's own work: the engine plus the call).

    .venv/bin/python bench/real_size.py [--rounds 1] [--episodes 3] [--micro-batch 8] [--engines continuous vllm ...]

Writes `bench/results/real_size.json` after every run; a run that fails is recorded as failed (its stderr's
last lines) and the others go on.
"""

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, run_command  # noqa: E402  (bench/ is a folder of scripts, not a package)

RESULT = REPO / "bench" / "results" / "real_size.json"
ENGINES = ["hf", "continuous", "vllm", "vllm-gomp"]
SAMPLES, NEW_TOKENS = 32, 32


def overrides(model: Path, engine: str, episodes: int, bf16: bool, exp: str, micro_batch: int) -> list[str]:
    out = ["configs/grpo.yaml", f"runtime.num_episode={episodes}", f"runtime.sample_per_episode={SAMPLES}",
           f"runtime.generation_batch_size={SAMPLES}", f"runtime.train_micro_batch_size={micro_batch}",
           f"runtime.train_global_batch_size={SAMPLES}", "runtime.eval_episode_interval=0",
           "runtime.enable_eval_before_training=false", "runtime.save_episode_interval=0",
           f"runtime.rollout_engine={engine.split('-')[0]}", f"runtime.exp_name={exp}",
           f"models.policy.args_dict.max_new_tokens={NEW_TOKENS}",
           f"models.policy.args_dict.min_new_tokens={NEW_TOKENS}"]
    if engine == "continuous":
        out.append(f"models.policy.args_dict.max_num_seqs={SAMPLES}")
    for m in ("policy", "reference", "ppo_policy"):
        out.append(f"models.{m}.args_dict.model_path={model}")
        if bf16:
            out.append(f"models.{m}.args_dict.bf16=true")
    return out


def run(work: Path, model: Path, engine: str, episodes: int, bf16: bool, round_: int, micro_batch: int) -> dict:
    exp = f"{engine}-r{round_}"
    out = work / exp
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(out / "prefect"), OMP_NUM_THREADS="2")
    env.pop("PREFECT_API_URL", None)
    if engine == "vllm-gomp":  # an OpenMP named in LD_PRELOAD: the run preloads none of its own
        import torch

        env["LD_PRELOAD"] = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))[0]
    cmd = [str(REPO / ".venv" / "bin" / "chatlearn"), "train", f"runtime.output_dir={out}",
           *overrides(model, engine, episodes, bf16, exp, micro_batch)]
    wall, proc = run_command(cmd, env)  # a failed run is recorded, and the other engines' runs go on
    # the run's directory is `out` itself: output_dir ends with exp_name
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    failed = {"failed": f"exit {proc.returncode}: " + " ".join(proc.stderr.split()[-60:])} if proc.returncode else {}
    return {"wall_seconds": wall, **failed, "rows": [
        {"episode": r["episode"], "episode_seconds": r["episode_seconds"],
         "generate_seconds": r["stage_seconds"]["generate"], "train_seconds": r["stage_seconds"]["train"],
         "sync_seconds": r["stage_seconds"].get("sync", 0.0), "peak_memory_mb": r.get("peak_memory_mb"),
         "tokens": r["response_length_mean"] * r["num_samples"]} for r in rows]}


def summarize(runs: list[dict]) -> dict | None:
    later = [row for got in runs if "failed" not in got for row in got["rows"][1:]]  # the first episode warms up
    if not later:
        return None
    med = {k: statistics.median(row[k] for row in later)
           for k in ("episode_seconds", "generate_seconds", "train_seconds", "sync_seconds")}
    med["generate_tokens_per_second"] = statistics.median(row["tokens"] / row["generate_seconds"] for row in later)
    med["peak_memory_mb"] = max(row["peak_memory_mb"] or 0 for got in runs for row in got["rows"])
    med["episodes_measured"] = len(later)
    return med


def main(args: argparse.Namespace) -> None:
    import vs_trl
    from rollout import build_qwen05

    from chatlearn.models.hf.tiny import ensure_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-real-size-"))
    tok_from = ensure_tiny_model(work / "tiny")
    model = work / "qwen0.5b"
    build_qwen05(model, Path(tok_from))
    bf16 = vs_trl.cpu_has_bf16()
    runs: dict[str, list[dict]] = {e: [] for e in args.engines}
    for r in range(args.rounds):
        for engine in args.engines:
            got = run(work, model, engine, args.episodes, bf16, r, args.micro_batch)
            runs[engine].append(got)
            print(f"round {r + 1}, {engine}: {[round(x['episode_seconds'], 1) for x in got['rows']]} s an episode"
                  + (f"; FAILED, {got['failed'][:300]}" if "failed" in got else ""), flush=True)
            write(runs, bf16, args)
    table = write(runs, bf16, args)
    base = table.get("continuous")
    print(f"\nGRPO, Qwen2.5-0.5B shapes, {'bf16' if bf16 else 'float32'}, {SAMPLES} samples x {NEW_TOKENS} tokens, "
          f"median of {max((m['episodes_measured'] for m in table.values() if m), default=0)} episodes per engine")
    print(f"{'engine':11s} {'episode s':>9s} {'vs cont.':>8s} {'generate s':>10s} {'gen tok/s':>9s} {'vs cont.':>8s} "
          f"{'train s':>8s} {'sync s':>7s} {'peak MB':>8s}")
    for e, m in table.items():
        if m is None:
            print(f"{e:11s} failed: {[got.get('failed', '')[:200] for got in runs[e]]}")
            continue
        ep = f"{base['episode_seconds'] / m['episode_seconds']:.2f}x" if base else "-"
        tok = f"{m['generate_tokens_per_second'] / base['generate_tokens_per_second']:.2f}x" if base else "-"
        print(f"{e:11s} {m['episode_seconds']:9.2f} {ep:>8s} {m['generate_seconds']:10.2f} "
              f"{m['generate_tokens_per_second']:9.1f} {tok:>8s} {m['train_seconds']:8.2f} {m['sync_seconds']:7.2f} "
              f"{m['peak_memory_mb']:8.0f}")
    print(f"wrote {RESULT.relative_to(REPO)}")


def write(runs: dict[str, list[dict]], bf16: bool, args: argparse.Namespace) -> dict:
    """The table of the runs so far, written with them to RESULT."""
    table = {e: summarize(got) for e, got in runs.items() if got}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "dtype": "bfloat16" if bf16 else "float32",
                                  "cpus": os.cpu_count(), "samples": SAMPLES, "new_tokens": NEW_TOKENS,
                                  "micro_batch": args.micro_batch, "rounds": args.rounds, "episodes": args.episodes,
                                  "table": table, "runs": runs}, indent=1))
    return table


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--episodes", type=int, default=3, help="episodes per run (the first is warm-up)")
    p.add_argument("--micro-batch", type=int, default=8, help="train_micro_batch_size (the 32 samples: one step)")
    p.add_argument("--engines", nargs="*", choices=ENGINES, default=ENGINES)
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse(sys.argv[1:]))
