"""The rollout engines side by side: seconds and peak memory of one generation batch, per engine.

Two workloads, each generation batch drawn with the per-sample sampler as a run draws it:

* **variable**: bench/vs_trl.py's variable-length work (its model, with the EOS row set for a mean response
  near 64 tokens, limit 256; 512 prompts of 8-64 tokens), one batch of 512;
* **default**: the embedded default's policy (the tiny Llama, ``configs/default.yaml``'s ``max_new_tokens``),
  one batch of the default's ``generation_batch_size`` max-digit prompts.

Each engine runs in a fresh process (2 torch threads), ``--repeat`` times after one warm-up batch; the table
has the median seconds, the generated tokens per second and the process's peak RSS (VmHWM: the engine's
KV cache and activations on top of the same model). Writes ``bench/results/rollout.json``.

    .venv/bin/python bench/rollout.py [--repeat 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULT = BENCH / "results" / "rollout.json"
MODES = {"variable": [("hf", 0), ("continuous", 64), ("continuous", 128), ("continuous", 256)],
         "default": [("hf", 0), ("continuous", 256)]}


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(2)
    from chatlearn.models.hf.common import load_causal_lm, load_tokenizer
    from chatlearn.models.hf.policy import response_mask_from_eos
    from chatlearn.models.hf.rollout import ROLLOUT_ENGINES, Request

    model, tok = load_causal_lm(args.model).eval(), load_tokenizer(args.model)
    prompts = [json.loads(line)[args.key] for line in Path(args.data).read_text().splitlines()][: args.batch]
    enc = tok(prompts, padding=True, return_tensors="pt")
    times, tokens = [], 0
    for i in range(args.repeat + 1):
        req = Request(enc["input_ids"], enc["attention_mask"], args.new_tokens, 0, tok.eos_token_id,
                      tok.pad_token_id, do_sample=True, sample_ids=list(range(len(prompts))), seed=i,
                      max_num_seqs=args.slots or len(prompts))
        t = time.perf_counter()
        with torch.no_grad():
            response, _ = ROLLOUT_ENGINES[args.engine](model).generate(req)
        if i:  # the first is warm-up
            times.append(time.perf_counter() - t)
            tokens = int(response_mask_from_eos(response, tok.eos_token_id).sum())
    Path(args.out).write_text(json.dumps({"seconds": times, "tokens": tokens, "peak_rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak RSS since its exec (VmHWM): ``ru_maxrss`` would keep the forking parent's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_mode(work: Path, name: str, engine: str, slots: int, model: Path, data: Path, key: str, batch: int,
             new_tokens: int, repeat: int) -> dict:
    out = work / f"{name}-{engine}-{slots}.json"
    cmd = [sys.executable, __file__, "--worker", "--engine", engine, "--slots", str(slots), "--model", str(model),
           "--data", str(data), "--key", key, "--batch", str(batch), "--new-tokens", str(new_tokens),
           "--repeat", str(repeat), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="2"))
    got = json.loads(out.read_text())
    med = statistics.median(got["seconds"])
    return {"engine": engine, "max_num_seqs": slots or None, "seconds": med, "tokens": got["tokens"],
            "tokens_per_second": got["tokens"] / med, "peak_rss_mb": got["peak_rss_mb"], "runs": got["seconds"]}


def main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(BENCH))
    import vs_trl  # noqa: E402  (bench/ is a folder of scripts, not a package)

    from chatlearn.config import load_config
    from chatlearn.models.hf.tiny import ensure_tiny_model
    from chatlearn.tasks.max_digit import make_records

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    wl = vs_trl.WORKLOADS["variable"]
    vs_trl.build_model(work / "variable-model", wl)
    vs_trl.write_prompts(work / "variable.jsonl", 512, wl)
    cfg = load_config(str(REPO / "configs" / "default.yaml"), [])
    policy = cfg.models["policy"].args_dict
    ensure_tiny_model(work / "default-model", policy.get("tiny_model"))
    batch = cfg.runtime.generation_batch_size
    with (work / "default.jsonl").open("w") as f:
        for rec in make_records(batch, seed=0):
            f.write(json.dumps(rec) + "\n")
    setups = {"variable": (work / "variable-model", work / "variable.jsonl", "prompt", 512, wl.new_tokens),
              "default": (work / "default-model", work / "default.jsonl", policy.get("prompt_key", "prompt"),
                          batch, int(policy["max_new_tokens"]))}
    results = {}
    for name, modes in MODES.items():
        model, data, key, n, new_tokens = setups[name]
        results[name] = {"batch": n, "new_tokens": new_tokens, "modes": [
            run_mode(work, name, engine, slots, model, data, key, n, new_tokens, args.repeat)
            for engine, slots in modes]}
        base = results[name]["modes"][0]["seconds"]
        print(f"\n{name}: one batch of {n}, up to {new_tokens} new tokens (median of {args.repeat})")
        print(f"{'engine':12s} {'slots':>6s} {'seconds':>8s} {'vs hf':>6s} {'tokens/s':>9s} {'peak RSS MB':>12s}")
        for m in results[name]["modes"]:
            print(f"{m['engine']:12s} {str(m['max_num_seqs'] or '-'):>6s} {m['seconds']:8.2f} "
                  f"{base / m['seconds']:5.2f}x {m['tokens_per_second']:9.0f} {m['peak_rss_mb']:12.0f}")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "repeat": args.repeat, "threads": 2,
                                  "workloads": results}, indent=1))
    print(f"wrote {RESULT.relative_to(REPO)}")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    for flag in ("--worker",):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag, kind in (("--engine", str), ("--slots", int), ("--model", str), ("--data", str), ("--key", str),
                       ("--batch", int), ("--new-tokens", int), ("--out", str)):
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    worker(arguments) if arguments.worker else main(arguments)
