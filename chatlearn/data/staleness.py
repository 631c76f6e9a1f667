"""Samples too old to train on, in pipelined episodes (``runtime.max_staleness``).

A sample carries ``policy_version``, the weights version that generated it (`chatlearn.runtime.weights.versions`;
with partial rollouts, the version of its last round, and each token's own in ``token_versions``);
when the trainer at version ``trained_version`` would train on it, its staleness is the difference. One older
than ``max_staleness`` is dropped, with the rest of its group (a prompt's responses are normalised together and
trained together), and counted.
"""

from collections.abc import Sequence
from typing import Any

from chatlearn.data.stream import group_blocks


def drop_stale(samples: Sequence[dict[str, Any]], trained_version: int, max_staleness: int,
               group_size: int = 1) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The samples fresh enough to train on, and the episode's staleness metrics over all of them (samples
    without a version: generated on the trainer's current weights, staleness 0)."""
    def age(s: dict[str, Any]) -> int:
        return trained_version - int(s.get("policy_version", trained_version))

    ages = [age(s) for s in samples]
    kept: list[dict[str, Any]] = []
    for group in group_blocks(samples, group_size):
        if max(age(s) for s in group) <= max_staleness:
            kept.extend(group)
    metrics = {"staleness_mean": sum(ages) / len(ages) if ages else 0.0,
               "staleness_max": float(max(ages, default=0)), "dropped_stale": float(len(samples) - len(kept))}
    if samples and all("token_versions" in s for s in samples):  # per token: a partial rollout spans versions
        tokens = [(trained_version - s["token_versions"][s["response_mask"].bool()]).float() for s in samples]
        count = sum(t.numel() for t in tokens)
        metrics["staleness_token_mean"] = float(sum(t.sum() for t in tokens) / count) if count else 0.0
    return kept, metrics
