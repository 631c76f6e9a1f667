"""What per-sample traces cost an episode of the embedded default (issue 47, item 5: at most 2 %, nothing when off).

Two measurements, printed as tables and written to `bench/results/trace_cost.json`:

* the work a trace adds to an episode, timed alone on an episode's worth of samples of the default's shape
  (128 samples, prompts of 8 tokens, responses of 2): the StreamDataset's rows (`trace_rows`), the table's write
  (`write_trace`, fsync included) and the UI's samples (`explaining`); the median of ``--repeat`` runs. The
  artifact and the events are posted in the background (`api_link`), off the episode's path;
* whole `chatlearn train` runs of the default, ``runtime.trace_samples`` none and all alternating (``--rounds``
  of each), ``--episodes`` episodes each: the median `episode_seconds`, and the wall time from "ready to train"
  to the process's end per episode (which has the recorder's write in it), per variant, and all against none.

    .venv/bin/python bench/trace_cost.py [--rounds 2] [--episodes 10] [--repeat 20]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chatlearn.runtime.records.traces import explaining, trace_rows, write_trace  # noqa: E402


def episode_samples(n: int = 128, prompt: int = 8, response: int = 2) -> list[dict]:
    """Samples as the default's StreamDataset holds them (PPO: per-token advantages, returns, KL, log-probs)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        out.append({"sample_id": i, "group_id": i, "prompt": "max 3 9 4 ?", "response": "9",
                    "prompt_ids": torch.randint(4, 30, (prompt,), generator=g), "prompt_mask": torch.ones(prompt),
                    "response_ids": torch.randint(4, 30, (response,), generator=g),
                    "response_mask": torch.ones(response), "scores": torch.rand((), generator=g),
                    "advantages": torch.randn(response, generator=g), "returns": torch.randn(response, generator=g),
                    "kl": torch.rand(response, generator=g), "logprobs": -torch.rand(response, generator=g),
                    "values": torch.randn(response, generator=g)})
    return out


def added_work(repeat: int) -> dict:
    samples = episode_samples()
    times = {"trace_rows": [], "write_trace": [], "explaining": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeat):
            t0 = time.perf_counter()
            rows = trace_rows(samples, range(len(samples)), r, "all", 42)
            t1 = time.perf_counter()
            size = write_trace(tmp, r, rows)
            t2 = time.perf_counter()
            explaining(rows, 42)
            t3 = time.perf_counter()
            times["trace_rows"].append(t1 - t0)
            times["write_trace"].append(t2 - t1)
            times["explaining"].append(t3 - t2)
    out = {k: statistics.median(v) * 1000 for k, v in times.items()}
    out["total_ms"] = sum(out.values())
    out["bytes_per_episode"] = size
    return out


def train(variant: str, episodes: int, out: str) -> dict:
    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=out)
    env.pop("PREFECT_API_URL", None)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "chatlearn.cli", "train", f"runtime.num_episode={episodes}",
                          f"runtime.trace_samples={variant}", f"runtime.exp_name={variant}",
                          "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    total = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(res.stderr[-3000:])
    ready = float(re.search(r"ready to train in ([\d.]+)s", res.stderr)[1])
    rows = [json.loads(line) for line in (Path(out) / variant / "metrics.jsonl").read_text().splitlines()]
    return {"episode_seconds": statistics.median(r["episode_seconds"] for r in rows[1:]),
            "process_seconds": total, "ready_seconds": ready,
            "trace_bytes": statistics.median(r.get("trace_bytes", 0) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()

    work = added_work(args.repeat)
    print("work a trace adds to an episode of the default (128 samples), median of", args.repeat)
    for key in ("trace_rows", "write_trace", "explaining", "total_ms"):
        print(f"  {key:<12} {work[key]:8.2f} ms")
    print(f"  table size   {work['bytes_per_episode']:,} bytes")

    if args.rounds == 0:  # the added work only
        return
    runs: dict[str, list[dict]] = {"none": [], "all": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for variant in (("none", "all") if r % 2 == 0 else ("all", "none")):
                runs[variant].append(train(variant, args.episodes, os.path.join(tmp, f"round{r}")))
    table = {}
    for variant, got in runs.items():
        table[variant] = {"episode_seconds": statistics.median(g["episode_seconds"] for g in got),
                          "process_seconds": statistics.median(g["process_seconds"] for g in got),
                          "trace_bytes": statistics.median(g["trace_bytes"] for g in got)}
    ratio = table["all"]["episode_seconds"] / table["none"]["episode_seconds"]
    share = work["total_ms"] / 1000 / table["none"]["episode_seconds"]
    print(f"\nwhole runs, {args.rounds} of each, {args.episodes} episodes (median episode after the first)")
    print(f"  {'trace_samples':<14}{'episode s':>10}{'process s':>11}{'table bytes':>13}")
    for variant, row in table.items():
        print(f"  {variant:<14}{row['episode_seconds']:>10.3f}{row['process_seconds']:>11.1f}"
              f"{row['trace_bytes']:>13,.0f}")
    print(f"  all / none episode seconds: {ratio:.3f}; the added work alone: {100 * share:.2f} % of an episode")
    out = REPO / "bench" / "results" / "trace_cost.json"
    out.write_text(json.dumps({"added_work_ms": work, "runs": runs, "medians": table, "ratio_all_none": ratio,
                               "added_work_share": share, "args": vars(args)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
