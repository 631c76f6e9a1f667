"""Our GRPO against TRL's GRPOTrainer on the same work, measured side by side in one run.

The work, for both: GRPO on 64 prompts x 4 samples per step (256 responses, one optimizer step on all 256 in
4 micro-batches of 64), 16-token prompts, exactly 32 new tokens (EOS never drawn: ``min_new_tokens``), an
fp32 Llama (hidden 256, 4 layers, 4 heads, FFN 688, vocab 1024: 3.7M parameters) built once here with one seed
and loaded by both with ``from_pretrained``, a word-level tokenizer of 1024 tokens (``t4`` ... ``t1023``), no
reference model (KL weight 0), no gradient checkpointing (TRL's default is on), AdamW at a constant learning
rate, clip 0.2 / 0.28, loss summed over the tokens of the whole batch (TRL's ``dapo``, our ``grpo``), 2 torch
threads. The reward is a cheap rule with variance inside every group: the fraction of response tokens whose
id has the parity of the prompt's first token id.

One difference in the work stays: our sampler returns the responses' log-probs (one more forward pass over
prompt + response, in the generate stage; ``old_logprobs: generation``), while TRL skips old log-probs when
each batch is trained once (``num_iterations=1``) and uses the detached current ones.

- Ours runs the real ``chatlearn train bench/configs/grpo_vs_trl.yaml`` (its own Prefect server, Ray, the
  three models colocated in one 2-CPU worker process) for K episodes; the per-episode ``stage_seconds`` and
  ``episode_seconds`` come from ``run_dir/metrics.jsonl``.
- TRL runs ``GRPOTrainer`` for K steps in its own process (this script with ``--trl-worker``); a callback
  times each optimizer step (from one step's end to the next), and the trainer's ``_generate``,
  ``_calculate_rewards`` and ``_generate_and_score_completions`` are timed to split a step into generate,
  score, the rest of the rollout, and train.

Rounds interleave one process of ours and one of TRL; each process's first episode/step is warm-up and
dropped. Medians are over all kept episodes/steps of all rounds. Prints a table and writes
``bench/results/vs_trl.json`` (settings, per-round raw numbers, medians, ratios, versions).

    .venv/bin/python bench/vs_trl.py [--rounds 3] [--steps 8]      # needs `pip install -e '.[bench]'`
    .venv/bin/python bench/vs_trl.py --smoke                        # 1 round, 2 steps, 8 prompts
"""

import argparse
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
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, vocab_size=VOCAB)
PROMPT_TOKENS = 16
NEW_TOKENS = 32
PER_PROMPT = 4
MICRO_STEPS = 4  # micro-batches per optimizer step, both
LR = 1e-4
THREADS = 2


# ---- the task: the rule reward (imported by our run's reward tasks as `vs_trl:parity_reward`) ----

def parity_score(prompt: str, response: str) -> float:
    """Fraction of the response's tokens whose id has the parity of the prompt's first token id."""
    target = int(prompt.split()[0][1:]) % 2
    words = response.split()
    return sum(int(w[1:]) % 2 == target for w in words) / len(words) if words else 0.0


def parity_reward(sample: dict) -> float:
    """Ours: a rule reward function takes a sample dict (record fields + response text)."""
    return parity_score(sample["prompt"], sample["response"])


def trl_parity_reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """TRL: a reward function takes the batch's prompts and completions."""
    return [parity_score(p, c) for p, c in zip(prompts, completions, strict=True)]


# ---- the shared model, tokenizer and prompts ----

def build_model(path: Path) -> int:
    """A word-level tokenizer of VOCAB tokens and a seeded random-init fp32 Llama, saved with save_pretrained.
    Returns the parameter count."""
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
    config = LlamaConfig(**MODEL, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         dtype="float32")
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def write_prompts(path: Path, n: int) -> None:
    """n prompts of PROMPT_TOKENS random non-special tokens, one JSON record each."""
    rng = random.Random(SEED)
    with path.open("w") as f:
        for _ in range(n):
            words = [f"t{rng.randrange(len(SPECIALS), VOCAB)}" for _ in range(PROMPT_TOKENS)]
            f.write(json.dumps({"prompt": " ".join(words)}) + "\n")


# ---- ours: the real `chatlearn train` ----

def run_ours(work: Path, model: Path, data: Path, steps: int, prompts: int, tag: str) -> dict:
    sys.path.insert(0, str(BENCH))
    from common import run_train  # bench/ is a folder of scripts, not a package

    os.environ.update(VS_TRL_MODEL=str(model), VS_TRL_DATA=str(data),
                      PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")])))
    out = work / f"ours-{tag}"
    samples = prompts * PER_PROMPT
    wall = run_train(out, [str(CONFIG.relative_to(REPO)), f"runtime.num_episode={steps}",
                           f"runtime.sample_per_episode={samples}", f"runtime.generation_batch_size={samples}",
                           f"runtime.train_global_batch_size={samples}",
                           f"runtime.train_micro_batch_size={samples // MICRO_STEPS}"], "chatlearn train (ours)")
    rows = [json.loads(line) for line in (out / "vs_trl" / "metrics.jsonl").read_text().splitlines()]
    episodes = [{"episode_seconds": r["episode_seconds"],
                 "stages": r.get("stage_seconds", {}),
                 "outside_stages": r["episode_seconds"] - sum(r.get("stage_seconds", {}).values()),
                 "reward_mean": r.get("reward_mean"),
                 "response_length_mean": r.get("response_length_mean")} for r in rows]
    return {"wall_seconds": wall, "startup_seconds": rows[0].get("startup_seconds"), "steps": episodes}


# ---- TRL: GRPOTrainer in its own process ----

def run_trl(work: Path, model: Path, data: Path, steps: int, prompts: int, tag: str) -> dict:
    from common import timed_run  # bench/ is a folder of scripts, not a package

    out = work / f"trl-{tag}.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", "--model", str(model), "--data",
           str(data), "--steps", str(steps), "--prompts", str(prompts), "--out", str(out),
           "--work", str(work / f"trl-{tag}")]
    wall = timed_run(cmd, env, "TRL worker")
    result = json.loads(out.read_text())
    result["wall_seconds"] = wall
    return result


def trl_worker(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(THREADS)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

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
    config = GRPOConfig(
        output_dir=args.work, max_steps=args.steps, seed=SEED, use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=args.prompts * PER_PROMPT // MICRO_STEPS,
        gradient_accumulation_steps=MICRO_STEPS, num_generations=PER_PROMPT,
        max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS},
        temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", num_iterations=1,
        gradient_checkpointing=False,  # TRL's default is on: it recomputes the forward in backward; ours does not
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = TimedGRPOTrainer(model=model, reward_funcs=trl_parity_reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    Path(args.out).write_text(json.dumps({"startup_seconds": marks["train_begin"], "steps": steps,
                                          "threads": torch.get_num_threads()}))


# ---- medians, table, JSON ----

def summarise(runs: list[dict], prompts: int) -> dict:
    kept = [s for run in runs for s in run["steps"][1:]]  # each process's first episode/step is warm-up
    key = "episode_seconds" if "episode_seconds" in kept[0] else "step_seconds"
    step = statistics.median(s[key] for s in kept)
    stages = sorted({k for s in kept for k in s["stages"]})
    return {
        "steps_kept": len(kept),
        "step_seconds": step,
        "prompts_per_second": statistics.median(prompts / s[key] for s in kept),
        "generated_tokens_per_second": statistics.median(prompts * PER_PROMPT * NEW_TOKENS / s[key] for s in kept),
        "stage_seconds": {k: statistics.median(s["stages"].get(k, 0.0) for s in kept) for k in stages},
        "outside_stages_seconds": statistics.median(s["outside_stages"] for s in kept),
        "startup_seconds": statistics.median(r["startup_seconds"] for r in runs),
        "process_wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
        "response_length_mean": statistics.median(s["response_length_mean"] for s in kept
                                                  if s.get("response_length_mean") is not None),
    }


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ours, trl, ratio = result["medians"]["ours"], result["medians"]["trl"], result["ratio_ours_over_trl"]
    table = Table(title=f"GRPO, {result['settings']['prompts_per_step']} prompts x {PER_PROMPT} samples x "
                        f"{NEW_TOKENS} tokens per step: medians of {ours['steps_kept']} / {trl['steps_kept']} "
                        f"steps over {result['settings']['rounds']} interleaved rounds")
    for col in ("", "ours (chatlearn train)", "TRL GRPOTrainer", "ours / TRL"):
        table.add_column(col, justify="left" if not col else "right")
    table.add_row("s per step (episode)", f"{ours['step_seconds']:.2f}", f"{trl['step_seconds']:.2f}",
                  f"{ratio['step_seconds']:.2f}")
    table.add_row("prompts / s", f"{ours['prompts_per_second']:.1f}", f"{trl['prompts_per_second']:.1f}",
                  f"{ratio['prompts_per_second']:.2f}")
    table.add_row("generated tokens / s", f"{ours['generated_tokens_per_second']:.0f}",
                  f"{trl['generated_tokens_per_second']:.0f}", f"{ratio['generated_tokens_per_second']:.2f}")
    for name in ("generate", "score", "rollout_rest", "train", "sync"):
        a, b = ours["stage_seconds"].get(name), trl["stage_seconds"].get(name)
        table.add_row(f"  {name} s", "-" if a is None else f"{a:.2f}", "-" if b is None else f"{b:.2f}",
                      f"{a / b:.2f}" if a is not None and b and min(a, b) >= 0.01 else "")
    for name in sorted(set(ours["stage_seconds"]) - {"generate", "score", "train", "sync"}):
        table.add_row(f"  {name} s", f"{ours['stage_seconds'][name]:.2f}", "-", "")
    table.add_row("  outside stages s", f"{ours['outside_stages_seconds']:.2f}",
                  f"{trl['outside_stages_seconds']:.2f}", "")
    table.add_row("start-up to step 1 s", f"{ours['startup_seconds']:.1f}", f"{trl['startup_seconds']:.1f}", "")
    table.add_row("whole process s", f"{ours['process_wall_seconds']:.1f}", f"{trl['process_wall_seconds']:.1f}", "")
    table.add_row("response length", f"{ours['response_length_mean']:.1f}", f"{trl['response_length_mean']:.1f}", "")
    Console().print(table)


def versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "trl", "accelerate", "datasets", "ray",
                                             "prefect")} | {"python": platform.python_version()}


def main(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-vs-trl-"))
    model, data = work / "model", work / "prompts.jsonl"
    n_params = build_model(model)
    write_prompts(data, args.prompts * args.steps)
    raw: dict[str, list[dict]] = {"ours": [], "trl": []}
    for i in range(args.rounds):
        for name, run in (("ours", run_ours), ("trl", run_trl)):
            raw[name].append(run(work, model, data, args.steps, args.prompts, str(i)))
            kept = raw[name][-1]["steps"][1:]
            key = "episode_seconds" if name == "ours" else "step_seconds"
            med = statistics.median(s[key] for s in kept) if kept else float("nan")
            print(f"round {i + 1}/{args.rounds}: {name}: {med:.2f} s per step (median of {len(kept)})",
                  file=sys.stderr)
    medians = {name: summarise(runs, args.prompts) for name, runs in raw.items()}
    ratio = {k: medians["ours"][k] / medians["trl"][k]
             for k in ("step_seconds", "prompts_per_second", "generated_tokens_per_second")}
    result = {
        "settings": {"prompts_per_step": args.prompts, "samples_per_prompt": PER_PROMPT,
                     "samples_per_step": args.prompts * PER_PROMPT, "prompt_tokens": PROMPT_TOKENS,
                     "new_tokens": NEW_TOKENS, "micro_batches_per_step": MICRO_STEPS, "model": MODEL,
                     "parameters": n_params, "dtype": "float32", "lr": LR, "threads": THREADS,
                     "steps_per_process": args.steps, "rounds": args.rounds, "warm_up_dropped_per_process": 1,
                     "smoke": args.smoke, "machine": f"{os.cpu_count()} CPUs",
                     "date": time.strftime("%Y-%m-%d")},
        "versions": versions(),
        "medians": medians,
        "ratio_ours_over_trl": ratio,
        "rounds": [{"ours": o, "trl": t} for o, t in zip(raw["ours"], raw["trl"], strict=True)],
    }
    print_table(result)
    if not args.smoke:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(result, indent=1))
        print(f"wrote {RESULT.relative_to(REPO)}")
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (one process of each per round)")
    p.add_argument("--steps", type=int, default=8, help="episodes / steps per process (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step (x4 samples)")
    p.add_argument("--smoke", action="store_true", help="1 round, 2 steps, 8 prompts; writes no JSON")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.prompts = 1, 2, 8
    if args.steps < 2 or args.prompts % MICRO_STEPS:
        p.error(f"--steps must be >= 2 (the first is warm-up) and --prompts a multiple of {MICRO_STEPS}")
    return args


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    if arguments.trl_worker:
        trl_worker(arguments)
    else:
        main(arguments)
