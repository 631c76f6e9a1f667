"""What an episode's body receives: the run's spec and everything that lives while the run lives.

`launch` (:mod:`chatlearn.runtime.launch`) builds one `RunContext` per start of the run's actors and the train
flow hands it to every episode explicitly; nothing reaches an episode through a module global or a context
variable. It holds:

* the frozen `RunSpec` (what the config says, :mod:`chatlearn.runtime.spec`);
* the `Actors`: the worker processes by model and replica, with the driver's own handles (looking an actor up
  by name asks the GCS, and a lookup waiting while the GCS is gone never returns: `chatlearn.runtime.cluster.
  head`), and the StreamDataset actor;
* what launch found out: the weight routes, the dataset sizes, the producer's pad token, the placement;
* the rollout strategy chosen for the run (:mod:`chatlearn.runtime.rollout`), which carries what generation
  keeps across episodes (weight versions, responses in flight);
* how the episode runs its calls (`FlowCalls`, implemented by the flows layer) and the flows' steps.
"""

from typing import Any

from chatlearn.runtime.calls.dispatch import FlowCalls
from chatlearn.runtime.calls.handles import ModelHandle, ReplicaHandle
from chatlearn.runtime.compute_flow import Step
from chatlearn.runtime.spec import RunSpec
from chatlearn.runtime.weights.sync import SyncRoute

__all__ = ["Actors", "RunContext"]


class Actors:
    """The run's worker processes: ``names[model][replica]`` are the processes of one replica's ranks, and the
    driver's handle of each process by name (``handles``)."""

    def __init__(self, names: dict[str, list[list[str]]], handles: dict[str, Any]) -> None:
        self.names, self.handles = names, handles

    def __repr__(self) -> str:
        return f"Actors({', '.join(f'{m}: {len(r)} replica(s)' for m, r in self.names.items())})"

    def process(self, name: str) -> Any:
        """A worker process of the run, by name."""
        return self.handles[name]

    def heads(self, model: str) -> list[ReplicaHandle]:
        """Every replica of ``model``, called as one (all its ranks get each call; rank 0's result is returned)."""
        return [ReplicaHandle([ModelHandle(self.handles[n], model, n) for n in rep]) for rep in self.names[model]]

    def ranks(self, model: str) -> list[ModelHandle]:
        """Every rank of every replica of ``model``."""
        return [ModelHandle(self.handles[n], model, n) for rep in self.names[model] for n in rep]

    def every_rank(self) -> list[ModelHandle]:
        """Every rank of every model (a process hosting several colocated models is in it once per model)."""
        return [h for model in self.names for h in self.ranks(model)]

    def processes(self) -> dict[str, Any]:
        """Every worker process by name, once."""
        return {n: self.handles[n] for reps in self.names.values() for rep in reps for n in rep}


class RunContext:
    """One start of a run, as the train flow and its episodes see it (see the module's doc). Its attributes are
    set once, here; what changes from episode to episode lives inside the rollout."""

    # no __dict__: Prefect shows an episode's parameters as JSON, and an object it cannot encode (no fields to
    # walk) is shown as ``<RunContext>`` instead of being walked through its handles
    __slots__ = ("actors", "calls", "dataset_size", "eval_dataset_size", "pad_token_id", "placement", "rollout",
                 "spec", "steps", "stream", "sync_routes")

    def __init__(self, spec: RunSpec, actors: Actors, stream: Any, rollout: Any, calls: FlowCalls,
                 sync_routes: list[SyncRoute] | None = None, steps: dict[str, Step] | None = None,
                 dataset_size: int = 0, eval_dataset_size: int = 0, pad_token_id: int = 0,
                 placement: list[dict[str, Any]] | None = None) -> None:
        self.spec = spec
        self.actors = actors
        self.stream = stream  # the StreamDataset actor
        self.rollout = rollout  # the run's rollout strategy (chatlearn.runtime.rollout.Rollout)
        self.calls = calls
        self.sync_routes = list(sync_routes or [])
        self.steps = dict(steps or {})  # the flows' steps: functions of the driver, run as Ray tasks
        self.dataset_size, self.eval_dataset_size = dataset_size, eval_dataset_size
        self.pad_token_id = pad_token_id  # the producer's (batches the driver collates)
        self.placement = list(placement or [])  # one row per worker process

    def __repr__(self) -> str:
        return f"RunContext({self.spec.runtime.exp_name}, {self.actors!r}, rollout {self.spec.rollout})"

    def as_parameter(self) -> RunSpec:
        """What an episode's flow run shows as its ``ctx`` parameter: the run's spec (JSON), not its handles."""
        return self.spec

    def __reduce__(self) -> tuple:
        # an episode's flow run context travels with the Prefect tasks it starts on Ray (rule rewards, environment
        # steps), its parameters included: there the context is its description (it holds handles and locks)
        return str, (repr(self),)
