"""Reward: a Python rule function served as a CPU model, or a Hugging Face scalar reward model.

Both end in the same place: a score per sample, then the PPO experience (KL-penalized per-token rewards and
GAE advantages/returns) when the upstream outputs carry log-probs and values, as ChatLearn's reward
inference does. Whitening of advantages happens in the trainer, over each global batch.
"""

from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers import AutoModelForSequenceClassification

from chatlearn.algorithms import get_advantage_estimator, kl_penalized_rewards
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

    @field_validator("reward_fn")
    @classmethod
    def _importable(cls, spec: str) -> str:
        # checked with the config, before any actor starts, not first in the reward actor's setup
        import_callable(spec)
        return spec


class ModelRewardArgs(PPOExperienceArgs, HFModelArgs):
    pass


class _ExperienceMixin:
    """Scores -> KL-penalized rewards -> advantages/returns, for any reward module."""

    args: PPOExperienceArgs

    def make_experience(self, data: dict, scores: torch.Tensor) -> dict:
        scores = scores.float().clamp(-self.args.score_clip, self.args.score_clip)
        out: dict[str, Any] = {"scores": scores}
        if all(k in data for k in ("logprobs", "ref_logprobs", "values", "response_mask")):
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
        samples = split_batch({k: v for k, v in data.items() if not isinstance(v, torch.Tensor)})
        return torch.tensor([float(self.reward_fn(s)) for s in samples], dtype=torch.float32)

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

    @torch.no_grad()
    def score(self, data: dict) -> torch.Tensor:
        texts = [p + r for p, r in zip(data["prompt"], data["response"], strict=True)]
        enc = self.tokenizer(texts, padding=True, return_tensors="pt").to(self.device)
        return self.model(**enc).logits[:, 0].float().cpu()

    def forward_step(self, data, iteration):
        return self.make_experience(data, self.score(data))

    def eval_step(self, data):
        return {"scores": self.score(data)}
