"""A local Prefect API for runs started without `PREFECT_API_URL`, shared safely between runs.

Ephemeral mode is not an option with Ray (every Ray worker would start its own temporary server). So
`chatlearn train` starts `prefect server start` on 127.0.0.1 for the run, prints where the UI is, and stops
it at the end. Runs that overlap share one server: a state file under a file lock records the server and
the live runs using it; the last run out stops it, and a server left behind by a killed run is adopted
(its users are dead) rather than fought over. The database lives in `CHATLEARN_PREFECT_HOME`
(default `~/.chatlearn/prefect`), so the UI keeps the history of earlier runs.

Direct Python calls (`train_flow(cfg)`, `engine.learn()`) use the same server (`flows.prevalidated`), and
`chatlearn server` keeps it up between runs (`serve_forever`): it is one more user, so runs join it and
never stop it. "An API is configured" means Prefect's effective `PREFECT_API_URL` (environment, profile,
`temporary_settings`, the pytest harness), so a configured server or Prefect Cloud is always used as is.
"""

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


def _start_server(timeout: float, port: int | None = None) -> tuple[int, str]:
    home = prefect_home()
    port = port or _free_port()
    url = f"http://127.0.0.1:{port}/api"
    # The UI asks `GET /ui-settings` where the API is; unset, the server answers Prefect's default port 4200
    # whatever `--port` says, and the page shows "Can't connect to Server API". Both names: old and new.
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_UI_API_URL=url, PREFECT_UI_API_URL=url)
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


def configured_api_url() -> str | None:
    """The Prefect API this process would talk to, or None (Prefect would fall back to ephemeral mode).

    Prefect's effective setting covers profiles, `temporary_settings` and the pytest harness; the
    environment is read too because Prefect reads it once at import, and a launcher may set it later.
    """
    return os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value() or None


def _join_local_server(timeout: float) -> tuple[str, str]:
    """Register this process as a user of the shared local server, starting it if none is healthy.

    Returns (api url, "started" | "reusing").
    """
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
        return state["url"], started


# a server that is alive but has not answered for this long is taken for hung and started again
_HUNG_S = 30.0


def restart_local_server(url: str, timeout: float = 90.0) -> bool:
    """Start the shared local server at ``url`` again, on the same port and database, when its process is
    gone (or hung for `_HUNG_S`); True when it answers. Any run using it may do this (under the state lock:
    the first one restarts it, the others find it answering). Clients keep their URL, so the flow runs, logs
    and artifacts of the runs go on where they were."""
    with _locked_state() as state:
        if state.get("url") != url or healthy(url):
            return healthy(url)
        pid = state.get("pid")
        if _alive(pid):
            since = state.setdefault("unhealthy_since", time.time())
            if time.time() - since < _HUNG_S:
                return False
            _stop(pid)
        state.pop("unhealthy_since", None)
        port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        state["pid"], _ = _start_server(timeout, port)
        return True


def _leave_local_server() -> None:
    """Unregister this process; the last live user stops the server (dead users do not count)."""
    me = os.getpid()
    with _locked_state() as state:
        users = [p for p in state.get("users", []) if _alive(p) and p != me]
        state["users"] = users
        if not users and state.get("pid"):
            _stop(state["pid"])
            state.clear()


@contextlib.contextmanager
def local_prefect_api(timeout: float = 90.0, announce: Callable[[str], Any] = print) -> Iterator[str]:
    """Yield a Prefect API URL: the configured one if any, else a shared local server (started if needed).

    Nesting is harmless: an inner call sees the URL the outer one set and just yields it.
    """
    existing = configured_api_url()
    if existing:
        if PREFECT_API_URL.value() == existing:
            yield existing
        else:  # set in the environment after Prefect read it: make Prefect's clients see it too
            with temporary_settings({PREFECT_API_URL: existing}):
                yield existing
        return
    from chatlearn.runtime.records import api_link  # it imports this module

    url, started = _join_local_server(timeout)
    announce(f"Prefect UI ({started} local server): {url.removesuffix('/api')}")
    os.environ["PREFECT_API_URL"] = url
    try:
        # the server this run uses is started again if it dies meanwhile (api_link)
        with temporary_settings({PREFECT_API_URL: url}), api_link.watch(url, lambda: restart_local_server(url)):
            yield url
    finally:
        # queued logs and events go out while the server is still up (else: 'Error logging to API'), for a
        # bounded time: a server that is gone must not hold the command at exit
        api_link.drain_prefect(timeout=10)
        os.environ.pop("PREFECT_API_URL", None)
        _leave_local_server()


def serve_forever(announce: Callable[[str], Any] = print, timeout: float = 90.0) -> None:
    """Keep the shared local server up until SIGINT/SIGTERM (`chatlearn server`).

    Starts or joins the server as `local_prefect_api` does, but always the local one (an API set in this
    shell is only mentioned): the point is a UI that outlives runs, and a URL to export for `prefect`
    commands and workers. This process counts as a user, so runs join the server and leave it up; on a
    signal it leaves like a run does, stopping the server if no run uses it. A server process that dies meanwhile
    is started again on the same port and database (see `CHATLEARN_PREFECT_HOME/server.log` for why it died).
    """
    other = configured_api_url()
    stop = threading.Event()  # handlers first: a signal while the server starts still leaves cleanly
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        url, started = _join_local_server(timeout)
    except BaseException:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise
    try:
        announce(f"Prefect UI ({started} local server): {url.removesuffix('/api')}")
        if other and other != url:
            announce(f"note: PREFECT_API_URL is set to {other} here; runs started with it use that API")
        announce(f"export PREFECT_API_URL={url}")
        announce("serving until Ctrl-C (runs started meanwhile use this server and leave it up)")
        sys.stdout.flush()  # `print` into a pipe or file would hold the lines back until we exit
        while not stop.wait(1.0):
            with _locked_state() as state:
                server_pid = state.get("pid")
            if not _alive(server_pid):  # a run may have started it again already; else this does
                announce(f"the Prefect server (pid {server_pid}) exited; starting it again on the same database "
                         f"(see {prefect_home() / 'server.log'})")
                restart_local_server(url, timeout)
                sys.stdout.flush()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _leave_local_server()
