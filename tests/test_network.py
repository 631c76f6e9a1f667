"""A local `chatlearn train` opens nothing to the network: every socket its processes listen on (the Prefect
server it starts, Ray's GCS, raylet, agents, workers and actors) is bound to a loopback address."""

import ipaddress
import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration


def listening(root: psutil.Process) -> dict[tuple[str, int], str]:
    """(address, port) -> process name, for every listening TCP socket of ``root`` and its descendants."""
    try:
        procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in procs:
            with_name = procs[conn.pid]
            try:
                name = " ".join(with_name.cmdline()[:3])[:80]
            except psutil.Error:
                name = "?"
            out[(conn.laddr.ip, conn.laddr.port)] = name
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_a_local_run_listens_on_loopback_only(tiny_model_dir, tmp_path):
    # the command's defaults, not the test session's: no Prefect API (it starts its own server), Ray's auth
    # mode unset (the run turns token authentication on)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_AUTH_MODE", "RAY_ADDRESS")}
    env.update(CHATLEARN_OUTPUT_DIR=str(tmp_path / "out"), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               CHATLEARN_PREFECT_HOME=str(tmp_path / "prefect"), HOME=str(tmp_path / "home"))
    proc = subprocess.Popen([sys.executable, "-m", "chatlearn.cli", "train", "runtime.num_episode=2",
                             "runtime.eval_episode_interval=0"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    seen: dict[tuple[str, int], str] = {}
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(listening(root))
        time.sleep(0.2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "home" / ".ray" / "auth_token").is_file(), "token authentication was not turned on"
    names = {name for name in seen.values()}
    assert any("prefect" in n for n in names) and any("raylet" in n or "ray::" in n for n in names), seen
    assert len(seen) >= 5, seen  # the Prefect server, GCS, raylet, agents, workers were all sampled
    exposed = {addr: name for addr, name in seen.items() if not is_loopback(addr[0])}
    assert not exposed, f"listening beyond loopback: {exposed}"
