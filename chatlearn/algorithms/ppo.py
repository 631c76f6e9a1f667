"""PPO math as pure tensor-in / tensor-out functions (in the spirit of verl's ``core_algos.py``).

Nothing here knows about models, optimizers, Ray or Prefect: every function takes
tensors and floats and returns tensors (plus, for losses, a dict of python floats
for logging).  That keeps the numerics unit-testable against hand-computed values
and lets the trainer pick implementations by name through
:mod:`chatlearn.algorithms.registry`.

Conventions used throughout:

* ``B`` = batch size, ``T`` = response length (prompt tokens are never included).
* ``mask`` is a bool or float ``[B, T]`` tensor: 1 for real response tokens, 0 for
  padding.  Responses are right-padded, so the valid tokens of a row are a prefix,
  but the functions below only rely on that where stated.
* Padded positions may contain garbage (even NaN/inf) in the inputs; the outputs
  are always exactly 0 there.  Masking is done with ``torch.where`` instead of
  multiplication for that reason (``nan * 0 == nan``).
"""

import torch

from chatlearn.algorithms.registry import register_policy_loss, register_value_loss

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "whiten_global_batch",
    "kl_penalized_rewards",
    "gae_advantages_and_returns",
    "ppo_clipped_policy_loss",
    "ppo_clipped_value_loss",
    "logprobs_from_logits",
]

# exp() of a log-ratio above ~88 overflows float32 to inf, and inf * 0 advantages gives NaN
# that poisons the whole batch.  A ratio of e^20 (or e^-20) is already far outside any clip
# range, so clamping only touches tokens that are hopelessly off-policy anyway (their
# gradient becomes 0, as verl does) while keeping loss and gradients finite.
_MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------------------
# masked reductions
# --------------------------------------------------------------------------------------


def _zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with masked-out entries replaced by exactly 0 (NaN-safe, unlike ``x * mask``)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over entries where ``mask`` is set.

    Args:
        x: ``[B, T]`` (any shape broadcastable with ``mask``).
        mask: same shape as ``x``; bool or float 0/1.
        dim: reduce over this dim only; ``None`` reduces everything to a scalar.

    Returns:
        Scalar if ``dim is None`` else ``x`` reduced over ``dim`` (e.g. ``[B]`` for ``dim=-1``).
    """
    masked = _zero_padding(x, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over masked entries only, so padding never dilutes token-level averages.

    A reduction with no valid entry (all-padding row or empty batch) returns 0 rather
    than NaN: an empty row contributes nothing to a loss and must not poison it.

    Args:
        x: ``[B, T]``.
        mask: ``[B, T]`` bool or float 0/1.
        dim: as in :func:`masked_sum`.

    Returns:
        Scalar if ``dim is None`` else the reduced tensor (``[B]`` for ``dim=-1``).
    """
    total = masked_sum(x, mask, dim)
    count = masked_sum(torch.ones_like(x), mask, dim)
    return torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked entries (scalar).

    ``unbiased=True`` applies Bessel's correction ``n / (n - 1)``, matching
    ``torch.var`` on the valid entries.  With fewer than 2 valid entries the
    correction is undefined, so the (biased) value is returned instead of raising:
    a tiny last micro-batch should not crash a training run.

    Args:
        x: ``[B, T]``.
        mask: ``[B, T]`` bool or float 0/1.
        unbiased: whether to apply Bessel's correction.

    Returns:
        0-dim tensor.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = masked_sum(torch.ones_like(x), mask)
        correction = torch.where(count > 1, count / (count - 1).clamp_min(1), torch.ones_like(count))
        var = var * correction
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to zero mean / unit variance using statistics of the masked entries only.

    Used on advantages so the policy-gradient scale does not depend on the reward
    scale; padding is excluded from the statistics because it is not data.

    Args:
        x: ``[B, T]``.
        mask: ``[B, T]`` bool or float 0/1.
        shift_mean: if False, the original mean is added back (only the scale is
            normalised), which keeps the sign information of e.g. raw rewards.
        eps: added to the variance before ``rsqrt`` so a constant input does not divide by 0.

    Returns:
        ``[B, T]``, exactly 0 at padded positions.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_padding(whitened, mask)


def whiten_global_batch(
    xs: list[torch.Tensor], masks: list[torch.Tensor], eps: float = 1e-8
) -> list[torch.Tensor]:
    """:func:`masked_whiten` with one mean/variance over several micro-batches of different widths.

    The trainer whitens advantages over its whole global batch (as ChatLearn does across data-parallel
    ranks), whose micro-batches are padded to their own response lengths.

    Args:
        xs: ``[B_i, T_i]`` each.
        masks: ``[B_i, T_i]`` each, bool or float 0/1.
        eps: as in :func:`masked_whiten`.

    Returns:
        ``[B_i, T_i]`` each, exactly 0 at padded positions.
    """
    valid = [m.bool() for m in masks]
    flat = torch.cat([x[v] for x, v in zip(xs, valid, strict=True)]).unsqueeze(0)
    whitened = masked_whiten(flat, torch.ones_like(flat), eps=eps)[0]
    out, start = [], 0
    for x, v in zip(xs, valid, strict=True):
        y = torch.zeros_like(x)
        n = int(v.sum())
        y[v] = whitened[start : start + n]
        start += n
        out.append(y)
    return out


# --------------------------------------------------------------------------------------
# rewards and advantages
# --------------------------------------------------------------------------------------


def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn a sequence-level reward-model score into a dense per-token reward.

    Every response token pays ``kl_coef * (logprob - ref_logprob)`` (a per-token
    estimate of KL(policy || reference)), which keeps the policy close to the
    reference model; the reward-model score is only credited at the last valid
    token because it judges the whole completed response.  Computed without
    gradient: rewards are targets, not something to differentiate through.

    Args:
        scores: ``[B]`` scalar reward-model score per sequence.
        logprobs: ``[B, T]`` log-probs of the response tokens under the rollout policy.
        ref_logprobs: ``[B, T]`` log-probs under the frozen reference model.
        mask: ``[B, T]`` response mask.
        kl_coef: weight of the KL penalty.

    Returns:
        ``(rewards [B, T], kl [B, T])``, both 0 at padding.  A row with no valid
        token gets no score (all zeros) instead of an out-of-range write.
    """
    with torch.no_grad():
        kl = _zero_padding(logprobs - ref_logprobs, mask.bool())
    return outcome_rewards(scores, mask, -kl_coef * kl), kl


def outcome_rewards(scores: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` ``[B]`` credited at each row's last valid token, added to the per-token ``rewards`` ``[B, T]``
    (e.g. a KL penalty; default zeros). A row with no valid token gets no score."""
    with torch.no_grad():
        valid = mask.bool()
        if rewards is None:
            rewards = torch.zeros(valid.shape, dtype=torch.promote_types(scores.dtype, torch.float32),
                                  device=valid.device)
        # Index of the last valid token per row (-1 if none). Using the max valid
        # position rather than ``length - 1`` stays correct even for non-prefix masks.
        positions = torch.arange(valid.shape[-1], device=valid.device).expand_as(valid)
        last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=-1).values  # [B]
        has_token = last >= 0
        score_at_last = torch.where(
            has_token, scores.to(rewards.dtype), torch.zeros((), dtype=rewards.dtype, device=rewards.device)
        )
        return rewards.scatter_add(-1, last.clamp_min(0).unsqueeze(-1), score_at_last.unsqueeze(-1))


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over the valid tokens, right to left (REINFORCE's returns, no critic);
    a padded position passes the running return through unchanged and is 0 itself."""
    with torch.no_grad():
        valid = mask.bool()
        out = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[-1])):
            running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
            out[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return out


def gae_advantages_and_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016), computed right-to-left.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    where "t+1" is the next *valid* token.  After the last valid token the episode
    has ended, so ``V = 0`` and ``A = 0`` there (no bootstrapping from padding).
    Padded positions are skipped entirely (their value/reward is never read into a
    valid position), so garbage in the padding cannot leak into the result.

    ``returns = advantages + values`` is the critic's regression target
    (the lambda-return).  Advantages are returned *unwhitened*: whitening is a
    trainer choice (see :func:`masked_whiten`) and must not affect the returns.
    Computed without gradient because both outputs are targets. The registered estimator ``"gae"``
    (:mod:`chatlearn.algorithms.advantages`) calls it on the KL-penalised rewards.

    Args:
        rewards: ``[B, T]`` per-token rewards (e.g. from :func:`kl_penalized_rewards`).
        values: ``[B, T]`` critic values ``V(s_t)`` from rollout time.
        mask: ``[B, T]`` response mask.
        gamma: discount factor.
        lam: GAE lambda (bias/variance trade-off; 1 = Monte-Carlo, 0 = TD(0)).

    Returns:
        ``(advantages [B, T], returns [B, T])``, both 0 at padding.
    """
    with torch.no_grad():
        valid = mask.bool()
        zeros = torch.zeros_like(values[:, 0])
        next_value = zeros  # V of the next valid token; 0 beyond the end of the episode
        next_adv = zeros  # A of the next valid token
        advantages_reversed = []
        for t in reversed(range(rewards.shape[-1])):
            valid_t = valid[:, t]
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            adv_t = delta + gamma * lam * next_adv
            # At padding keep carrying the state from the right, so padding is transparent.
            next_adv = torch.where(valid_t, adv_t, next_adv)
            next_value = torch.where(valid_t, values[:, t], next_value)
            advantages_reversed.append(torch.where(valid_t, adv_t, zeros))
        advantages = torch.stack(advantages_reversed[::-1], dim=-1)
        returns = _zero_padding(advantages + values, valid)
    return advantages, returns


# --------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------


@register_policy_loss("ppo_clip", family="ppo")
def ppo_clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate objective (Schulman et al. 2017), as a loss to minimise; with ``clip_ratio_c``,
    dual-clip PPO (Ye et al. 2019).

    Per token: ``max(-A * r, -A * clip(r, 1 - eps, 1 + eps))`` with
    ``r = exp(logprobs - old_logprobs)``.  Taking the max (pessimistic bound) removes
    the incentive to move the ratio further once it is outside the trust region in
    the direction the advantage favours; the gradient there is exactly 0.  The loss
    is the mean over all valid tokens of the batch (token-level averaging, so long
    responses are not down-weighted per token).

    Args:
        logprobs: ``[B, T]`` log-probs under the current policy (requires grad).
        old_logprobs: ``[B, T]`` log-probs under the rollout policy.
        advantages: ``[B, T]``.
        mask: ``[B, T]`` response mask.
        cliprange: PPO epsilon.
        clip_ratio_c: dual clip (> 1; None: off). For a negative advantage the loss is at most
            ``-A * clip_ratio_c``: a token whose ratio exploded on a bad action cannot dominate the batch
            (plain PPO's max leaves ``-A * ratio`` unbounded there). Positive advantages are unchanged.

    Returns:
        ``(loss, stats)``: loss is a 0-dim tensor; stats are python floats:
        ``clipfrac`` (fraction of valid tokens where the clipped term was active),
        ``approx_kl`` (mean of ``old - new`` log-probs, a cheap KL(old || new) estimate),
        ``ratio_mean``, and with ``clip_ratio_c`` ``dual_clipfrac`` (the dual bound was active).
    """
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.maximum(unclipped, clipped)
    dual = None
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    loss = masked_mean(per_token, mask)

    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask).item(),
            "approx_kl": masked_mean(old_logprobs - logprobs, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
        if dual is not None:
            stats["dual_clipfrac"] = masked_mean(dual.to(ratio.dtype), mask).item()
    return loss, stats


@register_value_loss("ppo_clip")
def ppo_clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped critic loss: ``0.5 * mean(max((v - R)^2, (clip(v, old - c, old + c) - R)^2))``.

    Clipping the new value prediction to a band around the rollout-time value
    mirrors the policy trust region, so one noisy batch of returns cannot move
    the critic far; the max makes the loss pessimistic like the policy loss.

    Args:
        values: ``[B, T]`` current critic predictions (requires grad).
        old_values: ``[B, T]`` critic predictions at rollout time.
        returns: ``[B, T]`` regression targets (from the advantage estimator).
        mask: ``[B, T]`` response mask.
        cliprange_value: half-width ``c`` of the clip band.

    Returns:
        ``(loss, stats)`` with ``stats["vf_clipfrac"]`` = fraction of valid tokens where
        the clipped term was the larger one.
    """
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask)

    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(values.dtype), mask).item(),
        }
    return loss, stats


# --------------------------------------------------------------------------------------
# model outputs
# --------------------------------------------------------------------------------------


LOGPROB_CHUNK_ROWS = 512  # token positions per chunk: at most this many x vocab floats exist at once


def _chunks(rows: int) -> range:
    return range(0, rows, LOGPROB_CHUNK_ROWS)


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / T)[label], a chunk of positions at a time, forward and backward.

    Forward keeps only the per-position log-sum-exp (no [rows, V] float copy), and backward rebuilds each
    chunk's softmax from the logits: ``d lp / d x = (onehot(label) - softmax(x / T)) / T``. Autograd over
    ``log_softmax(...).gather`` would keep the whole float32 [rows, V] result (and for bf16 logits its float32
    copy too) until the backward pass."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        out_dtype = torch.promote_types(logits.dtype, torch.float32)
        flat = logits.reshape(-1, logits.shape[-1])
        idx = labels.reshape(-1, 1).long()
        lp = torch.empty(flat.shape[0], dtype=out_dtype, device=logits.device)
        lse = torch.empty_like(lp)
        for s in _chunks(flat.shape[0]):
            x = flat[s:s + LOGPROB_CHUNK_ROWS].to(out_dtype) / temperature
            lse[s:s + LOGPROB_CHUNK_ROWS] = torch.logsumexp(x, -1)
            lp[s:s + LOGPROB_CHUNK_ROWS] = x.gather(-1, idx[s:s + LOGPROB_CHUNK_ROWS]).squeeze(-1)
        lp -= lse
        ctx.save_for_backward(logits, idx, lse)
        ctx.temperature = temperature
        return lp.view(labels.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, idx, lse = ctx.saved_tensors
        t = ctx.temperature
        flat = logits.reshape(-1, logits.shape[-1])
        g = grad.reshape(-1, 1).to(lse.dtype)
        out = torch.empty_like(flat)
        for s in _chunks(flat.shape[0]):
            e = s + LOGPROB_CHUNK_ROWS
            d = torch.exp(flat[s:e].to(lse.dtype) / t - lse[s:e, None]).mul_(-g[s:e])
            d.scatter_add_(-1, idx[s:e], g[s:e])
            out[s:e] = d.div_(t)
        return out.view_as(logits), None, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each label token under ``softmax(logits / temperature)``.

    Computed as ``x[label] - logsumexp(x)``, stable for large logits (unlike ``log(softmax(x))``), and in
    chunks of positions, so neither pass holds ``batch x length x vocab`` floats beyond the logits themselves
    and their gradient. Half-precision logits are upcast to float32 chunk by chunk: PPO ratios are ``exp`` of
    *differences* of these values, and bf16's ~3 significant digits would make ``ratio`` noise.

    Args:
        logits: ``[B, T, V]`` (the logits that *predict* ``labels``, i.e. already shifted).
        labels: ``[B, T]`` integer token ids.
        temperature: the sampling temperature the logits are divided by.

    Returns:
        ``[B, T]`` log-probs (float32 for half-precision inputs, else ``logits.dtype``).
    """
    return _TokenLogprobs.apply(logits, labels, temperature)
