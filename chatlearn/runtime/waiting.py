"""How a stage waits for its Ray calls: bounded by `runtime.stage_timeout_s`, and interruptible by a stop.

A bare `ray.get` blocks until the result is there: a stuck model (a deadlocked collective, a hook that never
returns) hangs the run forever, and a SIGTERM only lands when the call returns. `StageClock.get` waits in
short slices instead; past the stage's deadline it cancels what is still running and raises a RunError
naming the episode, the stage and the models that did not answer; after a stop signal it raises `Stopped`.
"""

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import ray

from chatlearn.runtime.stopping import Stopped, stop_signal, stopping
from chatlearn.utils.errors import RunError

_SLICE_S = 0.5  # how often a waiting stage looks at the clock and the stop flag


class StageTimeout(RunError):
    """A stage ran past `runtime.stage_timeout_s`."""


class StageClock:
    """The deadline of one stage of one episode; ``get`` is `ray.get` bounded by it."""

    def __init__(self, stage: str, episode: int, timeout_s: float | None) -> None:
        self.stage, self.episode, self.timeout_s = stage, episode, timeout_s
        self.deadline = time.monotonic() + timeout_s if timeout_s else None

    def get(self, refs: Any, models: str | Sequence[str] | None = None) -> Any:
        """``ray.get(refs)`` (one ref or a list), raising StageTimeout past the deadline (naming ``models``:
        one name for all refs, or one per ref) and Stopped after a stop signal."""
        single = not isinstance(refs, list | tuple)
        every = [refs] if single else list(refs)
        names = [models] * len(every) if isinstance(models, str) or models is None else list(models)
        pending = every
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_SLICE_S, fetch_local=False)
            if not pending:
                break
            if stopping():
                raise Stopped(stop_signal() or "SIGTERM")
            if self.deadline is not None and time.monotonic() > self.deadline:
                waiting = sorted({n for r, n in zip(every, names, strict=True) if r in pending and n})
                for ref in pending:
                    with contextlib.suppress(Exception):
                        ray.cancel(ref)
                who = f" from {', '.join(waiting)}" if waiting else ""
                where = f"episode {self.episode + 1}, {self.stage}" if self.episode >= 0 else self.stage
                raise StageTimeout(f"{where}: no result after {self.timeout_s:g} s"
                                   f"{who} (runtime.stage_timeout_s); the model is stuck or the limit is too low")
        return ray.get(refs)
