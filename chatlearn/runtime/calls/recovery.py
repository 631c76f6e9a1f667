"""A model process that dies does not end the run: find which ones are gone, say so, and let the train flow
recreate them and redo the episode from the last checkpoint (``runtime.max_restarts`` times at most).

ChatLearn (and every peer we know) stops the whole job when one model process dies. Here the train flow
treats a lost process like a crash of the whole run that the re-run resumes: it tears the remaining actors
down, starts a fresh set in the same Ray (the lost node's capacity is simply gone from the placement), and
resumes from the last committed checkpoint. Resume is exact, so on CPU with a fixed seed the final weights
equal an undisturbed run's (tests/test_recovery.py).

A failure counts as a lost process only when a worker of the run is really gone afterwards (its actor no
longer answers), not from the exception's type alone: a peer rank of a dead process fails with a gloo
"Connection closed" from a live actor, and a user error must never be retried.

The Ray head going away (chatlearn.runtime.cluster.head) is asked about first, since the checks above need
it: every model process went with it (`HeadLost`). Of a local Ray the run started, that is a lost process like
any other, and the restart starts a fresh local Ray; of a cluster the run joined, `launch` turns it into
`RayHeadGone`, which ends the run.
"""

import contextlib
import json
import os
import signal
from typing import Any

import ray

from chatlearn.utils.errors import RunError


class ProcessLost(RunError):
    """Model processes of the run died (killed, out of memory, their node gone): recoverable by a restart."""

    def __init__(self, message: str, lost: list[str] | None = None, nodes: list[str] | None = None) -> None:
        super().__init__(message)
        self.lost = list(lost or [])
        self.nodes = list(nodes or [])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.lost, self.nodes))


class HeadLost(ProcessLost):
    """The Ray head went away, and every model process with it (``local``: the head of a local Ray the run
    started, which a restart replaces; else the head of a cluster the run joined)."""

    def __init__(self, message: str, local: bool = True) -> None:
        super().__init__(message)
        self.local = local

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.local))


def _during(episode: int | None) -> str:
    return f" during episode {episode + 1}" if episode is not None and episode >= 0 else ""  # counted from 1


# The watch of the Ray head while a run's actors exist (`chatlearn.runtime.cluster.head.HeadWatch` adds itself):
# process-wide, as the driver's one connection to Ray is; every wait of the driver asks it (`check_head`)
WATCHES: list[Any] = []


def head_loss(episode: int | None) -> HeadLost | None:
    """A HeadLost if the Ray head went away (``episode``: the one running, 0-based), None while it is there (or
    nothing watches it)."""
    gone = WATCHES[-1].gone if WATCHES else None
    if gone is None:
        return None
    if gone.local:
        return HeadLost(f"the head of the local Ray went away{_during(episode)} ({gone.what}); starting a fresh "
                        "local Ray")
    return HeadLost(f"the Ray head at {gone.address} went away{_during(episode)} ({gone.what}); the run's model "
                    "processes end with it. Re-run the same command once the cluster is back to resume from the "
                    "last checkpoint", local=False)


def check_head(episode: int | None) -> None:
    """Raise `head_loss`'s HeadLost if the Ray head went away."""
    lost = head_loss(episode)
    if lost is not None:
        raise lost


def lost_processes(processes: dict[str, Any], timeout_s: float = 10.0) -> list[str]:
    """Names of the worker processes (name -> actor handle) that no longer answer a ping."""
    pings = {name: actor.ping.remote() for name, actor in processes.items()}
    lost = []
    for name, ref in pings.items():
        try:
            ray.get(ref, timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                ray.exceptions.GetTimeoutError):
            lost.append(name)
    return lost


def dead_nodes(before: set[str]) -> list[str]:
    """Of the Ray node ids ``before``, those no longer alive (with their address), e.g. ``"3f2a… (10.0.0.7)"``."""
    alive = {}
    for node in ray.nodes():
        alive[node["NodeID"]] = (node.get("Alive", False), node.get("NodeManagerAddress", "?"))
    return [f"{nid[:12]} ({alive.get(nid, (False, '?'))[1]})" for nid in sorted(before)
            if not alive.get(nid, (False, ""))[0]]


def alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def process_loss(exc: BaseException, processes: dict[str, Any], nodes_before: set[str],
                 episode: int | None) -> ProcessLost | None:
    """A ProcessLost describing ``exc`` when run processes are gone after it, else None (not recoverable)."""
    head = head_loss(episode)  # with the head gone, nothing below would get an answer
    if head is not None:
        return head
    with contextlib.suppress(Exception):
        lost = lost_processes(processes)
        if not lost:
            return None
        nodes = dead_nodes(nodes_before)
        where = f"during episode {episode + 1}" if episode is not None else "while starting"  # counted from 1
        msg = f"model process{'es' if len(lost) > 1 else ''} {', '.join(lost)} died {where}"
        if nodes:
            msg += f" (node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)} left the cluster)"
        return ProcessLost(msg, lost, nodes)
    return None


# -- fault injection for the tests and the soak benchmark ---------------------------------------------------

# Why process-wide: the point is set in the environment, and the run that recovers from the kill redoes the
# episode and passes it again; kept per run directory, so that each run of one process (the tests') fires it.
_FIRED: set[tuple[str, str]] = set()


def kill_point(point: str, episode: int, run_dir: str) -> None:
    """SIGKILL a model's worker process if ``CHATLEARN_KILL_AT`` is ``<model>:<point>:<episode>`` (once per run
    directory in a driver process: the redone episode passes the point again). The pid comes from
    ``run_dir/placement.json`` (rank 0 of replica 0). A real SIGKILL of a Ray worker at an exact moment, as a lost
    process would be."""
    spec = os.environ.get("CHATLEARN_KILL_AT", "")
    model, _, rest = spec.partition(":")
    if not model or rest != f"{point}:{episode}" or (run_dir, spec) in _FIRED:
        return
    _FIRED.add((run_dir, spec))
    with open(os.path.join(run_dir, "placement.json")) as f:
        pid = json.load(f)["ranks"][model][0][0]["pid"]
    os.kill(pid, signal.SIGKILL)
