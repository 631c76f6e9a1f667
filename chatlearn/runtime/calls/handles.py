"""What the episode tasks need to find the run's actors and to know what is due: names and a few numbers.

Prefect serializes flow parameters to JSON for its API, so the episode subflow gets a small, readable
`RunHandle` (namespace, actor names, dataset sizes, the plan, and the handful of config numbers the stage
tasks read) and each task looks its actors up by name; no task carries the whole config.
`RefBox` carries ObjectRefs between tasks without a task runner resolving them (RayTaskRunner `ray.get`s every
bare ObjectRef it finds in task parameters, which would drag rollouts through every task process; the episode's
thread-pool runner would not, but a boxed ref reads the same under both).

Who owns an episode's batches: the driver (the flow process), whatever the engine. Ray makes the caller the owner
of a call's return values, so a call whose result is a batch (`BATCH_METHODS`, a flow step, the StreamDataset's
samples) returns it as a return value of its own, beside a small ``done`` value the stage waits on (two returns):
the batch stays in the object store where it was made and the driver never fetches it, only the next calls
do. An object dies with its owner: a batch the model process put itself died with that process, and a ref that
crossed workers which then exited could be freed while still in use (ray-project/ray#18456, seen once in CI).
Owned by the driver, which holds its ref until the episode ends and makes every call that reads it, a batch
outlives the process that made it and never crosses a worker on its way (tests/test_engine_runs.py).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import ray
from pydantic import BaseModel, Field

from chatlearn.envs.turns import TurnSpec
from chatlearn.models.rule import RuleSpec
from chatlearn.runtime.plan import EpisodePlan
from chatlearn.runtime.weights.sync import SyncRoute

# The driver's own handles of the actors `launch` created, by (namespace, name). Looking an actor up by name asks
# the GCS, and a lookup waiting when the GCS goes away never returns (chatlearn.runtime.cluster.head); elsewhere
# (a Ray task given a RunHandle) actors are looked up by name.
_OWN: dict[tuple[str, str], Any] = {}


@contextlib.contextmanager
def own_actors(namespace: str, actors: dict[str, Any]) -> Iterator[None]:
    """Within: the driver finds these actors (name -> handle) by their handles, without asking the GCS."""
    keys = [(namespace, name) for name in actors]
    _OWN.update(zip(keys, actors.values(), strict=True))
    try:
        yield
    finally:
        for key in keys:
            _OWN.pop(key, None)


def get_actor(name: str, namespace: str) -> Any:
    """The actor ``name``: the driver's own handle when it has one, else Ray's lookup by name."""
    own = _OWN.get((namespace, name))
    return own if own is not None else ray.get_actor(name, namespace=namespace)


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
    max_staleness: int = Field(0, description="runtime.max_staleness (pipelined episodes)")
    sampling_rounds: int = Field(1, description="the most generation rounds of an episode: runtime."
                                 "max_sampling_rounds with dynamic_sampling, else 1")
    # pipelined episodes: the policy's weights by version (chatlearn.runtime.weights.versions), in the driver
    versions: Any = Field(None, exclude=True)
    # partial rollouts: the responses in flight by episode (chatlearn.data.partial_rollout), in the driver
    partial: Any = Field(None, exclude=True)
    agent: TurnSpec | None = Field(None, description="task_type: agent: the environment and the turn limits "
                                   "(flows/agent_turns.py)")
    pad_token_id: int = Field(0, description="the producer's pad token (batches the driver collates)")
    # the flows' steps (functions of the driver, run as Ray tasks): not sent to the Prefect API
    steps: dict[str, Any] = Field(default_factory=dict, exclude=True)

    def actor(self, process: str) -> Any:
        """A worker process of the run, by name."""
        return get_actor(process, self.namespace)

    def stream(self) -> Any:
        """The run's StreamDataset actor."""
        return get_actor(self.stream_actor, self.namespace)

    def heads(self, model: str) -> list["ReplicaHandle"]:
        """Every replica of `model`, called as one (all its ranks get each call; rank 0's result is returned)."""
        return [ReplicaHandle([self._handle(model, n) for n in rep]) for rep in self.actors[model]]

    def all_actors(self, model: str) -> list["ModelHandle"]:
        """Every rank of every replica of `model`."""
        return [self._handle(model, n) for rep in self.actors[model] for n in rep]

    def _handle(self, model: str, process: str) -> "ModelHandle":
        return ModelHandle(get_actor(process, self.namespace), model, process)


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


# Model methods whose result is a batch of the episode: returned as an object of its own, owned by the caller
# (`Worker.run_batch`), never fetched by the stage that waits for it
BATCH_METHODS = frozenset({"generate", "forward"})


class Call:
    """One call of one model replica (or of a flow step): the ObjectRef of every rank (a replica of several
    processes runs each call on all its ranks together), which a stage waits on (`StageClock.get`), so a rank
    that failed or hangs is seen within the stage's deadline. For a call that makes a batch these are the ranks'
    small ``done`` values and ``batch`` is rank 0's batch, owned by the caller and left where it was made;
    otherwise ``refs[0]`` is the result. Passed as an argument of another replica call, a Call stands for its
    result (``ref``)."""

    __slots__ = ("batch", "model", "refs")

    def __init__(self, model: str, refs: list[Any], batch: Any = None):
        self.model, self.refs, self.batch = model, refs, batch

    @property
    def ref(self) -> Any:
        return self.batch if self.batch is not None else self.refs[0]

    def __repr__(self) -> str:
        return f"Call({self.model}, {len(self.refs)} ranks{', a batch' if self.batch is not None else ''})"


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
        sent = [getattr(r, self.method).remote(*args, **kwargs) for r in self.ranks]
        if self.method in BATCH_METHODS:  # every rank's (done, batch); rank 0's batch is the replica's
            return Call(self.ranks[0].model, [done for done, _ in sent], batch=sent[0][1])
        return Call(self.ranks[0].model, sent)


class _ModelMethod:
    def __init__(self, actor: Any, model: str, method: str):
        self.actor, self.model, self.method = actor, model, method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """The call's ObjectRef; for a batch method (`BATCH_METHODS`) two: ``done`` and the batch."""
        if self.method in BATCH_METHODS:
            return self.actor.run_batch.remote(self.model, self.method, *args, **kwargs)
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
