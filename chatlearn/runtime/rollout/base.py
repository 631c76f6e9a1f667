"""The single-turn rollout, and the interface every rollout strategy has.

A rollout strategy is what an episode's generation does: which prompts go to the producer (the environment
flow's first call), on which weights, and what happens to its answers before scoring. The stages call it and
never branch on the mode; the modes are subclasses registered by name (:mod:`chatlearn.runtime.rollout`):

* `Rollout` (``single_turn``): the producer answers the episode's prompts once;
* ``multi_turn`` (:mod:`.multi_turn`): the environments answer and the policy goes on until each conversation
  ends;
* ``partial`` (:mod:`.partial`): responses are generated over several episodes, the unfinished ones carried.

Orthogonal to the mode is where the policy's weights come from (``weights``,
:mod:`chatlearn.runtime.weights.versions`): synced by the sync stage, or, in pipelined episodes, published
versions of the trainer's weights that an episode generates on whatever trains meanwhile. Which engine decodes
(``runtime.rollout_engine``: ``hf``, ``continuous``, ...) is the producer module's own registry, inside its
process (`chatlearn.models.hf.rollout`).
"""

from typing import Any, ClassVar

from chatlearn.checkpoint.data_checkpoint import DataCheckpoint
from chatlearn.data.sampler import episode_generation_batches, eval_prompt_batches
from chatlearn.runtime.calls.dispatch import Batches
from chatlearn.runtime.calls.handles import RefBox
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.compute_flow import ComputeFlow
from chatlearn.runtime.context import RunContext
from chatlearn.runtime.spec import RunSpec
from chatlearn.runtime.weights.sync import SyncRoute
from chatlearn.runtime.weights.versions import PolicyWeights

__all__ = ["Rollout"]


class Rollout:
    """An episode's generation, single-turn: the producer answers the episode's prompt batches, dealt over its
    replicas. Subclasses change `_batches` (what the producer is sent) and `_answered` (what becomes of its
    answers); the carried state, if any, is saved with the checkpoint (`save`) and read back (`start`)."""

    name: ClassVar[str] = "single_turn"

    def __init__(self, spec: RunSpec, weights: PolicyWeights) -> None:
        self.spec, self.weights = spec, weights

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.weights!r})"

    # ---- the run ----

    def start(self, ctx: RunContext, resumed: DataCheckpoint | None) -> None:
        """Before the first episode: what this run carries, from ``resumed`` (a checkpoint) or from nothing."""
        self.weights.start(ctx, resumed)

    def save(self, ctx: RunContext, episode: int, iteration: int, clock: StageClock) -> dict[str, Any]:
        """With episode ``episode``'s checkpoint (trainer ``iteration``): what the next episodes need of the
        rollout, as the data checkpoint's fields (``policy_versions``, ``partial_rollouts``)."""
        return {"policy_versions": self.weights.save(ctx, episode, iteration, clock)}

    # ---- the stages ----

    def generate(self, ctx: RunContext, episode: int, consumed_samples: int, sampling_round: int = 0) -> RefBox:
        """The producer answers episode ``episode``'s prompts (``sampling_round`` > 0: dynamic sampling's next round
        of the episode, the stream's next prompts). Returns the batches to score (refs, with the episode's
        numbers and the mode's metrics in ``meta``)."""
        clock = StageClock("generate", episode, self.spec.runtime.stage_timeout_s)
        rt, flow = self.spec.runtime, self.spec.plan.environment
        replicas = len(ctx.actors.names[flow.producer.model])
        prompts = episode_generation_batches(ctx.dataset_size, consumed_samples, rt.sample_per_episode,
                                             self.spec.generation_batch_size, replicas, rt.shuffle_seed,
                                             self.spec.group_size)
        num_samples = sum(len(idx) for _, idx, _ in prompts)
        first_iteration = (episode * self.spec.sampling_rounds + sampling_round) * len(prompts)
        # stream positions identify samples: per-sample seeds make responses independent of the batching
        version = self._version(episode)
        batches = self._batches(episode, prompts, first_iteration, consumed_samples, version, replicas)
        with self.weights.turn(flow.producer.model, version, clock):
            refs = ctx.calls.run(ctx, flow, [0], {}, batches, clock)[0].refs
        refs, metrics = self._answered(ctx, episode, flow, refs, batches, clock)
        return RefBox(refs, seconds=clock.seconds(), num_batches=len(refs), num_samples=num_samples,
                      first_iteration=first_iteration, episode=episode, first_sample_id=consumed_samples,
                      metrics=metrics)

    def evaluate(self, ctx: RunContext, episode: int, clock: StageClock) -> tuple[dict[int, RefBox], dict[str, float]]:
        """The evaluator flow on the eval set, on the weights episode ``episode`` trained (-1: before training):
        every node's result, and the mode's eval metrics."""
        flow = self.spec.plan.evaluator
        replicas = len(ctx.actors.names[flow.producer.model])
        prompts = [(r, idx, None) for r, idx in eval_prompt_batches(ctx.eval_dataset_size,
                                                                   self.spec.generation_batch_size, replicas)]
        batches = Batches(len(prompts), 0, prompts, is_eval=True, episode_start=0)
        # pipelined: on the weights this episode trained, while the next episodes generate on older ones
        with self.weights.turn(flow.producer.model, episode + 1, clock):
            return self._evaluate(ctx, flow, batches, clock)

    def routes_to_sync(self, due: list[SyncRoute]) -> list[SyncRoute]:
        """Of the weight routes due after training, those the sync stage copies now (not the policy's, when its
        weights go by published versions)."""
        return self.weights.routes(due)

    def publish(self, episode: int, clock: StageClock) -> list[str]:
        """After episode ``episode`` trained and synced: the trainer's weights the next episodes generate on."""
        return self.weights.publish(episode, clock)

    # ---- what the modes change ----

    def _version(self, episode: int) -> int | None:
        """The weights version episode ``episode`` generates on, when samples are tagged with it."""
        return self.weights.version(episode)

    def _batches(self, episode: int, prompts: list[tuple[int, list[int], list[int]]], first_iteration: int,
                 consumed_samples: int, version: int | None, replicas: int) -> Batches:
        return Batches(len(prompts), first_iteration, prompts, episode_start=consumed_samples,
                       policy_version=version)

    def _answered(self, ctx: RunContext, episode: int, flow: ComputeFlow, refs: list[Any], batches: Batches,
                  clock: StageClock) -> tuple[list[Any], dict[str, float]]:
        """What goes on to scoring of the producer's answers, and the mode's metrics of the episode."""
        return refs, {}

    def _evaluate(self, ctx: RunContext, flow: ComputeFlow, batches: Batches,
                  clock: StageClock) -> tuple[dict[int, RefBox], dict[str, float]]:
        return ctx.calls.run(ctx, flow, list(range(len(flow.nodes))), {}, batches, clock), {}
