"""Reward: a Python rule function, or a Hugging Face scalar reward model.

Both end in the same place: a score per sample, then the experience, as ChatLearn's reward inference does, by
the advantage estimator the engine names (``args_dict.advantage_estimator``, default the engine's; see
:mod:`chatlearn.algorithms.advantages`): PPO's ``gae`` (KL-penalized per-token rewards and GAE
advantages/returns) under rlhf, GRPO's ``grpo`` (group-normalised advantages, one per response) under grpo and
online_dpo. A batch without what the estimator reads is an error naming it, never silently no advantages.
Whitening of PPO advantages happens in the trainer, over each global batch.

How a rule function is called (each call bounded by a timeout, errors naming the hook and the sample) is
`chatlearn.models.rule`. With ``fan_out`` (the default) the rule is not called in the reward's actor: each
batch is a Prefect task on Ray (``flows/rule_tasks.py``) and the actor gets its scores with the other
scorers' outputs, so it only builds the experience.

A score or an advantage that is not finite (a reward model's NaN, a policy's NaN log-probs in the KL penalty)
is a `RunError` naming the sample here, where it is made: trained on, it would turn every weight into NaN.
"""

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from transformers import AutoModelForSequenceClassification

from chatlearn.algorithms import ADVANTAGE_ESTIMATORS, advantage_estimator_inputs, get_advantage_estimator
from chatlearn.config.engines import ENGINES
from chatlearn.models.base_module import BaseModule
from chatlearn.models.hf.common import HFModelArgs, HFModule, ensure_model_files, load_tokenizer
from chatlearn.models.rule import RuleSpec, score_key
from chatlearn.utils.errors import RunError
from chatlearn.utils.finite import batch_sample, describe_sample, nonfinite_rows, nonfinite_summary
from chatlearn.utils.imports import import_callable


class PPOExperienceArgs(BaseModel):
    model_config = ConfigDict(extra="allow")

    kl_coef: float = Field(0.02, ge=0, description="weight of the per-token KL penalty to the reference")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    advantage_estimator: str | None = Field(
        None, description="registered advantage estimator (gae, grpo); default: the engine's (rlhf: gae, grpo and "
        "online_dpo: grpo)")
    score_clip: float = Field(100.0, gt=0, description="clip scores to +-score_clip (ChatLearn cliprange_reward)")
    reward_weights: dict[str, float] = Field(
        default_factory=dict, description="when this reward's inputs hold other rewards' scores (their "
        "score_step or forward_step outputs in the flow), the weight of each by model name in the sum it trains "
        "on, this reward's own included; 1.0 for a name not listed")

    @field_validator("advantage_estimator")
    @classmethod
    def _registered(cls, name: str | None) -> str | None:
        # checked with the config, before any actor starts
        if name is not None and name not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
        return name


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


class _ExperienceMixin:
    """Scores -> advantages (and whatever else the engine's advantage estimator makes), for any reward module."""

    args: PPOExperienceArgs
    name: str
    runtime_args: Any

    @staticmethod
    def estimator_inputs(name: str) -> tuple[str, ...] | None:
        """The batch fields the estimator ``name`` reads (None: no such estimator); the engine checks ask it."""
        return advantage_estimator_inputs(name) if name in ADVANTAGE_ESTIMATORS else None

    def advantage_estimator(self) -> str:
        """The estimator this reward runs: ``args_dict.advantage_estimator``, else its engine's."""
        spec = ENGINES.get(self.runtime_args.engine)
        name = self.args.advantage_estimator or (spec.advantage_estimator if spec is not None else None)
        if name is None:
            raise RunError(f"{self.name}: the {self.runtime_args.engine} engine trains on no advantages; set "
                           f"models.{self.name}.args_dict.advantage_estimator (known: {sorted(ADVANTAGE_ESTIMATORS)})")
        return name

    def combined(self, data: dict, own: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This reward's scores plus every other reward's among its inputs (``rewards/<name>``), weighted by
        ``reward_weights``; and, when there are others, its own scores under its name (each reward is logged by
        name). Alone it is just its own scores."""
        own_key = score_key(self.name)
        others = sorted((k, v) for k, v in data.items() if k.startswith("rewards/") and k != own_key)
        if not others:
            return own, {}
        weights = self.args.reward_weights
        total = weights.get(self.name, 1.0) * own.float()
        for key, value in others:
            total = total + weights.get(key.removeprefix("rewards/"), 1.0) * torch.as_tensor(value).float()
        return total, {own_key: own}

    def experience_step(self, data: dict, own: torch.Tensor) -> dict:
        """``forward_step``: the combined scores turned into the experience, each reward's scores kept."""
        total, parts = self.combined(data, own)
        return {**self.make_experience(data, total), **parts}

    def eval_scores(self, data: dict, own: torch.Tensor) -> dict:
        """``eval_step``: the combined scores, each reward's scores kept."""
        total, parts = self.combined(data, own)
        return {"scores": total, **parts}

    def score_step(self, data: dict) -> dict:
        """Only this reward's scores, as ``rewards/<name>``, for another reward of the flow to add to its own."""
        own = self.score(data)
        self._check_finite(data, own.float(), "score")
        return {score_key(self.name): own}

    def make_experience(self, data: dict, scores: torch.Tensor) -> dict:
        # before the clip: clamp turns an infinite score into a finite +-score_clip and would hide it
        self._check_finite(data, scores.float(), "score")
        scores = scores.float().clamp(-self.args.score_clip, self.args.score_clip)
        name = self.advantage_estimator()
        missing = [k for k in advantage_estimator_inputs(name) if k not in data]
        if missing:  # not silently no advantages: the engine's models do not give what its estimator reads
            raise RunError(f"{self.name}: the advantage estimator {name!r} reads {missing}, which the batch does not "
                           f"hold (its fields: {sorted(data)})")
        out: dict[str, Any] = {"scores": scores}
        out.update(get_advantage_estimator(name)({**data, "scores": scores}, self.args))
        self._check_advantages(data, out)
        return out

    def _check_finite(self, data: dict, values: torch.Tensor, what: str, mask: torch.Tensor | None = None,
                      hint: str = "") -> None:
        """A RunError naming the first sample whose ``values`` (a row per sample; only where ``mask`` is on,
        when it has their shape) hold a NaN or an infinity."""
        rows = nonfinite_rows(values, mask)
        if not rows:
            return
        row = values[rows[0]]
        if mask is not None and mask.shape == values.shape:
            row = row[mask[rows[0]].bool()]
        more = f" and {len(rows) - 1} more sample(s)" if len(rows) > 1 else ""
        raise RunError(f"{self.name}: non-finite {what} ({nonfinite_summary(row)}) for "
                       f"{describe_sample(batch_sample(data, rows[0]))}{more}{hint}")

    def _check_advantages(self, data: dict, out: dict) -> None:
        """Advantages (and returns) must be finite; when they are not, name the input that made them so."""
        mask = data.get("response_mask")
        for key, what in (("logprobs", "policy log-probs"), ("ref_logprobs", "reference log-probs"),
                          ("values", "values")):
            if isinstance(data.get(key), torch.Tensor):
                self._check_finite(data, data[key], what, mask, "; its advantages would be too")
        for key in ("advantages", "returns"):
            if isinstance(out.get(key), torch.Tensor):
                self._check_finite(data, out[key], key, mask)


class RuleReward(_ExperienceMixin, BaseModule):
    """Serves `reward_fn(sample) -> float` as a model; `sample` holds the record fields plus `response`."""

    args_schema = RuleRewardArgs

    def setup(self) -> None:
        self.rule = RuleSpec.of(self.args)
        import_callable(self.rule.reward_fn)  # a hook this process cannot import fails the setup, not a batch

    def score(self, data: dict) -> torch.Tensor:
        """The rule's scores; those its fanned-out reward tasks computed already (``rewards/<name>``) win."""
        if score_key(self.name) in data:
            return torch.as_tensor(data[score_key(self.name)], dtype=torch.float32)
        return torch.tensor(self.rule.score(data), dtype=torch.float32)

    def forward_step(self, data, iteration):
        return self.experience_step(data, self.score(data))

    def eval_step(self, data):
        return self.eval_scores(data, self.score(data))


class ModelReward(_ExperienceMixin, HFModule):
    """A `AutoModelForSequenceClassification` with one label scores prompt+response text."""

    args_schema = ModelRewardArgs
    # prompt+response as text under its own tokenizer: the preflight measures prompts against its context too
    reads_text = True

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
        scores = self.model(**enc).logits[:, 0].float().cpu()
        self._check_finite(data, scores, "reward model score")  # eval scores too: eval metrics average them
        return scores

    def forward_step(self, data, iteration):
        return self.experience_step(data, self.score(data))

    def eval_step(self, data):
        return self.eval_scores(data, self.score(data))
