"""Samples too old to train on, in pipelined episodes (``runtime.max_staleness``).

A sample carries ``policy_version``, the weights version that generated it (`chatlearn.runtime.weights.versions`;
with partial rollouts, the version of its last round, and each token's own in ``token_versions``);
when the trainer at version ``trained_version`` would train on it, its staleness is the difference. One older
than ``max_staleness`` is dropped, with the rest of its group (a prompt's responses are normalised together and
trained together), and counted.
"""

from collections.abc import Sequence
from typing import Any


def drop_stale(samples: Sequence[dict[str, Any]], trained_version: int, max_staleness: int,
               group_size: int = 1) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The samples fresh enough to train on, and the episode's staleness metrics over all of them (samples
    without a version: generated on the trainer's current weights, staleness 0)."""
    ages = [trained_version - int(s.get("policy_version", trained_version)) for s in samples]
    size = max(1, group_size)
    kept: list[dict[str, Any]] = []
    for start in range(0, len(samples), size):
        if max(ages[start:start + size], default=0) <= max_staleness:
            kept.extend(samples[start:start + size])
    metrics = {"staleness_mean": sum(ages) / len(ages) if ages else 0.0,
               "staleness_max": float(max(ages, default=0)), "dropped_stale": float(len(samples) - len(kept))}
    if samples and all("token_versions" in s for s in samples):  # per token: a partial rollout spans versions
        tokens = [(trained_version - s["token_versions"][s["response_mask"].bool()]).float() for s in samples]
        count = sum(t.numel() for t in tokens)
        metrics["staleness_token_mean"] = float(sum(t.sum() for t in tokens) / count) if count else 0.0
    return kept, metrics
