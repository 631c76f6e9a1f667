"""What the episode tasks need to find the run's actors and to know what is due: names and a few numbers.

Prefect serializes flow parameters to JSON for its API, so the episode subflow gets a small, readable
`RunHandle` (namespace, actor names, dataset sizes, the plan, and the handful of config numbers the stage
tasks read) and each task looks its actors up by name; no task carries the whole config.
`RefBox` carries ObjectRefs between tasks without a task runner resolving them (RayTaskRunner `ray.get`s every
bare ObjectRef it finds in task parameters, which would drag rollouts through every task process; the episode's
thread-pool runner would not, but a boxed ref reads the same under both).
"""

from typing import Any

import ray
from pydantic import BaseModel, Field

from chatlearn.models.rule import RuleSpec
from chatlearn.runtime.plan import EpisodePlan
from chatlearn.runtime.weights.sync import SyncRoute


class RunHandle(BaseModel):
    namespace: str
    actors: dict[str, list[list[str]]]
    plan: EpisodePlan
    dataset_size: int
    eval_dataset_size: int = 0
    run_dir: str
    exp_name: str
    data_checkpoint_path: str = ""
    stream_actor: str = ""
    # the config numbers the stage tasks read
    sample_per_episode: int = Field(description="runtime.sample_per_episode")
    generation_batch_size: int = Field(description="the producer's generation batch size")
    shuffle_seed: int | None = Field(None, description="seed of the prompt order (None: file order)")
    group_size: int = Field(1, description="responses per prompt (the producer's num_inference_per_prompt)")
    sync_frequency: dict[str, int] = Field(default_factory=dict, description="per model receiving weights")
    save_episode_interval: int | None = None
    num_episode: int = Field(0, description="runtime.num_episode (the last episode always checkpoints)")
    eval_episode_interval: int = 0
    checkpoint_models: list[str] = Field(default_factory=list, description="models that save checkpoints")
    eval_post_process_fn: str | None = None
    placement: list[dict[str, Any]] = Field(default_factory=list, description="one row per worker process")
    rule_rewards: dict[str, RuleSpec] = Field(default_factory=dict, description="rule rewards scored one "
                                              "Prefect task per batch on Ray (flows/rule_tasks.py)")
    sync_routes: list[SyncRoute] = Field(default_factory=list, description="trainer -> inference weight routes")
    concurrent_comm: bool = True
    param_sync_max_workers: int | None = None
    stage_timeout_s: float | None = Field(None, description="runtime.stage_timeout_s (chatlearn.runtime.calls.waiting)")
    # the flows' steps (functions of the driver, run as Ray tasks): not sent to the Prefect API
    steps: dict[str, Any] = Field(default_factory=dict, exclude=True)

    def actor(self, process: str) -> Any:
        """A worker process of the run, by name."""
        return ray.get_actor(process, namespace=self.namespace)

    def stream(self) -> Any:
        """The run's StreamDataset actor."""
        return ray.get_actor(self.stream_actor, namespace=self.namespace)

    def heads(self, model: str) -> list["ReplicaHandle"]:
        """Every replica of `model`, called as one (all its ranks get each call; rank 0's result is returned)."""
        return [ReplicaHandle([self._handle(model, n) for n in rep]) for rep in self.actors[model]]

    def all_actors(self, model: str) -> list["ModelHandle"]:
        """Every rank of every replica of `model`."""
        return [self._handle(model, n) for rep in self.actors[model] for n in rep]

    def _handle(self, model: str, process: str) -> "ModelHandle":
        return ModelHandle(ray.get_actor(process, namespace=self.namespace), model, process)


class ModelHandle:
    """One rank of one model, inside a worker process that may host other models too.

    ``handle.generate.remote(...)`` runs ``generate`` of this model's host in that process, so dispatch code
    reads as if every model rank were its own actor. ``process`` names the worker: two handles with the same
    process are colocated in one process (parameter sync between them is an in-process copy).
    """

    def __init__(self, actor: Any, model: str, process: str):
        self.actor, self.model, self.process = actor, model, process

    def __getattr__(self, method: str) -> "_ModelMethod":
        if method.startswith("_"):
            raise AttributeError(method)
        return _ModelMethod(self.actor, self.model, method)

    def __repr__(self) -> str:
        return f"ModelHandle({self.model} in {self.process})"


class Call:
    """One call of one model replica: the ObjectRef of every rank (a replica of several processes runs each
    call on all its ranks together). ``ref`` is rank 0's, the replica's result; a stage waits on all of them
    (`StageClock.get`), so a rank that failed or hangs is seen within the stage's deadline. Passed as an
    argument of another replica call, a Call stands for its result (``ref``)."""

    __slots__ = ("model", "refs")

    def __init__(self, model: str, refs: list[Any]):
        self.model, self.refs = model, refs

    @property
    def ref(self) -> Any:
        return self.refs[0]

    def __repr__(self) -> str:
        return f"Call({self.model}, {len(self.refs)} ranks)"


def _ref_of(value: Any) -> Any:
    return value.ref if isinstance(value, Call) else value


class ReplicaHandle:
    """All ranks of one model replica, called as one: ``replica.train.remote(...)`` sends the call to every
    rank (a replica of several processes runs it together: DDP, FSDP2, tensor parallel) and returns a
    :class:`Call` holding every rank's ObjectRef."""

    def __init__(self, ranks: list[ModelHandle]):
        self.ranks = ranks
        self.actor, self.model, self.process = ranks[0].actor, ranks[0].model, ranks[0].process

    def __getattr__(self, method: str) -> "_ReplicaMethod":
        if method.startswith("_"):
            raise AttributeError(method)
        return _ReplicaMethod(self.ranks, method)

    def __repr__(self) -> str:
        return f"ReplicaHandle({self.model} in {','.join(r.process for r in self.ranks)})"


class _ReplicaMethod:
    def __init__(self, ranks: list[ModelHandle], method: str):
        self.ranks, self.method = ranks, method

    def remote(self, *args: Any, **kwargs: Any) -> Call:
        args = tuple(_ref_of(a) for a in args)
        kwargs = {k: _ref_of(v) for k, v in kwargs.items()}
        return Call(self.ranks[0].model, [getattr(r, self.method).remote(*args, **kwargs) for r in self.ranks])


class _ModelMethod:
    def __init__(self, actor: Any, model: str, method: str):
        self.actor, self.model, self.method = actor, model, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.actor.run.remote(self.model, self.method, *args, **kwargs)


class RefBox:
    """An opaque holder of ObjectRefs (plus small metadata) that task runners pass through untouched."""

    def __init__(self, refs: list[Any], **meta: Any):
        self.refs = refs
        self.meta = meta

    def __len__(self) -> int:
        return len(self.refs)

    def __repr__(self) -> str:
        return f"RefBox({len(self.refs)} refs, {self.meta})"
