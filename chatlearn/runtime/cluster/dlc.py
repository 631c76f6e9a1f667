"""``runtime_env.platform: DLC``: the multi-node bootstrap of Alibaba PAI-DLC, as ChatLearn does it.

On DLC every node of a job runs the same command with ``RANK``, ``JOB_NAME`` and ``CUSTOM_PORTS`` set. Rank 0
starts the Ray head on the first free custom port and runs the training as the driver; every other rank joins
the head as a Ray node and waits until the head is gone, then exits 0. Hosts are ``{JOB_NAME}-master-0`` and
``{JOB_NAME}-worker-{rank-1}``. ``LOCAL_MASTER_ADDR`` stands in for DLC on other machines (ChatLearn's mock):
it is the head's address, and the nodes use it too when it is a loopback address (several nodes on one
machine, each with its own ``CUSTOM_PORTS`` node-manager port). Without these variables a DLC config warns and
runs on this machine alone, as ChatLearn falls back to local mode.

Unlike ChatLearn, the Ray processes are started with ``ray start --block`` as children of the command, so
stopping them stops exactly this job's Ray node (never other Ray instances on the machine).
"""

import contextlib
import ctypes
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from chatlearn.config.errors import ConfigWarning

__all__ = ["DLCNode", "dlc_head", "dlc_node", "serve_as_worker"]

# Ports Ray reserves by default (client server, dashboard, dashboard agent, metrics, worker port range).
_RAY_PORTS = {10001, 8265, 49948, 52365, 63529}
_RAY_WORKER_PORTS = range(10002, 20000)


@dataclass(frozen=True)
class DLCNode:
    rank: int
    master: str  # the head's host
    address: str  # this node's host
    port: int  # the head's GCS port
    node_manager_port: int
    nodes: int = 0  # WORLD_SIZE: the job's node count (0: unknown, do not wait for them)

    @property
    def head_address(self) -> str:
        return f"{self.master}:{self.port}"


def dlc_node(platform: str, environ: Mapping[str, str] = os.environ) -> DLCNode | None:
    """This node's role in a DLC job, or None when the config does not ask for DLC or the job's variables are
    missing (then a warning, and the run stays on this machine)."""
    if platform.strip().lower() != "dlc":
        return None
    local = environ.get("LOCAL_MASTER_ADDR")
    needed = ("CUSTOM_PORTS", "RANK") if local else ("CUSTOM_PORTS", "JOB_NAME", "RANK")
    missing = [k for k in needed if not environ.get(k)]
    if missing:
        warnings.warn(f"runtime_env.platform: DLC, but {', '.join(missing)} not set (is the job submitted to DLC with "
                      "customPortList / createSvcForAllWorkers?); running on this machine alone", ConfigWarning,
                      stacklevel=2)
        return None
    try:
        rank = int(environ["RANK"])
        ports = [int(p) for p in environ["CUSTOM_PORTS"].replace(",", ";").split(";") if p.strip()]
    except ValueError:
        raise ValueError(f"DLC: RANK={environ['RANK']!r} and CUSTOM_PORTS={environ['CUSTOM_PORTS']!r} must be a "
                         "number and ';'-separated port numbers") from None
    ports = [p for p in ports if p not in _RAY_PORTS and p not in _RAY_WORKER_PORTS]
    if len(ports) < 2:
        raise ValueError(f"DLC: CUSTOM_PORTS={environ['CUSTOM_PORTS']!r} needs two ports Ray does not reserve "
                         "(not 8265, 10001-19999, 49948, 52365, 63529)")
    if local:
        master = local
        address = local if _is_loopback(local) else socket.gethostbyname(socket.gethostname())
    else:
        job = environ["JOB_NAME"]
        master = f"{job}-master-0"
        address = master if rank == 0 else f"{job}-worker-{rank - 1}"
    nodes = int(environ.get("WORLD_SIZE", "0") or 0)
    return DLCNode(rank, master, address, ports[0], ports[1], nodes)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _ray_start(node: DLCNode, gpus: int | None) -> list[str]:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray, "start", "--block", "--disable-usage-stats", f"--node-ip-address={node.address}",
           f"--node-manager-port={node.node_manager_port}"]
    cmd += ["--head", f"--port={node.port}", "--include-dashboard=false"] if node.rank == 0 else [
        f"--address={node.head_address}"]
    if gpus is not None:
        cmd.append(f"--num-gpus={gpus}")
    return cmd


def _reachable(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False


def _die_with_parent() -> None:
    """In the child: ask Linux for a SIGTERM when the chatlearn process dies, even by SIGKILL, so its Ray node
    does not outlive the job's command (best effort: some sandboxes, e.g. gVisor, do not deliver it)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _popen(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # `ray start --block` stops the processes it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def dlc_head(node: DLCNode, gpus: int | None = None, timeout_s: float = 120.0) -> Iterator[str]:
    """Rank 0: start the Ray head, yield its address for ``RAY_ADDRESS``, stop it on the way out (the other
    ranks see it gone and exit). The run waits for the job's ``WORLD_SIZE`` nodes before placing models."""
    proc = _popen(_ray_start(node, gpus))
    try:
        deadline = time.monotonic() + timeout_s
        while not _reachable(node.master, node.port):
            if proc.poll() is not None:
                raise RuntimeError(f"DLC: the Ray head did not start: {proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"DLC: the Ray head at {node.head_address} did not come up in {timeout_s:.0f}s")
            time.sleep(0.5)
        yield node.head_address
    finally:
        _stop(proc)


def serve_as_worker(node: DLCNode, gpus: int | None = None, wait_for_head_s: float = 600.0,
                    poll_s: float = 2.0) -> int:
    """Rank > 0: join the head as a Ray node (waiting for it to come up), serve until the head is gone, exit."""
    deadline = time.monotonic() + wait_for_head_s
    while not _reachable(node.master, node.port):
        if time.monotonic() > deadline:
            print(f"chatlearn: DLC rank {node.rank}: no Ray head at {node.head_address} after {wait_for_head_s:.0f}s",
                  file=sys.stderr)
            return 1
        time.sleep(poll_s)
    proc = _popen(_ray_start(node, gpus))
    # a SIGTERM (the job being stopped) runs the cleanup below instead of leaving the Ray node behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"chatlearn: DLC rank {node.rank}: joined the Ray head at {node.head_address}", file=sys.stderr)
    try:
        misses = 0
        while misses < 3:
            if proc.poll() is not None:
                print(f"chatlearn: DLC rank {node.rank}: the Ray node stopped: {proc.stderr.read()[-2000:]}",
                      file=sys.stderr)
                return 1
            misses = 0 if _reachable(node.master, node.port) else misses + 1
            time.sleep(poll_s)
        print(f"chatlearn: DLC rank {node.rank}: the head is gone, exiting", file=sys.stderr)
        return 0
    finally:
        _stop(proc)
