"""Partial rollouts (``runtime.use_partial_rollout``): a response is generated over several episodes, round i at
most its share of ``max_new_tokens``; what did not finish is continued by the next episode, first.

The buffer of responses in flight and the release rule (whole prompt groups, or parts of groups) are
:mod:`chatlearn.data.partial_rollout`; this strategy sends the producer the continued responses before the
episode's new prompts, settles what it answered, and keeps the buffers by episode (pipelined episodes generate
ahead of the checkpoint that saves them). Samples are tagged with the weights version that generated them.
"""

import os
from typing import Any

import ray

from chatlearn.checkpoint.data_checkpoint import DataCheckpoint
from chatlearn.data.batch import collate_samples, split_batch
from chatlearn.data.partial_rollout import PartialRollouts, RolloutBuffer, continuation_batches
from chatlearn.data.relay import RelayCheckpointError
from chatlearn.runtime.calls.dispatch import Batches
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.compute_flow import ComputeFlow
from chatlearn.runtime.context import RunContext
from chatlearn.runtime.rollout.base import Rollout
from chatlearn.runtime.spec import RunSpec
from chatlearn.runtime.weights.versions import PolicyWeights, generation_version
from chatlearn.utils.errors import RunError
from chatlearn.utils.storage import writing

__all__ = ["PartialRollout"]


class PartialRollout(Rollout):
    """Responses carried across episodes (the module's doc)."""

    name = "partial"

    def __init__(self, spec: RunSpec, weights: PolicyWeights) -> None:
        super().__init__(spec, weights)
        rt = spec.runtime
        self.buffers = PartialRollouts(spec.rollout_round_budgets, spec.group_size, spec.generation_batch_size,
                                       keep=rt.max_staleness + 1,
                                       mini_response=rt.partial_rollout_manager_config.mini_response_per_prompt)

    def start(self, ctx: RunContext, resumed: DataCheckpoint | None) -> None:
        super().start(ctx, resumed)
        buffer = None
        if resumed is not None:
            if not resumed.partial_rollouts:
                raise RunError(f"the data checkpoint of episode {resumed.episode + 1} in "
                               f"{self.spec.data_checkpoint_path} holds no partial rollouts, which runtime."
                               "use_partial_rollout continues (was it written by a run without partial rollouts?)")
            try:
                buffer = RolloutBuffer.load(resumed.partial_rollouts)
            except (OSError, RelayCheckpointError) as exc:
                raise RunError(f"the partial rollouts of episode {resumed.episode + 1}'s data checkpoint cannot be "
                               f"read: {exc}") from exc
        self.buffers.start(resumed.episode + 1 if resumed is not None else 0, buffer)

    def save(self, ctx: RunContext, episode: int, iteration: int, clock: StageClock) -> dict[str, Any]:
        saved = super().save(ctx, episode, iteration, clock)
        # the responses in flight, as this episode's generation left them
        directory = os.path.join(self.spec.data_checkpoint_path, "partial_rollouts", f"iter_{iteration:07d}")
        with writing("the partial rollouts", directory):  # a full disk: one RunError naming the path
            saved["partial_rollouts"] = self.buffers.after(episode).save(directory, episode)
        return saved

    def _version(self, episode: int) -> int | None:
        # every sample is tagged with the weights that generated it (a response may span several)
        return generation_version(episode, self.spec.runtime.max_staleness)

    def _batches(self, episode: int, prompts: list[tuple[int, list[int], list[int]]], first_iteration: int,
                 consumed_samples: int, version: int | None, replicas: int) -> Batches:
        # the responses begun earlier go on first, each batch one round's budget; then the new prompts, round 0
        budgets = self.buffers.budgets
        continued = continuation_batches(self.buffers.before(episode).unfinished, budgets,
                                         self.spec.generation_batch_size)
        rounds = [{"continued": ray.put(samples), "max_new_tokens": budget} for budget, samples in continued]
        prompts = [(i % replicas, [], [s["sample_id"] for s in samples])
                   for i, (_, samples) in enumerate(continued)] + prompts
        rounds += [{"max_new_tokens": budgets[0]}] * (len(prompts) - len(rounds))
        return Batches(len(prompts), first_iteration, prompts, episode_start=consumed_samples,
                       policy_version=version, rounds=rounds)

    def _answered(self, ctx: RunContext, episode: int, flow: ComputeFlow, refs: list[Any], batches: Batches,
                  clock: StageClock) -> tuple[list[Any], dict[str, float]]:
        # what finished goes on to scoring, by whole prompt groups (or parts); the rest waits
        produced = [s for batch in clock.get(refs, flow.producer.model) for s in split_batch(batch)]
        released, metrics = self.buffers.settle(episode, produced)
        return [ray.put(collate_samples(b, ctx.pad_token_id)) for b in released], metrics
