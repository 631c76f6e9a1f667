"""Reward: a Python rule function, or a Hugging Face scalar reward model.

Both end in the same place: a score per sample, then the experience, as ChatLearn's reward inference does, by
the advantage estimator the engine names (``args_dict.advantage_estimator``, default its trainer's; see
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
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from transformers import AutoModelForSequenceClassification

from chatlearn.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    WHITENED_ESTIMATORS,
    advantage_estimator_inputs,
    advantage_estimator_settings,
    get_advantage_estimator,
)
from chatlearn.algorithms.registry import ADVANTAGE_ESTIMATOR_SHAPE, ADVANTAGE_SHAPES, name_problem
from chatlearn.models.base_module import BaseModule
from chatlearn.models.hf.common import HFModelArgs, HFModule, ensure_model_files, load_tokenizer
from chatlearn.models.rule import RuleSpec, score_key, takes_keyword
from chatlearn.utils.errors import RunError
from chatlearn.utils.finite import batch_sample, describe_sample, nonfinite_rows, nonfinite_summary
from chatlearn.utils.imports import import_callable


class PPOExperienceArgs(BaseModel):
    model_config = ConfigDict(extra="allow")

    kl_coef: float | None = Field(
        None, ge=0, description="weight of the per-token KL penalty to the reference in the reward (gae, "
        "reinforce_pp, reinforce_pp_baseline; verl's use_kl_in_reward); default 0.02 for gae, else 0")
    kl_estimator: str = Field(
        "k1", description="the reward KL penalty's per-token estimator, a registered one: k1, k2, k3 "
        "(chatlearn.algorithms.kl; verl's kl_penalty)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of GAE and of REINFORCE++'s returns")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    advantage_estimator: str | None = Field(
        None, description="registered advantage estimator (gae, grpo, dr_grpo, rloo, reinforce_pp, "
        "reinforce_pp_baseline); default: the engine's (rlhf: gae, grpo and online_dpo: grpo)")
    score_clip: float = Field(100.0, gt=0, description="clip scores to +-score_clip (ChatLearn cliprange_reward)")
    overlong_buffer_len: int = Field(
        0, ge=0, description="DAPO's overlong reward shaping: a response longer than max_response_length minus "
        "this many tokens loses overlong_penalty_factor * (its excess / this) from its score, up to the factor at "
        "the limit; 0: off")
    overlong_penalty_factor: float = Field(1.0, gt=0, description="the overlong penalty at the length limit")
    max_response_length: int | None = Field(
        None, gt=0, description="the length limit the overlong penalty counts to: the policy's max_new_tokens "
        "(only with overlong_buffer_len)")

    @model_validator(mode="after")
    def _overlong(self) -> "PPOExperienceArgs":
        if self.overlong_buffer_len and self.max_response_length is None:
            raise ValueError("overlong_buffer_len needs max_response_length (the policy's max_new_tokens)")
        # by value: a deployment's run form may send the defaults too
        if not self.overlong_buffer_len and (self.max_response_length is not None
                                             or self.overlong_penalty_factor != 1.0):
            raise ValueError("max_response_length and overlong_penalty_factor shape overlong responses only with "
                             "overlong_buffer_len > 0")
        if self.overlong_buffer_len and self.overlong_buffer_len > self.max_response_length:
            raise ValueError(f"overlong_buffer_len {self.overlong_buffer_len} exceeds max_response_length "
                             f"{self.max_response_length}")
        return self
    reward_weights: dict[str, float] = Field(
        default_factory=dict, description="when this reward's inputs hold other rewards' scores (their "
        "score_step or forward_step outputs in the flow), the weight of each by model name in the sum it trains "
        "on, this reward's own included; 1.0 for a name not listed")

    # checked with the config, before any actor starts
    @field_validator("advantage_estimator")
    @classmethod
    def _registered(cls, name: str | None) -> str | None:
        if name is not None and (problem := name_problem("advantage estimator", name, ADVANTAGE_ESTIMATORS)):
            raise ValueError(problem)
        return name

    @field_validator("kl_estimator")
    @classmethod
    def _known_kl(cls, name: str) -> str:
        if (problem := name_problem("KL estimator", name, KL_ESTIMATORS)) is not None:
            raise ValueError(problem)
        return name


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, ``[B]``: 0 up to ``max_length - buffer`` tokens, then falling linearly
    to ``-factor`` at ``max_length``. A response cut at the limit has not finished its answer; the buffer tells
    the policy so before the cut, with a signal that grows with the excess rather than a cliff."""
    excess = lengths.float() - (max_length - buffer)
    return torch.clamp(-excess / buffer * factor, max=0.0)


class RuleRewardArgs(PPOExperienceArgs):
    reward_fn: str = Field(..., description="'package.module:function' taking a sample dict, returning a float")
    fan_out: bool = Field(True, description="score each generation batch in its own Prefect task on Ray, in "
                          "parallel (False: in the reward's actor)")
    num_cpus_per_task: float = Field(1.0, ge=0, description="Ray CPUs of each fanned-out reward task")
    timeout_s: float = Field(60.0, gt=0, description="longest one call of reward_fn may take, in seconds")
    answer_key: str | None = Field(
        None, description="field of a data record that holds the reference answer of a verifiable reward, handed "
        "to reward_fn as its answer_key argument (the built-in math rewards read 'answer' without it; verl's "
        "ground truth)")

    @field_validator("reward_fn")
    @classmethod
    def _importable(cls, spec: str) -> str:
        # checked with the config, before any actor starts, not first in the reward actor's setup
        import_callable(spec)
        return spec

    @model_validator(mode="after")
    def _takes_answer_key(self) -> "RuleRewardArgs":
        if self.answer_key is not None and not takes_keyword(import_callable(self.reward_fn), "answer_key"):
            raise ValueError(f"answer_key is given, and reward_fn {self.reward_fn} takes no answer_key argument; "
                             "add one (def reward(sample, answer_key='answer')), or remove answer_key")
        return self


class ModelRewardArgs(PPOExperienceArgs, HFModelArgs):
    remote_url: str | None = Field(
        None, description="score on the reward server at this http(s) URL (`chatlearn reward-server MODEL_PATH "
        "--port P`, chatlearn.models.hf.reward_server) instead of loading a model here: this process then holds no "
        "model, and model_path, dtype and bf16 are the server's (refused here)")
    remote_batch_size: int = Field(32, gt=0, description="with remote_url: texts per request (the server scores "
                                   "them in batches of its own --batch-size)")
    remote_timeout_s: float = Field(60.0, gt=0, description="with remote_url: the longest one request may wait for "
                                    "the server (to connect, and for each read of its answer), in seconds")
    remote_retries: int = Field(3, ge=0, description="with remote_url: how many times a request that failed "
                                "(connection refused or reset, a timeout, a 5xx) is sent again; setup tries the "
                                "server's /health as often")
    remote_backoff_s: float = Field(1.0, ge=0, description="with remote_url: the wait before the first retry, "
                                    "doubling for each next one")

    @field_validator("remote_url")
    @classmethod
    def _remote_only(cls, url: str | None, info: Any) -> str | None:
        if url is None:
            return url
        # lazy: the client's module is needed only by a reward served elsewhere
        from chatlearn.models.hf.remote_reward import url_problem

        problem = url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        local = [f"model_path={info.data['model_path']!r}" if info.data.get("model_path") else "",
                 f"dtype={info.data['dtype']!r}" if info.data.get("dtype", "float32") != "float32" else "",
                 "bf16=true" if info.data.get("bf16") else ""]
        if any(local):
            raise ValueError(f"the reward model is served at {url}, so {', '.join(filter(None, local))} would load "
                             "nothing here: give them to `chatlearn reward-server` (MODEL_PATH, --dtype) and remove "
                             "them, or remove remote_url to load the model in this process")
        return url

    @field_validator("remote_batch_size", "remote_timeout_s", "remote_retries", "remote_backoff_s")
    @classmethod
    def _with_remote_url(cls, value: Any, info: Any) -> Any:
        # only when given: a default is never checked. Without remote_url in info.data, remote_url itself failed
        if "remote_url" in info.data and info.data["remote_url"] is None:
            raise ValueError(f"{info.field_name} sets how the reward server is called, and there is none: set "
                             "remote_url too, or remove it")
        return value


class _ExperienceMixin:
    """Scores -> advantages (and whatever else the engine's advantage estimator makes), for any reward module."""

    args: PPOExperienceArgs
    name: str
    runtime_args: Any
    # the estimator the engine's trainer trains on (its module's default_advantage_estimator), set when the
    # engine is resolved (`chatlearn.runtime.plan.EngineFlows.resolve`): what it runs when args_dict names none
    engine_estimator: str | None = None

    @staticmethod
    def estimator_inputs(name: str) -> tuple[str, ...] | None:
        """The batch fields the estimator ``name`` reads (None: no such estimator); the engine checks ask it."""
        return advantage_estimator_inputs(name) if name in ADVANTAGE_ESTIMATORS else None

    @staticmethod
    def estimator_settings(name: str) -> tuple[str, ...] | None:
        """The reward settings the estimator ``name`` reads (None: no such estimator); the engine checks ask."""
        return advantage_estimator_settings(name) if name in ADVANTAGE_ESTIMATORS else None

    @staticmethod
    def estimator_whitened(name: str) -> bool:
        """Whether the trainer whitens the estimator ``name``'s advantages over each global batch (REINFORCE++)."""
        return name in WHITENED_ESTIMATORS

    @staticmethod
    def estimator_shape(name: str) -> tuple[str, str] | None:
        """The advantages the estimator ``name`` makes, ``(shape, what it means)`` (``token``: per response token
        [B, T]; ``sequence``: per sequence [B]); None: no such estimator. The engine checks ask it."""
        shape = ADVANTAGE_ESTIMATOR_SHAPE.get(name)
        return None if shape is None else (shape, ADVANTAGE_SHAPES[shape])

    @staticmethod
    def estimators_of_shape(shapes: tuple[str, ...]) -> list[str]:
        """The registered estimators that make advantages of one of ``shapes``, sorted."""
        return sorted(n for n, s in ADVANTAGE_ESTIMATOR_SHAPE.items() if s in shapes)

    def advantage_estimator(self) -> str:
        """The estimator this reward runs: ``args_dict.advantage_estimator``, else the one its engine's trainer
        trains on (``engine_estimator``)."""
        name = self.args.advantage_estimator or self.engine_estimator
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
        shaped = {}
        if self.args.overlong_buffer_len:
            penalty = overlong_penalty(data["response_mask"].sum(-1), self.args.max_response_length,
                                       self.args.overlong_buffer_len, self.args.overlong_penalty_factor)
            scores, shaped = scores + penalty, {"overlong_penalty": penalty}
        name = self.advantage_estimator()
        missing = [k for k in advantage_estimator_inputs(name) if k not in data]
        if missing:  # not silently no advantages: the engine's models do not give what its estimator reads
            raise RunError(f"{self.name}: the advantage estimator {name!r} reads {missing}, which the batch does not "
                           f"hold (its fields: {sorted(data)})")
        out: dict[str, Any] = {"scores": scores, **shaped}
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
    """A `AutoModelForSequenceClassification` with one label scores prompt+response text: loaded here from
    ``model_path``, or served by a reward server (``args_dict.remote_url``; `chatlearn reward-server`,
    :mod:`chatlearn.models.hf.reward_server`), which loads and scores it with this class's own `load` and
    `score_texts`, so a remote score is the local one. Remote, setup loads no model: it asks the server's
    ``/health`` (:mod:`chatlearn.models.hf.remote_reward`: timeouts, retries, one line naming the URL)."""

    args_schema = ModelRewardArgs
    # prompt+response as text under its own tokenizer: the preflight measures prompts against its context too
    # (not a remote one's: its model_path is the server's)
    reads_text = True
    remote: Any = None  # the reward server's client (chatlearn.models.hf.remote_reward.RemoteReward), if remote

    @staticmethod
    def load(path: str, dtype: str = "float32", device: torch.device | str = "cpu") -> tuple[Any, torch.nn.Module]:
        """The tokenizer and the one-label model of ``path``, in eval mode on ``device`` (here and on the server)."""
        tokenizer = load_tokenizer(path)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=getattr(torch, dtype)
        ).to(device).eval()
        return tokenizer, model

    @staticmethod
    @torch.no_grad()
    def score_texts(model: Any, tokenizer: Any, texts: list[str], device: torch.device | str) -> torch.Tensor:
        """The model's scores [B] (float32, CPU) of ``texts``, padded (left) to the longest, not truncated."""
        enc = tokenizer(texts, padding=True, return_tensors="pt").to(device)
        return model(**enc).logits[:, 0].float().cpu()

    def setup(self) -> None:
        if self.args.remote_url:
            # lazy: the client's module is needed only by a reward served elsewhere
            from chatlearn.models.hf.remote_reward import RemoteReward

            self.remote = RemoteReward.of(self.args, self.name)
            self.remote.health()  # a server that is not up: said now, with the command that starts one
            return
        ensure_model_files(self.args)
        self.tokenizer, self.model = self.load(self.args.model_path, self.args.dtype, self.device)
        self.parallelize()

    def prepare_files(self, module_args) -> None:
        if not self.args_schema.model_validate(module_args.args_dict or {}).remote_url:
            super().prepare_files(module_args)

    def check_files(self, module_args) -> list[str]:
        args = self.args_schema.model_validate(module_args.args_dict or {})
        if args.remote_url:
            return []  # the server's files: it checks them when it starts
        return [p + " (or args_dict.remote_url: a reward server's URL, `chatlearn reward-server`)"
                if p.startswith("args_dict.model_path: required") else p for p in super().check_files(module_args)]

    def score(self, data: dict) -> torch.Tensor:
        texts = [p + r for p, r in zip(data["prompt"], data["response"], strict=True)]
        if self.remote is not None:
            scores = torch.tensor(self.remote.score(texts), dtype=torch.float32)
            self._check_finite(data, scores, f"score from the reward server at {self.remote.url}")
            return scores
        scores = self.score_texts(self.model, self.tokenizer, texts, self.device)
        self._check_finite(data, scores, "reward model score")  # eval scores too: eval metrics average them
        return scores

    def forward_step(self, data, iteration):
        return self.experience_step(data, self.score(data))

    def eval_step(self, data):
        return self.eval_scores(data, self.score(data))
