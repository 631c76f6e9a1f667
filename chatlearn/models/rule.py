"""Rule rewards: a Python function scores each sample. Everything about calling one lives here.

A rule is a `RuleSpec` (the hook ``package.module:function``, the timeout of one call, the CPUs of one
batch's task). `RuleSpec.score` scores one batch: the per-sample dicts a hook sees (`text_samples`), each call
bounded by the timeout (`score_samples`), an error naming the hook and the sample (`RewardError`). The same
call scores a batch wherever it runs: in the reward's actor (``fan_out: false``), or as one Prefect task per
batch on Ray (``fan_out: true``, the default; ``flows/rule_tasks.py``), whose scores the score stage hands to
the reward's actor with the other scorers' outputs.
"""

import concurrent.futures
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel

from chatlearn.data.batch import split_batch
from chatlearn.utils.errors import RunError
from chatlearn.utils.finite import describe_sample, nonfinite_summary, one_line
from chatlearn.utils.imports import import_callable


def score_key(model: str) -> str:
    """The batch field that holds reward ``model``'s own scores (``rewards/<model>``): a rule's fanned-out tasks
    hand them to the model's call there, and a reward reading another's adds them to its own."""
    return f"rewards/{model}"


class RewardError(RunError):
    """A rule reward function that failed, timed out or returned something unusable, on a named sample (a
    RunError: the CLI prints it as one line, the traceback of the hook goes to the run's log)."""


def hook_name(spec: str) -> str:
    """How errors name a rule reward function: ``reward hook package.module:function``."""
    return f"reward hook {spec}"


def score_samples(fn: Callable[[dict], Any], samples: list[dict], timeout_s: float, where: str,
                  episode_start: int | None = None) -> list[float]:
    """``fn(sample)`` for each sample, each call bounded by ``timeout_s``; a RewardError names ``where`` (the
    hook, see `hook_name`) and the sample, e.g. ``reward hook mod:fn raised ValueError: boom for sample 3
    (prompt "max 3 7 1 ?")``.

    ``episode_start`` (the ``sample_id`` of the episode's first sample, 0 for the eval set) lets the error
    name the sample by its index in the episode; without it the ``sample_id`` names it. The call runs in a
    helper thread so a stuck function becomes an error within the timeout (the thread itself cannot be
    killed; the run stops anyway). Non-numbers and non-finite numbers are errors too: a NaN reward would
    otherwise train on silently.
    """

    def describe(sample: dict) -> str:
        sid = sample.get("sample_id")
        index = sid - episode_start if episode_start is not None and isinstance(sid, int) else None
        return describe_sample(sample, index)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
    out: list[float] = []
    try:
        for sample in samples:
            future = pool.submit(fn, sample)
            try:
                value = future.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                raise RewardError(f"{where} took longer than timeout_s={timeout_s:g}s for {describe(sample)}") \
                    from None
            except Exception as exc:
                raise RewardError(f"{where} raised {type(exc).__name__}: {one_line(exc)} for {describe(sample)}") \
                    from exc
            if isinstance(value, bool) or not isinstance(value, int | float) or nonfinite_summary(value):
                raise RewardError(f"{where} returned {one_line(repr(value), 80)} for {describe(sample)}; expected "
                                  "a finite number")
            out.append(float(value))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return out


def text_samples(data: dict) -> list[dict]:
    """The per-sample dicts a rule function sees: record fields, response text, ids (no tensors)."""
    return split_batch({k: v for k, v in data.items() if not isinstance(v, torch.Tensor)})


def takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` can be called with the keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume it does, the call will tell
        return True
    return any(p.kind == p.VAR_KEYWORD or (p.name == name and p.kind != p.POSITIONAL_ONLY) for p in params)


class RuleSpec(BaseModel):
    """One rule reward: its hook, the longest one call may take, the Ray CPUs of one batch's task, and the
    record field of the reference answer the hook is told (``answer_key``; None: the hook's own default)."""

    reward_fn: str
    timeout_s: float
    num_cpus: float = 1.0
    answer_key: str | None = None

    @classmethod
    def of(cls, args: Any) -> "RuleSpec":
        """The rule a `RuleRewardArgs` (``models.<name>.args_dict``) describes."""
        return cls(reward_fn=args.reward_fn, timeout_s=args.timeout_s, num_cpus=args.num_cpus_per_task,
                   answer_key=args.answer_key)

    def score(self, data: dict, episode_start: int | None = None) -> list[float]:
        """The rule's score of each sample of one batch; a RewardError names the hook and the sample (by its
        index in the episode when ``episode_start``, the episode's first ``sample_id``, is given)."""
        fn = import_callable(self.reward_fn)
        if self.answer_key is not None:
            fn = functools.partial(fn, answer_key=self.answer_key)
        return score_samples(fn, text_samples(data), self.timeout_s, hook_name(self.reward_fn), episode_start)
