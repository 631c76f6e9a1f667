"""How a trainer's step weighs its micro-batches: one mean over the whole global batch.

A global batch arrives as micro-batches of different sizes (and, for token means, different response
lengths). Gradient accumulation must give the step of one big batch, so each micro-batch's loss (a mean over
its own units) is weighted by its share of the global batch's units: ``count_i / total``. What a unit is
depends on what the loss averages:

* ``token-mean``: response tokens (PPO policy and value; GRPO and GSPO, whose registered losses sum over the
  tokens and divide by the global ``total`` themselves, so the share only weighs their statistics);
* ``sequence-mean``: sequences (DPO: one preference pair per sequence);
* the policy-gradient modes of :func:`aggregate_loss` (``POLICY_LOSS_AGGREGATIONS``, verl's
  ``loss_agg_mode`` names): ``seq-mean-token-sum``, ``seq-mean-token-mean`` and ``seq-mean-token-sum-norm``
  (Dr.GRPO's constant normaliser) average over the sequences that have a response token;
* any other count a trainer computes (online DPO: the ordered pairs of each micro-batch).

Statistics are weighted the same way, so summed over the micro-batches (and data-parallel ranks) they are the
global batch's means.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from chatlearn.algorithms.registry import name_problem
from chatlearn.data.batch import loss_mask

__all__ = ["LOSS_AGGREGATIONS", "POLICY_LOSS_AGGREGATIONS", "GlobalMean", "aggregate_loss", "global_mean",
           "policy_aggregation_problem", "units"]


def _response_tokens(mb: dict) -> float:
    return float(loss_mask(mb).sum())


def _sequences(mb: dict) -> float:
    return float(len(mb["response_ids"]))


def _answered(mb: dict) -> float:
    # a sequence with no response token adds nothing to a sequence mean, as in verl's agg_loss
    return float((loss_mask(mb).sum(-1) > 0).sum())


# the unit each named aggregation averages over, counted in one micro-batch
LOSS_AGGREGATIONS: dict[str, Callable[[dict], float]] = {
    "token-mean": _response_tokens,
    "sequence-mean": _sequences,
    "seq-mean-token-sum": _answered,
    "seq-mean-token-mean": _answered,
    "seq-mean-token-sum-norm": _answered,
}

# the modes a token-level policy loss may be aggregated with (aggregate_loss); the others count a trainer's own units
POLICY_LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def policy_aggregation_problem(mode: str) -> str | None:
    """Why ``mode`` cannot aggregate a per-token policy loss (``loss_agg_mode``), as one line; None if it can."""
    if mode in LOSS_AGGREGATIONS and mode not in POLICY_LOSS_AGGREGATIONS:
        return (f"{mode!r} counts a trainer's own units, not a per-token policy loss's; one of "
                f"{', '.join(POLICY_LOSS_AGGREGATIONS)}")
    return name_problem("loss aggregation mode", mode, POLICY_LOSS_AGGREGATIONS)


class GlobalMean(NamedTuple):
    """``weights[i]``: micro-batch ``i``'s share of the global batch; ``total``: the units of the global batch
    (1.0 when it has none, so a division by it is safe); ``count``: the units, 0 when there are none."""

    weights: list[float]
    total: float
    count: float


def units(data_list: Sequence[dict], aggregation: str) -> list[float]:
    """The units (``LOSS_AGGREGATIONS[aggregation]``) of each micro-batch; an unknown name lists the known."""
    try:
        count = LOSS_AGGREGATIONS[aggregation]
    except KeyError:
        raise KeyError(f"Unknown loss aggregation {aggregation!r}; known: {sorted(LOSS_AGGREGATIONS)}") from None
    return [count(mb) for mb in data_list]


def global_mean(counts: Sequence[float]) -> GlobalMean:
    """Each micro-batch's share ``counts[i] / sum(counts)`` of the global batch (all 0 when it has no unit)."""
    count = float(sum(counts))
    total = count or 1.0
    return GlobalMean([c / total for c in counts], total, count)


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", total: float | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """One micro-batch's share of a loss given per token (``[B, T]``, garbage allowed at padding), aggregated as
    ``mode`` over a global batch of ``total`` units (``LOSS_AGGREGATIONS[mode]``; default: this batch's own, so
    the result is the batch's plain mean). The shares of the micro-batches add up to the global batch's loss:

    * ``token-mean``: the sum over response tokens / ``total`` tokens (long responses weigh more);
    * ``seq-mean-token-sum``: each sequence's token sum, averaged over ``total`` sequences;
    * ``seq-mean-token-mean``: each sequence's token mean, averaged over ``total`` sequences (every response
      weighs the same, whatever its length: GRPO's original normalisation);
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` divided by the constant ``scale`` (Dr.GRPO: the
      generation budget), so no length normalisation biases the gradient towards short or long answers.
    """
    valid = mask.bool()
    x = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if mode not in POLICY_LOSS_AGGREGATIONS:
        raise KeyError(f"Unknown loss aggregation {mode!r}; known: {list(POLICY_LOSS_AGGREGATIONS)}")
    if total is None:
        total = units([{"response_mask": mask}], mode)[0] or 1.0
    if total <= 0:
        raise ValueError(f"the global batch's units must be > 0, got {total}")
    if mode == "token-mean":
        return x.sum() / total
    per_seq = x.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / valid.sum(-1).clamp_min(1).to(x.dtype)
    loss = per_seq.sum() / total
    if mode == "seq-mean-token-sum-norm":
        if scale is None or scale <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs a constant normaliser > 0 (the generation budget), "
                             f"got {scale}")
        loss = loss / scale
    return loss
