"""How the driver waits for its Ray calls: bounded by `runtime.stage_timeout_s`, and interruptible by a stop.

A bare `ray.get` blocks until the result is there: a stuck model (a deadlocked collective, a hook that never
returns) hangs the run forever, and a SIGTERM only lands when the call returns. `StageClock.get` waits in
short slices instead; past the stage's deadline it cancels what is still running and raises a RunError
naming the episode, the stage and the models that did not answer; after a stop signal it raises `Stopped`, and
once the Ray head went away what `chatlearn.runtime.calls.recovery.check_head` raises.
It waits on every rank of a replica call (a `Call`), so a failed or stuck rank other than 0 is seen too.
This is the driver's one way to wait for its actors (tests/test_layers.py checks no other `ray.get` in the
driver goes without a timeout).
"""

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import ray

from chatlearn.runtime.calls.handles import Call
from chatlearn.runtime.calls.recovery import check_head
from chatlearn.runtime.calls.stopping import Stopped, stop_signal, stopping
from chatlearn.utils.errors import RunError

_SLICE_S = 0.5  # how often a waiting stage looks at the clock and the stop flag


class StageTimeout(RunError):
    """A stage ran past `runtime.stage_timeout_s`."""


class StageClock:
    """The deadline of one stage of one episode (``episode`` -1: a step outside episodes, e.g. ``setup``);
    ``get`` is `ray.get` bounded by it. ``seconds()`` is the time since the stage started."""

    def __init__(self, stage: str, episode: int, timeout_s: float | None) -> None:
        self.stage, self.episode, self.timeout_s = stage, episode, timeout_s
        self.start = time.monotonic()
        self.deadline = self.start + timeout_s if timeout_s else None

    def seconds(self) -> float:
        return time.monotonic() - self.start

    def get(self, calls: Any, models: str | Sequence[str] | None = None) -> Any:
        """The results of ``calls``: one or a list of replica `Call`s (rank 0's result each; every rank waited
        for) or ObjectRefs. Raises StageTimeout past the deadline, naming ``models`` (one name for all, one
        per call; default: each Call's model) and Stopped after a stop signal."""
        single = not isinstance(calls, list | tuple)
        every = [calls] if single else list(calls)
        if isinstance(models, str):
            names = [models] * len(every)
        elif models is None:
            names = [c.model if isinstance(c, Call) else None for c in every]
        else:
            names = list(models)
        groups = [c.refs if isinstance(c, Call) else [c] for c in every]
        flat = [r for g in groups for r in g]
        owner = {r: n for g, n in zip(groups, names, strict=True) for r in g}
        pending = flat
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_SLICE_S, fetch_local=False)
            if not pending:
                break
            if stopping():
                raise Stopped(stop_signal() or "SIGTERM")
            check_head(self.episode)
            if self.deadline is not None and time.monotonic() > self.deadline:
                waiting = sorted({owner[r] for r in pending if owner[r]})
                for ref in pending:
                    with contextlib.suppress(Exception):
                        ray.cancel(ref)
                who = f" from {', '.join(waiting)}" if waiting else ""
                where = f"episode {self.episode + 1}, {self.stage}" if self.episode >= 0 else self.stage
                raise StageTimeout(f"{where}: no result after {self.timeout_s:g} s"
                                   f"{who} (runtime.stage_timeout_s); the model is stuck or the limit is too low")
        # everything is done: this only fetches (a rank's error raises here); the slack covers a slow transfer
        left = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0) + 60.0
        values = ray.get(flat, timeout=left)
        firsts, i = [], 0
        for g in groups:
            firsts.append(values[i])
            i += len(g)
        return firsts[0] if single else firsts


def fetch(value: Any, timeout_s: float | None) -> Any:
    """Inside a model process: an upstream result handed over as a ref nested in the arguments (Ray resolves
    only top-level refs), fetched within the stage's limit (`runtime.stage_timeout_s`), so a producer that
    never answers fails this call instead of holding its process past the driver's deadline."""
    return ray.get(value, timeout=timeout_s) if isinstance(value, ray.ObjectRef) else value


# Steps outside an episode (loading a large model in `setup`, exporting it) may take longer than a stage
# limit tuned for the episodes; they get at least this much.
MIN_STEP_TIMEOUT_S = 600.0


def wait(calls: Any, step: str, timeout_s: float | None, models: str | Sequence[str] | None = None) -> Any:
    """`StageClock.get` for one step of the driver outside an episode (``setup``, ``resume``, ``export``):
    the stop check, every rank waited for, and the deadline `runtime.stage_timeout_s`, but at least
    `MIN_STEP_TIMEOUT_S`."""
    return StageClock(step, -1, max(timeout_s, MIN_STEP_TIMEOUT_S) if timeout_s else None).get(calls, models)
