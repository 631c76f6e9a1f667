"""Prefect events a run emits, for automations to act on (notify, pause a deployment, start an eval).

* ``chatlearn.episode.completed``: after each episode's row, with the episode (counted from 1), its metrics and
  its model checkpoints (empty when the episode saved none);
* ``chatlearn.run.stalled``: once for an episode that has taken more than ``runtime.stall_factor`` times the
  median of the run's episodes so far (after three of them), while it is still running (`StallWatch`).

Their resource is the run, ``chatlearn.run.<exp_name>`` (a deployment's runs: ``chatlearn.run.<deployment>-*``),
labelled with its run directory; the train flow run and its deployment are related resources. They go through
the run's API link, so an API that is away costs them, never the run (`chatlearn.runtime.prefect.api_link`).
"""

import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect.events import emit_event

from chatlearn.runtime.prefect import api_link

__all__ = ["COMPLETED", "STALLED", "StallWatch", "emit", "related_runs", "run_resource"]

COMPLETED = "chatlearn.episode.completed"
STALLED = "chatlearn.run.stalled"


def run_resource(exp_name: str, run_dir: str) -> dict[str, str]:
    return {"prefect.resource.id": f"chatlearn.run.{exp_name}", "prefect.resource.name": exp_name,
            "chatlearn.run-dir": os.path.abspath(run_dir)}


def related_runs(flow_run: Any) -> list[dict[str, str]]:
    """The resources an event of the run names as related: its train flow run (``flow_run``, None outside one)
    and the deployment that started it, if one did (what an automation of that deployment matches)."""
    if flow_run is None:
        return []
    related = [{"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.role": "flow-run"}]
    if getattr(flow_run, "deployment_id", None):
        related.append({"prefect.resource.id": f"prefect.deployment.{flow_run.deployment_id}",
                        "prefect.resource.role": "deployment"})
    return related


def emit(event: str, resource: dict[str, str], payload: dict[str, Any], related: list[dict[str, str]]) -> None:
    """``event`` about ``resource``, sent in the background."""
    api_link.post(emit_event, event=event, resource=resource, payload=payload, related=related)


class StallWatch:
    """Calls ``stalled(episode, seconds, median)`` once for an episode whose time so far passes ``factor`` times
    the median of the episodes before it (three at least; ``factor`` 0: never), checking every ``every`` s from a
    thread of its own. `episode_done` gives it each episode's time as the run records it."""

    def __init__(self, factor: float, stalled: Callable[[int, float, float], None], first: int,
                 every: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.factor, self.stalled, self.every, self.clock = factor, stalled, every, clock
        self.episode, self.started = first, clock()
        self.seconds: list[float] = []
        self.warned: set[int] = set()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="chatlearn-stall-watch", daemon=True) \
            if factor > 0 else None
        if self._thread is not None:
            self._thread.start()

    def episode_done(self, episode: int, seconds: float) -> None:
        with self._lock:
            self.seconds.append(seconds)
            self.episode, self.started = episode + 1, self.clock()

    def check(self) -> None:
        """Whether the running episode has stalled, now (the thread calls it every ``every`` s)."""
        with self._lock:
            if self.factor <= 0 or len(self.seconds) < 3 or self.episode in self.warned:
                return
            median = statistics.median(self.seconds)
            elapsed = self.clock() - self.started
            if elapsed <= self.factor * median:
                return
            self.warned.add(self.episode)
            episode = self.episode
        self.stalled(episode, elapsed, median)

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._done.wait(self.every):
            self.check()
