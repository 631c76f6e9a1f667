"""Ray's private API in one place: the few things the cluster code needs that Ray offers only under `ray._private`.

The rule: no module of `chatlearn/` or `flows/` but this one imports `ray._private` / `ray._raylet` or reads a
private attribute of a Ray object (`tests/test_layers.py`); each use is a small function here, listed in
`PRIVATE_USES` with what it relies on, and `tests/test_private_api_pins.py` checks those against the installed Ray,
so a Ray upgrade that moves one fails there in one line naming this file, not mid-run. It sits in `cluster/`
because the cluster code (`launch`, `head`) is its only caller; Prefect's internals have their own room
(`chatlearn.runtime.prefect`).
"""

import contextlib
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import ray

VERIFIED_WITH = {"ray": "2.60.0"}

# (what this module relies on, the file to port when it moves), written as `chatlearn.runtime.prefect.PRIVATE_USES`
# is: a callable with its parameters' names (with a ``...``: the ones relied on), or an attribute that exists
PRIVATE_USES: list[tuple[str, str]] = [
    ("ray._private.accelerators.get_accelerator_manager_for_resource(resource_name)",
     "chatlearn/runtime/cluster/ray_private.py"),
    ("ray._private.accelerators.AcceleratorManager.get_current_node_num_accelerators()",
     "chatlearn/runtime/cluster/ray_private.py"),
    ("ray._private.accelerators.AcceleratorManager.get_current_process_visible_accelerator_ids()",
     "chatlearn/runtime/cluster/ray_private.py"),
    ("ray._private.authentication.authentication_token_setup._enable_token_auth()",
     "chatlearn/runtime/cluster/ray_private.py"),
    ("ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR", "chatlearn/runtime/cluster/ray_private.py"),
    ("ray._private.ray_constants.ENABLE_RAY_CLUSTER", "chatlearn/runtime/cluster/ray_private.py"),
    ("ray._private.worker._global_node", "chatlearn/runtime/cluster/ray_private.py"),
    ("ray._private.node.Node.all_processes", "chatlearn/runtime/cluster/ray_private.py"),
    ("ray._private.worker.Worker.gcs_client", "chatlearn/runtime/cluster/ray_private.py"),
    ("ray._raylet.InnerGcsClient.check_alive(self, node_ids, timeout)", "chatlearn/runtime/cluster/ray_private.py"),
    ("ray.init(address, ..., _node_ip_address)", "chatlearn/runtime/cluster/ray_private.py"),
]


def local_accelerators(resource: str = "GPU") -> tuple[int, list[str] | None]:
    """(how many ``resource`` devices this node has, the ids visible to this process or None when not
    restricted), as Ray's own `ray.init` detects them. Raises where Ray cannot tell (no driver library)."""
    from ray._private.accelerators import get_accelerator_manager_for_resource  # loads only when asked

    manager = get_accelerator_manager_for_resource(resource)
    return manager.get_current_node_num_accelerators(), manager.get_current_process_visible_accelerator_ids()


def enable_token_auth() -> None:
    """Ray's token authentication for a new local cluster: sets ``RAY_AUTH_MODE=token`` and refreshes the mode
    this process already cached (as Ray's own default does, without its warning)."""
    from ray._private.authentication import authentication_token_setup as auth  # loads only when asked

    auth._enable_token_auth()


@contextlib.contextmanager
def ray_clusters_disabled() -> Iterator[None]:
    """Ray's macOS/Windows mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) for the block: in `ray_constants`, where
    Ray's node-address lookup reads it at call time (it is read from the environment at import), and in the
    environment the Ray processes started meanwhile inherit; both put back after."""
    from ray._private import ray_constants  # loads only when asked

    saved_env = os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, None)
        else:
            os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = saved_env


def local_ray_processes() -> dict[str, list[subprocess.Popen | None]]:
    """The processes `ray.init` started for this driver's local Ray, by Ray's name for them (``gcs_server``,
    ``raylet``, the monitors); None for one it did not start as a child."""
    node = ray._private.worker._global_node
    return {name: [info.process for info in infos] for name, infos in node.all_processes.items()}


def check_gcs_alive(timeout: float) -> None:
    """Ask the GCS of the Ray this process is connected to whether it answers; raises (an RpcError) when it does
    not within ``timeout`` seconds."""
    ray._private.worker.global_worker.gcs_client.check_alive([], timeout=timeout)


def node_ip_address(address: str) -> dict[str, Any]:
    """`ray.init`'s keyword for this machine's address in the cluster (its private ``_node_ip_address``)."""
    return {"_node_ip_address": address}
