"""Our GRPO against TRL's GRPOTrainer on the same work, measured side by side in one run, on two workloads.

**variable** (real-shaped): 64 prompts x 8 samples per step (512 responses, one optimizer step in 4
micro-batches of 128), prompts of 8-64 tokens, responses up to 256 new tokens ending where EOS is drawn:
the model's EOS row is set (once, seeded) so that the mean response is about 64 tokens with a long tail to
the limit. bf16 where the CPU has it (AMX-BF16 or AVX512-BF16; fp32 otherwise) on both sides: ours with
``bf16: true``, TRL with its own ``bf16=True``. TRL runs with plain ``generate`` every round, and with
transformers' paged continuous batching (``use_transformers_paged``) in the first round (``--paged-steps``
steps, killed past ``--paged-timeout`` seconds: far slower on this CPU); the faster is the baseline.

**fixed** (the first comparison): 64 prompts x 4 samples (256 responses, 4 micro-batches of 64),
16-token prompts, exactly 32 new tokens (EOS never drawn: ``min_new_tokens``), fp32.

Both: a Llama (hidden 256, 4 layers, 4 heads, FFN 688, vocab 1024: 3.7M parameters) built here with one
seed and loaded by both with ``from_pretrained``, a word-level tokenizer of 1024 tokens (``t4`` ...
``t1023``), no reference model (KL weight 0), no gradient checkpointing (TRL's default is on), AdamW at a
constant learning rate, clip 0.2 / 0.28, loss summed over the tokens of the whole batch (TRL's ``dapo``, our
``grpo``), 2 torch threads, old log-probs not recomputed (one optimizer step per batch: TRL's
``num_iterations=1``, our ``old_logprobs: generation``). The reward is a cheap rule with variance inside
every group: the fraction of response tokens whose id has the parity of the prompt's first token id. Each
side's reward function also records every response's length (in tokens, EOS excluded), so the length
histogram printed for both comes from the responses each side really trained on.

- Ours runs the real ``chatlearn train bench/configs/grpo_vs_trl.yaml`` (its own Prefect server, Ray, the
  models colocated in one 2-CPU worker process) for K episodes, with the workload's overrides and our
  settings for it (``OURS``); the per-episode ``stage_seconds`` and ``episode_seconds`` come from
  ``run_dir/metrics.jsonl``.
- TRL runs ``GRPOTrainer`` for K steps in its own process (this script with ``--trl-worker``); a callback
  times each optimizer step (from one step's end to the next), and the trainer's ``_generate``,
  ``_calculate_rewards`` and ``_generate_and_score_completions`` are timed to split a step into generate,
  score, the rest of the rollout, and train.

Rounds interleave one process of each side; each process's first episode/step is warm-up and dropped.
Medians are over all kept episodes/steps of all rounds. Prints a table per workload and writes
``bench/results/vs_trl.json`` (settings, per-round raw numbers, medians, ratios, histograms, versions).

    .venv/bin/python bench/vs_trl.py [--workload variable|fixed|both] [--rounds 2] [--steps 4]
    .venv/bin/python bench/vs_trl.py --smoke      # 1 round, 2 steps, 8 prompts, 32 new tokens at most
"""

import argparse
import collections
import dataclasses
import itertools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CONFIG = BENCH / "configs" / "grpo_vs_trl.yaml"
RESULT = BENCH / "results" / "vs_trl.json"

SEED = 42
VOCAB = 1024
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
EOS = 2
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=VOCAB)
LR = 1e-4
THREADS = 2


def cpu_has_bf16() -> bool:
    """AMX-BF16 or AVX512-BF16 in /proc/cpuinfo: bf16 matmuls run natively (otherwise they are emulated)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    per_prompt: int  # samples per prompt
    prompt_tokens: tuple[int, int]  # lengths drawn uniformly in [lo, hi]
    new_tokens: int  # the response limit
    fixed_length: bool  # EOS never drawn (min_new_tokens = new_tokens); else EOS drawn as the model says
    micro_steps: int  # micro-batches per optimizer step, both sides
    bf16: bool
    mean_length: int = 0  # the EOS row is calibrated for this mean response length (variable only)
    # our settings for this work, as `chatlearn train` overrides (each the config default where absent)
    ours: tuple[str, ...] = ()

    @property
    def max_positions(self) -> int:
        return 64 if self.fixed_length else 512


WORKLOADS = {
    "variable": Workload("variable", per_prompt=8, prompt_tokens=(8, 64), new_tokens=256, fixed_length=False,
                         micro_steps=4, bf16=cpu_has_bf16(), mean_length=64,
                         ours=("runtime.rollout_engine=continuous", "models.ppo_policy.packing=true",
                               "models.ppo_policy.max_token_in_packing=1024")),
    "fixed": Workload("fixed", per_prompt=4, prompt_tokens=(16, 16), new_tokens=32, fixed_length=True,
                      micro_steps=4, bf16=False),
}


# ---- the task: the rule reward (imported by our run's reward tasks as `vs_trl:parity_reward`) ----

def parity_score(prompt: str, response: str) -> float:
    """Fraction of the response's tokens whose id has the parity of the prompt's first token id."""
    target = int(prompt.split()[0][1:]) % 2
    words = response.split()
    return sum(int(w[1:]) % 2 == target for w in words) / len(words) if words else 0.0


def record_lengths(responses: list[str]) -> None:
    """Append the responses' lengths in tokens (one word per token) to $VS_TRL_LENGTHS, when set (the
    histogram). Lines of one write are appended whole, so several reward processes can share the file."""
    path = os.environ.get("VS_TRL_LENGTHS")
    if path:
        with open(path, "a") as f:
            f.write("".join(f"{len(r.split())}\n" for r in responses))


def parity_reward(sample: dict) -> float:
    """Ours: a rule reward function takes a sample dict (record fields + response text)."""
    record_lengths([sample["response"]])
    return parity_score(sample["prompt"], sample["response"])


def trl_parity_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """TRL: a reward function takes the batch's prompts and completions."""
    record_lengths(completions)
    return [parity_score(p, c) for p, c in zip(prompts, completions, strict=True)]


# ---- the shared model, tokenizer and prompts ----

def build_model(path: Path, work: Workload) -> dict:
    """A word-level tokenizer of VOCAB tokens and a seeded random-init fp32 Llama, saved with save_pretrained.
    For a variable-length workload the EOS row of the LM head is set to ``alpha * u``, ``u`` the unit mean of
    the final hidden states over random sequences: EOS's logit then has a positive mean at every position,
    and ``alpha`` is found by bisection so that the expected response length (the survival sum of EOS's
    per-position probabilities over random 256-token sequences) is ``work.mean_length``. Returns the
    parameter count and alpha."""
    import torch
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # decoding joins tokens with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>", padding_side="left").save_pretrained(path)
    torch.manual_seed(SEED)
    config = LlamaConfig(**MODEL, max_position_embeddings=work.max_positions, pad_token_id=0, bos_token_id=1,
                         eos_token_id=EOS, tie_word_embeddings=False, dtype="float32")
    model = LlamaForCausalLM(config).float().eval()
    alpha = None
    if not work.fixed_length:
        gen = torch.Generator().manual_seed(SEED)
        ids = torch.randint(len(SPECIALS), VOCAB, (32, work.new_tokens), generator=gen)
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm
            u = hidden.reshape(-1, hidden.shape[-1]).mean(0)
            u = u / u.norm()
            others = model.lm_head(hidden)
            others[..., EOS] = float("-inf")
            rest = others.logsumexp(-1)  # [N, T]
            proj = hidden @ u

            def mean_length(a: float) -> float:
                p_eos = torch.sigmoid(a * proj - rest)  # P(EOS) = e^l / (e^l + sum of the others)
                survive = torch.cumprod(1 - p_eos, -1)  # P(no EOS in the first t+1 tokens)
                return float((1 + survive[:, :-1].sum(-1)).mean())

            lo, hi = 0.0, 64.0
            for _ in range(60):
                alpha = (lo + hi) / 2
                lo, hi = (alpha, hi) if mean_length(alpha) > work.mean_length else (lo, alpha)
            # random sequences are not sampled ones: the mean sampled length is then set by bisection on
            # alpha around that start, 192 samples drawn by our continuous engine per try
            alpha = calibrate_on_samples(model, u, work, alpha)
            model.lm_head.weight[EOS] = alpha * u
    model.save_pretrained(path)
    return {"parameters": sum(p.numel() for p in model.parameters()), "eos_alpha": alpha}


def calibrate_on_samples(model, u, work: Workload, alpha: float, tries: int = 7, n: int = 192) -> float:
    """alpha whose n sampled responses (seeded prompts of the workload's lengths) have a mean length nearest
    ``work.mean_length``, by bisection in [alpha / 2, 3 alpha]."""
    import torch

    from chatlearn.models.hf.rollout import ROLLOUT_ENGINES, Request

    rng = random.Random(SEED + 1)
    lo_len, hi_len = work.prompt_tokens
    width = hi_len
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i in range(n):
        length = rng.randint(lo_len, hi_len)
        ids[i, width - length:] = torch.tensor([rng.randrange(len(SPECIALS), VOCAB) for _ in range(length)])
        mask[i, width - length:] = 1

    def sampled_mean(a: float) -> float:
        model.lm_head.weight[EOS] = a * u
        req = Request(ids, mask, work.new_tokens, 0, EOS, 0, do_sample=True, sample_ids=list(range(n)),
                      seed=SEED, max_num_seqs=n)
        response, _ = ROLLOUT_ENGINES["continuous"](model).generate(req)
        ended = (response == EOS).float()
        return float(torch.where(ended.any(-1), ended.argmax(-1).float(), float(work.new_tokens)).mean())

    lo, hi = alpha / 2, alpha * 3
    best = (float("inf"), alpha)
    for _ in range(tries):
        mid = (lo + hi) / 2
        got = sampled_mean(mid)
        best = min(best, (abs(got - work.mean_length), mid))
        lo, hi = (mid, hi) if got > work.mean_length else (lo, mid)
    return best[1]


def write_prompts(path: Path, n: int, work: Workload) -> None:
    """n prompts of random non-special tokens, lengths uniform in work.prompt_tokens, one JSON record each."""
    rng = random.Random(SEED)
    lo, hi = work.prompt_tokens
    with path.open("w") as f:
        for _ in range(n):
            words = [f"t{rng.randrange(len(SPECIALS), VOCAB)}" for _ in range(rng.randint(lo, hi))]
            f.write(json.dumps({"prompt": " ".join(words)}) + "\n")


# ---- ours: the real `chatlearn train` ----

def run_ours(work: Path, model: Path, data: Path, steps: int, prompts: int, wl: Workload, tag: str) -> dict:
    sys.path.insert(0, str(BENCH))
    from common import run_train  # bench/ is a folder of scripts, not a package

    lengths = work / f"ours-{wl.name}-{tag}.lengths"
    os.environ.update(VS_TRL_MODEL=str(model), VS_TRL_DATA=str(data), VS_TRL_LENGTHS=str(lengths),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")])))
    out = work / f"ours-{wl.name}-{tag}"
    samples = prompts * wl.per_prompt
    overrides = [str(CONFIG.relative_to(REPO)), f"runtime.num_episode={steps}",
                 f"runtime.sample_per_episode={samples}", f"runtime.generation_batch_size={samples}",
                 f"runtime.train_global_batch_size={samples}",
                 f"runtime.train_micro_batch_size={samples // wl.micro_steps}",
                 f"models.policy.args_dict.max_new_tokens={wl.new_tokens}",
                 f"models.policy.args_dict.min_new_tokens={wl.new_tokens if wl.fixed_length else 0}",
                 f"models.policy.args_dict.num_inference_per_prompt={wl.per_prompt}"]
    if wl.bf16:
        overrides += ["models.policy.args_dict.bf16=true", "models.ppo_policy.args_dict.bf16=true"]
    wall = run_train(out, overrides + list(wl.ours), "chatlearn train (ours)")
    rows = [json.loads(line) for line in (out / "vs_trl" / "metrics.jsonl").read_text().splitlines()]
    episodes = [{"episode_seconds": r["episode_seconds"],
                 "stages": r.get("stage_seconds", {}),
                 "outside_stages": r["episode_seconds"] - sum(r.get("stage_seconds", {}).values()),
                 "reward_mean": r.get("reward_mean"),
                 "response_length_mean": r.get("response_length_mean")} for r in rows]
    return {"wall_seconds": wall, "startup_seconds": rows[0].get("startup_seconds"), "steps": episodes,
            "peak_memory_mb": max((r.get("peak_memory_mb") or 0) for r in rows) or None,
            "lengths": read_lengths(lengths)}


def read_lengths(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


# ---- TRL: GRPOTrainer in its own process ----

def run_trl(work: Path, model: Path, data: Path, steps: int, prompts: int, wl: Workload, tag: str,
            paged: bool = False, timeout: float | None = None) -> dict | None:
    """TRL's process; None when it ran past ``timeout`` (killed)."""
    import subprocess

    from common import timed_run  # bench/ is a folder of scripts, not a package

    side = "trl_paged" if paged else "trl"
    out = work / f"{side}-{wl.name}-{tag}.json"
    lengths = work / f"{side}-{wl.name}-{tag}.lengths"
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", VS_TRL_LENGTHS=str(lengths))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", "--model", str(model), "--data",
           str(data), "--steps", str(steps), "--prompts", str(prompts), "--out", str(out),
           "--work", str(work / f"{side}-{wl.name}-{tag}"), "--workload", wl.name]
    if paged:
        cmd.append("--paged")
    if wl.new_tokens != WORKLOADS[wl.name].new_tokens:
        cmd += ["--new-tokens", str(wl.new_tokens)]
    try:
        wall = timed_run(cmd, env, f"TRL worker ({side})", timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    result = json.loads(out.read_text())
    result["wall_seconds"] = wall
    result["lengths"] = read_lengths(lengths)
    return result


def trl_worker(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(THREADS)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    wl = workload(args)
    timer: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timer[name] = timer.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            return timed("generate", super()._generate)(prompts)

        def _calculate_rewards(self, *a, **k):
            return timed("score", super()._calculate_rewards)(*a, **k)

        def _generate_and_score_completions(self, inputs):
            return timed("rollout", super()._generate_and_score_completions)(inputs)

    steps: list[dict] = []
    marks: dict[str, float] = {}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks["last_end"] = time.perf_counter()
            marks["train_begin"] = marks["last_end"] - t_start

        def on_step_begin(self, *_, **__):
            marks["begin"] = time.perf_counter()
            timer.clear()

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            inside = now - marks["begin"]
            rollout = timer.get("rollout", 0.0)
            steps.append({"step_seconds": now - marks["last_end"],
                          "stages": {"generate": timer.get("generate", 0.0), "score": timer.get("score", 0.0),
                                     "rollout_rest": rollout - timer.get("generate", 0.0) - timer.get("score", 0.0),
                                     "train": inside - rollout},
                          "outside_stages": now - marks["last_end"] - inside})
            marks["last_end"] = now

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and steps and "reward" in logs:
                steps[-1]["reward_mean"] = logs["reward"]
                steps[-1]["response_length_mean"] = logs.get("completions/mean_length")

    records = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    dataset = Dataset.from_list(records)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    samples = args.prompts * wl.per_prompt
    config = GRPOConfig(
        output_dir=args.work, max_steps=args.steps, seed=SEED, use_cpu=True, bf16=wl.bf16, fp16=False,
        per_device_train_batch_size=samples // wl.micro_steps,
        gradient_accumulation_steps=wl.micro_steps, num_generations=wl.per_prompt,
        max_completion_length=wl.new_tokens,
        generation_kwargs={"min_new_tokens": wl.new_tokens} if wl.fixed_length else None,
        use_transformers_paged=args.paged,
        temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", num_iterations=1,
        gradient_checkpointing=False,  # TRL's default is on: it recomputes the forward in backward; ours does not
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = TimedGRPOTrainer(model=model, reward_funcs=trl_parity_reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    sys.path.insert(0, str(BENCH))
    from rollout import peak_rss_mb  # bench/ is a folder of scripts, not a package

    peak = peak_rss_mb()  # since exec: ru_maxrss would keep the forking bench's
    Path(args.out).write_text(json.dumps({"startup_seconds": marks["train_begin"], "steps": steps,
                                          "threads": torch.get_num_threads(), "peak_memory_mb": peak}))


# ---- medians, table, JSON ----

def histogram(lengths: list[int], limit: int) -> dict:
    """Counts per length bucket (the last bucket: responses that reached the limit) and the mean."""
    if not lengths:
        return {}
    edges = [e for e in (0, 8, 16, 32, 64, 128, 192) if e < limit] + [limit, limit + 1]  # the last: at the limit
    pairs = list(itertools.pairwise(edges))
    counts = collections.Counter(next(f"{lo}-{hi - 1}" for lo, hi in pairs if n < hi) for n in lengths)
    return {"mean": statistics.mean(lengths), "max": max(lengths), "n": len(lengths),
            "at_limit": sum(n >= limit for n in lengths) / len(lengths),
            "buckets": {f"{lo}-{hi - 1}": counts.get(f"{lo}-{hi - 1}", 0) for lo, hi in pairs}}


def summarise(runs: list[dict], prompts: int, wl: Workload) -> dict:
    kept = [s for run in runs for s in run["steps"][1:]]  # each process's first episode/step is warm-up
    key = "episode_seconds" if "episode_seconds" in kept[0] else "step_seconds"
    step = statistics.median(s[key] for s in kept)
    stages = sorted({k for s in kept for k in s["stages"]})
    lengths = [n for run in runs for n in run.get("lengths", [])]
    return {
        "steps_kept": len(kept),
        "step_seconds": step,
        "prompts_per_second": statistics.median(prompts / s[key] for s in kept),
        "generated_tokens_per_second": statistics.median(
            prompts * wl.per_prompt * (s.get("response_length_mean") or 0) / s[key] for s in kept),
        "stage_seconds": {k: statistics.median(s["stages"].get(k, 0.0) for s in kept) for k in stages},
        "outside_stages_seconds": statistics.median(s["outside_stages"] for s in kept),
        "startup_seconds": statistics.median(r["startup_seconds"] for r in runs),
        "process_wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
        "response_length_mean": statistics.median(s["response_length_mean"] for s in kept
                                                  if s.get("response_length_mean") is not None),
        "peak_memory_mb": max((r.get("peak_memory_mb") or 0) for r in runs) or None,
        "lengths": histogram(lengths, wl.new_tokens),
    }


def print_table(name: str, result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result["settings"]
    med, base = result["medians"], result["baseline"]
    sides = ["ours"] + [k for k in ("trl", "trl_paged") if k in med]
    table = Table(title=f"{name}: GRPO, {s['prompts_per_step']} prompts x {s['samples_per_prompt']} samples, "
                        f"responses up to {s['new_tokens']} tokens ({s['dtype']}): medians over "
                        f"{s['rounds']} interleaved rounds; baseline {base}")
    table.add_column("")
    for side in sides:
        table.add_column({"ours": "ours (chatlearn train)", "trl": "TRL GRPOTrainer",
                          "trl_paged": "TRL, paged generation"}[side], justify="right")
    table.add_column(f"ours / {base}", justify="right")

    def row(label, get, fmt, ratio=True):
        vals = [get(med[side]) for side in sides]
        a, b = get(med["ours"]), get(med[base])
        table.add_row(label, *("-" if v is None else fmt.format(v) for v in vals),
                      f"{a / b:.2f}" if ratio and a is not None and b and min(a, b) >= 0.01 else "")

    row("s per step (episode)", lambda m: m["step_seconds"], "{:.2f}")
    row("prompts / s", lambda m: m["prompts_per_second"], "{:.2f}")
    row("generated tokens / s", lambda m: m["generated_tokens_per_second"], "{:.0f}")
    for stage in ("generate", "score", "rollout_rest", "train", "sync"):
        row(f"  {stage} s", lambda m, st=stage: m["stage_seconds"].get(st), "{:.2f}")
    row("  outside stages s", lambda m: m["outside_stages_seconds"], "{:.2f}", ratio=False)
    row("start-up to step 1 s", lambda m: m["startup_seconds"], "{:.1f}", ratio=False)
    row("whole process s", lambda m: m["process_wall_seconds"], "{:.1f}", ratio=False)
    row("response length (mean)", lambda m: m["response_length_mean"], "{:.1f}", ratio=False)
    row("peak RSS MB (max process)", lambda m: m["peak_memory_mb"], "{:.0f}", ratio=False)
    Console().print(table)
    hist = Table(title=f"{name}: response lengths (tokens, EOS excluded), all kept and warm-up steps")
    hist.add_column("length")
    for side in sides:
        hist.add_column(side, justify="right")
    buckets = next((med[side]["lengths"].get("buckets") for side in sides if med[side]["lengths"]), None) or {}
    for bucket in buckets:
        hist.add_row(bucket, *(str(med[side]["lengths"].get("buckets", {}).get(bucket, "-")) for side in sides))
    hist.add_row("mean", *(f"{med[side]['lengths'].get('mean', float('nan')):.1f}" for side in sides))
    hist.add_row("at the limit", *(f"{med[side]['lengths'].get('at_limit', float('nan')):.3f}" for side in sides))
    Console().print(hist)


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "trl", "accelerate", "datasets", "ray",
                                             "prefect")} | {"python": platform.python_version()}


def workload(args: argparse.Namespace, name: str | None = None) -> Workload:
    wl = WORKLOADS[name or args.workload]
    if args.new_tokens:
        wl = dataclasses.replace(wl, new_tokens=args.new_tokens)
    return wl


def run_workload(args: argparse.Namespace, wl: Workload, work: Path) -> dict:
    model, data = work / f"model-{wl.name}", work / f"prompts-{wl.name}.jsonl"
    built = build_model(model, wl)
    write_prompts(data, args.prompts * args.steps, wl)
    sides = {"ours": run_ours, "trl": run_trl}
    paged_note = None
    if not wl.fixed_length:  # transformers' continuous batching only differs where lengths do
        # measured in the first round only, args.paged_steps steps, killed past args.paged_timeout seconds: on
        # this CPU it is far slower than plain generate (the smoke run: 11x), so a full set of rounds would
        # take hours; the plain one is the baseline unless it is faster
        sides["trl_paged"] = lambda *a: run_trl(*a[:3], args.paged_steps, *a[4:], paged=True,
                                                timeout=args.paged_timeout)
    raw: dict[str, list[dict]] = {name: [] for name in sides}
    for i in range(args.rounds):
        for name, run in sides.items():
            if name == "trl_paged" and i > 0:
                continue
            got = run(work, model, data, args.steps, args.prompts, wl, str(i))
            if got is None:
                paged_note = f"killed after {args.paged_timeout:.0f} s before finishing {args.paged_steps} steps"
                print(f"{wl.name} round {i + 1}: {name}: {paged_note}", file=sys.stderr)
                continue
            raw[name].append(got)
            kept = raw[name][-1]["steps"][1:]
            key = "episode_seconds" if name == "ours" else "step_seconds"
            med = statistics.median(s[key] for s in kept) if kept else float("nan")
            print(f"{wl.name} round {i + 1}/{args.rounds}: {name}: {med:.2f} s per step (median of {len(kept)})",
                  file=sys.stderr)
    medians = {name: summarise(runs, args.prompts, wl) for name, runs in raw.items() if runs}
    base = min((k for k in medians if k != "ours"), key=lambda k: medians[k]["step_seconds"])
    ratio = {k: medians["ours"][k] / medians[base][k]
             for k in ("step_seconds", "prompts_per_second", "generated_tokens_per_second")}
    result = {
        "settings": {"prompts_per_step": args.prompts, "samples_per_prompt": wl.per_prompt,
                     "samples_per_step": args.prompts * wl.per_prompt, "prompt_tokens": wl.prompt_tokens,
                     "new_tokens": wl.new_tokens, "fixed_length": wl.fixed_length,
                     "mean_length_target": wl.mean_length or None, "eos_alpha": built["eos_alpha"],
                     "micro_batches_per_step": wl.micro_steps, "model": MODEL, "parameters": built["parameters"],
                     "dtype": "bfloat16 mixed (fp32 weights)" if wl.bf16 else "float32",
                     "ours_overrides": list(wl.ours), "lr": LR, "threads": THREADS,
                     "steps_per_process": args.steps, "rounds": args.rounds, "warm_up_dropped_per_process": 1,
                     "smoke": args.smoke, "machine": f"{os.cpu_count()} CPUs", "cpu_bf16": cpu_has_bf16(),
                     "date": time.strftime("%Y-%m-%d")},
        "baseline": base,
        "medians": medians,
        "ratio_ours_over_baseline": ratio,
        "trl_paged": paged_note or (f"first round only, {args.paged_steps} steps" if "trl_paged" in sides else None),
        "rounds": [{name: raw[name][i] | {"lengths": None} for name in raw if i < len(raw[name])}
                   for i in range(args.rounds)],
    }
    print_table(wl.name, result)
    return result


def main(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    names = ["variable", "fixed"] if args.workload == "both" else [args.workload]
    results = {name: run_workload(args, workload(args, name), work) for name in names}
    out = {"workloads": results, "versions": versions()}
    if not args.smoke:
        old = json.loads(RESULT.read_text()) if RESULT.exists() else {}
        if "workloads" in old:  # a run of one workload keeps the other's last numbers
            out["workloads"] = old["workloads"] | results
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(out, indent=1))
        print(f"wrote {RESULT.relative_to(REPO)}")
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=["variable", "fixed", "both"], default="both")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (one process of each side per round)")
    p.add_argument("--steps", type=int, default=4, help="episodes / steps per process (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--new-tokens", type=int, default=0, help="response limit (default: the workload's)")
    p.add_argument("--paged-steps", type=int, default=2, help="steps of the TRL paged-generation process")
    p.add_argument("--paged-timeout", type=float, default=900, help="seconds before that process is killed")
    p.add_argument("--smoke", action="store_true", help="1 round, 2 steps, 8 prompts, 32 tokens; writes no JSON")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--paged", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.prompts, args.new_tokens, args.paged_steps = 1, 2, 8, 32, 2
    if args.steps < 2 or args.prompts % 4:
        p.error("--steps must be >= 2 (the first is warm-up) and --prompts a multiple of 4")
    return args


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    if arguments.trl_worker:
        trl_worker(arguments)
    else:
        main(arguments)
