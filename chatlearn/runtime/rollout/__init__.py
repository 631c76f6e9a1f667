"""Rollout strategies: what an episode's generation does, one object per run, chosen when the run is launched.

The registry maps a mode's name (`chatlearn.runtime.spec.rollout_mode`: ``single_turn``, ``multi_turn``,
``partial``) to its class; `rollout_for` builds the run's strategy with the policy's weight source (synced, or
published versions in pipelined episodes). Adding a mode is one subclass of `Rollout` registered here; the stages
only call the strategy's methods (:mod:`.base` documents the interface).
"""

from chatlearn.runtime.rollout.base import Rollout
from chatlearn.runtime.rollout.multi_turn import MultiTurn
from chatlearn.runtime.rollout.partial import PartialRollout
from chatlearn.runtime.spec import RunSpec
from chatlearn.runtime.weights.versions import PolicyWeights

__all__ = ["ROLLOUTS", "Rollout", "rollout_for"]

ROLLOUTS: dict[str, type[Rollout]] = {cls.name: cls for cls in (Rollout, MultiTurn, PartialRollout)}


def rollout_for(spec: RunSpec, weights: PolicyWeights) -> Rollout:
    """The run's rollout strategy: the registered class of ``spec.rollout``, generating on ``weights``."""
    try:
        cls = ROLLOUTS[spec.rollout]
    except KeyError:
        raise ValueError(f"unknown rollout strategy {spec.rollout!r}; registered: {sorted(ROLLOUTS)}") from None
    return cls(spec, weights)
