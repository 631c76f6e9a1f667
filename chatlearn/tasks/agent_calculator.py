"""A task that needs a tool: sums of three 3-digit numbers, with a calculator (`configs/agent_calculator.yaml`).

A prompt is one user message, ``123+456+789``; the answer is the sum. The policy may call the calculator in the
Hermes/Qwen format its chat template defines (``<tool_call>{"name":"calculator","arguments":{"expression":
"123+456+789"}}</tool_call>``), read the result as a tool turn, and answer; its first answer without a call is
final (`CalculatorTask`). The reward is 1.0 for the right sum and partial credit for the digits in place
(``0.1`` per right digit of four, at most 0.4), so a guess near the sum teaches something too.

A random-init model never writes a well-formed call, as a base model rarely does before instruction tuning;
RL on this task starts from a model that already calls the tool some of the time (not shipped yet: the tiny
model's short supervised warm-up did not learn to copy the expression into the call).

Run `python -m chatlearn.tasks.agent_calculator OUT_DIR` to regenerate the shipped JSONL files.
"""

import json
import random
import sys
from pathlib import Path
from typing import Any

from chatlearn.envs.tool_env import ToolEnvironment


def make_records(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` sums of three 3-digit numbers as chat prompts, with their answers."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        terms = [rng.randrange(100, 1000) for _ in range(3)]
        records.append({"prompt": [{"role": "user", "content": "+".join(map(str, terms))}],
                        "answer": str(sum(terms))})
    return records


def call_text(expression: str) -> str:
    """The calculator call an answer holds, in the template's format (compact JSON: fewer tokens)."""
    return '<tool_call>\n{"name":"calculator","arguments":{"expression":"' + expression + '"}}\n</tool_call>'


def digits_score(answer: str, target: str) -> float:
    """1.0 for the right sum; else 0.1 for each of its digits in place (at most 0.4 for a 4-digit sum)."""
    words = answer.replace(",", " ").split()
    guess = next((w for w in reversed(words) if w.isdigit()), "")
    if guess == target:
        return 1.0
    return 0.1 * sum(a == b for a, b in zip(guess.zfill(len(target))[-len(target):], target, strict=True))


class CalculatorTask(ToolEnvironment):
    """The calculator and the sum to find (the record's ``answer``)."""

    def __init__(self) -> None:
        super().__init__(["calculator"])

    def judge(self, answer: str) -> float:
        return digits_score(answer, str(self.sample["answer"]))


def eval_metrics(results: list[dict], context: dict) -> dict:
    """Eval hook: how often the final answer is the sum, and how often the conversation called the tool."""
    n = max(1, len(results))
    return {"eval_exact_match": sum(float(r.get("env_reward", 0.0)) == 1.0 for r in results) / n,
            "eval_called_tool": sum(int(r.get("tool_calls", 0)) > 0 for r in results) / n}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "configs/data")
    write_jsonl(out / "agent_calculator_train.jsonl", make_records(2048, seed=1))
    write_jsonl(out / "agent_calculator_eval.jsonl", make_records(64, seed=2))
