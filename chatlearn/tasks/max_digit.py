"""The embedded verifiable task: answer with the largest digit of the prompt.

A prompt is `max 3 7 1 ?`, the answer is `7`, read from the first character of the response. The reward
is a rule, so no reward model is needed and the signal is exact: 1.0 when the response starts with the
answer, partial credit (up to 0.5) for a first digit close to it, so a random-init policy gets a gradient
from its first episode, and 0 when the response does not start with a digit.
Run `python -m chatlearn.tasks.max_digit OUT_DIR` to regenerate the shipped JSONL files.
"""

import json
import random
import sys
from pathlib import Path


def make_records(n: int, seed: int, min_digits: int = 3, max_digits: int = 4) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(min_digits, max_digits))]
        records.append({"prompt": "max " + " ".join(map(str, digits)) + " ?", "answer": str(max(digits))})
    return records


def make_pairs(n: int, seed: int) -> list[dict]:
    """Preference pairs for DPO: the right digit is chosen, a wrong one rejected."""
    rng = random.Random(seed)
    pairs = []
    for rec in make_records(n, seed):
        wrong = rng.choice([d for d in "0123456789" if d != rec["answer"]])
        pairs.append({**rec, "chosen": rec["answer"], "rejected": wrong})
    return pairs


def pair_eval_metrics(results: list[dict], context: dict) -> dict:
    """Eval hook of the DPO config: how often the trained policy prefers the chosen response over the
    rejected one more than the reference does (implicit reward margin > 0), and the mean margin."""
    n = max(1, len(results))
    return {
        "eval_preference_accuracy": sum(float(r["preferred"]) for r in results) / n,
        "eval_reward_margin": sum(float(r["scores"]) for r in results) / n,
    }


def max_digit_reward(sample: dict) -> float:
    """1.0 if the response starts with the answer, 0.5 * closeness for another digit, else 0."""
    response = sample["response"].strip()
    if not response[:1].isdigit():
        return 0.0
    if response[0] == sample["answer"]:
        return 1.0
    return 0.5 * (1.0 - abs(int(response[0]) - int(sample["answer"])) / 9.0)


def format_reward(sample: dict) -> float:
    """1.0 when the response is one digit and nothing else (a format reward, GRPOMath's second reward)."""
    response = sample["response"].strip()
    return float(len(response) == 1 and response.isdigit())


def exact_match(sample: dict) -> float:
    """1.0 when the response starts with the answer."""
    return float(sample["response"].strip()[:1] == sample["answer"])


def eval_metrics(results: list[dict], context: dict) -> dict:
    """Eval post-processing hook: mean reward and the fraction answered exactly."""
    n = max(1, len(results))
    return {
        "eval_reward_mean": sum(max_digit_reward(r) for r in results) / n,
        "eval_exact_match": sum(exact_match(r) for r in results) / n,
    }


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "configs/data")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "max_digit_train.jsonl", make_records(4096, seed=1))
    write_jsonl(out / "max_digit_eval.jsonl", make_records(128, seed=2))
    write_jsonl(out / "max_digit_pairs_train.jsonl", make_pairs(1024, seed=3))
    write_jsonl(out / "max_digit_pairs_eval.jsonl", make_pairs(128, seed=4))
