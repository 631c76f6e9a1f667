"""Reward: a Python rule function, or a Hugging Face scalar reward model.

Both end in the same place: a score per sample, then the experience, as ChatLearn's reward inference does:
PPO's (KL-penalized per-token rewards and GAE advantages/returns) when the upstream outputs carry log-probs
and values; GRPO's (group-normalised advantages, one per response) when they carry prompt groups and no
values (no critic). Whitening of PPO advantages happens in the trainer, over each global batch.

A rule function is called by :func:`score_samples`, which bounds each call by a timeout and names the sample
when the function raises or returns something that is not a finite number. In a run the rule is not called
in the reward's actor: the score and eval stages fan the batches out as Prefect tasks on Ray
(``flows/stage_tasks.py``) and hand the scores to the actor, which only builds the experience.
"""

import concurrent.futures
import math
from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers import AutoModelForSequenceClassification

from chatlearn.algorithms import get_advantage_estimator, kl_penalized_rewards
from chatlearn.algorithms.grpo import group_advantages_by_id
from chatlearn.data.batch import split_batch
from chatlearn.models.base_module import BaseModule
from chatlearn.models.hf.common import HFModelArgs, HFModule, ensure_model_files, load_tokenizer
from chatlearn.utils.imports import import_callable


class PPOExperienceArgs(BaseModel):
    model_config = ConfigDict(extra="allow")

    kl_coef: float = Field(0.02, ge=0, description="weight of the per-token KL penalty to the reference")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    advantage_estimator: str = Field("gae", description="registered advantage estimator")
    score_clip: float = Field(100.0, gt=0, description="clip scores to +-score_clip (ChatLearn cliprange_reward)")


class RuleRewardArgs(PPOExperienceArgs):
    reward_fn: str = Field(..., description="'package.module:function' taking a sample dict, returning a float")
    fan_out: bool = Field(True, description="score each generation batch in its own Prefect task on Ray, in "
                          "parallel (False: in the reward's actor)")
    num_cpus_per_task: float = Field(1.0, ge=0, description="Ray CPUs of each fanned-out reward task")
    timeout_s: float = Field(60.0, gt=0, description="longest one call of reward_fn may take, in seconds")

    @field_validator("reward_fn")
    @classmethod
    def _importable(cls, spec: str) -> str:
        # checked with the config, before any actor starts, not first in the reward actor's setup
        import_callable(spec)
        return spec


class ModelRewardArgs(PPOExperienceArgs, HFModelArgs):
    pass


class RewardError(RuntimeError):
    """A rule reward function that failed, timed out or returned something unusable, on a named sample."""


def _describe(sample: dict) -> str:
    sid = sample.get("sample_id")
    prompt = str(sample.get("prompt", ""))[:60]
    return f"sample {sid}" + (f" (prompt {prompt!r})" if prompt else "")


def score_samples(fn: Callable[[dict], Any], samples: list[dict], timeout_s: float, where: str) -> list[float]:
    """``fn(sample)`` for each sample, each call bounded by ``timeout_s``; a RewardError names the sample.

    The call runs in a helper thread so a stuck function becomes an error within the timeout (the thread
    itself cannot be killed; the run stops anyway). Non-numbers and non-finite numbers are errors too: a NaN
    reward would otherwise train on silently.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
    out: list[float] = []
    try:
        for sample in samples:
            future = pool.submit(fn, sample)
            try:
                value = future.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                raise RewardError(f"{where}: took longer than timeout_s={timeout_s:g}s on {_describe(sample)}") \
                    from None
            except Exception as exc:
                raise RewardError(f"{where}: raised {type(exc).__name__}: {exc} on {_describe(sample)}") from exc
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RewardError(f"{where}: returned {value!r} on {_describe(sample)}; expected a finite number")
            out.append(float(value))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return out


def text_samples(data: dict) -> list[dict]:
    """The per-sample dicts a rule function sees: record fields, response text, ids (no tensors)."""
    return split_batch({k: v for k, v in data.items() if not isinstance(v, torch.Tensor)})


class _ExperienceMixin:
    """Scores -> KL-penalized rewards -> advantages/returns, for any reward module."""

    args: PPOExperienceArgs

    def make_experience(self, data: dict, scores: torch.Tensor) -> dict:
        scores = scores.float().clamp(-self.args.score_clip, self.args.score_clip)
        out: dict[str, Any] = {"scores": scores}
        if "group_id" in data and "values" not in data:
            # GRPO: no critic, each response is judged against the other responses to its prompt
            out["advantages"] = group_advantages_by_id(scores, data["group_id"])
            if "ref_logprobs" in data and "logprobs" in data:
                mask = data["response_mask"]
                out["kl"] = (data["logprobs"] - data["ref_logprobs"]) * mask  # reported, not a reward penalty
        elif all(k in data for k in ("logprobs", "ref_logprobs", "values", "response_mask")):
            mask = data["response_mask"]
            rewards, kl = kl_penalized_rewards(scores, data["logprobs"], data["ref_logprobs"], mask, self.args.kl_coef)
            estimator = get_advantage_estimator(self.args.advantage_estimator)
            adv, ret = estimator(rewards=rewards, values=data["values"], mask=mask, gamma=self.args.gamma,
                                 lam=self.args.lam)
            out.update(rewards=rewards, kl=kl, advantages=adv, returns=ret)
        return out


class RuleReward(_ExperienceMixin, BaseModule):
    """Serves `reward_fn(sample) -> float` as a model; `sample` holds the record fields plus `response`."""

    args_schema = RuleRewardArgs

    def setup(self) -> None:
        self.reward_fn: Callable[[dict], float] = import_callable(self.args.reward_fn)

    def score(self, data: dict) -> torch.Tensor:
        """The rule's scores; those the fanned-out reward tasks computed already (``data["scores"]``) win."""
        if "scores" in data:
            return torch.as_tensor(data["scores"], dtype=torch.float32)
        where = f"{self.name} reward_fn {self.args.reward_fn}"
        values = score_samples(self.reward_fn, text_samples(data), self.args.timeout_s, where)
        return torch.tensor(values, dtype=torch.float32)

    def forward_step(self, data, iteration):
        return self.make_experience(data, self.score(data))

    def eval_step(self, data):
        return {"scores": self.score(data)}


class ModelReward(_ExperienceMixin, HFModule):
    """A `AutoModelForSequenceClassification` with one label scores prompt+response text."""

    args_schema = ModelRewardArgs

    def setup(self) -> None:
        ensure_model_files(self.args)
        self.tokenizer = load_tokenizer(self.args.model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.args.model_path, num_labels=1, dtype=getattr(torch, self.args.dtype)
        ).to(self.device).eval()
        self.parallelize()

    @torch.no_grad()
    def score(self, data: dict) -> torch.Tensor:
        texts = [p + r for p, r in zip(data["prompt"], data["response"], strict=True)]
        enc = self.tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
        return self.model(**enc).logits[:, 0].float().cpu()

    def forward_step(self, data, iteration):
        return self.make_experience(data, self.score(data))

    def eval_step(self, data):
        return {"scores": self.score(data)}
