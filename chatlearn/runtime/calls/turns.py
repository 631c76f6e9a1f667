"""The order in which a stage sends its calls to the model processes.

The calls of a compute flow that do not read each other run at once, each in its own thread (``flows/
model_calls.py``). A replica of several processes needs one order of calls on all its ranks (their collectives
pair up in that order), so a stage sends its calls in the flow's node order: `Turns`.
"""

import threading
import time

from chatlearn.runtime.calls.stopping import Stopped, stop_signal, stopping
from chatlearn.runtime.calls.waiting import StageClock
from chatlearn.utils.errors import RunError


class Turns:
    """The order in which a stage's calls are sent: node ``i`` sends after every earlier node of the stage sent
    (or gave up). `abort` releases every waiter with an error (a call failed; the stage is failing)."""

    def __init__(self, nodes: list[int]):
        self.order = list(nodes)
        self.done: set[int] = set()
        self.aborted = False
        self.cond = threading.Condition()

    def wait(self, node: int, clock: StageClock) -> None:
        earlier = self.order[:self.order.index(node)]
        with self.cond:
            while not self.aborted and not self.done.issuperset(earlier):
                if stopping():
                    raise Stopped(stop_signal() or "SIGTERM")
                if clock.deadline is not None and time.monotonic() > clock.deadline:
                    raise RunError(f"{clock.stage}: an earlier call of the flow did not send its batches before "
                                   "the stage's deadline (runtime.stage_timeout_s)")
                self.cond.wait(0.5)
            if self.aborted:
                raise RunError(f"{clock.stage}: an earlier call of the flow failed")

    def release(self, node: int) -> None:
        with self.cond:
            self.done.add(node)
            self.cond.notify_all()

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def __reduce__(self) -> tuple:
        # a call's task run parameters travel with the Prefect tasks it starts on Ray (a rule reward's): there the
        # turns are their description (a condition variable does not pickle)
        return str, (f"Turns({self.order})",)
