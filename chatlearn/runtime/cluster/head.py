"""The Ray head going away mid-run: noticed within seconds, before Ray's own client ends the driver.

When the GCS (the head's control store) stops answering, Ray's C++ client in the driver waits
``gcs_rpc_server_reconnect_timeout_s`` (60 s unless ``RAY_gcs_rpc_server_reconnect_timeout_s`` says otherwise)
and then ends the process ("Failed to connect to GCS within 60 seconds ... The program will terminate"): exit
1, no line of ours, the Prefect server the run started and Ray's agents left running, the flow run left
Running. Calls to the actors go straight to their processes and keep working meanwhile, but a GCS call
(``ray.get_actor``, ``ray.nodes``, removing a placement group) never returns, and one still waiting keeps the
old client and its timer alive after ``ray.shutdown()``: the process is ended 60 s after the GCS died even on a
fresh Ray (measured with Ray 2.60). With no GCS call left waiting, ``ray.shutdown()`` and a new ``ray.init``
in the same process work, and the process lives on.

So `HeadWatch` runs a thread for as long as the run's actors exist:

* a local Ray the run started (``local``): the driver is the parent of its GCS server and raylet, so their exit
  is seen within `POLL_S`. The rest of that Ray (raylet, agents, workers) is killed at once (`reaper.end`):
  every call to the actors fails, nothing of the dead Ray outlives it, and the train flow starts a fresh local
  Ray and resumes from the last checkpoint as for a lost model process (`chatlearn.runtime.calls.recovery`,
  ``runtime.max_restarts``).
* a cluster joined through ``RAY_ADDRESS`` (or a Ray the caller started): the GCS is pinged every `POLL_S`;
  silent for `grace_s` (half of Ray's reconnect window: a head that GCS fault tolerance brings back sooner is
  ridden out, and the other half is left to end cleanly), the head is gone. The run ends with `RayHeadGone`:
  one line naming the address, the flow run Crashed; the run's actors are asked to exit by a call of their own
  (no GCS needed), after the call they are in; a re-run resumes from the last checkpoint.

Once the head is gone the driver makes no GCS call: its waits for the actors raise within half a second
(`chatlearn.runtime.calls.waiting`, which asks the watch through `chatlearn.runtime.calls.recovery`), it finds
its actors through its own handles (`chatlearn.runtime.context.Actors`), and `launch` skips its GCS teardown.
"""

import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ray

from chatlearn.runtime.calls import recovery
from chatlearn.runtime.cluster import ray_private, reaper
from chatlearn.utils.errors import RunCrashed

POLL_S = 0.5  # how often the head is looked at
PING_TIMEOUT_S = 1.0  # a joined cluster's GCS ping
RECONNECT_VAR = "RAY_gcs_rpc_server_reconnect_timeout_s"
RAY_RECONNECT_S = 60.0  # Ray's default for it


class RayHeadGone(RunCrashed):
    """The head of the Ray cluster the run joined went away: the run ends (Prefect: Crashed); a re-run resumes."""


def reconnect_window_s() -> float:
    """How long Ray's client in this process waits for a silent GCS before it ends the process."""
    try:
        return float(os.environ.get(RECONNECT_VAR, RAY_RECONNECT_S))
    except ValueError:
        return RAY_RECONNECT_S


def grace_s() -> float:
    """How long a joined cluster's GCS may stay silent before its head counts as gone."""
    return max(POLL_S, reconnect_window_s() / 2)


@dataclass(frozen=True)
class Gone:
    """How the head went: ``local`` (a Ray the run started), its ``address``, and ``what`` was seen."""

    local: bool
    address: str
    what: str


def _exit_text(code: int) -> str:
    if code < 0:
        with_name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return f"killed by {with_name}"
    return f"exited with status {code}"


class HeadWatch:
    """Watches the head of the Ray this process is connected to, until `close` (see the module docstring)."""

    def __init__(self, local: bool) -> None:
        self.local = local
        self.gone: Gone | None = None
        self.address = ray.get_runtime_context().gcs_address
        self._vital: dict[str, Any] = {}
        self._roots: list[int] = []
        if local:  # the processes a local Ray cannot live without, and every process it started
            processes = ray_private.local_ray_processes()
            self._vital = {name: processes[name][0] for name in ("gcs_server", "raylet")}
            self._roots = local_ray_pids()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="chatlearn-head-watch", daemon=True)
        recovery.WATCHES.append(self)
        self._thread.start()

    def _watch(self) -> None:
        answered = time.monotonic()
        while not self._closed.wait(POLL_S):
            if self.local:
                for name, proc in self._vital.items():
                    code = proc.poll()
                    if code is not None:
                        self._lose(f"its {name}, pid {proc.pid}, {_exit_text(code)}")
                        return
            elif _gcs_answers():
                answered = time.monotonic()
            elif time.monotonic() - answered > grace_s():
                self._lose(f"its GCS has not answered for {grace_s():g} s")
                return

    def _lose(self, what: str) -> None:
        if self.local and reaper.supported():  # what is left of that Ray (raylet, agents, workers) goes now
            reaper.end(reaper.descendants(self._roots))
        self.gone = Gone(self.local, self.address, what)

    def end_actors(self, actors: Iterable[Any]) -> None:
        """With the head gone: ask the run's actors on a joined cluster to exit, by a call of their own (`ray.kill`
        goes through the GCS); they exit after the call they are in. A local Ray's went with it."""
        if self.local:
            return
        for actor in actors:
            try:
                actor.__ray_terminate__.remote()
            except Exception:  # gone already
                pass

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=PING_TIMEOUT_S + POLL_S + 1)
        if self in recovery.WATCHES:
            recovery.WATCHES.remove(self)


def local_ray_pids() -> list[int]:
    """The processes `ray.init` started for the local Ray of this driver (GCS server, raylet, monitors)."""
    return [proc.pid for procs in ray_private.local_ray_processes().values() for proc in procs if proc]


def _gcs_answers() -> bool:
    try:
        ray_private.check_gcs_alive(timeout=PING_TIMEOUT_S)
        return True
    except Exception:  # RpcError: unavailable or timed out
        return False
