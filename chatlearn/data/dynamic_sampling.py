"""DAPO's dynamic sampling: train only on prompt groups whose responses the reward tells apart.

A group whose responses all score the same has zero advantage under every group estimator (GRPO, Dr.GRPO,
RLOO): it costs a training forward and backward and teaches nothing, and as the policy gets good most groups
become all-correct. With ``runtime.dynamic_sampling`` an episode scores its generation, keeps the groups with at
least two distinct scores, and generates the next prompts of the stream while fewer than ``sample_per_episode``
samples are kept, for at most ``max_sampling_rounds`` rounds in all (each round one episode's worth of prompts).
It then trains on the first ``sample_per_episode`` kept samples, whole groups in stream order, or on fewer when
the rounds ran out (counted: ``dynamic_sampling_rounds``, ``filtered_groups``, ``num_samples``).

The rounds' prompts are the stream's next ones (``consumed_samples`` advances by every round), their sample ids
their stream positions, so a run is the same whatever the batching, and a resumed run reads on where it was.
"""

from typing import Any

__all__ = ["informative_groups", "keep_informative"]


def _group(sample: dict[str, Any]) -> int:
    return int(sample["group_id"])


def informative_groups(samples: list[dict[str, Any]]) -> tuple[list[list[dict[str, Any]]], int]:
    """(the groups with at least two distinct ``scores``, in stream order; how many groups were all equal)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault(_group(s), []).append(s)
    kept, dropped = [], 0
    for gid in sorted(groups):
        members = sorted(groups[gid], key=lambda s: int(s["sample_id"]))
        if len({float(s["scores"]) for s in members}) > 1:
            kept.append(members)
        else:
            dropped += 1
    return kept, dropped


def keep_informative(samples: list[dict[str, Any]], sample_per_episode: int) -> tuple[list[dict[str, Any]], int]:
    """(the first ``sample_per_episode`` samples of the informative groups, whole groups only; the number of
    all-equal groups dropped)."""
    kept, dropped = informative_groups(samples)
    out: list[dict[str, Any]] = []
    for members in kept:
        if len(out) + len(members) > sample_per_episode:
            break
        out.extend(members)
    return out, dropped
