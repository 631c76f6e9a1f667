"""A local Prefect API for runs started without `PREFECT_API_URL`, shared safely between runs.

Ephemeral mode is not an option with Ray (every Ray worker would start its own temporary server). So
`chatlearn train` starts `prefect server start` on 127.0.0.1 for the run, prints where the UI is, and stops
it at the end. Runs that overlap share one server: a state file under a file lock records the server and
the live runs using it; the last run out stops it, and a server left behind by a killed run is adopted
(its users are dead) rather than fought over. The database lives in `CHATLEARN_PREFECT_HOME`
(default `~/.chatlearn/prefect`), so the UI keeps the history of earlier runs.
"""

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings


def prefect_home() -> Path:
    return Path(os.environ.get("CHATLEARN_PREFECT_HOME", "~/.chatlearn/prefect")).expanduser()


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except Exception:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _locked_state() -> Iterator[dict]:
    home = prefect_home()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "server.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = home / "server.json"
        try:
            state = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, json.JSONDecodeError):
            state = {}
        yield state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)


def _start_server(timeout: float) -> tuple[int, str]:
    home = prefect_home()
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {home / 'server.log'}")
        if healthy(url, timeout=1.0):
            return proc.pid, url
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"prefect server did not become healthy in {timeout:.0f}s; see {home / 'server.log'}")


def _stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    for _ in range(50):
        if not _alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _drain_prefect_workers() -> None:
    """Send queued logs and events while the server is still up (else: 'Error logging to API')."""
    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=10)


@contextlib.contextmanager
def local_prefect_api(timeout: float = 90.0, announce=print) -> Iterator[str]:
    """Yield a Prefect API URL: `PREFECT_API_URL` if set, else a shared local server (started if needed)."""
    existing = os.environ.get("PREFECT_API_URL")
    if existing:
        yield existing
        return
    me = os.getpid()
    with _locked_state() as state:
        users = [p for p in state.get("users", []) if _alive(p) and p != me]
        if not (_alive(state.get("pid")) and healthy(state.get("url", ""))):
            if _alive(state.get("pid")):
                _stop(state["pid"])
            state["pid"], state["url"] = _start_server(timeout)
            started = "started"
        else:
            started = "reusing"
        state["users"] = users + [me]
        url = state["url"]
    announce(f"Prefect UI ({started} local server): {url.removesuffix('/api')}")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            yield url
    finally:
        _drain_prefect_workers()
        os.environ.pop("PREFECT_API_URL", None)
        with _locked_state() as state:
            users = [p for p in state.get("users", []) if _alive(p) and p != me]
            state["users"] = users
            if not users and state.get("pid"):
                _stop(state["pid"])
                state.clear()
