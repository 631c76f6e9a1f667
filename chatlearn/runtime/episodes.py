"""How a run's episodes run: one after another (`Episodes`), or pipelined (`Pipeline`), chosen once at the start
(`episodes_for`). Each episode is a subflow run of its own; the train flow's loop only asks for the next one.

Around each episode, whatever runs it: ChatLearn's episode hooks on every rank (``before_episode``,
``after_episode``), the profiler's ranges (`chatlearn.runtime.records.profiling`), and the episode's own
measurements (wall seconds, the largest process's peak memory, what colocated models handed over).

Pipelined episodes (``runtime.max_staleness`` k > 0): the generation of the next k episodes runs while this one
scores and trains. The train flow hands episode E to `Pipeline.run`. By then episodes E+1 .. E+k have been
started, each in a thread of its own with its own subflow run: it generates at once (on the weights of version
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
import time
from collections.abc import Callable
from typing import Any

from chatlearn.data.sampler import episode_generation_batches
from chatlearn.runtime.calls.stopping import Stopped, stop_signal, stopping
from chatlearn.runtime.calls.waiting import wait
from chatlearn.runtime.context import RunContext
from chatlearn.runtime.records.profiling import EpisodeInstruments
from chatlearn.runtime.weights.versions import generation_version
from chatlearn.utils.faults import crash_point

_POLL_S = 0.2


class PipelineStopped(Exception):
    """An episode started ahead is given up: an earlier one failed or the run stops."""


class EpisodeGate:
    """Where an episode started ahead waits after generating: `open` (with the trainer iteration the episode
    starts from) once the episode before it is done. Synchronous episodes get one open from the start."""

    # no __dict__: an episode's parameters are shown as JSON, and Prefect shows what it cannot walk as ``<EpisodeGate>``
    __slots__ = ("_generated", "_given_up", "_open", "start_iteration")

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


# ``call(episode, parameters, next_episode)`` runs one episode's subflow (`Subflows`) and returns its metrics
EpisodeCall = Callable[[int, dict[str, Any], "int | None"], dict[str, Any]]


class Episodes:
    """The run's episodes, one after another: each waits for the one before it to end."""

    def __init__(self, ctx: RunContext, call: EpisodeCall, first: int, consumed_samples: int) -> None:
        self.ctx, self.call, self.num_episode = ctx, call, ctx.spec.runtime.num_episode

    def run(self, episode: int, consumed_samples: int, start_iteration: int) -> dict[str, Any]:
        """Episode ``episode`` to its end: its metrics."""
        parameters = {"ctx": self.ctx, "episode": episode, "consumed_samples": consumed_samples,
                      "gate": EpisodeGate(start_iteration)}
        return self.call(episode, parameters, episode + 1 if episode + 1 < self.num_episode else None)

    def close(self) -> None:
        """Give up what was started ahead (nothing, here)."""


class Measured:
    """Episodes of a runner (`Episodes`, `Pipeline`) with what the train flow wants around each: ChatLearn's episode
    hooks on every rank, the profiler's ranges, the episode's wall seconds and memory."""

    def __init__(self, runner: Episodes, ctx: RunContext, first: int) -> None:
        self.runner, self.ctx = runner, ctx
        self.hosts = ctx.actors.every_rank()  # every rank of every model: ChatLearn's episode hooks
        self.workers = list(ctx.actors.processes().values())
        self.instruments = EpisodeInstruments.of(ctx.spec.runtime, self.workers, first)
        self._released: int | None = None

    def run(self, episode: int, consumed_samples: int, start_iteration: int) -> dict[str, Any]:
        """Episode ``episode`` to its end: its metrics, with its wall seconds and memory."""
        timeout = self.ctx.spec.runtime.stage_timeout_s
        if self._released is None:  # what was handed over before the first episode (the eval before training)
            self._released = self._released_bytes()
        t0 = time.perf_counter()
        crash_point("episode_start", episode)
        wait([h.before_episode.remote() for h in self.hosts], "before_episode", timeout)
        with self.instruments.episode(episode):
            metrics = self.runner.run(episode, consumed_samples, start_iteration)
        wait([h.after_episode.remote() for h in self.hosts], "after_episode", timeout)
        metrics["episode_seconds"] = time.perf_counter() - t0
        released = self._released_bytes()
        if released:
            metrics["handover_mb"] = (released - self._released) / 2**20
            self._released = released
        metrics["peak_memory_mb"] = max(wait([h.peak_memory.remote() for h in self.hosts], "memory report", timeout))
        return metrics

    def _released_bytes(self) -> int:
        """Bytes the colocated models handed over so far (offloaded weights/optimizer states, freed grads)."""
        reports = wait([w.memory_report.remote() for w in self.workers], "memory report",
                       self.ctx.spec.runtime.stage_timeout_s)
        return sum(n for rep in reports for model in rep.values() for n in model["released"].values())

    def close(self) -> None:
        self.runner.close()


def episodes_for(ctx: RunContext, call: EpisodeCall, first: int, consumed_samples: int,
                 prepare: Callable[[int], None] | None = None) -> Measured:
    """The run's episode runner, chosen once: pipelined when the policy generates on published weight versions
    (``runtime.max_staleness`` > 0), else one after another. ``prepare(episode)`` has an episode's flow run
    created in the background (`Subflows.prepare`), for the pipeline's episodes started ahead."""
    if ctx.spec.runtime.max_staleness > 0:
        runner: Episodes = Pipeline(ctx, call, first, consumed_samples, prepare)
    else:
        runner = Episodes(ctx, call, first, consumed_samples)
    return Measured(runner, ctx, first)


class Pipeline(Episodes):
    """Episodes from ``first`` on, up to ``runtime.max_staleness`` ahead of the one the train flow is on (the
    module's doc). ``prepare(episode)`` has an episode's flow run created in the background, one episode before it
    may start."""

    def __init__(self, ctx: RunContext, call: EpisodeCall, first: int, consumed_samples: int,
                 prepare: Callable[[int], None] | None = None) -> None:
        super().__init__(ctx, call, first, consumed_samples)
        self.prepare = prepare
        self.k = ctx.spec.runtime.max_staleness
        self.versions = ctx.rollout.weights  # the published versions (WeightVersions)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.k + 1, thread_name_prefix="episode")
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._gates: dict[int, EpisodeGate] = {}
        self._consumed = {first: consumed_samples}

    def consumed_before(self, episode: int) -> int:
        """Samples consumed before ``episode``: the sampler's own arithmetic, so an episode started ahead reads
        the prompts the synchronous run would."""
        spec = self.ctx.spec
        replicas = len(self.ctx.actors.names[spec.plan.producer])
        while episode not in self._consumed:
            last = max(self._consumed)
            batches = episode_generation_batches(self.ctx.dataset_size, self._consumed[last],
                                                 spec.runtime.sample_per_episode, spec.generation_batch_size,
                                                 replicas, spec.runtime.shuffle_seed, spec.group_size)
            self._consumed[last + 1] = self._consumed[last] + sum(len(idx) for _, idx, _ in batches)
        return self._consumed[episode]

    def run(self, episode: int, consumed_samples: int, start_iteration: int) -> dict[str, Any]:
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
        parameters = {"ctx": self.ctx, "episode": episode, "consumed_samples": self.consumed_before(episode),
                      "gate": gate}
        next_episode = episode + 1 if episode + 1 < self.num_episode else None
        ctx = contextvars.copy_context()  # the train flow run's context: the subflow records under it
        self._futures[episode] = self._pool.submit(ctx.run, self._episode, episode, before, parameters, next_episode)

    def _episode(self, episode: int, before: EpisodeGate | None, parameters: dict[str, Any],
                 next_episode: int | None) -> Any:
        gate: EpisodeGate = parameters["gate"]
        if before is not None:
            before.wait_generated()  # the policy's calls in episode order
        self.versions.wait_for(generation_version(episode, self.k), f"episode {episode + 1}, generate",
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
