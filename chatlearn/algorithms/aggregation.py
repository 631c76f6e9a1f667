"""How a trainer's step weighs its micro-batches: one mean over the whole global batch.

A global batch arrives as micro-batches of different sizes (and, for token means, different response
lengths). Gradient accumulation must give the step of one big batch, so each micro-batch's loss (a mean over
its own units) is weighted by its share of the global batch's units: ``count_i / total``. What a unit is
depends on what the loss averages:

* ``token-mean``: response tokens (PPO policy and value; GRPO and GSPO, whose registered losses sum over the
  tokens and divide by the global ``total`` themselves, so the share only weighs their statistics);
* ``sequence-mean``: sequences (DPO: one preference pair per sequence);
* any other count a trainer computes (online DPO: the ordered pairs of each micro-batch).

Statistics are weighted the same way, so summed over the micro-batches (and data-parallel ranks) they are the
global batch's means.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = ["LOSS_AGGREGATIONS", "GlobalMean", "global_mean", "units"]


def _response_tokens(mb: dict) -> float:
    return float(mb["response_mask"].sum())


def _sequences(mb: dict) -> float:
    return float(len(mb["response_ids"]))


# the unit each named aggregation averages over, counted in one micro-batch
LOSS_AGGREGATIONS: dict[str, Callable[[dict], float]] = {
    "token-mean": _response_tokens,
    "sequence-mean": _sequences,
}


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
