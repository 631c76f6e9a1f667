"""How close our train step and our generation come to what this machine can do: FLOP/s against its measured
sgemm FLOP/s, generation tokens/s against its memory-bandwidth (and compute) bound.

The setting is bench/vs_trl.py's (its builders make the model, tokenizer and prompts): GRPO, 64 prompts x 4
samples = 256 responses, 16-token prompts, exactly 32 new tokens, an fp32 Llama (hidden 256, 4 layers, 4 heads,
FFN 688, vocab 1024: 3.7M parameters), one optimizer step on the 256 responses in 4 micro-batches of 64, 2 torch
threads. Our modules run in this process with no Ray and no Prefect: ``PolicyInference`` and
``GRPOPolicyTrainer`` bound and set up as the tests do (``tests/test_engines_unit.py``), with the args of
bench/configs/grpo_vs_trl.yaml. The train step's micro-batches are real: one ``forward_step`` of the policy,
the parity reward, group advantages, re-batched by ``training_batches`` and ``collate_samples`` as the actor does.

What is measured (all times are medians of ``--reps`` after one untimed warm-up):

- sgemm: ``torch.mm`` of fp32 square matrices (512, 1024, 2048) with 2 threads; the best size is the "peak".
  Also the model's own matmul shapes, as a FLOP-weighted mix (total FLOPs / total seconds): for training, the
  linear layers of one micro-batch (64 x 48 tokens) forward, input-gradient and weight-gradient; for decoding,
  the linear layers at 256 rows (one token per response). Attention's small batched matmuls are not in the mix.
- memory bandwidth: the sum (read) and the copy (read + write) of a 256 MiB fp32 tensor, bytes/s.
- train step: ``GRPOPolicyTrainer.train_step`` on the 4 micro-batches (forward, backward, loss, clipping,
  AdamW). FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode`` over one whole step (matmuls and
  attention: its sdpa formulas are given the CPU flash-attention kernels, which it would count as 0; elementwise
  work is not counted), cross-checked with 6 N T (N: parameters less the input embedding,
  T: 256 x 48 tokens, every position's logits are computed) plus attention. FLOP/s against the peak sgemm and
  against the shape-matched mix: the issue's target is >= 60 % of sgemm.
- generation: ``PolicyInference.forward_step`` on one batch of 256 (the 64 prompts x 4; Hugging Face
  ``generate`` with the KV cache and our per-sample Gumbel sampler, which keeps the drawn tokens' log-probs as
  it goes), in tokens/s and counted FLOP/s. Its parts are timed on their own: ``generate`` greedy without our
  sampler (the decode loop), the sampler's 32 calls alone, and, for comparison, the separate log-prob pass
  ``forward_step`` ran after generating until e9b5c77. The bound for the decode
  loop: each of its 32 forward passes reads the weights once (less the input embedding, which is gathered) and
  the KV cache so far, at the measured read bandwidth; the compute bound is its counted FLOPs at the peak sgemm;
  the roofline is the larger, and it is ``forward_step``'s bound too (the sampler adds no matmul). The
  weights (14 MB less the input embedding) fit in this machine's L3 cache (see ``machine``), so their share of
  the memory bound is loose; the KV cache (up to ~100 MB at 256 x 48 positions) does not fit.

Timings on a shared 2-core machine are noisy: read the medians (the spread is in the JSON), nothing is asserted.
Prints a table and writes ``bench/results/mfu.json``.

    .venv/bin/python bench/mfu.py [--reps 5]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402  (bench/ is a folder of scripts, not a package: the setting's builders)
from common import REPO  # noqa: E402

RESULT = REPO / "bench" / "results" / "mfu.json"
THREADS = vs_trl.THREADS
PROMPTS = 64
SAMPLES = PROMPTS * vs_trl.PER_PROMPT
MICRO = SAMPLES // vs_trl.MICRO_STEPS
SEQ = vs_trl.PROMPT_TOKENS + vs_trl.NEW_TOKENS
SQUARE_SIZES = (512, 1024, 2048)
BANDWIDTH_BYTES = 256 * 2**20
MIN_SAMPLE_SECONDS = 0.05  # a timed sample repeats a short kernel until it lasts this long
TARGET = 0.60


# ---- timing ----

def seconds_per_call(fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds per call of `fn`, `reps` samples after one warm-up; a sample loops `fn` enough times to last at
    least MIN_SAMPLE_SECONDS (so kernels of a millisecond are timed over many calls)."""
    fn()
    t0 = time.perf_counter()
    fn()
    inner = max(1, int(MIN_SAMPLE_SECONDS / max(time.perf_counter() - t0, 1e-7)))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return samples


def spread(samples: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": samples}


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of `fn` by FlopCounterMode: matmuls and attention. Its registry misses the CPU flash-attention
    kernels that scaled_dot_product_attention runs here (it would count 0 for them): they get its sdpa formulas
    (the full S x S product, the causal half not taken off, as for the other kernels)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten
    cpu_attention = {
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *_, out_shape=None, **__: sdpa_flop_count(q, k, v),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda g, q, k, v, *_, out_shape=None, **__: sdpa_backward_flop_count(g, q, k, v),
    }
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        fn()
    return int(counter.get_total_flops())


# ---- the machine: sgemm and memory bandwidth ----

def sgemm_square(reps: int) -> dict[str, Any]:
    import torch

    sizes = {}
    for n in SQUARE_SIZES:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        t = seconds_per_call(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), reps)
        sizes[str(n)] = {"seconds": spread(t), "flops_per_second": 2 * n**3 / statistics.median(t)}
    best = max(sizes, key=lambda k: sizes[k]["flops_per_second"])
    return {"sizes": sizes, "peak_size": int(best), "peak_flops_per_second": sizes[best]["flops_per_second"]}


def linear_pairs() -> list[tuple[str, int, int, int]]:
    """The model's linear layers as (name, in, out, how many)."""
    m, layers = vs_trl.MODEL, vs_trl.MODEL["num_hidden_layers"]
    h, f, v = m["hidden_size"], m["intermediate_size"], m["vocab_size"]
    return [("q,k,v,o", h, h, 4 * layers), ("gate,up", h, f, 2 * layers), ("down", f, h, layers),
            ("lm_head", h, v, 1)]


def sgemm_mix(rows: int, backward: bool, reps: int) -> dict[str, Any]:
    """The model's linear layers at `rows` rows as torch runs them (F.linear forward; the input gradient
    gy @ W and the weight gradient gy.T @ x in backward), FLOP-weighted: total FLOPs / total seconds."""
    import torch
    import torch.nn.functional as F

    parts, flops, seconds = [], 0, 0.0
    for name, d_in, d_out, count in linear_pairs():
        x, w, gy = torch.randn(rows, d_in), torch.randn(d_out, d_in), torch.randn(rows, d_out)
        ops = {"forward": lambda x=x, w=w: F.linear(x, w)}
        if backward:
            ops["input_grad"] = lambda gy=gy, w=w: torch.mm(gy, w)
            ops["weight_grad"] = lambda gy=gy, x=x: torch.mm(gy.t(), x)
        for op, fn in ops.items():
            t = statistics.median(seconds_per_call(fn, reps))
            f = 2 * rows * d_in * d_out
            parts.append({"layer": name, "op": op, "shape": f"[{rows},{d_in}]x[{d_in},{d_out}]" if op == "forward"
                          else f"[{rows},{d_out}]x[{d_out},{d_in}]" if op == "input_grad"
                          else f"[{d_out},{rows}]x[{rows},{d_in}]", "count": count, "flops_per_second": f / t})
            flops += f * count
            seconds += t * count
    return {"rows": rows, "backward": backward, "flops": flops, "seconds": seconds,
            "flops_per_second": flops / seconds, "parts": parts}


def bandwidth(reps: int) -> dict[str, Any]:
    import torch

    x = torch.ones(BANDWIDTH_BYTES // 4)
    y = torch.empty_like(x)
    read = seconds_per_call(lambda: x.sum(), reps)
    copy = seconds_per_call(lambda: y.copy_(x), reps)
    return {"tensor_bytes": BANDWIDTH_BYTES,
            "read_bytes_per_second": BANDWIDTH_BYTES / statistics.median(read), "read_seconds": spread(read),
            "copy_bytes_per_second": 2 * BANDWIDTH_BYTES / statistics.median(copy), "copy_seconds": spread(copy)}


# ---- our modules, in this process ----

def bound(cls: type, name: str, args: dict, trainable: bool) -> Any:
    """A module bound and set up as the tests do (tests/test_engines_unit.py), with 2 CPUs per process."""
    from chatlearn.utils.arguments import ModelConfig, RuntimeConfig

    rt = RuntimeConfig(sample_per_episode=SAMPLES, generation_batch_size=SAMPLES, train_micro_batch_size=MICRO,
                       train_global_batch_size=SAMPLES, seed=vs_trl.SEED)
    mod = cls(name)
    mod.bind(ModelConfig(num_cpu=THREADS, cpu_per_process=THREADS, trainable=trainable, args_dict=args), rt, 0,
             seed=vs_trl.SEED)
    mod.setup()
    return mod


def config_args(model: str, path: Path) -> dict:
    import yaml

    args = dict(yaml.safe_load(vs_trl.CONFIG.read_text())["models"][model]["args_dict"])
    args["model_path"] = str(path)
    return args


def modules(work: Path) -> tuple[Any, Any, dict, int]:
    """The policy, the trainer, a generation batch of the 256 prompts' groups, and the parameter count."""
    from chatlearn.models.hf.grpo_trainer import GRPOPolicyTrainer
    from chatlearn.models.hf.policy import PolicyInference

    model_dir, data = work / "model", work / "prompts.jsonl"
    n_params = vs_trl.build_model(model_dir)
    vs_trl.write_prompts(data, PROMPTS)
    records = [json.loads(line) for line in data.read_text().splitlines()]
    policy = bound(PolicyInference, "policy", config_args("policy", model_dir), trainable=False)
    trainer = bound(GRPOPolicyTrainer, "ppo_policy", config_args("ppo_policy", model_dir), trainable=True)
    grouped = [r for r in records for _ in range(vs_trl.PER_PROMPT)]
    batch = policy.collate_fn(policy.build_dataset(grouped))
    batch["sample_id"] = list(range(SAMPLES))
    batch["group_id"] = [i // vs_trl.PER_PROMPT for i in range(SAMPLES)]
    return policy, trainer, batch, n_params


def train_micro_batches(policy: Any, generated: dict) -> list[dict]:
    """One optimizer step's micro-batches, as the actor makes them: scores, group advantages, re-batching."""
    import torch

    from chatlearn.algorithms.grpo import group_advantages_by_id
    from chatlearn.data.batch import collate_samples, split_batch
    from chatlearn.data.stream import training_batches

    scores = torch.tensor([vs_trl.parity_score(p, r) for p, r in zip(generated["prompt"], generated["response"],
                                                                     strict=True)])
    out = {**generated, "scores": scores, "advantages": group_advantages_by_id(scores, generated["group_id"])}
    steps = training_batches(split_batch(out), MICRO, SAMPLES, 1, seed=vs_trl.SEED, group_size=vs_trl.PER_PROMPT)
    assert len(steps) == 1 and len(steps[0]) == vs_trl.MICRO_STEPS
    data_list = [collate_samples(mb, policy.tokenizer.pad_token_id) for mb in steps[0]]
    assert all(tuple(mb["response_ids"].shape) == (MICRO, vs_trl.NEW_TOKENS) for mb in data_list)
    return data_list


def reps_of(fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds of `reps` calls of a long `fn` after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# ---- the measures ----

def measure_train(trainer: Any, data_list: list[dict], n_nonembed: int, reps: int) -> dict[str, Any]:
    m = vs_trl.MODEL
    step = iter(range(10**6))
    counted = count_flops(lambda: trainer.train_step(data_list, next(step)))
    tokens = SAMPLES * SEQ
    attention = 3 * 4 * SAMPLES * SEQ**2 * m["hidden_size"] * m["num_hidden_layers"]  # QK^T and AV, fwd + 2x bwd
    t = reps_of(lambda: trainer.train_step(data_list, next(step)), reps)
    return {"tokens": tokens, "flops_counted": counted, "flops_6nt": 6 * n_nonembed * tokens,
            "flops_attention_analytic": attention, "seconds": spread(t),
            "flops_per_second": counted / statistics.median(t)}


def decode_bytes(param_bytes: int) -> int:
    """Bytes the decode loop must read at least: per forward pass the weights once and the KV cache so far
    (K and V of every layer at every earlier position); the first pass (the prompt) has no cache to read."""
    m = vs_trl.MODEL
    kv_per_position = 2 * m["num_hidden_layers"] * m["hidden_size"] * 4 * SAMPLES
    total = 0
    for k in range(vs_trl.NEW_TOKENS):  # pass 0 is the prompt, pass k >= 1 feeds token k and reads P + k positions
        total += param_bytes + (kv_per_position * (vs_trl.PROMPT_TOKENS + k) if k else 0)
    return total


def measure_generation(policy: Any, batch: dict, generated: dict, reps: int, param_bytes: int, peak: float,
                       read_bw: float) -> dict[str, Any]:
    import torch

    from chatlearn.models.hf.common import response_logprobs
    from chatlearn.models.hf.policy import PerSampleSampler

    tok = policy.tokenizer
    it = iter(range(1, 10**6))

    def ours() -> dict:
        return policy.forward_step(batch, next(it))

    def greedy() -> torch.Tensor:
        with torch.no_grad():
            return policy.model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"],
                                         max_new_tokens=vs_trl.NEW_TOKENS, min_new_tokens=vs_trl.NEW_TOKENS,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                         use_cache=True, do_sample=False)

    width = batch["prompt_ids"].shape[1]
    sampler = PerSampleSampler(policy.seed, batch["sample_id"], policy.args.temperature, policy.args.top_k,
                               policy.args.top_p, prompt_width=width)
    scores = torch.randn(SAMPLES, vs_trl.VOCAB)
    ids = [torch.zeros(SAMPLES, width + k, dtype=torch.long) for k in range(vs_trl.NEW_TOKENS)]

    def sample_only() -> None:
        for i in ids:
            sampler(i, scores)

    def logprob_pass() -> torch.Tensor:
        with torch.no_grad():
            return response_logprobs(policy.infer_model, generated, policy.device, policy.args.temperature)

    assert greedy().shape == (SAMPLES, width + vs_trl.NEW_TOKENS)  # EOS never drawn: min_new_tokens
    flops = {"forward_step": count_flops(ours), "decode_loop": count_flops(greedy),
             "logprob_pass": count_flops(logprob_pass)}
    times = {"forward_step": reps_of(ours, reps), "decode_loop": reps_of(greedy, reps),
             "sampler": reps_of(sample_only, reps), "logprob_pass": reps_of(logprob_pass, reps)}
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = SAMPLES * vs_trl.NEW_TOKENS
    read = decode_bytes(param_bytes)
    memory_s, compute_s = read / read_bw, flops["decode_loop"] / peak
    # forward_step's bound: the decode loop's (the sampler and its log-probs add no matmul)
    step_s = max(memory_s, compute_s)
    return {
        "batch": SAMPLES, "new_tokens": vs_trl.NEW_TOKENS, "tokens": tokens, "flops_counted": flops,
        "seconds": {k: spread(v) for k, v in times.items()},
        "tokens_per_second": {k: tokens / med[k] for k in ("forward_step", "decode_loop")},
        "flops_per_second": {k: flops[k] / med[k] for k in flops},
        "bound": {"bytes_read": read, "weight_bytes_per_pass": param_bytes, "kv_bytes": read - vs_trl.NEW_TOKENS
                  * param_bytes, "memory_seconds": memory_s, "compute_seconds": compute_s,
                  "roofline_seconds": max(memory_s, compute_s),
                  "memory_tokens_per_second": tokens / memory_s, "compute_tokens_per_second": tokens / compute_s,
                  "roofline_tokens_per_second": tokens / max(memory_s, compute_s),
                  "forward_step_bound_seconds": step_s, "forward_step_bound_tokens_per_second": tokens / step_s},
    }


# ---- table, JSON ----

def pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m, tr, g = r["machine_measures"], r["train_step"], r["generation"]
    peak, mix_t, mix_d = m["sgemm_peak_flops_per_second"], m["sgemm_train_shapes"], m["sgemm_decode_shapes"]
    bw, gf = m["bandwidth"], 1e9
    t = Table(title=f"MFU: {SAMPLES} responses x {vs_trl.NEW_TOKENS} tokens, {r['settings']['parameters'] / 1e6:.1f}M"
                    f" params fp32, {THREADS} threads, medians of {r['settings']['reps']}",
              caption="% peak: of the best square sgemm; % shapes: of sgemm at the model's own linear shapes "
                      f"(train: {mix_t['rows']} rows fwd+bwd, generation: {mix_d['rows']} rows)")
    for col in ("", "measured", "% peak", "% shapes"):
        t.add_column(col, justify="left" if not col else "right")
    for n, sq in m["sgemm_square"]["sizes"].items():
        t.add_row(f"sgemm {n}^3 GFLOP/s", f"{sq['flops_per_second'] / gf:.1f}", pct(sq["flops_per_second"] / peak), "")
    t.add_row("sgemm train shapes GFLOP/s", f"{mix_t['flops_per_second'] / gf:.1f}",
              pct(mix_t["flops_per_second"] / peak), "")
    t.add_row("sgemm decode shapes GFLOP/s", f"{mix_d['flops_per_second'] / gf:.1f}",
              pct(mix_d["flops_per_second"] / peak), "")
    t.add_row("memory read GB/s (256 MiB sum)", f"{bw['read_bytes_per_second'] / gf:.1f}", "", "")
    t.add_row("memory copy GB/s (256 MiB, r+w)", f"{bw['copy_bytes_per_second'] / gf:.1f}", "", "")
    t.add_section()
    t.add_row("train step s", f"{tr['seconds']['median']:.2f}", "", "")
    t.add_row("  GFLOP counted / 6NT+attention",
              f"{tr['flops_counted'] / gf:.0f} / {(tr['flops_6nt'] + tr['flops_attention_analytic']) / gf:.0f}",
              "", "")
    t.add_row(f"  GFLOP/s (target {pct(TARGET)} of sgemm)", f"{tr['flops_per_second'] / gf:.1f}",
              pct(tr["flops_per_second"] / peak), pct(tr["flops_per_second"] / mix_t["flops_per_second"]))
    t.add_section()
    sec, fl, tps, b = g["seconds"], g["flops_per_second"], g["tokens_per_second"], g["bound"]
    t.add_row("forward_step s (ours)", f"{sec['forward_step']['median']:.2f}", "", "")
    t.add_row("  decode loop s (greedy generate)", f"{sec['decode_loop']['median']:.2f}", "", "")
    t.add_row("  our sampler s (32 calls alone)", f"{sec['sampler']['median']:.2f}", "", "")
    t.add_row("  a separate log-prob pass s (not run since e9b5c77)", f"{sec['logprob_pass']['median']:.2f}", "", "")
    for k, name in (("forward_step", "forward_step"), ("decode_loop", "decode loop")):
        t.add_row(f"{name} GFLOP/s", f"{fl[k] / gf:.1f}", pct(fl[k] / peak), pct(fl[k] / mix_d["flops_per_second"]))
    t.add_row("log-prob pass GFLOP/s", f"{fl['logprob_pass'] / gf:.1f}", pct(fl["logprob_pass"] / peak),
              pct(fl["logprob_pass"] / mix_t["flops_per_second"]))
    t.add_row("forward_step tokens/s", f"{tps['forward_step']:.0f}", "", "")
    t.add_row("decode loop tokens/s", f"{tps['decode_loop']:.0f}", "", "")
    t.add_row("  bound: memory (weights + KV)", f"{b['memory_tokens_per_second']:.0f}", "", "")
    t.add_row("  bound: compute (at peak sgemm)", f"{b['compute_tokens_per_second']:.0f}", "", "")
    t.add_row("  decode loop / roofline bound", pct(tps["decode_loop"] / b["roofline_tokens_per_second"]), "", "")
    t.add_row("forward_step / its bound",
              pct(tps["forward_step"] / b["forward_step_bound_tokens_per_second"]), "", "")
    Console().print(t)
    for note in r["notes"]:
        print(f"- {note}")


def notes(r: dict) -> list[str]:
    """What the numbers need read alongside them, from the numbers."""
    tr, g, b = r["train_step"], r["generation"], r["generation"]["bound"]
    ratio = r["ratios"]["train_step_of_peak_sgemm"]
    sec = {k: v["median"] for k, v in g["seconds"].items()}
    kv_peak = 2 * vs_trl.MODEL["num_hidden_layers"] * vs_trl.MODEL["hidden_size"] * 4 * SAMPLES * SEQ
    bound = "compute" if b["compute_seconds"] >= b["memory_seconds"] else "memory"
    return [
        f"train step at {pct(ratio)} of peak sgemm: {'at or above' if ratio >= TARGET else 'below'} the "
        f"{pct(TARGET)} target (one run's medians; noisy on a shared machine)",
        f"decoding {SAMPLES} rows is {bound}-bound here: {b['compute_seconds']:.2f} s of matmul at peak sgemm "
        f"against {b['memory_seconds']:.3f} s to read weights + KV at the measured bandwidth",
        f"the weights ({b['weight_bytes_per_pass'] / 1e6:.1f} MB) fit in the L3 cache, so their share of the memory "
        f"bound is loose; the KV cache (up to {kv_peak / 1e6:.0f} MB) does not",
        f"forward_step: the sampler's Python loop (one torch.Generator per row and step) is "
        f"{pct(sec['sampler'] / sec['forward_step'])} of it, "
        f"a separate log-prob pass would add {pct(sec['logprob_pass'] / sec['forward_step'])} (the sampler keeps "
        f"the log-probs instead)",
        f"FLOPs counted are matmuls and attention (the full S x S product, not halved for the causal mask), "
        f"elementwise work is not: counted {tr['flops_counted'] / 1e9:.0f} GFLOP per train step against "
        f"6NT {tr['flops_6nt'] / 1e9:.0f} + attention {tr['flops_attention_analytic'] / 1e9:.0f}",
    ]


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers")} | {"python": platform.python_version()}


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    caches = []
    for level in ("L2", "L3"):
        p = Path(f"/sys/devices/system/cpu/cpu0/cache/index{2 if level == 'L2' else 3}/size")
        if p.exists():
            caches.append(f"{level} {p.read_text().strip()}")
    return ", ".join(filter(None, [f"{os.cpu_count()} CPUs", model, *caches]))


def main(args: argparse.Namespace) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    t_start = time.perf_counter()
    torch.set_num_threads(THREADS)
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="bench-mfu-") as work:  # the modules hold the model once set up
        policy, trainer, batch, n_params = modules(Path(work))
    torch.set_num_threads(THREADS)
    embed = vs_trl.MODEL["vocab_size"] * vs_trl.MODEL["hidden_size"]
    n_nonembed = n_params - embed
    print("machine: sgemm, bandwidth", file=sys.stderr)
    square = sgemm_square(args.reps)
    peak = square["peak_flops_per_second"]
    measures = {"sgemm_square": square, "sgemm_peak_flops_per_second": peak,
                "sgemm_train_shapes": sgemm_mix(MICRO * SEQ, True, args.reps),
                "sgemm_decode_shapes": sgemm_mix(SAMPLES, False, args.reps), "bandwidth": bandwidth(args.reps)}
    print("generation", file=sys.stderr)
    generated = policy.forward_step(batch, 0)
    gen = measure_generation(policy, batch, generated, args.reps, n_nonembed * 4, peak,
                             measures["bandwidth"]["read_bytes_per_second"])
    print("train step", file=sys.stderr)
    train = measure_train(trainer, train_micro_batches(policy, generated), n_nonembed, args.reps)
    mix_t, mix_d = measures["sgemm_train_shapes"]["flops_per_second"], measures["sgemm_decode_shapes"][
        "flops_per_second"]
    result = {
        "settings": {"prompts": PROMPTS, "samples_per_prompt": vs_trl.PER_PROMPT, "samples": SAMPLES,
                     "prompt_tokens": vs_trl.PROMPT_TOKENS, "new_tokens": vs_trl.NEW_TOKENS,
                     "micro_batches": vs_trl.MICRO_STEPS, "micro_batch": MICRO, "model": vs_trl.MODEL,
                     "parameters": n_params, "parameters_less_input_embedding": n_nonembed, "dtype": "float32",
                     "threads": torch.get_num_threads(), "reps": args.reps, "machine": machine(),
                     "date": time.strftime("%Y-%m-%d")},
        "versions": versions(),
        "machine_measures": measures,
        "train_step": train,
        "generation": gen,
        "ratios": {
            "train_step_of_peak_sgemm": train["flops_per_second"] / peak,
            "train_step_of_train_shape_sgemm": train["flops_per_second"] / mix_t,
            "train_step_target_of_peak_sgemm": TARGET,
            "forward_step_flops_of_peak_sgemm": gen["flops_per_second"]["forward_step"] / peak,
            "forward_step_flops_of_decode_shape_sgemm": gen["flops_per_second"]["forward_step"] / mix_d,
            "decode_loop_flops_of_peak_sgemm": gen["flops_per_second"]["decode_loop"] / peak,
            "decode_loop_tokens_of_memory_bound": gen["tokens_per_second"]["decode_loop"]
            / gen["bound"]["memory_tokens_per_second"],
            "decode_loop_tokens_of_roofline_bound": gen["tokens_per_second"]["decode_loop"]
            / gen["bound"]["roofline_tokens_per_second"],
            "forward_step_tokens_of_its_bound": gen["tokens_per_second"]["forward_step"]
            / gen["bound"]["forward_step_bound_tokens_per_second"],
        },
    }
    result["notes"] = notes(result)
    result["settings"]["wall_seconds"] = time.perf_counter() - t_start
    print_table(result)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=1))
    print(f"wrote {RESULT.relative_to(REPO)} ({result['settings']['wall_seconds']:.0f} s)")
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each measure (after one warm-up)")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


if __name__ == "__main__":
    main(parse(sys.argv[1:]))
