"""Padding-free (packed) training on CPU (issue 25 item 3): which attention keeps packed sequences apart fastest,
and what packing gains over padding in a real trainer step.

1. Attention options, forward + backward of a tiny Llama (hidden 256, 4 layers, 4 heads) on ONE packed row of
   2k-8k tokens made of sequences of 8-32 prompt and 1-256 response tokens (mean ~64):
   * ``sdpa`` / ``eager``: transformers' own, which builds a dense T x T block-diagonal mask from the restarting
     position ids (``masking_utils.find_packed_sequence_indices``; only with ``use_cache=False``);
   * ``flex_attention``: transformers' block mask; torch 2.13 has no flex backward on CPU (recorded, not timed);
   * ``chatlearn_packed``: what ``models.<name>.packing`` runs (chatlearn/models/hf/packing.py), one causal
     SDPA per sequence (cost: the sum of their squares);
   * ``padded in attention``: the sequences gathered into one [S, H, L_max, D] SDPA with a key mask, scattered
     back (the other way to avoid the T x T mask; here only).
   Each option's logits are checked against the sequences run one by one (max abs difference).
2. The GRPO trainer's step (the real module) on a global batch of 64 samples of the same length distribution:
   padded micro-batches of 8 samples (each padded to its own widths, as the runtime collates) against packed
   micro-batches cut by ``max_token_in_packing``; and the reference's scoring forward, padded against packed.
   Both paths are checked to give the same gradient / log-probs.

Options are interleaved round by round; medians are reported. One torch thread by default (a model process
runs ``cpu_per_process`` threads, 1 unless set); on a machine shared with other work the numbers are noisy.

    .venv/bin/python bench/packing.py [--rounds 3] [--threads 1] [--sizes 2048,4096,8192] [--memory-only]

3. Each variant's trainer step in a fresh process: its peak RSS above what the process held before the step
   (``--memory-only`` runs just this).

Writes ``bench/results/packing.json``.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from chatlearn.config import ModelConfig, RuntimeConfig  # noqa: E402
from chatlearn.data.batch import collate_samples  # noqa: E402
from chatlearn.models.hf.grpo_trainer import GRPOPolicyTrainer  # noqa: E402
from chatlearn.models.hf.packing import PACKED_ATTENTION, packed_mask, sequence_bounds  # noqa: E402
from chatlearn.models.hf.reference import ReferenceModel  # noqa: E402
from chatlearn.models.hf.tiny import ensure_tiny_model  # noqa: E402

RESULTS = REPO / "bench" / "results" / "packing.json"


def padded_in_attention(module, query, key, value, attention_mask, **kwargs):
    """The alternative to per-sequence SDPA: gather the sequences into [S, H, L_max, D], one masked SDPA,
    scatter back."""
    if attention_mask is not None or kwargs.get("position_ids") is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    segments = sequence_bounds(kwargs["position_ids"])
    lengths = torch.tensor([e - s for s, e in segments])
    starts = torch.tensor([s for s, _ in segments])
    width = int(lengths.max())
    steps = torch.arange(width)
    valid = steps[None] < lengths[:, None]
    index = (starts[:, None] + steps[None]).clamp(max=query.shape[2] - 1)
    mask = valid[:, None, None, :] & torch.ones(width, width, dtype=torch.bool).tril()[None, None]
    q, k, v = (t[0][:, index].transpose(0, 1) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=kwargs.get("scaling"))
    return out.transpose(1, 2)[valid][None], None


AttentionInterface.register("padded_in_attention", padded_in_attention)
AttentionMaskInterface.register("padded_in_attention", packed_mask)

OPTIONS = [  # label, attn_implementation
    ("sdpa, dense block-diagonal mask", "sdpa"),
    ("eager, dense block-diagonal mask", "eager"),
    ("flex_attention, block mask", "flex_attention"),
    ("chatlearn_packed: SDPA per sequence", PACKED_ATTENTION),
    ("one SDPA over sequences padded in attention", "padded_in_attention"),
]


def lengths(n: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts 8-32 tokens, responses 1-256 (geometric, mean ~64)."""
    prompts = torch.randint(8, 33, (n,), generator=gen)
    u = torch.rand(n, generator=gen).clamp(min=1e-6)
    responses = (torch.log(u) * -64.0).ceil().clamp(1, 256).long()
    return list(zip(prompts.tolist(), responses.tolist(), strict=True))


def packed_row(total: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A row of ``total`` tokens: whole sequences (the last one cut to fit); ids, position ids, sequences."""
    seqs, used = [], 0
    while used < total:
        p, r = lengths(1, gen)[0]
        seqs.append(min(p + r, total - used))
        used += seqs[-1]
    pos = torch.cat([torch.arange(n) for n in seqs])[None]
    return torch.randint(4, 40, (1, total), generator=gen), pos, len(seqs)


def time_attention(sizes: list[int], rounds: int) -> list[dict]:
    cfg = LlamaConfig(vocab_size=40, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    rows, failed = [], {}
    gen = torch.Generator().manual_seed(0)
    for size in sizes:
        ids, pos, count = packed_row(size, gen)
        starts = [s for s, _ in sequence_bounds(pos)]
        with torch.no_grad():  # the reference: every sequence alone
            model.set_attn_implementation("sdpa")
            alone = torch.cat([model(input_ids=ids[:, s:e], use_cache=False).logits
                               for s, e in zip(starts, [*starts[1:], size], strict=True)], 1)
        times: dict[str, list[float]] = {label: [] for label, _ in OPTIONS}
        diffs: dict[str, float | str] = {}
        for _ in range(rounds):
            for label, impl in OPTIONS:
                if label in failed:
                    diffs[label] = failed[label]
                    continue
                model.set_attn_implementation(impl)
                model.zero_grad(set_to_none=True)
                try:
                    t0 = time.perf_counter()
                    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                    logits.sum().backward()
                    times[label].append(time.perf_counter() - t0)
                except (NotImplementedError, RuntimeError) as exc:  # not tried again at any size
                    failed[label] = diffs[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
                    continue
                diffs[label] = float((logits.detach() - alone).abs().max())
        for label, _ in OPTIONS:
            ok = isinstance(diffs[label], float)
            rows.append({"tokens": size, "sequences": count, "option": label,
                         "seconds": statistics.median(times[label]) if ok else None,
                         "max_abs_logit_diff_vs_alone": diffs[label] if ok else None,
                         "error": None if ok else diffs[label]})
            shown = f"{rows[-1]['seconds']:8.3f} s   diff {diffs[label]:.1e}" if ok else f"  not run: {diffs[label]}"
            print(f"  {size:5d} tokens, {count:3d} seqs  {label:45s} {shown}", flush=True)
    return rows


def global_batch(n: int, seed: int) -> list[dict]:
    """``n`` samples as the trainer gets them (prompt, response, old log-probs, advantages, reference)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p, r in lengths(n, gen):
        out.append({"prompt_ids": torch.randint(4, 40, (p,), generator=gen), "prompt_mask": torch.ones(p),
                    "response_ids": torch.randint(4, 40, (r,), generator=gen), "response_mask": torch.ones(r),
                    "logprobs": -torch.rand(r, generator=gen) * 3, "ref_logprobs": -torch.rand(r, generator=gen) * 3,
                    "advantages": torch.randn(1, generator=gen).expand(r).clone()})
    return out


def module(cls, path: str, packing: bool, budget: int, trainable: bool):
    m = cls("ppo_policy")
    m.bind(ModelConfig(num_cpu=1, trainable=trainable, packing=packing, max_token_in_packing=budget,
                       args_dict={"model_path": path, "max_grad_norm": 1e9, "kl_coef": 0.05}), RuntimeConfig(), 0,
           seed=7)
    m.setup()
    return m


def time_steps(path: str, rounds: int, samples: int = 64, micro: int = 8) -> dict:
    data = global_batch(samples, 1)
    padded_mbs = [collate_samples(data[i:i + micro]) for i in range(0, samples, micro)]
    whole = collate_samples(data)
    real = sum(int(s["prompt_mask"].sum() + s["response_mask"].sum()) for s in data)
    padded_tokens = sum(mb["prompt_ids"].numel() + mb["response_ids"].numel() for mb in padded_mbs)
    variants = [("padded, 8 samples per micro-batch", False, 0), ("packed, max_token_in_packing 1024", True, 1024),
                ("packed, max_token_in_packing 4096", True, 4096)]
    trainers = {label: module(GRPOPolicyTrainer, path, p, b, True) for label, p, b in variants}
    for t in trainers.values():
        t.optimizer.step = lambda: None  # the same weights every round: the gradients are compared
    refs = {label: module(ReferenceModel, path, p, b or 32768, False) for label, p, b in variants[::2]}
    step_times: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    score_times: dict[str, list[float]] = {label: [] for label in refs}
    grads, scores = {}, {}
    for _ in range(rounds):
        for label, _, _ in variants:
            t0 = time.perf_counter()
            trainers[label].train_step([dict(mb) for mb in padded_mbs], 0)
            step_times[label].append(time.perf_counter() - t0)
            grads[label] = torch.cat([p.grad.reshape(-1) for p in trainers[label].model.parameters()])
        for label, ref in refs.items():
            t0 = time.perf_counter()
            scores[label] = ref.forward_step(dict(whole), 0)["ref_logprobs"]
            score_times[label].append(time.perf_counter() - t0)
    base = variants[0][0]
    scale = float(grads[base].abs().max())
    out = {"samples": samples, "real_tokens": real, "padded_tokens_computed": padded_tokens,
           "mean_response_tokens": sum(int(s["response_mask"].sum()) for s in data) / samples, "train_step": [],
           "reference_forward_step": []}
    for label, _, _ in variants:
        row = {"variant": label, "micro_batches": len(trainers[label].micro_batches(list(padded_mbs))),
               "seconds": statistics.median(step_times[label]),
               "grad_max_rel_diff_vs_padded": float((grads[label] - grads[base]).abs().max()) / scale}
        out["train_step"].append(row)
        print(f"  train step  {label:36s} {row['micro_batches']:3d} micro-batches {row['seconds']:8.3f} s   "
              f"grad diff {row['grad_max_rel_diff_vs_padded']:.1e} (relative)", flush=True)
    for label in refs:
        row = {"variant": label.split(",")[0] + ("" if label == base else ", max_token_in_packing 32768"),
               "seconds": statistics.median(score_times[label]),
               "max_abs_logprob_diff_vs_padded": float((scores[label] - scores[base]).abs().max())}
        out["reference_forward_step"].append(row)
        print(f"  reference forward_step of {samples}  {row['variant']:40s} {row['seconds']:8.3f} s   "
              f"diff {row['max_abs_logprob_diff_vs_padded']:.1e}", flush=True)
    return out


VARIANTS = {"padded": (False, 0), "packed-1024": (True, 1024), "packed-4096": (True, 4096)}


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_worker(variant: str, path: str, out: str, samples: int = 64, micro: int = 8) -> None:
    """In a process of its own: the GRPO trainer's step on the bench's global batch; the step's peak RSS above
    what the process held before it (VmHWM reset through /proc/self/clear_refs after a first step)."""
    packing, budget = VARIANTS[variant]
    data = global_batch(samples, 1)
    mbs = [collate_samples(data[i:i + micro]) for i in range(0, samples, micro)]
    trainer = module(GRPOPolicyTrainer, path, packing, budget, True)
    trainer.train_step([dict(mb) for mb in mbs], 0)  # optimizer state and allocator pools exist from here on
    before = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    trainer.train_step([dict(mb) for mb in mbs], 1)
    Path(out).write_text(json.dumps({"rss_before_mb": before, "step_peak_mb": _status_mb("VmHWM")}))


def step_memory(path: str) -> list[dict]:
    """Each variant's train-step peak RSS, each in a fresh process (one thread)."""
    import os
    import subprocess

    rows = []
    for variant in VARIANTS:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, __file__, "--memory-worker", variant, path, f.name], check=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
            got = json.loads(Path(f.name).read_text())
        row = {"variant": variant, **got, "step_above_before_mb": got["step_peak_mb"] - got["rss_before_mb"]}
        rows.append(row)
        print(f"  {variant:12s} RSS before the step {row['rss_before_mb']:7.0f} MB, peak in the step "
              f"{row['step_peak_mb']:7.0f} MB (+{row['step_above_before_mb']:.0f})", flush=True)
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--memory-worker"]:
        memory_worker(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="2048,4096,8192")
    ap.add_argument("--memory-only", action="store_true", help="only the train step's peak RSS per variant "
                    "(merged into the existing results file)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_only:
        with tempfile.TemporaryDirectory() as tmp:
            path = str(ensure_tiny_model(Path(tmp) / "tiny", {"max_position_embeddings": 512}))
            print("GRPO trainer step on 64 samples, peak RSS, each variant in its own process:")
            memory = step_memory(path)
        results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        results["step_memory"] = memory
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {RESULTS.relative_to(REPO)}")
        return
    print(f"attention on one packed row, forward + backward (median of {args.rounds}, {args.threads} thread(s)):")
    attention = time_attention([int(s) for s in args.sizes.split(",")], args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(ensure_tiny_model(Path(tmp) / "tiny", {"max_position_embeddings": 512}))
        print("GRPO trainer step and reference scoring on 64 samples, padded against packed:")
        steps = time_steps(path, args.rounds)
        print("GRPO trainer step on 64 samples, peak RSS, each variant in its own process:")
        memory = step_memory(path)
    torch.set_num_threads(args.threads)  # the modules set their own thread count
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "torch": torch.__version__,
                                   "attention": attention, "step": steps, "step_memory": memory}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
