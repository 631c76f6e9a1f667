"""The rollout engines side by side: seconds and peak memory of one generation batch, per engine.

Two workloads, each generation batch drawn with the per-sample sampler as a run draws it:

* **variable**: bench/vs_trl.py's variable-length work (its model, with the EOS row set for a mean response
  near 64 tokens, limit 256; 512 prompts of 8-64 tokens), one batch of 512;
* **default**: the embedded default's policy (the tiny Llama, ``configs/default.yaml``'s ``max_new_tokens``),
  one batch of the default's ``generation_batch_size`` max-digit prompts;
* **qwen0.5b**: a random-init model of Qwen2.5-0.5B's shapes (bf16 where the CPU has it) with the tiny Llama's
  character tokenizer, one batch of 32 max-digit prompts, 32 new tokens each (the issue's GRPO episode).

Engines: ``hf``, ``continuous`` and ``vllm`` (vLLM's CPU build; its start-up, loading the model, is reported
apart: the ``startup s`` column).

Each engine runs in a fresh process (2 torch threads), ``--repeat`` times after one warm-up batch; the table
has the median seconds, the generated tokens per second and the process's peak RSS (VmHWM: the engine's
KV cache and activations on top of the same model). Writes ``bench/results/rollout.json``.

    .venv/bin/python bench/rollout.py [--repeat 3] [--only qwen0.5b ...]
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
# "vllm-gomp": vllm in a process without the OpenMP a run's policy process starts with (VLLMEngine.process_env),
# torch's own instead: what that preload is worth
MODES = {"variable": [("hf", 0), ("continuous", 64), ("continuous", 128), ("continuous", 256), ("vllm", 0)],
         "default": [("hf", 0), ("continuous", 256), ("vllm", 0)],
         "qwen0.5b": [("hf", 0), ("continuous", 32), ("vllm", 0), ("vllm-gomp", 0)]}
# Qwen2.5-0.5B's shapes (tied, 14 heads over 2 KV heads, the vocabulary padded to 151,936 rows past the
# tokenizer's), random init, bf16 where the CPU has it: a model of the size users start RL from
QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True, max_position_embeddings=32_768,
              rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(2)
    from chatlearn.models.hf.common import load_causal_lm, load_tokenizer
    from chatlearn.models.hf.policy import response_mask_to_stop
    from chatlearn.models.hf.rollout import ROLLOUT_ENGINES, Request

    model, tok = load_causal_lm(args.model, args.dtype).eval(), load_tokenizer(args.model)
    prompts = [json.loads(line)[args.key] for line in Path(args.data).read_text().splitlines()][: args.batch]
    enc = tok(prompts, padding=True, return_tensors="pt")
    times, tokens = [], 0
    start = time.perf_counter()
    engine = ROLLOUT_ENGINES[args.engine.split("-")[0]](model)  # once, as the policy makes it in its setup
    startup = time.perf_counter() - start
    for i in range(args.repeat + 1):
        req = Request(enc["input_ids"], enc["attention_mask"], args.new_tokens, 0, tok.eos_token_id,
                      tok.pad_token_id, do_sample=True, sample_ids=list(range(len(prompts))), seed=i,
                      max_num_seqs=args.slots or len(prompts))
        t = time.perf_counter()
        with torch.no_grad():
            response, _ = engine.generate(req)
        if i:  # the first is warm-up
            times.append(time.perf_counter() - t)
            tokens = int(response_mask_to_stop(response, tok.eos_token_id).sum())
    Path(args.out).write_text(json.dumps({"seconds": times, "tokens": tokens, "peak_rss_mb": peak_rss_mb(),
                                          "startup_seconds": startup}))


def peak_rss_mb() -> float:
    """This process's peak RSS since its exec (VmHWM): ``ru_maxrss`` would keep the forking parent's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_mode(work: Path, name: str, engine: str, slots: int, model: Path, data: Path, key: str, batch: int,
             new_tokens: int, repeat: int, dtype: str) -> dict:
    out = work / f"{name}-{engine}-{slots}.json"
    cmd = [sys.executable, __file__, "--worker", "--engine", engine, "--slots", str(slots), "--model", str(model),
           "--data", str(data), "--key", key, "--batch", str(batch), "--new-tokens", str(new_tokens),
           "--repeat", str(repeat), "--out", str(out), "--dtype", dtype]
    from chatlearn.models.hf.policy import ROLLOUT_ENGINES  # the policy's registry: vllm's engine registered

    # the environment a run's policy process starts with for this engine (vllm: Intel's OpenMP preloaded)
    own = ROLLOUT_ENGINES[engine].process_env() if engine in ROLLOUT_ENGINES else {}
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="2", **own))
    got = json.loads(out.read_text())
    med = statistics.median(got["seconds"])
    return {"engine": engine, "max_num_seqs": slots or None, "seconds": med, "tokens": got["tokens"],
            "tokens_per_second": got["tokens"] / med, "peak_rss_mb": got["peak_rss_mb"], "runs": got["seconds"],
            "startup_seconds": got["startup_seconds"]}


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
    if not args.only or "qwen0.5b" in args.only:  # 0.5B parameters written out: only when it runs
        build_qwen05(work / "qwen0.5b-model", work / "default-model")
    with (work / "qwen.jsonl").open("w") as f:
        for rec in make_records(32, seed=1):
            f.write(json.dumps(rec) + "\n")
    bf16 = "bfloat16" if vs_trl.cpu_has_bf16() else "float32"
    setups = {"variable": (work / "variable-model", work / "variable.jsonl", "prompt", 512, wl.new_tokens,
                           "float32"),
              "default": (work / "default-model", work / "default.jsonl", policy.get("prompt_key", "prompt"),
                          batch, int(policy["max_new_tokens"]), "float32"),
              # GRPO's episode of the issue: 32 samples of 32 tokens (random init: EOS almost never comes)
              "qwen0.5b": (work / "qwen0.5b-model", work / "qwen.jsonl", policy.get("prompt_key", "prompt"), 32, 32,
                           bf16)}
    results = {}
    for name, modes in MODES.items():
        if args.only and name not in args.only:
            continue
        model, data, key, n, new_tokens, dtype = setups[name]
        results[name] = {"batch": n, "new_tokens": new_tokens, "dtype": dtype, "modes": [
            run_mode(work, name, engine, slots, model, data, key, n, new_tokens, args.repeat, dtype)
            for engine, slots in modes]}
        base = results[name]["modes"][0]["seconds"]
        print(f"\n{name}: one batch of {n}, up to {new_tokens} new tokens, {dtype} (median of {args.repeat})")
        print(f"{'engine':12s} {'slots':>6s} {'seconds':>8s} {'vs hf':>6s} {'tokens/s':>9s} {'peak RSS MB':>12s} "
              f"{'startup s':>10s}")
        for m in results[name]["modes"]:
            print(f"{m['engine']:12s} {str(m['max_num_seqs'] or '-'):>6s} {m['seconds']:8.2f} "
                  f"{base / m['seconds']:5.2f}x {m['tokens_per_second']:9.0f} {m['peak_rss_mb']:12.0f} "
                  f"{m['startup_seconds']:10.1f}")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    if args.only and RESULT.exists():  # the other workloads' last results stay
        results = {**json.loads(RESULT.read_text())["workloads"], **results}
    RESULT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "repeat": args.repeat, "threads": 2,
                                  "workloads": results}, indent=1))
    print(f"wrote {RESULT.relative_to(REPO)}")


def build_qwen05(path: Path, tokenizer_from: Path) -> None:
    """A random-init Qwen2 of Qwen2.5-0.5B's shapes (QWEN05) with ``tokenizer_from``'s tokenizer, saved in bf16."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_from)  # a character-level one: it reads the same as Qwen2's BPE
    tok.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN05, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", nargs="*", choices=sorted(MODES), help="these workloads only")
    for flag in ("--worker",):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag, kind in (("--engine", str), ("--slots", int), ("--model", str), ("--data", str), ("--key", str),
                       ("--batch", int), ("--new-tokens", int), ("--out", str), ("--dtype", str)):
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    worker(arguments) if arguments.worker else main(arguments)
