"""What a run shows of its model processes: NVTX ranges for nsys (`runtime.nsys`) and a torch profiler trace of
one episode (`runtime.profiler_dir`).

Both live inside the worker processes (:class:`StageMarks`, one per worker), since that is where the model's
work runs; the train flow only says when an episode begins and ends (:class:`EpisodeInstruments`). Every
model call of a stage is entered as one range named ``episode N/<stage>/<model>`` (N counted from 1, as the
terminal's metrics line counts), so nsys's timeline and the profiler trace read like the Prefect UI.

ChatLearn profiles a few steps of replica 0 with ``torch.profiler`` and pushes NVTX ranges around each
decorated call; here the unit is the episode (what a user compares with the stage seconds of the metrics
line): the first episode the run trains is profiled, in every worker process that hosts a replica 0 rank.
"""

import functools
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from chatlearn.runtime.calls.waiting import wait

# Model methods that make up a stage of the episode; anything else (setup, ping, checkpoint loading) is
# not an episode's work and gets no range.
_STAGE_OF = {"generate": "generate", "forward": "score", "train": "train", "save_checkpoint": "checkpoint",
             "get_weights": "sync", "set_weights": "sync", "sync_weights": "sync"}

NVTX_NEEDS_CUDA = ("runtime.nsys=True: NVTX ranges need a CUDA build of torch; this one ({version}) has none, so "
                   "the model processes mark no ranges")


@functools.cache
def nvtx_works() -> bool:
    """Whether this process's torch can emit NVTX ranges: a CPU-only build raises on every NVTX call (its
    ``torch.cuda.nvtx`` is a stub), a CUDA build emits them even where no GPU is visible."""
    try:
        torch.cuda.nvtx.range_push("chatlearn-probe")
        torch.cuda.nvtx.range_pop()
    except (RuntimeError, AttributeError):
        return False
    return True


@contextmanager
def nvtx_range(label: str) -> Iterator[None]:
    """An NVTX range around the block, or nothing where torch cannot emit NVTX (a CPU build): the one way
    ranges are entered, so a CPU run with `runtime.nsys` goes on instead of failing in every model call."""
    if not nvtx_works():
        yield
        return
    torch.cuda.nvtx.range_push(label)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def stage_of(method: str, kwargs: Mapping[str, Any]) -> str | None:
    """The episode stage a model call belongs to (eval generation and scoring are `eval`), None if none."""
    stage = _STAGE_OF.get(method)
    if stage in ("generate", "score") and kwargs.get("is_eval"):
        return "eval"
    return stage


def trace_name(ranks: Mapping[str, tuple[int, int]]) -> str | None:
    """The file stem of a worker's trace: the replica 0 models it hosts and their rank, e.g. `ppo_policy-rank0`
    (colocated models share a process, hence one trace: `policy+reference-rank0`); None if it hosts none."""
    models = [m for m, (replica, _) in ranks.items() if replica == 0]
    if not models:
        return None
    return f"{'+'.join(models)}-rank{ranks[models[0]][1]}"


class StageMarks:
    """A worker's NVTX ranges and torch profiler. ``ranks`` maps each hosted model to (replica, rank)."""

    def __init__(self, nsys: bool, ranks: Mapping[str, tuple[int, int]]):
        self.nsys = nsys
        self.ranks = dict(ranks)
        self.episode: int | None = None
        self.profiler: torch.profiler.profile | None = None
        self.trace_path: str | None = None

    def begin(self, episode: int, profiler_dir: str | None = None) -> dict[str, Any]:
        """The episode starts: later ranges name it; with ``profiler_dir``, start the torch profiler if this
        process hosts a replica 0 rank (ChatLearn profiles replica 0 only). Says what this process can do."""
        self.episode = episode
        name = trace_name(self.ranks)
        if profiler_dir and name is not None and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            os.makedirs(profiler_dir, exist_ok=True)
            self.trace_path = os.path.join(profiler_dir, f"{name}-episode{episode + 1}.json")
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        return {"nvtx": nvtx_works(), "profiling": self.profiler is not None, "torch": torch.__version__}

    def end(self) -> list[str]:
        """The episode is over: stop the profiler, if running, and write its Chrome trace (Perfetto opens it)."""
        if self.profiler is None:
            return []
        prof, path = self.profiler, self.trace_path
        self.profiler, self.trace_path = None, None
        prof.stop()
        prof.export_chrome_trace(path)
        return [path]

    def stage(self, model: str, method: str, kwargs: Mapping[str, Any] | None = None) -> Any:
        """A context for one model call: an NVTX range (nsys) and a profiler label named
        `episode N/<stage>/<model>`; nothing when neither is on or the call is not an episode's work."""
        nvtx = self.nsys and nvtx_works()
        if not (nvtx or self.profiler is not None):
            return nullcontext()
        stage = stage_of(method, kwargs or {})
        if stage is None:
            return nullcontext()
        label = f"{stage}/{model}" if self.episode is None else f"episode {self.episode + 1}/{stage}/{model}"
        return self._marked(label, nvtx)

    @contextmanager
    def _marked(self, label: str, nvtx: bool) -> Iterator[None]:
        with nvtx_range(label) if nvtx else nullcontext():
            with torch.profiler.record_function(label) if self.profiler is not None else nullcontext():
                yield


class EpisodeInstruments:
    """The train flow's side: tells every worker process when an episode begins and ends, when `runtime.nsys`
    or `runtime.profiler_dir` asks for it (otherwise it costs nothing), and says once when nsys cannot work."""

    def __init__(self, nsys: bool, profiler_dir: str | None, workers: list[Any], profile_episode: int,
                 timeout_s: float | None = None):
        self.timeout_s = timeout_s  # runtime.stage_timeout_s
        """``workers``: one Ray actor handle per worker process; ``profile_episode``: the 0-based episode to
        profile (the first one this run trains). A relative ``profiler_dir`` is taken from the driver's
        current directory, where the user ran the command, not the Ray worker's."""
        self.nsys = nsys
        self.profiler_dir = str(Path(profiler_dir).expanduser().resolve()) if profiler_dir else None
        self.workers = workers
        self.profile_episode = profile_episode
        self.warned = False
        self.traces: list[str] = []

    @classmethod
    def of(cls, runtime: Any, workers: list[Any], first_episode: int) -> "EpisodeInstruments":
        """From the run's `runtime` config and its worker processes (each once, colocated models or not)."""
        return cls(runtime.nsys, runtime.profiler_dir, list(workers), first_episode, runtime.stage_timeout_s)

    @contextmanager
    def episode(self, episode: int) -> Iterator[None]:
        """Wrap one episode's flow: mark its stages in the workers and, for the profiled episode, write the
        traces after it (not when it fails: the run stops and its actors are killed anyway)."""
        profile = self.profiler_dir if episode == self.profile_episode else None
        if not (self.nsys or profile):
            yield
            return
        states = wait([w.begin_episode.remote(episode, profile) for w in self.workers], "profiling", self.timeout_s)
        if self.nsys and not self.warned and not all(s["nvtx"] for s in states):
            self.warned = True
            versions = sorted({s["torch"] for s in states if not s["nvtx"]})
            sys.stderr.write(f"chatlearn: warning: {NVTX_NEEDS_CUDA.format(version=', '.join(versions))}\n")
        yield
        if any(s["profiling"] for s in states):
            ends = wait([w.end_episode.remote() for w in self.workers], "profiling", self.timeout_s)
            paths = [p for ps in ends for p in ps]
            self.traces += paths
            sys.stderr.write(f"torch profiler traces of episode {episode + 1} (open in https://ui.perfetto.dev): "
                             f"{', '.join(paths)}\n")
