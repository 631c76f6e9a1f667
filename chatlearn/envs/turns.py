"""One environment step of a batch of conversations: what a multi-turn rollout does between two policy turns.

The policy answered (its tokens are at the end of each sample's ``response_ids``, from ``turn_start`` on); each
sample's environment reads that answer as text and returns an observation, a reward and whether it is done.
A conversation that goes on gets the observation's tokens appended to its response, as the chat template
renders them (`chatlearn.envs.render`), with ``loss_mask`` 0 and log-prob 0: the policy continues from the
exact token ids it generated, never from a decoded and re-encoded text. A conversation ends when its
environment says done, after ``max_turns`` answers, or when a whole answer (``max_new_tokens``) would no longer
fit in ``max_total_tokens`` after the observation.

An ended conversation's ``response`` is its whole text after the prompt, decoded with the turn separators
(the policy's own ``response`` is one answer). Every sample leaving a step carries the same fields, so samples
that ended in different turns batch together: ``loss_mask``, ``turn_start``, ``env_reward`` (the sum of its
rewards), ``turns``, ``tool_calls``, ``tool_errors``.
"""

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, Field

from chatlearn.data.batch import PROMPT_KEYS, split_batch
from chatlearn.envs.base import EnvError, check_reset, check_step, load_environment
from chatlearn.envs.render import ObservationRenderer

__all__ = ["StepResult", "TurnSpec", "env_seed", "step_conversations"]

class TurnSpec(BaseModel):
    """What an environment step needs of the run (``runtime.agent`` and the policy's numbers)."""

    env: str = Field(description="the environment class, 'package.module:Class'")
    env_args: dict[str, Any] = Field(default_factory=dict)
    max_turns: int
    max_total_tokens: int
    max_new_tokens: int = Field(description="the policy's max_new_tokens: a whole answer")
    seed: int = Field(description="the run seed; each sample's environment is seeded from it and the sample id")
    model_path: str = Field(description="the policy's tokenizer, which renders the observations")
    num_cpus: float = 0.5
    timeout_s: float = 60.0
    retries: int = 0


def env_seed(seed: int, sample_id: int, is_eval: bool) -> int:
    """A sample's environment seed: fixed by the run seed and the sample id (eval samples apart from training
    ones, whose ids start at 0 too), so the same sample gives the same conversation in any batch or re-run."""
    return (seed * 1_000_003 + sample_id * 2 + int(is_eval)) % (2**31 - 1)


@dataclass
class StepResult:
    """A batch after one environment step: the conversations that go on (with their environments, in the same
    order) and those that ended."""

    going: list[dict[str, Any]]
    envs: list[Any]
    ended: list[dict[str, Any]]


def _append(sample: dict[str, Any], ids: list[int], length: int) -> None:
    """The observation's tokens after the response: every response-aligned tensor grows, ``response_ids`` by
    the tokens, ``response_mask`` by ones, the rest (``loss_mask``, log-probs, ...) by zeros."""
    obs = torch.tensor(ids, dtype=sample["response_ids"].dtype)
    for key, value in list(sample.items()):
        if key in PROMPT_KEYS or not isinstance(value, torch.Tensor) or value.dim() != 1 or value.shape[0] != length:
            continue
        if key == "response_ids":
            sample[key] = torch.cat([value, obs])
        elif key == "response_mask":
            sample[key] = torch.cat([value, torch.ones(len(ids), dtype=value.dtype)])
        else:
            sample[key] = torch.cat([value, torch.zeros(len(ids), dtype=value.dtype)])


def _reset_fields(sample: dict[str, Any]) -> dict[str, Any]:
    """What ``reset`` sees: the record's fields and ids, not the tensors."""
    return {k: v for k, v in sample.items() if not isinstance(v, torch.Tensor)}


def step_conversations(batch: dict[str, Any], envs: list[Any] | None, turn: int, spec: TurnSpec,
                       renderer: ObservationRenderer, is_eval: bool = False) -> StepResult:
    """Step each sample's environment on the policy's answer of ``turn`` (1 for the first answer; ``envs`` None:
    made and reset here). An environment that raises or returns something unusable is an EnvError naming the
    sample, the turn and the class."""
    samples = split_batch(batch)
    if envs is not None and len(envs) != len(samples):
        raise ValueError(f"{len(envs)} environments for a batch of {len(samples)} conversations")
    cls = load_environment(spec.env) if envs is None else None
    going, going_envs, ended = [], [], []
    for i, sample in enumerate(samples):
        sid = sample.get("sample_id", i)
        where = f"environment {spec.env} on sample {sid}, turn {turn}"
        length = int(sample["response_ids"].shape[0])
        start = int(sample.get("turn_start", 0))
        if "loss_mask" not in sample:  # a first answer: every token the policy's
            sample["loss_mask"] = torch.ones(length, dtype=torch.float32)
        try:
            if envs is None:
                env = cls(**spec.env_args)
                check_reset(env.reset({**_reset_fields(sample), "env_seed": env_seed(spec.seed, sid, is_eval)}),
                            where)
            else:
                env = envs[i]
            answer = sample["response_ids"][start:length].tolist()
            action = renderer.tokenizer.decode(answer, skip_special_tokens=True)
            obs, reward, done, info = check_step(env.step(action), where)
        except EnvError:
            raise
        except Exception as exc:
            raise EnvError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        sample["env_reward"] = float(sample.get("env_reward", 0.0)) + reward
        sample["turns"] = turn
        for key in ("tool_calls", "tool_errors"):
            sample[key] = int(sample.get(key, 0)) + int(info.get(key, 0))
        ids = renderer.ids(obs) if not done and turn < spec.max_turns else []
        eos = renderer.tokenizer.eos_token_id
        if ids and renderer.templated and (length == 0 or int(sample["response_ids"][length - 1]) != eos):
            # an answer cut off by max_new_tokens: its message ends as the template ends one (the EOS is the
            # observation's, out of the loss), so the conversation reads as the template renders it
            ids = [eos, *ids]
        if done or turn >= spec.max_turns or length + len(ids) + spec.max_new_tokens > spec.max_total_tokens:
            sample["turn_start"] = length
            # the whole conversation after the prompt, turn separators kept: what eval examples and rewards read
            sample["response"] = renderer.tokenizer.decode(sample["response_ids"].tolist(),
                                                           skip_special_tokens=False)
            ended.append(sample)
            continue
        _append(sample, ids, length)
        sample["turn_start"] = length + len(ids)
        going.append(sample)
        going_envs.append(env)
    return StepResult(going, going_envs, ended)
