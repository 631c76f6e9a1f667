"""Pipelined episodes (``runtime.max_staleness`` k > 0): the generation of the next k episodes runs while this one
scores and trains, each episode still a subflow run of its own.

The train flow hands episode E to `Pipeline.run`. By then episodes E+1 .. E+k have been started, each in a
thread of its own with its own subflow run: it generates at once (on the weights of version
``max(0, E - k)``, `chatlearn.runtime.weights.versions`) and then waits at its `EpisodeGate` until the episode
before it is done, so scoring, training, syncing, checkpointing and eval stay one episode after another, in the
order of the synchronous run. What may overlap is fixed by the config, not by timing:

* the generation of episode E starts once E-1's generation is done (the policy's calls stay in episode order)
  and the weights it needs are published (the sync stage of episode E-k-1);
* everything after generation starts once episode E-1 is committed by the train flow (its gate opens).

So the same config gives the same rows, and a re-run after a crash regenerates what was in flight exactly.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
from collections.abc import Callable
from typing import Any

from chatlearn.data.sampler import episode_generation_batches
from chatlearn.runtime.calls.handles import RunHandle
from chatlearn.runtime.calls.stopping import Stopped, stop_signal, stopping
from chatlearn.runtime.weights.versions import generation_version

_POLL_S = 0.2


class PipelineStopped(Exception):
    """An episode started ahead is given up: an earlier one failed or the run stops."""


class EpisodeGate:
    """Where an episode started ahead waits after generating: `open` (with the trainer iteration the episode
    starts from) once the episode before it is done. Synchronous episodes get one open from the start."""

    def __init__(self, start_iteration: int | None = None) -> None:
        self._open = threading.Event()
        self._generated = threading.Event()
        self._given_up: str | None = None
        self.start_iteration = start_iteration
        if start_iteration is not None:
            self._open.set()

    def __repr__(self) -> str:  # what the subflow's parameters show
        return f"EpisodeGate(start_iteration={self.start_iteration})"

    def __reduce__(self) -> tuple:
        # the flow run's context goes to the Prefect tasks on Ray (rule rewards) with its parameters: there it is
        # only its description (it holds threading events, which do not pickle)
        return str, (repr(self),)

    def open(self, start_iteration: int) -> None:
        self.start_iteration = start_iteration
        self._open.set()

    def give_up(self, why: str) -> None:
        self._given_up = why
        self._open.set()
        self._generated.set()

    def wait(self) -> int:
        """The trainer iteration to start from, once the gate opens (the stop check every `_POLL_S`)."""
        _wait(self._open)
        if self._given_up is not None:
            raise PipelineStopped(self._given_up)
        assert self.start_iteration is not None
        return self.start_iteration

    def generated(self) -> None:
        """The episode's generation is done: the next episode may generate."""
        self._generated.set()

    def wait_generated(self) -> None:
        _wait(self._generated)
        if self._given_up is not None:
            raise PipelineStopped(self._given_up)

    def given_up(self) -> PipelineStopped | None:
        return PipelineStopped(self._given_up) if self._given_up is not None else None


def _wait(event: threading.Event) -> None:
    while not event.wait(_POLL_S):
        if stopping():
            raise Stopped(stop_signal() or "SIGTERM")


class Pipeline:
    """Episodes from ``first`` to ``num_episode - 1``, up to ``run.max_staleness`` ahead of the one the train flow
    is on. ``call(episode, parameters, next_episode)`` runs one episode's subflow (`Subflows`); ``prepare(episode)``
    has its flow run created in the background (`Subflows.prepare`), one episode before it may start."""

    def __init__(self, call: Callable[[int, dict[str, Any], int | None], Any], run: RunHandle, first: int,
                 num_episode: int, consumed_samples: int, prepare: Callable[[int], None] | None = None) -> None:
        self.call, self.run_handle, self.num_episode = call, run, num_episode
        self.prepare = prepare
        self.k = run.max_staleness
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.k + 1, thread_name_prefix="episode")
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._gates: dict[int, EpisodeGate] = {}
        self._consumed = {first: consumed_samples}

    def consumed_before(self, episode: int) -> int:
        """Samples consumed before ``episode``: the sampler's own arithmetic, so an episode started ahead reads
        the prompts the synchronous run would."""
        while episode not in self._consumed:
            last = max(self._consumed)
            r = self.run_handle
            replicas = len(r.actors[r.plan.producer])
            batches = episode_generation_batches(r.dataset_size, self._consumed[last], r.sample_per_episode,
                                                 r.generation_batch_size, replicas, r.shuffle_seed, r.group_size)
            self._consumed[last + 1] = self._consumed[last] + sum(len(idx) for _, idx, _ in batches)
        return self._consumed[episode]

    def run(self, episode: int, start_iteration: int) -> Any:
        """Episode ``episode`` to its end (its metrics), the next ones started ahead."""
        if self.prepare is not None:  # their records, one episode further ahead: ready when they may start
            for e in range(episode, min(episode + self.k + 1, self.num_episode - 1) + 1):
                self.prepare(e)
        for e in range(episode, min(episode + self.k, self.num_episode - 1) + 1):
            if e not in self._futures:
                self._start(e)
        self._gates[episode].open(start_iteration)
        future = self._futures.pop(episode)
        while True:
            try:
                result = future.result(timeout=_POLL_S)
                break
            except concurrent.futures.TimeoutError:
                if stopping():
                    raise Stopped(stop_signal() or "SIGTERM") from None
        self._gates.pop(episode)
        return result

    def _start(self, episode: int) -> None:
        gate = self._gates[episode] = EpisodeGate()
        before = self._gates.get(episode - 1)
        parameters = {"run": self.run_handle, "episode": episode,
                      "consumed_samples": self.consumed_before(episode), "start_iteration": None, "gate": gate}
        next_episode = episode + 1 if episode + 1 < self.num_episode else None
        ctx = contextvars.copy_context()  # the train flow run's context: the subflow records under it
        self._futures[episode] = self._pool.submit(ctx.run, self._episode, episode, before, parameters, next_episode)

    def _episode(self, episode: int, before: EpisodeGate | None, parameters: dict[str, Any],
                 next_episode: int | None) -> Any:
        gate: EpisodeGate = parameters["gate"]
        if before is not None:
            before.wait_generated()  # the policy's calls in episode order
        self.run_handle.versions.wait_for(generation_version(episode, self.k), f"episode {episode + 1}, generate",
                                          given_up=gate.given_up)
        if (exc := gate.given_up()) is not None:
            raise exc
        return self.call(episode, parameters, next_episode)

    def close(self, why: str = "the run stopped") -> None:
        """Give up the episodes started ahead and wait for their threads (their calls end or fail)."""
        for gate in self._gates.values():
            gate.give_up(why)
        for future in self._futures.values():
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - given up: what it raised is the earlier failure's echo
                pass
        self._pool.shutdown(wait=True)
        self._futures.clear()
        self._gates.clear()
