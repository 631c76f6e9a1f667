"""A task that needs a tool: sums of three 3-digit numbers, with a calculator (`configs/agent_calculator.yaml`).

A record is ``{"prompt": [{"role": "user", "content": "123+456+789"}], "answer": "1368"}``: the prompt is one
chat message, so the policy's chat template renders it and the conversation's tool turns (`chatlearn.envs.render`)
follow in the same format; it is kept bare (no instruction, no tool schema) because the tiny models' context is
short. The policy may call the calculator in the Hermes/Qwen format (``<tool_call>{"name":"calculator",
"arguments":{"expression":"123+456+789"}}</tool_call>``), read the result as a tool turn, and answer; its first
answer without a call is final (`CalculatorTask`).

The reward (`CalculatorTask.judge`, summed by the runtime into ``env_reward``; the config's rule reward is
`env_reward`): 1.0 when the last integer of the final answer is the sum. Otherwise shaping, at most 0.4 so a
right sum always earns more: 0.1 per digit of the last integer in its place (units under units, so a near miss
earns more than a far one: the gradient a random-init policy gets from its first episode, as it never writes a
well-formed call), plus 0.1 once if a calculator call earlier in the conversation ran without an error (what a
policy that starts to use the tool gets before it copies the result right). A conversation cut off by
``max_turns`` before a final answer earns 0.

Run `python -m chatlearn.tasks.agent_calculator OUT_DIR` (default ``configs/data``) to regenerate the shipped
JSONL files.
"""

import random
import re
import sys
from pathlib import Path
from typing import Any

from chatlearn.envs.rewards import env_reward
from chatlearn.envs.tool_env import ToolEnvironment
from chatlearn.tasks.max_digit import write_jsonl

__all__ = ["CalculatorTask", "call_text", "digits_score", "env_reward", "eval_metrics", "last_integer",
           "make_records"]

DIGIT_CREDIT = 0.1  # per digit in place of a wrong final answer
CALL_CREDIT = 0.1  # once, for a calculator call that ran before a wrong final answer
_INTEGER = re.compile(r"\d+(?:,\d{3})*")  # thousands separators allowed: "1,368" is 1368


def make_records(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` sums of three 3-digit numbers as chat prompts, with their answers (the same for the same seed)."""
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


def last_integer(text: str) -> str | None:
    """The last integer written in ``text`` (digits only, separators dropped), or None."""
    found = _INTEGER.findall(text)
    return found[-1].replace(",", "") if found else None


def digits_score(answer: str, target: str) -> float:
    """1.0 when the last integer of ``answer`` is ``target``; else 0.1 per digit of it in place (right-aligned)."""
    guess = last_integer(answer)
    if guess is None:
        return 0.0
    if int(guess) == int(target):
        return 1.0
    aligned = guess.zfill(len(target))[-len(target):]
    return DIGIT_CREDIT * sum(a == b for a, b in zip(aligned, target, strict=True))


class CalculatorTask(ToolEnvironment):
    """The calculator and the sum to find (the record's ``answer``); the reward is the module docstring's."""

    def __init__(self) -> None:
        super().__init__(["calculator"])

    def judge(self, answer: str) -> float:
        score = digits_score(answer, str(self.sample["answer"]))
        if score >= 1.0:
            return 1.0
        return score + (CALL_CREDIT if self.succeeded > 0 else 0.0)


def eval_metrics(results: list[dict], context: dict) -> dict:
    """Eval hook (``runtime.eval_post_process_fn``): the mean reward (the environment's, else the score), how
    often the final answer is the sum, how often a conversation called the tool, and the mean calls where the
    results count them (``tool_calls``)."""
    n = max(1, len(results))
    rewards = [float(r["env_reward"] if "env_reward" in r else r.get("scores", 0.0)) for r in results]
    metrics = {"eval_reward_mean": sum(rewards) / n,
               "eval_exact_match": sum(x >= 1.0 for x in rewards) / n,
               "eval_called_tool": sum(int(r.get("tool_calls", 0)) > 0 for r in results) / n}
    counted = [int(r["tool_calls"]) for r in results if "tool_calls" in r]
    if counted:
        metrics["eval_tool_calls_mean"] = sum(counted) / len(counted)
    return metrics


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "configs/data")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "agent_calculator_train.jsonl", make_records(2048, seed=1))
    write_jsonl(out / "agent_calculator_eval.jsonl", make_records(64, seed=2))
