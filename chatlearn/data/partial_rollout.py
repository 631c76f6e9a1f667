"""Partial rollouts (``runtime.use_partial_rollout``, ChatLearn HEAD's names): a response is generated over up to
``max_rollout_round`` episodes, at most ``max_new_tokens * rollout_ratio[i]`` new tokens in round i.

After an episode's generation, what the driver holds (a `RolloutBuffer`, checkpointed with the episode):

* ``unfinished``: responses that used their round's budget without a stop token (EOS, the policy's
  ``stop_token_list``); the next episode continues them on its weights (the policy reads their tokens so far as
  the ends of their prompts; the per-sample sampler draws their later tokens with the noise of the same response
  steps, so on unchanged weights a response continued in later rounds is the response generated at once);
* ``waiting``: finished responses whose prompt group is not finished yet.

A response is finished when it ends with a stop token, reaches ``max_new_tokens``, or has had its last round.
ChatLearn's rule moves a prompt's finished responses to scoring and training once more than
``mini_response_per_prompt`` of its group are finished, and each response that finishes after that at once. The
default here, ``num_inference_per_prompt - 1``, waits for the whole group, so group advantages are over the
whole group, as in a run without partial rollouts. A smaller value trains a group in parts, as ChatLearn does:
each part's advantages are normalised over that part (the score stage sees one part of a group in a batch; a batch holds
parts of one size), so a response that finishes alone after its group was released scores 0 against itself.
Unlike ChatLearn's manager (``random.shuffle``, unseeded), the order is fixed: groups by id, responses by sample
id, so a re-run after a crash makes the same batches.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chatlearn.data.relay import load_sample_sets, save_sample_sets

STEM = "partial_rollouts"


@dataclass
class RolloutBuffer:
    """What the responses of a run stand at after an episode's generation (per-sample dicts, `split_batch`'s)."""

    unfinished: list[dict[str, Any]] = field(default_factory=list)
    waiting: list[dict[str, Any]] = field(default_factory=list)
    # group id -> responses of it released so far, for the groups released in part (mini_response_per_prompt)
    released: dict[int, int] = field(default_factory=dict)

    def save(self, directory: str, episode: int) -> str:
        extra = {"episode": episode, "released": [[g, n] for g, n in sorted(self.released.items())]}
        save_sample_sets(directory, [(0, self.unfinished), (1, self.waiting)], extra, stem=STEM)
        return directory

    @classmethod
    def load(cls, directory: str) -> "RolloutBuffer":
        sets, meta = load_sample_sets(directory, stem=STEM)
        by_id = dict(sets)
        return cls(unfinished=by_id.get(0, []), waiting=by_id.get(1, []),
                   released={int(g): int(n) for g, n in meta.get("released", [])})


def _group(sample: dict[str, Any]) -> int:
    return int(sample["group_id"]) if "group_id" in sample else int(sample["sample_id"])


def continuation_batches(unfinished: Sequence[dict[str, Any]], budgets: Sequence[int], batch_size: int
                         ) -> list[tuple[int, list[dict[str, Any]]]]:
    """(round budget, samples) for every batch that continues responses: one round per batch (the policy takes
    one budget per batch), by round then sample id, at most ``batch_size`` samples each."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for s in sorted(unfinished, key=lambda s: int(s["sample_id"])):
        by_round.setdefault(int(s["rollout_round"]), []).append(s)
    out = []
    for rnd in sorted(by_round):
        samples = by_round[rnd]
        out += [(budgets[rnd], samples[i:i + batch_size]) for i in range(0, len(samples), max(1, batch_size))]
    return out


def settle(buffer: RolloutBuffer, produced: Sequence[dict[str, Any]], group_size: int, max_rounds: int,
           mini_response: int | None = None) -> tuple[list[list[dict[str, Any]]], RolloutBuffer, dict[str, float]]:
    """After an episode's generation (``produced``: its new and continued responses): the prompt groups, or parts
    of groups, that train now (each a list by sample id, by group id), the buffer for the next episode, and the
    episode's counts (ChatLearn's ``round_{i}_samples``: responses generated in round i).

    A group's finished responses are released once more than ``mini_response`` (default ``group_size - 1``: the
    whole group) of it are finished, and each that finishes later as it does (ChatLearn's rule)."""
    mini = group_size - 1 if mini_response is None else mini_response
    metrics: dict[str, float] = {f"round_{i}_samples": 0.0 for i in range(max_rounds)}
    finished, unfinished = [], []
    for s in produced:
        metrics[f"round_{int(s['rollout_round']) - 1}_samples"] += 1
        if s["rollout_finished"] or int(s["rollout_round"]) >= max_rounds:
            finished.append(s)
        else:
            unfinished.append(s)
    groups: dict[int, list[dict[str, Any]]] = {}
    for s in [*buffer.waiting, *finished]:
        groups.setdefault(_group(s), []).append(s)
    released, waiting, counts = [], [], dict(buffer.released)
    for gid in sorted(groups):
        members = sorted(groups[gid], key=lambda s: int(s["sample_id"]))
        done = counts.get(gid, 0) + len(members)
        if done > mini:
            released.append(members)
            counts[gid] = done
        else:
            waiting += members
    unfinished.sort(key=lambda s: int(s["sample_id"]))
    parts = sum(1 for g in released if len(g) < group_size)
    metrics.update(partial_released=float(sum(len(g) for g in released)), partial_unfinished=float(len(unfinished)),
                   partial_waiting=float(len(waiting)), partial_group_parts=float(parts))
    return released, RolloutBuffer(unfinished, waiting, {g: n for g, n in counts.items() if n < group_size}), metrics


def release_batches(groups: Sequence[list[dict[str, Any]]], batch_size: int) -> list[list[dict[str, Any]]]:
    """Whole groups (or parts of groups) packed in order into batches of at most ``batch_size`` samples (a group
    larger than that is a batch of its own): a reward normalises each group within one batch. A batch holds
    groups of one size (the advantage estimators refuse a batch of unequal groups, which would mean a cut
    group); whole groups come first, then the parts by size, largest first."""
    out: list[list[dict[str, Any]]] = []
    for size in sorted({len(g) for g in groups}, reverse=True):
        start = len(out)
        for group in (g for g in groups if len(g) == size):
            if len(out) > start and len(out[-1]) + len(group) <= batch_size:
                out[-1] += group
            else:
                out.append(list(group))
    return out


class PartialRollouts:
    """A run's rollout buffers by episode, in the driver: episode E continues the buffer episode E-1 left
    (pipelined episodes generate in episode order, so it is there), and the checkpoint of episode E saves the
    one E left, while later episodes may have generated already. Buffers no episode can need are dropped."""

    def __init__(self, budgets: list[int], group_size: int, batch_size: int, keep: int = 1,
                 mini_response: int | None = None) -> None:
        self.budgets, self.group_size, self.batch_size = list(budgets), group_size, batch_size
        self.mini_response = mini_response
        self.max_rounds = len(budgets)
        self.keep = keep  # how many episodes after E may generate before E's checkpoint: max_staleness + 1
        self._after: dict[int, RolloutBuffer] = {}

    def start(self, episode: int, buffer: RolloutBuffer | None = None) -> None:
        """The run goes on at ``episode`` from ``buffer`` (a checkpoint's; none: nothing in flight)."""
        self._after = {episode - 1: buffer or RolloutBuffer()}

    def before(self, episode: int) -> RolloutBuffer:
        return self._after[episode - 1]

    def after(self, episode: int) -> RolloutBuffer:
        return self._after[episode]

    def settle(self, episode: int, produced: Sequence[dict[str, Any]]
               ) -> tuple[list[list[dict[str, Any]]], dict[str, float]]:
        """Record episode ``episode``'s generation (`settle`): the batches of the groups it finished, its counts."""
        groups, buffer, metrics = settle(self.before(episode), produced, self.group_size, self.max_rounds,
                                        self.mini_response)
        self._after[episode] = buffer
        for old in [e for e in self._after if e < episode - self.keep]:
            del self._after[old]
        return release_batches(groups, self.batch_size), metrics
