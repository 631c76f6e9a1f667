"""GRPO-family math (GRPO, GSPO) as pure tensor functions, following ChatLearn HEAD (v1.2).

Why a separate module from :mod:`chatlearn.algorithms.ppo`: GRPO has no critic.  Its
advantage comes from comparing the several responses sampled for the same prompt
(:func:`group_advantages`), and its loss differs from plain PPO-clip in ways that change
training dynamics and so must match the reference exactly:

* asymmetric ("clip-higher") ratio clipping, ``pos_clip_ratio`` / ``neg_clip_ratio``;
* a clamp of the log-ratio before ``exp`` (``diff_clip_ratio``) and a final upper bound on
  the per-token loss (``final_clip_ratio``);
* normalisation by the number of response tokens of the **global** batch, so the losses of
  micro-batches can simply be summed (gradient accumulation) and every token weighs the same.

GSPO (:func:`gspo_sequence_loss`) shares all of that but uses one importance ratio per
sequence.  The KL to the reference model is an explicit loss term (:func:`k3_kl`) rather
than a reward penalty, and :func:`entropy_from_logits` provides the optional entropy bonus.

Reference sources (ChatLearn HEAD, ``chatlearn/algorithm/grpo_utils/``): ``loss_gallery.py``
(``calculate_grpo_loss``, ``calculate_gspo_loss``), ``advantage_compute.py`` (group
advantage), ``policy_trainer.py`` (k3 KL, global-token normalisation) and
``trainer_utils.py`` (entropy).  Conventions (``[B, T]`` response tensors, masks, NaN-safe
padding) are those of :mod:`chatlearn.algorithms.ppo`.

The policy losses are registered here (``"grpo"``, ``"gspo"``, ``"cispo"``); the advantage estimator ``"grpo"``
(:func:`group_advantages_by_id` on a scored batch) in :mod:`chatlearn.algorithms.advantages`.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from chatlearn.algorithms.aggregation import aggregate_loss
from chatlearn.algorithms.ppo import masked_mean
from chatlearn.algorithms.registry import register_policy_loss

__all__ = [
    "group_advantages",
    "group_advantages_by_id",
    "grpo_token_loss",
    "gspo_sequence_loss",
    "cispo_loss",
    "k3_kl",
    "entropy_from_logits",
]

# ChatLearn clamps the k3 KL to [-10, 10].  k3(x) = e^x - x - 1 is >= 10 for x >= ~2.6 and for
# x <= -11, so clamping x to [-20, 20] before exp() changes no output value; it only keeps e^x
# finite, so the clamp's zero gradient is not multiplied by inf (which would give NaN).
_K3_CLAMP = 10.0
_K3_MAX_LOG_RATIO = 20.0


def check_group_layout(n: int, group_size: int) -> int:
    """Validate that ``n`` samples form whole groups of ``group_size``; return the number of groups.

    Shared with :mod:`chatlearn.algorithms.dpo`.  A remainder means the flat batch is not laid
    out as consecutive per-prompt groups, and silently grouping it would mix prompts.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if n % group_size != 0:
        raise ValueError(f"number of samples {n} is not a multiple of group_size {group_size}")
    return n // group_size


# --------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-5) -> torch.Tensor:
    """Group-relative advantage: ``(r - group mean) / (group std + eps)`` per prompt group.

    Each response is judged only against the other responses to the same prompt, which
    replaces a learned critic as the baseline.  ``std`` is the *population* standard
    deviation (``unbiased=False``, divide by ``group_size``) because ChatLearn uses
    ``np.std`` (ddof=0) both at HEAD (``grpo_utils/advantage_compute.py``) and in v1.0.x
    (``examples/megatron/entry/train_grpo_math.py``); a group of 1 therefore has std 0.

    A group whose rewards are all equal carries no learning signal; its advantages are set
    to exactly 0 (not merely ``~1e-9`` from rounding in the mean), so such prompts contribute
    nothing to the loss.  Computed without gradient: advantages are targets.

    Args:
        rewards: ``[N]`` one scalar reward per response, laid out as ``N / group_size``
            consecutive groups of ``group_size`` responses to the same prompt.
        group_size: responses per prompt (ChatLearn's ``num_inference_per_prompt``).
        eps: added to the std so an almost-constant group does not blow up.

    Returns:
        ``[N]`` advantages (floating dtype of ``rewards``; float32 for integer rewards).

    Raises:
        ValueError: ``rewards`` is not 1-D, ``group_size < 1``, or ``N`` is not a multiple
            of ``group_size``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    num_groups = check_group_layout(rewards.shape[0], group_size)
    with torch.no_grad():
        r = rewards if rewards.is_floating_point() else rewards.float()
        grouped = r.view(num_groups, group_size)
        mean = grouped.mean(dim=-1, keepdim=True)
        std = grouped.std(dim=-1, unbiased=False, keepdim=True)
        adv = (grouped - mean) / (std + eps)
        constant = grouped.amax(dim=-1, keepdim=True) == grouped.amin(dim=-1, keepdim=True)
        adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def by_group(scores: torch.Tensor, group_ids: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` on the scores of responses labelled by prompt group, laid out as ``[groups, n]``, the result put
    back in the batch's order. Every group must be whole and all groups the same size (a batch that cut a group
    would normalise it against only part of its responses, silently): a ``ValueError`` names the group that is
    not. Computed without gradient: advantages are targets."""
    if scores.dim() != 1 or scores.shape[0] != len(group_ids):
        raise ValueError(f"rewards {tuple(scores.shape)} and {len(group_ids)} group ids do not match")
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(int(g), []).append(i)
    sizes = {len(m) for m in members.values()}
    if len(sizes) != 1:
        small = min(members, key=lambda g: len(members[g]))
        raise ValueError(f"prompt groups of unequal size {sorted(sizes)} (group {small} has "
                         f"{len(members[small])} responses): a batch must hold whole groups")
    order = [i for m in members.values() for i in m]
    with torch.no_grad():
        r = scores if scores.is_floating_point() else scores.float()
        grouped = fn(r[order].view(len(members), sizes.pop())).reshape(-1)
    out = torch.empty_like(grouped)
    out[order] = grouped
    return out


def group_advantages_by_id(rewards: torch.Tensor, group_ids: list[int], eps: float = 1e-5) -> torch.Tensor:
    """:func:`group_advantages` for responses labelled by prompt group instead of laid out in order (see
    :func:`by_group`)."""
    return by_group(rewards, group_ids, lambda g: group_advantages(g.reshape(-1), g.shape[-1], eps))


# --------------------------------------------------------------------------------------
# policy losses
# --------------------------------------------------------------------------------------


def _broadcast_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` per-sequence advantages -> ``[B, 1]``; ``[B, T]`` per-token ones unchanged."""
    if advantages.dim() == 1:
        if advantages.shape[0] != mask.shape[0]:
            raise ValueError(f"advantages {tuple(advantages.shape)} do not match batch size {mask.shape[0]}")
        return advantages.unsqueeze(-1)
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or match mask {tuple(mask.shape)}")
    return advantages


def _clipped_pg_loss(
    log_ratio: torch.Tensor,
    raw_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    pos_clip_ratio: float,
    neg_clip_ratio: float,
    diff_clip_ratio: float,
    final_clip_ratio: float,
    total: float | None,
    token_weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Shared tail of the GRPO and GSPO losses (ChatLearn ``loss_gallery.py``), see :func:`grpo_token_loss`.

    ``log_ratio`` is the (differentiable) per-token log-ratio the ratio is built from;
    ``raw_log_ratio`` the plain per-token ``logprobs - old_logprobs`` used for ``approx_kl``.
    Both must already be 0 at padding.
    """
    valid = mask.bool()
    adv = _broadcast_advantages(advantages, mask).to(log_ratio.dtype)
    adv = torch.where(valid, adv, torch.zeros((), dtype=adv.dtype, device=adv.device))
    ratio = torch.exp(torch.clamp(log_ratio, max=diff_clip_ratio))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - neg_clip_ratio, 1.0 + pos_clip_ratio)
    pg = torch.maximum(unclipped, clipped)
    # ChatLearn applies the final bound to every token, whatever the sign of A.  For A > 0 the
    # loss is -A * ratio <= 0 < final_clip_ratio, so only negative-advantage tokens are ever
    # bounded (dual-clip in effect), but the bound is on the loss value -A * ratio, not on
    # the ratio as in the dual-clip paper's c * |A|.
    per_token = torch.clamp(pg, max=final_clip_ratio)
    if token_weights is not None:  # an off-policy correction's importance weights (chatlearn.algorithms.off_policy)
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    loss = aggregate_loss(per_token, valid, loss_agg_mode, total, loss_scale_factor)

    with torch.no_grad():
        as_float = torch.promote_types(ratio.dtype, torch.float32)  # bf16 fractions would be coarse
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(as_float), valid).item(),
            "pos_clipfrac": masked_mean(((ratio > 1.0 + pos_clip_ratio) & (adv > 0)).to(as_float), valid).item(),
            "neg_clipfrac": masked_mean(((ratio < 1.0 - neg_clip_ratio) & (adv < 0)).to(as_float), valid).item(),
            "final_clipfrac": masked_mean((pg > final_clip_ratio).to(as_float), valid).item(),
            "approx_kl": masked_mean(-raw_log_ratio, valid).item(),
            "ratio_mean": masked_mean(ratio, valid).item(),
        }
    return loss, stats


@register_policy_loss("grpo", family="grpo")
def grpo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    pos_clip_ratio: float = 0.2,
    neg_clip_ratio: float = 0.2,
    diff_clip_ratio: float = 10.0,
    final_clip_ratio: float = 3.0,
    total: float | None = None,
    token_weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ChatLearn HEAD's token-level GRPO loss (``calculate_grpo_loss``), as a loss to minimise.

    Per valid token, with ``log_ratio = logprobs - old_logprobs``::

        ratio = exp(min(log_ratio, diff_clip_ratio))
        pg    = max(-A * ratio, -A * clamp(ratio, 1 - neg_clip_ratio, 1 + pos_clip_ratio))
        pg    = min(pg, final_clip_ratio)
        loss  = sum(pg over valid tokens) / total    (loss_agg_mode token-mean)

    * The log-ratio is clamped only from above (as in ChatLearn): ``exp`` cannot overflow,
      and a very negative log-ratio just gives ratio ~0.
    * Separate lower/upper clip ("clip-higher", DAPO) lets rare good tokens grow more than
      the symmetric PPO band would.
    * ``final_clip_ratio`` is applied to all tokens regardless of the advantage's sign
      (ChatLearn ``loss_gallery.py`` ``torch.min(pg_loss_clip, ones * final_clip_ratio)``);
      it only binds for negative advantages, bounding the loss of a token whose ratio
      exploded.  Pass ``float("inf")`` to disable it.
    * ``total`` should be the units of ``loss_agg_mode`` in the whole global batch (for
      ``token-mean``, ChatLearn's: the valid response tokens of all micro-batches and all
      data-parallel ranks' share as the caller's gradient reduction requires), so micro-batch
      losses are summed, not averaged.  ChatLearn also multiplies by the DP size because its
      all-reduce averages gradients; that scaling is left to the caller.  Defaults to this
      batch's own count (:func:`~chatlearn.algorithms.aggregation.aggregate_loss`, which also
      describes the sequence-mean modes and ``loss_scale_factor``).

    Padded positions may hold garbage (NaN/inf): they are zeroed before any arithmetic, so
    neither the loss nor the gradient sees them.

    Args:
        logprobs: ``[B, T]`` current-policy log-probs (requires grad).
        old_logprobs: ``[B, T]`` log-probs of the policy that generated the data.
        advantages: ``[B]`` per sequence (broadcast over tokens) or ``[B, T]`` per token.
        mask: ``[B, T]`` response mask.
        pos_clip_ratio: upper clip, ratio <= ``1 + pos_clip_ratio`` for A > 0.
        neg_clip_ratio: lower clip, ratio >= ``1 - neg_clip_ratio`` for A < 0.
        diff_clip_ratio: upper bound of the log-ratio before ``exp``.
        final_clip_ratio: upper bound of the per-token loss.
        total: normaliser, see above.
        token_weights: ``[B, T]`` importance weights each token's loss is multiplied by (an off-policy
            correction's, :mod:`chatlearn.algorithms.off_policy`); no gradient flows through them.
        loss_agg_mode: ``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean`` or
            ``seq-mean-token-sum-norm``.
        loss_scale_factor: the constant normaliser of ``seq-mean-token-sum-norm``.

    Returns:
        ``(loss, stats)``; stats are python floats averaged over this batch's valid tokens:
        ``clipfrac`` (the clipped term was strictly larger, i.e. clipping changed the loss),
        ``pos_clipfrac`` (ratio > 1 + pos_clip_ratio with A > 0), ``neg_clipfrac``
        (ratio < 1 - neg_clip_ratio with A < 0), both as ChatLearn's GSPO reports them,
        ``final_clipfrac`` (the final bound was active), ``approx_kl`` (mean of
        ``-log_ratio = old - new``, the k1 estimate of KL(old || new), as in
        :func:`~chatlearn.algorithms.ppo.ppo_clipped_policy_loss`) and ``ratio_mean``.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero)
    return _clipped_pg_loss(
        log_ratio,
        log_ratio.detach(),
        advantages,
        mask,
        pos_clip_ratio=pos_clip_ratio,
        neg_clip_ratio=neg_clip_ratio,
        diff_clip_ratio=diff_clip_ratio,
        final_clip_ratio=final_clip_ratio,
        total=total,
        token_weights=token_weights,
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
    )


@register_policy_loss("gspo", family="grpo")
def gspo_sequence_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    pos_clip_ratio: float = 0.2,
    neg_clip_ratio: float = 0.2,
    diff_clip_ratio: float = 10.0,
    final_clip_ratio: float = 3.0,
    total: float | None = None,
    token_weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Group Sequence Policy Optimization) loss, following ChatLearn's ``calculate_gspo_loss``.

    Token-level ratios are noisy for long responses; GSPO uses one importance ratio per
    sequence, ``exp(s_b)`` with ``s_b`` the mean of ``logprobs - old_logprobs`` over the
    sequence's valid tokens.  Every token of sequence ``b`` uses the log-ratio::

        s_b.detach() + logprobs - logprobs.detach()

    whose *value* is ``s_b`` but whose gradient w.r.t. each token's log-prob is 1, so each
    token receives ``d loss / d logprob_t = d loss / d log_ratio`` at the sequence ratio (the
    stop-gradient trick of ChatLearn/the GSPO paper's GSPO-token form).  Clipping, final
    bound, normalisation and stats are exactly those of :func:`grpo_token_loss` applied to
    that ratio.  ChatLearn's GSPO defaults are tighter (``pos/neg_clip_ratio=1e-3``,
    ``final_clip_ratio=0.01``) but its trainer always passes the configured values, so the
    defaults here are the GRPO ones; set the clips explicitly for GSPO runs.

    A sequence with no valid token has ``s_b = 0`` (ChatLearn divides by ``count + 1e-8``,
    which gives the same value); it contributes nothing anyway.

    Args and returns: as :func:`grpo_token_loss` (``advantages`` is normally ``[B]``).
    ``approx_kl`` is still the per-token ``mean(old - new)``.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    safe_logprobs = torch.where(valid, logprobs, zero)
    token_log_ratio = torch.where(valid, logprobs - old_logprobs, zero).detach()
    seq_log_ratio = masked_mean(token_log_ratio, valid, dim=-1)  # [B], no grad
    log_ratio = safe_logprobs - safe_logprobs.detach() + seq_log_ratio.unsqueeze(-1)
    log_ratio = torch.where(valid, log_ratio, zero)
    return _clipped_pg_loss(
        log_ratio,
        token_log_ratio,
        advantages,
        mask,
        pos_clip_ratio=pos_clip_ratio,
        neg_clip_ratio=neg_clip_ratio,
        diff_clip_ratio=diff_clip_ratio,
        final_clip_ratio=final_clip_ratio,
        total=total,
        token_weights=token_weights,
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
    )


@register_policy_loss("cispo", family="grpo")
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    pos_clip_ratio: float = 0.2,
    neg_clip_ratio: float = 0.2,
    total: float | None = None,
    token_weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1): the clipped importance weight as a constant, times the REINFORCE term.

    Per valid token, ``loss = -sg(clamp(ratio, 1 - neg_clip_ratio, 1 + pos_clip_ratio)) * A * logprobs`` with
    ``ratio = exp(logprobs - old_logprobs)`` (the log-ratio clamped to +-20, as verl does). Unlike PPO's clip,
    no token's gradient is ever zeroed: a token outside the band still learns, with its weight capped, which is
    what keeps the rare "fork" tokens of long reasoning in the update. The gradient w.r.t. ``logprobs`` is
    ``-sg(weight) * A`` (divided by the aggregation's normaliser).

    GRPO's other clips (``diff_clip_ratio``, ``final_clip_ratio``) do not apply, and the trainer refuses them.

    Returns ``(loss, stats)``: ``clipfrac`` (the weight was clipped), ``pos_clipfrac`` / ``neg_clipfrac``
    (above / below the band), ``final_clipfrac`` 0, ``approx_kl`` and ``ratio_mean`` as :func:`grpo_token_loss`.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero).detach()
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    weight = torch.clamp(ratio, 1.0 - neg_clip_ratio, 1.0 + pos_clip_ratio)
    adv = _broadcast_advantages(advantages, mask).to(logprobs.dtype)
    adv = torch.where(valid, adv, zero)
    per_token = -weight * adv * torch.where(valid, logprobs, zero)
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    loss = aggregate_loss(per_token, valid, loss_agg_mode, total, loss_scale_factor)
    with torch.no_grad():
        as_float = torch.promote_types(ratio.dtype, torch.float32)
        stats = {
            "clipfrac": masked_mean((weight != ratio).to(as_float), valid).item(),
            "pos_clipfrac": masked_mean((ratio > 1.0 + pos_clip_ratio).to(as_float), valid).item(),
            "neg_clipfrac": masked_mean((ratio < 1.0 - neg_clip_ratio).to(as_float), valid).item(),
            "final_clipfrac": 0.0,
            "approx_kl": masked_mean(-log_ratio, valid).item(),
            "ratio_mean": masked_mean(ratio, valid).item(),
        }
    return loss, stats


# --------------------------------------------------------------------------------------
# auxiliary terms
# --------------------------------------------------------------------------------------


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Elementwise k3 estimate of KL(policy || reference), clamped to ``[-10, 10]`` as in ChatLearn.

    With ``log_ratio = ref_logprobs - logprobs`` (ChatLearn HEAD ``policy_trainer.py``:
    ``kl = ref_logprobs - logprobs``) and ``ratio = exp(log_ratio)``, the per-token value is
    ``ratio - log_ratio - 1``: it is >= 0 everywhere, exactly 0 when the log-probs agree,
    and its expectation under the policy is KL(policy || reference) (Schulman's k3), with
    lower variance than the plain log-ratio.  The clamp to ``[-10, 10]`` bounds the
    contribution (and zeroes the gradient) of tokens far from the reference.

    Elementwise, no masking: the caller reduces it over valid tokens (ChatLearn sums it and
    divides by the global token count, like the policy loss, then weights by ``kl_coef``).

    Args:
        logprobs: ``[B, T]`` current-policy log-probs (requires grad).
        ref_logprobs: ``[B, T]`` reference-model log-probs.

    Returns:
        ``[B, T]`` k3 values in ``[0, 10]``.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_K3_MAX_LOG_RATIO, _K3_MAX_LOG_RATIO)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position: ``logsumexp(z) - sum(softmax(z) * z)``.

    Same formula as ChatLearn HEAD ``grpo_utils/trainer_utils.py`` ``entropy_from_logits``;
    it is stable for large logits.  Half-precision logits are upcast to float32 first, and
    ``-inf`` logits (banned tokens) contribute 0 instead of ``0 * -inf = NaN``.  Memory
    (chunking over ``T``) is left to the caller.

    Args:
        logits: ``[B, T, V]``.

    Returns:
        ``[B, T]`` entropies in nats.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    probs = F.softmax(logits, dim=-1)
    finite_logits = torch.where(torch.isneginf(logits), torch.zeros_like(logits), logits)
    return torch.logsumexp(logits, dim=-1) - (probs * finite_logits).sum(dim=-1)
