"""Multi-turn rollouts (``runtime.task_type: agent``): the policy's turns and the environment's steps, alternating.

After the policy's first answers (the producer's call, as in a single-turn episode), each batch's environments
step on them (one ``env-step`` task run per batch and turn on Ray, ``FlowCalls.step_envs``). The conversations
that go on are continued by the policy from their exact token ids (the producer's call again, on the batch of
those samples), and so on until each ended (`chatlearn.envs.turns`). A batch keeps its conversations together
from turn to turn, so it stays on one replica and its environments travel with it. The ended conversations, in
sample order, are the rollouts the score stage reads; the evaluator's other calls score the eval conversations.
"""

import time
from typing import Any

import ray

from chatlearn.data.batch import collate_samples
from chatlearn.envs.turns import TurnSpec
from chatlearn.runtime.calls.dispatch import Batches
from chatlearn.runtime.calls.handles import RefBox
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.runtime.compute_flow import ComputeFlow
from chatlearn.runtime.context import RunContext
from chatlearn.runtime.rollout.base import Rollout
from chatlearn.utils.faults import crash_point

__all__ = ["MultiTurn"]


class MultiTurn(Rollout):
    """Conversations of several turns with an environment (the module's doc)."""

    name = "multi_turn"

    def _answered(self, ctx: RunContext, episode: int, flow: ComputeFlow, refs: list[Any], batches: Batches,
                  clock: StageClock) -> tuple[list[Any], dict[str, float]]:
        return self._conversations(ctx, flow, refs, batches, clock)

    def _evaluate(self, ctx: RunContext, flow: ComputeFlow, batches: Batches,
                  clock: StageClock) -> tuple[dict[int, RefBox], dict[str, float]]:
        # the conversations end before the evaluator's other calls score them
        first = ctx.calls.run(ctx, flow, [0], {}, batches, clock)[0].refs
        refs, agent = self._conversations(ctx, flow, first, batches, clock, is_eval=True)
        done = ctx.calls.run(ctx, flow, list(range(1, len(flow.nodes))), {0: RefBox(refs)},
                             Batches(len(refs), 0, is_eval=True, episode_start=0), clock)
        return done, {f"eval_{k}": agent[k] for k in ("turns_mean", "tool_calls_mean", "tool_errors")}

    def _conversations(self, ctx: RunContext, flow: ComputeFlow, first: list[Any], batches: Batches,
                       clock: StageClock, is_eval: bool = False) -> tuple[list[Any], dict[str, float]]:
        """Go on from the producer's first answers (``first``, one ref per batch of ``batches``) until every
        conversation ended. Returns the ended conversations as batches (refs, in sample order, batches of the
        generation batch size) and the episode's agent metrics."""
        spec: TurnSpec = self.spec.agent
        t0 = time.perf_counter()
        refs, envs, replicas = list(first), [None] * len(first), [r for r, _, _ in batches.prompts]
        ended: list[dict[str, Any]] = []
        env_seconds = 0.0
        for turn in range(1, spec.max_turns + 1):
            s0 = time.perf_counter()
            results = ctx.calls.step_envs(spec, refs, envs, turn, is_eval, clock)
            env_seconds += time.perf_counter() - s0
            ended += [s for r in results for s in r.ended]
            if not is_eval:  # for resume tests: dies between two turns of the episode's conversations
                crash_point(f"agent_turn_{turn}", clock.episode)
            live = [(replicas[i], r) for i, r in enumerate(results) if r.going]
            if not live:
                break
            # the policy continues each batch's live conversations on the replica that began them
            prompts = [(replica, [], [s["sample_id"] for s in r.going]) for replica, r in live]
            rounds = [{"continued": ray.put(r.going)} for _, r in live]
            iteration = batches.first_iteration + turn * max(1, batches.count)
            more = Batches(len(prompts), iteration, prompts, is_eval=is_eval, episode_start=batches.episode_start,
                           rounds=rounds)
            refs = ctx.calls.run(ctx, flow, [0], {}, more, clock)[0].refs
            envs = [r.envs for _, r in live]
            replicas = [replica for replica, _ in live]
        ended.sort(key=lambda s: s["sample_id"])
        size = max(1, self.spec.generation_batch_size)
        out = [ray.put(collate_samples(ended[i:i + size], ctx.pad_token_id)) for i in range(0, len(ended), size)]
        n = max(1, len(ended))
        metrics = {"turns_mean": sum(s["turns"] for s in ended) / n,
                   "tool_calls_mean": sum(s["tool_calls"] for s in ended) / n,
                   "tool_errors": float(sum(s["tool_errors"] for s in ended)),
                   "env_reward_mean": sum(s["env_reward"] for s in ended) / n,
                   "env_seconds": env_seconds,  # the environment steps' wall time, the policy's turns apart
                   "agent_seconds": time.perf_counter() - t0}
        return out, metrics
