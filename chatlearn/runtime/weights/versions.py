"""The policy's weights by version, for pipelined episodes (``runtime.max_staleness`` k > 0).

Version v is the trainer's weights after v train stages (episodes 0 .. v-1; 0: as set up). Episode E generates
on version ``max(0, E - k)`` whatever the timing, so the same config gives the same samples twice and a re-run
after a crash regenerates them exactly. The two sides meet only here:

* the training side **publishes** version E + 1 after episode E trains (the sync stage): every trainer rank
  gathers its weights (`get_weights`) and rank 0's go into Ray's object store, so the trainer goes on at once;
* the generating side **loads** a version into every process of the policy's replicas before a stage of its
  own (generate, eval), between its batches, never in the middle of one: a stage holds the policy's `turn`
  while it loads and runs its calls, so two stages' calls never interleave on the policy.

A version is kept until no episode that may still run needs it (``release_below``); the ones a resume needs
are written with the checkpoint (`save`) and read back by `restore`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray
from safetensors.torch import save_file

from chatlearn.checkpoint.model_checkpoint import load_weights
from chatlearn.runtime.calls.stopping import Stopped, stop_signal, stopping
from chatlearn.runtime.calls.waiting import MIN_STEP_TIMEOUT_S, StageClock, StageTimeout
from chatlearn.runtime.weights.sync import SyncRoute
from chatlearn.utils.errors import RunError
from chatlearn.utils.storage import writing
from chatlearn.utils.tied import separate_storage, without_aliases

_POLL_S = 0.2


def generation_version(episode: int, max_staleness: int) -> int:
    """The weights version episode ``episode`` generates on."""
    return max(0, episode - max_staleness)


def _save_weights(weights: dict[str, Any], path: str) -> str:
    """In a Ray worker: one version's weights as safetensors, tied names stored once with their aliases in the
    header, as model checkpoints are (`chatlearn.utils.tied`; read back by `load_weights`)."""
    unique, aliases = without_aliases(weights)
    tmp = path + ".tmp"
    save_file(separate_storage({k: v.detach().contiguous() for k, v in unique.items()}), tmp,
              metadata=aliases or None)
    os.replace(tmp, path)  # never half a file under the name a resume reads
    return path


_SAVE = ray.remote(num_cpus=0, max_retries=0)(_save_weights)
_LOAD = ray.remote(num_cpus=0, max_retries=0)(load_weights)


class PolicyWeights:
    """Where the generating policy's weights come from, as the rollout asks (`chatlearn.runtime.rollout`).

    This base is synchronous episodes: the sync stage copies the trainer's weights into the policy with the other
    routes, so nothing is versioned, published or saved. `WeightVersions` is the pipelined source."""

    def __repr__(self) -> str:
        return "synced"

    def start(self, ctx: Any, resumed: Any) -> None:
        """Before the first episode (``resumed``: the data checkpoint the run goes on from, or None)."""

    def version(self, episode: int) -> int | None:
        """The version episode ``episode`` generates on, when generation runs on versions (else None)."""
        return None

    @contextlib.contextmanager
    def turn(self, model: str | None, version: int | None, clock: StageClock) -> Iterator[None]:
        """Around a stage's calls of ``model`` on ``version`` (nothing to do here)."""
        yield

    def routes(self, due: list[SyncRoute]) -> list[SyncRoute]:
        """Of the weight routes due after training, those the sync stage copies."""
        return due

    def publish(self, episode: int, clock: StageClock) -> list[str]:
        """After episode ``episode`` trained: what was published (a description per version)."""
        return []

    def save(self, ctx: Any, episode: int, iteration: int, clock: StageClock) -> dict[int, str]:
        """With episode ``episode``'s checkpoint: the versions the next episodes generate on, by file."""
        return {}


class WeightVersions(PolicyWeights):
    """The versions of ``route``'s trainer weights that generation may still need (see the module's doc)."""

    def __init__(self, route: SyncRoute, actor: Callable[[str], Any], max_staleness: int,
                 timeout_s: float | None = None):
        self.route, self.actor, self.max_staleness, self.timeout_s = route, actor, max_staleness, timeout_s
        self._refs: dict[int, Any] = {}
        self._changed = threading.Condition()
        self._loaded: int | None = None
        self.lock = threading.Lock()  # the policy's stages (generate, eval): one at a time, loads included

    def __repr__(self) -> str:
        return f"WeightVersions({self.route.key}, max_staleness={self.max_staleness})"

    def __reduce__(self) -> tuple:
        # the run's context reaches Prefect tasks on Ray (rule rewards) with the flow run's: the driver's versions
        # are only their description there (locks do not pickle)
        return str, (repr(self),)

    @property
    def model(self) -> str:
        return self.route.dst

    # ---- as the rollout asks (PolicyWeights) ----

    def start(self, ctx: Any, resumed: Any) -> None:
        """The trainer's weights as the first version; on resume the older versions the next episodes generate
        on, from the checkpoint (``resumed``: its `DataCheckpoint`)."""
        clock = StageClock("resume" if resumed else "setup", -1,
                           max(self.timeout_s or 0, MIN_STEP_TIMEOUT_S))
        if resumed is not None:
            missing = [v for v in range(generation_version(resumed.episode + 1, self.max_staleness),
                                        resumed.episode + 1) if v not in resumed.policy_versions]
            if missing:
                raise RunError(f"the data checkpoint of episode {resumed.episode + 1} in "
                               f"{ctx.spec.data_checkpoint_path} has no policy weights of version(s) {missing}, which "
                               f"runtime.max_staleness {self.max_staleness} generates on next (was it written by a "
                               f"run with a smaller max_staleness?)")
            self.restore(resumed.policy_versions)
        self.publish_version(resumed.episode + 1 if resumed is not None else 0, clock)

    def version(self, episode: int) -> int | None:
        return generation_version(episode, self.max_staleness)

    @contextlib.contextmanager
    def turn(self, model: str | None, version: int | None, clock: StageClock) -> Iterator[None]:
        """Around a stage's calls of ``model``: when it is the policy, its `turn` with ``version`` loaded (no other
        stage's calls in between)."""
        if model != self.model or version is None:
            yield
            return
        with self.lock:
            self.load(version, clock)
            yield

    def routes(self, due: list[SyncRoute]) -> list[SyncRoute]:
        return [r for r in due if r.key != self.route.key]  # the policy's weights go as versions

    def publish(self, episode: int, clock: StageClock) -> list[str]:
        self.publish_version(episode + 1, clock)
        self.release_below(generation_version(episode + 1, self.max_staleness))
        return [f"{self.route.key} (version {episode + 1})"]

    def save(self, ctx: Any, episode: int, iteration: int, clock: StageClock) -> dict[int, str]:
        directory = os.path.join(ctx.spec.data_checkpoint_path, "policy_versions", f"iter_{iteration:07d}")
        with writing("the policy versions", directory):  # a full disk: one RunError naming the path
            return self.save_versions(list(range(generation_version(episode + 1, self.max_staleness), episode + 1)),
                                      directory, clock)

    def versions(self) -> list[int]:
        with self._changed:
            return sorted(self._refs)

    def publish_version(self, version: int, clock: StageClock) -> None:
        """The trainer's current weights as ``version`` (every rank gathers; rank 0's are kept)."""
        # as a batch is made (`Worker.run_batch`): a small `done` per rank to wait on, and rank 0's weights as an
        # object of their own in the store, owned by the driver and never fetched by it
        calls = [self.actor(p).run_batch.remote(self.route.src, "get_weights") for p in self.route.src_ranks]
        clock.get([done for done, _ in calls], self.route.src)
        self._put(version, calls[0][1])

    def _put(self, version: int, ref: Any) -> None:
        with self._changed:
            self._refs[version] = ref
            self._changed.notify_all()

    def wait_for(self, version: int, what: str, timeout_s: float | None = None,
                 given_up: Callable[[], BaseException | None] | None = None) -> None:
        """Until ``version`` is published (the training side is that far), with the stop check, a deadline
        (default: the stage's) and ``given_up`` (an exception to raise instead, once it returns one)."""
        limit = timeout_s or self.timeout_s
        deadline = None if not limit else time.monotonic() + limit
        with self._changed:
            while version not in self._refs:
                if stopping():
                    raise Stopped(stop_signal() or "SIGTERM")
                if given_up is not None and (exc := given_up()) is not None:
                    raise exc
                if deadline is not None and time.monotonic() > deadline:
                    raise StageTimeout(f"{what}: the policy weights of version {version} ({self.route.src} after "
                                       f"{version} episode(s) of training) were not there after {limit:g} s "
                                       f"(runtime.stage_timeout_s)")
                self._changed.wait(_POLL_S)

    def load(self, version: int, clock: StageClock) -> None:
        """Put ``version`` into every process of the policy's replicas; the caller holds `lock`."""
        if self._loaded == version:
            return
        self.wait_for(version, f"{clock.stage} of episode {clock.episode + 1}")
        with self._changed:
            ref = self._refs[version]
        calls = [self.actor(p).run.remote(self.route.dst, "set_weights", ref)
                 for rep in self.route.dst_ranks for p in rep]
        clock.get(calls, self.route.dst)
        self._loaded = version

    def release_below(self, version: int) -> None:
        """Forget the versions older than ``version`` (no episode left to run generates on them)."""
        with self._changed:
            for v in [v for v in self._refs if v < version]:
                del self._refs[v]

    # ---- checkpoints: the versions a resume generates on ----

    def save_versions(self, versions: list[int], directory: str, clock: StageClock) -> dict[int, str]:
        """Write ``versions`` under ``directory`` (by Ray tasks, not through the driver); returns their files."""
        os.makedirs(directory, exist_ok=True)
        with self._changed:
            refs = {v: self._refs[v] for v in versions}
        calls = {v: _SAVE.remote(ref, os.path.join(directory, f"version_{v:07d}.safetensors"))
                 for v, ref in refs.items()}
        return dict(zip(calls, clock.get(list(calls.values()), "the policy versions"), strict=True))

    def restore(self, files: dict[int, str]) -> None:
        """Versions saved by `save`, back into the object store."""
        for v, path in files.items():
            if not os.path.isfile(path):
                raise FileNotFoundError(f"the checkpoint's policy weights of version {v} are missing: {path}")
            self._put(int(v), _LOAD.remote(path))
