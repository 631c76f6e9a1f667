"""Bring a run's actors up and down: Ray, the model actors, the StreamDataset, the prompt datasets.

Shared by the train and eval flows. The flow process is the Ray driver; actors are created here (never in a
task: an actor created inside a task dies with it) and killed on the way out, failures included.
"""

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import ray

from chatlearn.config import ChatLearnConfig
from chatlearn.config.user_code import shipped_code
from chatlearn.runtime.calls.stopping import keep_handlers
from chatlearn.runtime.cluster import ray_private, reaper
from chatlearn.runtime.cluster.placement import NodeSpec, plan_placement
from chatlearn.utils.devices import fake_gpus
from chatlearn.utils.imports import CODE_PATH_VAR, code_dirs, code_dirs_on_path

logger = logging.getLogger("chatlearn")

# Never uploaded with a working_dir: the local environment, history and run outputs.
ALWAYS_EXCLUDED = [".venv", ".git", "output"]
# Run in every Ray worker at its start: the user's code folders on its sys.path (chatlearn.utils.imports)
SETUP_HOOK = f"{code_dirs_on_path.__module__}.{code_dirs_on_path.__name__}"


def ray_runtime_env(cfg: ChatLearnConfig) -> dict[str, Any]:
    """`runtime_env` as Ray's runtime env, as ChatLearn builds it: pip, py_modules, excludes, the driver's
    PYTHONPATH, and the working_dir when it is not the current directory. (ChatLearn always uploads it; the
    current directory is left out here because relative paths such as ``./output`` would then resolve inside
    the uploaded copy on the workers, while the driver writes to the real one.)

    The user's code folders (the current directory, the config's folder, those of file-form hooks:
    `chatlearn.config.user_code`) go to every worker as ``CHATLEARN_CODE_PATH``, and a setup hook appends them
    to its ``sys.path`` (after the installed packages, so a folder of the project never shadows one). Joining a
    cluster (``RAY_ADDRESS``), whose other nodes may not share this file system, the hooks' own files are
    shipped as ``py_modules`` too."""
    env = cfg.runtime_env
    env_vars = {CODE_PATH_VAR: os.pathsep.join(code_dirs())}
    if os.environ.get("PYTHONPATH"):  # as ChatLearn: workers on every node see the driver's PYTHONPATH
        env_vars["PYTHONPATH"] = os.environ["PYTHONPATH"]
    out: dict[str, Any] = {"env_vars": env_vars, "worker_process_setup_hook": SETUP_HOOK}
    if env.pip:
        out["pip"] = list(env.pip)
    shipped = shipped_code(cfg) if os.environ.get("RAY_ADDRESS") else []
    py_modules = list(dict.fromkeys([*(env.py_modules or []), *shipped]))
    if py_modules:
        out["py_modules"] = py_modules
    if env.working_dir and os.path.abspath(env.working_dir) != os.getcwd():
        out["working_dir"] = env.working_dir
        out["excludes"] = list(env.excludes) + ALWAYS_EXCLUDED
    return out


def init_ray(cfg: ChatLearnConfig, namespace: str, names: list[str]) -> bool:
    """Join `RAY_ADDRESS` (or an already initialized Ray), else start a local Ray sized for the models.

    Returns whether this call started Ray (and so must shut it down). A local Ray gets at least as many
    logical CPUs as the plan's worker processes ask for, so CPU models schedule on a 2-core machine, and
    declares ``CHATLEARN_FAKE_GPUS`` GPUs when that is set (GPU placement tested without GPUs).
    """
    if ray.is_initialized():
        return False
    common: dict[str, Any] = dict(namespace=namespace, log_to_driver=False, configure_logging=False,
                                  runtime_env=ray_runtime_env(cfg))
    address = os.environ.get("RAY_ADDRESS")
    if address:
        if os.environ.get("CHATLEARN_NODE_IP_ADDRESS"):  # this machine's address in the cluster (DLC sets it)
            common.update(ray_private.node_ip_address(os.environ["CHATLEARN_NODE_IP_ADDRESS"]))
        with keep_handlers():
            ray.init(address=address, **common)
        _wait_for_nodes(int(os.environ.get("CHATLEARN_WAIT_FOR_NODES", "0") or 0))
        return True
    # Logical CPUs: what the workers ask for, plus room for the dispatch tasks' worker processes. Ray keeps
    # at most `num_cpus` idle workers; fewer would make it kill and re-spawn them (seconds of imports) often.
    gpus = fake_gpus() or None
    need = plan_placement(cfg, names, [NodeSpec(gpus or 10**6, None)]).cpus_required
    cpus = max(os.cpu_count() or 1, int(need + 0.999) + 4)
    # address="local": a new local Ray even when a `ray start` cluster (or its leftover address file) is on
    # this machine; joining one is what RAY_ADDRESS is for
    try:
        with loopback_only(), keep_handlers():
            ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False, **common)
    except BaseException:  # a stop (SIGTERM) or a failure halfway: what it started of the local Ray goes too,
        # the agents its raylet started included (they outlive their raylet by a minute: cluster/reaper.py)
        started = _local_ray_processes() if reaper.supported() else set()
        ray.shutdown()
        reaper.end(started)
        raise
    return True


def _local_ray_processes() -> set[reaper.Ident]:
    """What a local `ray.init` of this driver started so far, with everything below it (the raylet's agents and
    workers): the driver's descendants that run Ray's own programs, and their subtrees. (`ray.init` has no list
    of them until it has started them all.)"""
    ray_dir = os.path.dirname(ray.__file__) + os.sep

    def runs_ray(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return ray_dir.encode() in f.read()
        except OSError:
            return False

    return reaper.descendants(pid for pid, _ in reaper.descendants([os.getpid()]) if pid != os.getpid()
                              and runs_ray(pid))


def local_gpus() -> int:
    """The GPUs a local Ray started here would have: ``CHATLEARN_FAKE_GPUS``, else what Ray's own detection
    finds (the visible NVIDIA devices), 0 when it cannot tell."""
    if fake_gpus():
        return fake_gpus()
    try:
        count, visible = ray_private.local_accelerators("GPU")  # as Ray's ray.init detects them
        return min(count, len(visible)) if visible is not None else count
    except Exception:  # no driver library, an unknown platform: a machine without GPUs Ray can use
        return 0


def check_local_placement(cfg: ChatLearnConfig, names: list[str]) -> None:
    """For a run that starts its own local Ray (no ``RAY_ADDRESS``; the caller knows it is no DLC job), the plan
    against this machine before anything starts: a layout it cannot hold is a PlacementError now, one message,
    instead of after the Prefect server and Ray came up. CPUs never limit a local run (its Ray gets at least
    what the plan asks, `init_ray`). A run joining a cluster is checked against the live nodes in `launch`."""
    if os.environ.get("RAY_ADDRESS"):
        return
    plan_placement(cfg, names, [NodeSpec(local_gpus(), None)])


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Start a local Ray that listens on 127.0.0.1 only, with token authentication.

    Ray binds its gRPC servers (GCS, raylet, every worker and actor) and agents to all interfaces unless the
    node's address is the loopback one, and `ray.init(_node_ip_address="127.0.0.1")` is turned back into the
    machine's external address. Ray's macOS/Windows mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) is the one
    switch that makes a node use 127.0.0.1, and with it every server and agent binds loopback only
    (tests/test_local_run.py lists the sockets). The switch is read at import into `ray_constants`, so it is set
    there for this call and in the environment the Ray processes inherit, then put back: a later
    `ray.init(address=...)` joining a cluster in this process is not affected.

    Token authentication (`RAY_AUTH_MODE=token`, Ray generates `~/.ray/auth_token` once) is on unless the
    user chose a mode: other local users cannot reach the loopback ports without the token either.
    """
    if "RAY_AUTH_MODE" not in os.environ:  # as Ray's own default for a new local cluster, without its warning
        ray_private.enable_token_auth()  # sets the variable and refreshes the mode this process already cached
    with ray_private.ray_clusters_disabled():
        yield


def _wait_for_nodes(count: int, timeout_s: float = 300.0) -> None:
    """Wait until the cluster has ``count`` live nodes (a DLC job's WORLD_SIZE), so the placement sees them."""
    deadline = time.monotonic() + timeout_s
    while count > 1:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        if alive >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray cluster has {alive} of the job's {count} nodes after {timeout_s:.0f}s")
        time.sleep(1.0)
