"""DPO, IPO and online-DPO math as pure tensor functions, following ChatLearn v1.0.x.

Why these live apart from the RL losses: DPO needs no reward model, critic or sampling
ratio.  It turns a preference between two responses into a classification loss on the
difference of their (policy - reference) sequence log-probs, so its inputs are one
log-prob per *sequence* (``[B]``), produced by :func:`sequence_logprob`.

* Offline DPO (``DPOEngine``): fixed (chosen, rejected) pairs, :func:`dpo_loss` with
  optional conservative label smoothing (cDPO) or the IPO squared loss.
* Online DPO (``OnlineDPOEngine``): several responses are sampled per prompt and scored by
  a reward model; every pair inside a prompt group with a strictly higher reward becomes a
  (chosen, rejected) pair (:func:`online_dpo_pairs`, :func:`online_dpo_loss`).

Reference sources (ChatLearn ``v1.0.2``): ``examples/megatron/models/policy_trainer.py``
(``dpo_loss_fn``, ``get_online_dpo_loss``) and ``examples/huggingface/models/dpo/
policy_trainer.py`` (``DPOLoss``).  Conventions are those of :mod:`chatlearn.algorithms.ppo`.
"""

import torch
import torch.nn.functional as F

from chatlearn.algorithms.grpo import check_group_layout
from chatlearn.algorithms.ppo import masked_mean, masked_sum

__all__ = [
    "sequence_logprob",
    "dpo_loss",
    "online_dpo_pairs",
    "online_dpo_loss",
]


def sequence_logprob(logprobs: torch.Tensor, mask: torch.Tensor, length_normalize: bool = False) -> torch.Tensor:
    """Log-probability of each whole response: the sum of its valid tokens' log-probs.

    ``length_normalize=True`` returns the per-token mean instead, which online DPO uses
    (ChatLearn ``scores = logprobs.sum(-1) / length``) so that responses of different
    lengths to the same prompt are compared per token rather than penalising the longer one.
    Padding (even NaN) is ignored; a row with no valid token gives 0.

    Args:
        logprobs: ``[B, T]`` per-token log-probs of the response tokens.
        mask: ``[B, T]`` response mask.
        length_normalize: mean instead of sum.

    Returns:
        ``[B]``.
    """
    if length_normalize:
        return masked_mean(logprobs, mask, dim=-1)
    return masked_sum(logprobs, mask, dim=-1)


def _check_beta(beta: float) -> None:
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    ipo: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO loss (Rafailov et al. 2023) with cDPO label smoothing or the IPO variant, averaged over pairs.

    With ``logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)``:

    * sigmoid (DPO / cDPO): ``-(1 - ls) * logsigmoid(beta * logits) - ls * logsigmoid(-beta * logits)``;
      ``ls > 0`` assumes each preference label is flipped with probability ``ls``, which
      keeps the loss from driving the margin to infinity on noisy labels;
    * IPO (Azar et al. 2023, Eq. 17): ``(logits - 1 / (2 * beta)) ** 2``, which regresses
      the margin to a finite target instead of pushing it to infinity.

    This is ChatLearn's ``dpo_loss_fn`` (v1.0.2); as there, ``label_smoothing`` has no effect
    with IPO, so combining them is rejected here instead of being silently ignored.

    Args:
        policy_chosen: ``[B]`` sequence log-probs of the chosen responses under the policy (grad).
        policy_rejected: the same of the rejected responses.
        ref_chosen: ``[B]`` sequence log-probs of the chosen responses under the frozen reference.
        ref_rejected: the same of the rejected responses.
        beta: inverse temperature (ChatLearn's ``dpo_weight``), > 0.
        label_smoothing: cDPO label-flip probability in ``[0, 0.5]``.
        ipo: use the IPO squared loss.

    Returns:
        ``(loss, stats)``.  With implicit rewards ``beta * (policy - ref)``: ``reward_accuracy``
        (fraction of pairs whose chosen reward is strictly above the rejected one),
        ``reward_margin`` (mean chosen - rejected reward), ``chosen_reward`` and
        ``rejected_reward`` (means); python floats.
    """
    _check_beta(beta)
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    if ipo and label_smoothing != 0.0:
        raise ValueError("label_smoothing is not used by the IPO loss; set it to 0")
    shapes = {tuple(t.shape) for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1:
        raise ValueError(f"all sequence log-prob tensors must have the same shape, got {sorted(shapes)}")

    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if ipo:
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(-beta * logits)
    loss = losses.mean()

    with torch.no_grad():
        chosen_reward = beta * (policy_chosen - ref_chosen)
        rejected_reward = beta * (policy_rejected - ref_rejected)
        stats = {
            "reward_accuracy": (chosen_reward > rejected_reward).sum().item() / max(chosen_reward.numel(), 1),
            "reward_margin": (chosen_reward - rejected_reward).mean().item(),
            "chosen_reward": chosen_reward.mean().item(),
            "rejected_reward": rejected_reward.mean().item(),
        }
    return loss, stats


def online_dpo_pairs(rewards: torch.Tensor, group_size: int) -> list[tuple[int, int]]:
    """All ``(i, j)`` with ``rewards[i] > rewards[j]`` inside each prompt group, as global indices.

    ``rewards`` is laid out as consecutive groups of ``group_size`` responses to one prompt
    (ChatLearn: ``num_inference_per_prompt``).  Ties (and NaN rewards) give no pair: equal
    rewards express no preference.  Indices point into the flat ``[N]`` tensor and are
    computed from each group's fixed offset ``g * group_size``, so a group with no ordered
    pair contributes nothing and does not shift later groups.  (ChatLearn v1.0.2
    ``get_online_dpo_loss`` advanced its slice offset only for groups that produced a loss,
    so every later group read the wrong scores; that is deliberately not replicated.)

    Order: groups in order, then ``i`` ascending, then ``j`` ascending (row-major over the
    group's ``i, j`` grid, as ``torch.nonzero`` lists them in ChatLearn).

    Args:
        rewards: ``[N]`` reward-model score per response.
        group_size: responses per prompt.

    Returns:
        list of ``(chosen_index, rejected_index)``.

    Raises:
        ValueError: ``rewards`` not 1-D, ``group_size < 1`` or ``N`` not a multiple of it.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    num_groups = check_group_layout(rewards.shape[0], group_size)
    values = rewards.detach().cpu().tolist()
    pairs: list[tuple[int, int]] = []
    for g in range(num_groups):
        start = g * group_size
        for i in range(start, start + group_size):
            for j in range(start, start + group_size):
                if values[i] > values[j]:
                    pairs.append((i, j))
    return pairs


def online_dpo_loss(
    scores: torch.Tensor,
    pairs: list[tuple[int, int]],
    *,
    beta: float = 0.1,
    ipo: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Online-DPO loss over reward-ordered pairs: mean of ``-logsigmoid(beta * (s_i - s_j))``.

    ``scores`` are length-normalised ``(policy - reference)`` sequence log-probs (see
    :func:`sequence_logprob` with ``length_normalize=True``), so ``s_i - s_j`` is the DPO
    logit of preferring response ``i`` over ``j``.  IPO: ``(s_i - s_j - 1 / (2 beta)) ** 2``.

    Averaging: the mean over *all pairs* of the batch.  ChatLearn v1.0.2 instead averaged
    within each prompt group, summed the group means and divided by the number of groups
    (including groups without pairs, plus 1e-5), which weights a pair of a group with few
    ordered pairs more; a caller that wants that weighting can call this once per group.

    With no pair at all the loss is ``scores.sum() * 0``: exactly 0 but still attached to
    the graph, so ``backward()`` works and every parameter receives a (zero) gradient.

    Args:
        scores: ``[N]`` (requires grad through the policy part).
        pairs: ``(chosen, rejected)`` indices into ``scores``, e.g. from :func:`online_dpo_pairs`.
        beta: inverse temperature (ChatLearn's ``dpo_weight``), > 0.
        ipo: use the IPO squared loss.

    Returns:
        ``(loss, stats)``: ``num_pairs``, ``pair_accuracy`` (fraction with ``s_i > s_j``) and
        ``margin`` (mean ``s_i - s_j``), python floats (0 without pairs).
    """
    _check_beta(beta)
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [N], got shape {tuple(scores.shape)}")
    if not pairs:
        return scores.sum() * 0.0, {"num_pairs": 0.0, "pair_accuracy": 0.0, "margin": 0.0}

    n = scores.shape[0]
    for i, j in pairs:
        if not (0 <= i < n and 0 <= j < n) or i == j:
            raise ValueError(f"invalid pair ({i}, {j}) for {n} scores")
    chosen = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=scores.device)
    rejected = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=scores.device)
    diff = scores[chosen] - scores[rejected]
    if ipo:
        losses = (diff - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * diff)
    loss = losses.mean()

    with torch.no_grad():
        stats = {
            "num_pairs": float(len(pairs)),
            "pair_accuracy": (diff > 0).sum().item() / len(pairs),
            "margin": diff.mean().item(),
        }
    return loss, stats
