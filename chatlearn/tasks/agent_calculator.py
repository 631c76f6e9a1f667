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

A random-init model never writes a well-formed call: RL on tool use starts from an instruct model that has seen
the format. `warm_start` plays that step for the tiny model (``tiny_model.warm_start`` in
`configs/tiny_qwen2_calculator.yaml`, run once when the model is built): supervised steps on conversations that
call the calculator and answer its result, and on others that guess the sum in words, weighted so that the
policy RL starts from opens a call with probability `CALL_PROBABILITY` and guesses otherwise (its greedy answer
is a guess). GRPO then has to find out that calling pays.

Run `python -m chatlearn.tasks.agent_calculator OUT_DIR` (default ``configs/data``) to regenerate the shipped
JSONL files.
"""

import random
import re
import sys
from pathlib import Path
from typing import Any

import torch

from chatlearn.algorithms.ppo import masked_mean
from chatlearn.envs.render import ObservationRenderer
from chatlearn.envs.rewards import env_reward
from chatlearn.envs.tool_env import ToolEnvironment
from chatlearn.tasks.max_digit import write_jsonl

__all__ = ["CalculatorTask", "call_text", "digits_score", "env_reward", "eval_metrics", "last_integer",
           "make_records", "warm_start"]

DIGIT_CREDIT = 0.1  # per digit in place of a wrong final answer
CALL_CREDIT = 0.1  # once, for a calculator call that ran before a wrong final answer
CALL_PROBABILITY = 0.25  # how often the warm-started policy's first token opens a call
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


def _answer_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def _guess(answer: str, rng: random.Random) -> str:
    """What a policy that cannot add writes: a wrong sum in words, of the right length."""
    while True:
        guess = str(rng.randrange(10 ** (len(answer) - 1), 10 ** len(answer)))
        if guess != answer:
            return f"The sum is {guess}."


def _rows(tokenizer: Any, renderer: ObservationRenderer, records: list[dict], rng: random.Random,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask and loss mask of ``records`` as conversations a rollout would hold, padded on
    the right; the loss covers the answers' tokens.

    Half of them call the calculator, read its result as the template renders a tool turn (the tool's own
    output) and answer it; the others guess (`_guess`). The first token of an answer (a call's ``<`` or a guess's
    first word) is the policy's choice: it is trained in a third of the calls only, so the warm-started policy
    opens a call with probability `CALL_PROBABILITY` (1/6 of the rows against 1/2)."""
    tool = CalculatorTask()
    rows = []
    for record in records:
        prompt = tokenizer.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        mask = [0.0] * len(ids)
        if rng.random() < 0.5:
            tool.reset(record)
            action = call_text(record["prompt"][0]["content"])
            result = tool.step(action)[0]
            first = len(ids)
            for part, learn in ((_answer_ids(tokenizer, action), True), (renderer.ids(result), False),
                                (_answer_ids(tokenizer, result), True)):
                ids += part
                mask += [float(learn)] * len(part)
            if rng.random() >= CALL_PROBABILITY / (1 - CALL_PROBABILITY):
                mask[first] = 0.0
        else:
            part = _answer_ids(tokenizer, _guess(record["answer"], rng))
            ids += part
            mask += [1.0] * len(part)
        rows.append((ids, mask))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width))
    for i, (row, mask) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
        loss_mask[i, :len(mask)] = torch.tensor(mask)
    return ids, attention, loss_mask


def warm_start(model: torch.nn.Module, tokenizer: Any, seed: int, steps: int = 600, batch_size: int = 32,
               lr: float = 1e-3, warmup: int = 50) -> None:
    """Supervised steps (AdamW, cross-entropy over the answers' tokens) on the random-init ``model`` over the
    conversations of `_rows`, in place and seeded. On sums apart from the shipped data's (`make_records` seeds
    1 and 2).

    The copy of the expression into the call is what takes the steps: the loss on its digits stays at chance for
    about 200 steps, then falls. A learning rate of 1e-3 after a linear warm-up of 50 steps got there by step
    400; at 2e-3 without warm-up the same model never did in 450 steps."""
    rng = random.Random(seed)
    renderer = ObservationRenderer(tokenizer)
    records = make_records(steps * batch_size, seed=1_000_003 + seed)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        model.train()
        for step in range(steps):
            ids, attention, mask = _rows(tokenizer, renderer, records[step * batch_size:(step + 1) * batch_size], rng)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                    reduction="none")
            loss = masked_mean(nll, mask[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
    finally:
        torch.random.set_rng_state(state)
        model.eval()


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "configs/data")
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "agent_calculator_train.jsonl", make_records(2048, seed=1))
    write_jsonl(out / "agent_calculator_eval.jsonl", make_records(64, seed=2))
