"""Off-policy correction: importance weights for samples the trainer did not generate.

In pipelined episodes (``runtime.max_staleness``) a sample comes from the behaviour policy of an older sync, and
even in synchronous ones the sampler may differ from the trainer (bf16, another kernel). The PPO/GRPO ratio
is then taken against the **proximal** policy, the trainer's own log-probs recomputed before the update
(``old_logprobs: trainer``), and each token's loss is weighted by ``proximal / behaviour`` (the log-probs the
sampler recorded), bounded by ``cap``. Each correction is a registered pure function
``fn(proximal_logprobs, behaviour_logprobs, mask, *, cap) -> (weights, stats)``, chosen by name
(``models.ppo_policy.args_dict.rollout_correction``):

* ``tis_token`` / ``tis_seq``: truncated importance sampling, ``min(ratio, cap)`` per token, or one ratio per
  sequence (the product of its tokens' ratios) for every token of it;
* ``mis_token`` / ``mis_seq``: masked importance sampling, the ratio where it lies in ``[1/cap, cap]``, 0 (the
  token, or the whole sequence, left out) elsewhere;
* ``decoupled``: the decoupled PPO objective's behaviour weight (AReaL): the token ratio, 0 where it exceeds
  ``cap``.

``logprob_mismatch`` measures how far the sampler's log-probs are from the trainer's on the same tokens (a
kernel, dtype or engine difference, or staleness), whether or not a correction is applied.

Weights are 0 at padding and carry no gradient. Stats (over valid tokens; over sequences for the ``_seq``
ones): ``rollout_is_ratio_mean`` and ``rollout_is_ratio_max`` of the ratio before bounding, and
``rollout_is_clipped_frac``, the share truncated or left out.
"""

import math

import torch

from chatlearn.algorithms.ppo import masked_mean
from chatlearn.algorithms.registry import register_rollout_correction

_MAX_LOG_RATIO = 50.0  # exp(50) ~ 5e21: a sequence ratio past it is reported as that, never inf


def _token_log_ratio(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float32, device=proximal.device)
    return torch.where(mask.bool(), proximal.float() - behaviour.float(), zero).detach()


def _stats(ratio: torch.Tensor, valid: torch.Tensor, bounded: torch.Tensor) -> dict[str, float]:
    if not bool(valid.any()):
        return {"rollout_is_ratio_mean": 1.0, "rollout_is_ratio_max": 1.0, "rollout_is_clipped_frac": 0.0}
    return {"rollout_is_ratio_mean": masked_mean(ratio, valid).item(),
            "rollout_is_ratio_max": ratio[valid].max().item(),
            "rollout_is_clipped_frac": masked_mean(bounded.float(), valid).item()}


def _token(proximal, behaviour, mask, keep_low: float, cap: float, truncate: bool):
    valid = mask.bool()
    ratio = torch.exp(torch.clamp(_token_log_ratio(proximal, behaviour, mask), max=_MAX_LOG_RATIO))
    if truncate:
        weights, bounded = torch.clamp(ratio, max=cap), ratio > cap
    else:
        bounded = (ratio > cap) | (ratio < keep_low)
        weights = torch.where(bounded, torch.zeros_like(ratio), ratio)
    weights = torch.where(valid, weights, torch.zeros_like(weights))
    return weights, _stats(ratio, valid, bounded & valid)


def _sequence(proximal, behaviour, mask, cap: float, truncate: bool):
    valid = mask.bool()
    seq_log = _token_log_ratio(proximal, behaviour, mask).sum(-1)  # log of the product of the token ratios
    seq_ratio = torch.exp(torch.clamp(seq_log, max=_MAX_LOG_RATIO))
    has = valid.any(-1)
    if truncate:
        seq_w, bounded = torch.exp(torch.clamp(seq_log, max=math.log(cap))), seq_log > math.log(cap)
    else:
        bounded = (seq_log > math.log(cap)) | (seq_log < -math.log(cap))
        seq_w = torch.where(bounded, torch.zeros_like(seq_ratio), seq_ratio)
    weights = torch.where(valid, seq_w.unsqueeze(-1).expand_as(valid), torch.zeros((), device=valid.device))
    return weights, _stats(seq_ratio, has, bounded & has)


def logprob_mismatch(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """The sampler's log-probs against the trainer's, over the valid response tokens: the mean and largest
    ``|trainer - sampler|`` and ``rollout_kl``, the k3 estimate of KL(sampler || trainer) on the sampled tokens
    (``r - 1 - log r`` with ``r = exp(trainer - sampler)``: non-negative, 0 only where they agree)."""
    valid = mask.bool()
    if not bool(valid.any()):
        return {"rollout_logprob_diff_mean": 0.0, "rollout_logprob_diff_max": 0.0, "rollout_kl": 0.0}
    log_r = _token_log_ratio(trainer_logprobs, sampler_logprobs, mask)
    k3 = torch.exp(torch.clamp(log_r, max=_MAX_LOG_RATIO)) - 1.0 - log_r
    return {"rollout_logprob_diff_mean": masked_mean(log_r.abs(), valid).item(),
            "rollout_logprob_diff_max": log_r.abs()[valid].max().item(),
            "rollout_kl": masked_mean(k3, valid).item()}


def _check_cap(cap: float) -> None:
    if not cap > 1.0:
        raise ValueError(f"the rollout correction's cap must be > 1, got {cap}")


@register_rollout_correction("tis_token")
def tis_token(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
              cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS per token: ``min(exp(proximal - behaviour), cap)``."""
    _check_cap(cap)
    return _token(proximal_logprobs, behaviour_logprobs, mask, 0.0, cap, truncate=True)


@register_rollout_correction("tis_seq")
def tis_seq(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
            cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS per sequence: ``min(prod_t ratio_t, cap)`` for every token of the sequence."""
    _check_cap(cap)
    return _sequence(proximal_logprobs, behaviour_logprobs, mask, cap, truncate=True)


@register_rollout_correction("mis_token")
def mis_token(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
              cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked IS per token: the ratio inside ``[1/cap, cap]``, 0 outside."""
    _check_cap(cap)
    return _token(proximal_logprobs, behaviour_logprobs, mask, 1.0 / cap, cap, truncate=False)


@register_rollout_correction("mis_seq")
def mis_seq(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
            cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked IS per sequence: the sequence ratio inside ``[1/cap, cap]`` for all its tokens, else 0 for all."""
    _check_cap(cap)
    return _sequence(proximal_logprobs, behaviour_logprobs, mask, cap, truncate=False)


@register_rollout_correction("decoupled")
def decoupled(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
              cap: float = 5.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled PPO objective's behaviour weight: the token ratio, 0 where it exceeds ``cap`` (no lower
    bound); the clipped ratio itself is taken against the proximal policy by the policy loss."""
    _check_cap(cap)
    return _token(proximal_logprobs, behaviour_logprobs, mask, 0.0, cap, truncate=False)
