"""How the driver calls a model: one rank (`ModelHandle`), a replica of several ranks called as one
(`ReplicaHandle`, returning a `Call`), and `RefBox`, which carries ObjectRefs between tasks.

`RefBox` carries ObjectRefs between tasks without a task runner resolving them (RayTaskRunner `ray.get`s every
bare ObjectRef it finds in task parameters, which would drag rollouts through every task process; the episode's
thread-pool runner would not, but a boxed ref reads the same under both). The run's processes and their handles
are `chatlearn.runtime.context.Actors`.

Who owns an episode's batches: the driver (the flow process), whatever the engine. Ray makes the caller the owner
of a call's return values, so a call whose result is a batch (`BATCH_METHODS`, a flow step, the StreamDataset's
samples) returns it as a return value of its own, beside a small ``done`` value the stage waits on (two returns):
the batch stays in the object store where it was made and the driver never fetches it, only the next calls
do. An object dies with its owner: a batch the model process put itself died with that process, and a ref that
crossed workers which then exited could be freed while still in use (ray-project/ray#18456, seen once in CI).
Owned by the driver, which holds its ref until the episode ends and makes every call that reads it, a batch
outlives the process that made it and never crosses a worker on its way (tests/test_engine_runs.py).
"""

from typing import Any


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
