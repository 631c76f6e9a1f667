"""A local Prefect API for runs started without `PREFECT_API_URL`, shared safely between runs.

Ephemeral mode is not an option with Ray (every Ray worker would start its own temporary server). So
`chatlearn train` starts `prefect server start` on 127.0.0.1 for the run, prints where the UI is, and stops
it at the end. Runs that overlap share one server: a state file under a file lock records the server and
the live runs using it; the last run out stops it, and a server left behind by a killed run is adopted
(its users are dead) rather than fought over. The database lives in `CHATLEARN_PREFECT_HOME`
(default `~/.chatlearn/prefect`), so the UI keeps the history of earlier runs.

Direct Python calls (`train_flow(cfg)`, `engine.learn()`) use the same server
(`chatlearn.runtime.prefect.prevalidated`), and `chatlearn server` keeps it up between runs (`serve_forever`): it
is one more user, so runs join it and never stop it. "An API is configured" means Prefect's effective
`PREFECT_API_URL` (environment, profile, `temporary_settings`, the pytest harness), so a configured server or
Prefect Cloud is always used as is.
"""

import base64
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

from chatlearn.runtime.prefect import api_link
from chatlearn.runtime.prefect.api_link import healthy
from chatlearn.utils.errors import RunError


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


LOOPBACK = "127.0.0.1"
WILDCARD = ("0.0.0.0", "::", "")  # every address of this machine: local clients use the loopback one


def public_url(url: str, host: str) -> str:
    """The API address for other machines (and the UI in their browsers): this machine's name for a server on
    every address, else ``url``."""
    return url.replace(f"//{LOOPBACK}:", f"//{socket.getfqdn()}:", 1) if host in WILDCARD else url


def client_auth() -> str | None:
    """The basic-auth ``user:password`` this process's Prefect clients send (Prefect's PREFECT_API_AUTH_STRING)."""
    return os.environ.get("PREFECT_API_AUTH_STRING") or PREFECT_API_AUTH_STRING.value() or None


def authorized(url: str, auth: str | None, timeout: float = 5.0) -> bool:
    """Whether the API at ``url`` answers a request sent with ``auth`` (None: no credentials)."""
    request = urllib.request.Request(url.rstrip("/") + "/admin/version")
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status == 200
    except Exception:
        return False


@dataclass(frozen=True)
class ServerSettings:
    """How `chatlearn server` asks the local server to listen: host, port (None: a free one) and the basic-auth
    ``user:password`` (Prefect's PREFECT_SERVER_API_AUTH_STRING; handed to the server's environment, never
    printed or written down)."""

    host: str = LOOPBACK
    port: int | None = None
    auth: str | None = field(default=None, repr=False)

    def served_by(self, state: dict[str, Any]) -> bool:
        """Whether the recorded server listens and authenticates as asked."""
        url = state.get("url", "")
        return (state.get("host", LOOPBACK) == self.host
                and (self.port is None or url.endswith(f":{self.port}/api"))
                and bool(state.get("auth")) == bool(self.auth)
                and (not self.auth or authorized(url, self.auth)))

    def terms(self) -> str:
        return f"host {self.host}, port {self.port or 'any'}, {'with' if self.auth else 'without'} authentication"


# Task runs reach the server as events (Pending, Running, Completed each), which its task run recorder writes to
# the database. By default it writes each event in a transaction of its own: about 45 ms of server CPU per task
# run here, on the cores the model processes train on (an episode of the default has about 17 task runs). In
# batches of up to 100, flushed every second: about 15 ms (`bench/overhead.py`); the UI shows a task run's state
# up to a second later.
SERVER_TUNING = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}


def _start_server(timeout: float, port: int | None = None, host: str = LOOPBACK,
                  auth: str | None = None) -> tuple[int, str]:
    home = prefect_home()
    port = port or _free_port()
    url = f"http://{LOOPBACK if host in WILDCARD else host}:{port}/api"
    # The UI asks `GET /ui-settings` where the API is; unset, the server answers Prefect's default port 4200
    # whatever `--port` says, and the page shows "Can't connect to Server API". Both names: old and new.
    ui_api = public_url(url, host)
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_UI_API_URL=ui_api, PREFECT_UI_API_URL=ui_api)
    for key, value in SERVER_TUNING.items():  # what this shell sets wins
        env.setdefault(key, value)
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_SERVER_API_AUTH_STRING", None)  # basic auth exactly when asked for (ServerSettings.auth)
    if auth:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth
    log = open(home / "server.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {proc.returncode}; see {home / 'server.log'}")
            if healthy(url, timeout=1.0):
                return proc.pid, url
            time.sleep(0.3)
    except BaseException:  # a stop (SIGTERM, Ctrl-C) while it starts: the server, in its own session, goes too
        _stop(proc.pid)
        raise
    _stop(proc.pid)
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


def _join_local_server(timeout: float, server: "ServerSettings | None" = None) -> tuple[str, str]:
    """Register this process as a user of the shared local server, starting it if none is healthy: as
    `server` says (`chatlearn server`), else any will do (a run), on 127.0.0.1 without authentication when it
    starts one. A server that requires authentication needs this process's credentials (RunError otherwise).

    Returns (api url, "started" | "reusing").
    """
    me = os.getpid()
    with _locked_state() as state:
        users = [p for p in state.get("users", []) if _alive(p) and p != me]
        running = _alive(state.get("pid")) and healthy(state.get("url", ""))
        if running and server is not None and not server.served_by(state):
            if users:
                raise RunError(f"the local Prefect server {state['url']} (pid {state['pid']}) serves {len(users)} "
                               f"run(s) on other terms than asked ({server.terms()}); stop them first")
            running = False  # nobody uses it: started again as asked
        if not running:
            if _alive(state.get("pid")):
                _stop(state["pid"])
            wanted = server or ServerSettings()
            state["pid"], state["url"] = _start_server(timeout, wanted.port, wanted.host, wanted.auth)
            state.update(host=wanted.host, auth=bool(wanted.auth))
            started = "started"
        else:
            started = "reusing"
        credentials = server.auth if server is not None else client_auth()
        if state.get("auth") and not authorized(state["url"], credentials):
            raise RunError(f"the local Prefect server {state['url']} requires authentication, and this process "
                           f"{'sends other credentials' if credentials else 'sends none'}: set "
                           "PREFECT_API_AUTH_STRING to the user:password it was started with "
                           "(PREFECT_SERVER_API_AUTH_STRING of `chatlearn server`)")
        state["users"] = users + [me]
        return state["url"], started


# a server that is alive but has not answered for this long is taken for hung and started again
_HUNG_S = 60.0


def restart_local_server(url: str, timeout: float = 90.0) -> bool:
    """Start the shared local server at ``url`` again, on the same port and database, when its process is
    gone (or hung for `_HUNG_S`); True when it answers. Any run using it may do this (under the state lock:
    the first one restarts it, the others find it answering). Clients keep their URL, so the flow runs, logs
    and artifacts of the runs go on where they were."""
    with _locked_state() as state:
        if state.get("url") != url or healthy(url):
            state.pop("unhealthy_since", None)
            return healthy(url)
        pid = state.get("pid")
        if _alive(pid):
            since = state.setdefault("unhealthy_since", time.time())
            if time.time() - since < _HUNG_S:
                return False
            _stop(pid)
        state.pop("unhealthy_since", None)
        port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        # as it was: its host, and its authentication (this process's credentials are the server's: they
        # worked); never open without them
        auth = client_auth() if state.get("auth") else None
        if state.get("auth") and not auth:
            return False
        state["pid"], _ = _start_server(timeout, port, state.get("host", LOOPBACK), auth)
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


def serve_forever(announce: Callable[[str], Any] = print, timeout: float = 90.0,
                  server: ServerSettings | None = None) -> None:
    """Keep the shared local server up until SIGINT/SIGTERM (`chatlearn server`).

    Starts or joins the server as `local_prefect_api` does, but always the local one (an API set in this
    shell is only mentioned): the point is a UI that outlives runs, and a URL to export for `prefect`
    commands and workers. This process counts as a user, so runs join the server and leave it up; on a
    signal it leaves like a run does, stopping the server if no run uses it. A server process that dies meanwhile
    is started again on the same port and database (see `CHATLEARN_PREFECT_HOME/server.log` for why it died).
    `server`: the host, port and authentication asked for (default: 127.0.0.1, a free port, none); a server
    running on other terms is started again as asked when no run uses it (RunError when one does).
    """
    server = server or ServerSettings()
    other = configured_api_url()
    stop = threading.Event()  # handlers first: a signal while the server starts still leaves cleanly
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        url, started = _join_local_server(timeout, server)
    except BaseException:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise
    try:
        announce(f"Prefect UI ({started} local server): {public_url(url, server.host).removesuffix('/api')}")
        if other and other != url:
            announce(f"note: PREFECT_API_URL is set to {other} here; runs started with it use that API")
        announce(f"export PREFECT_API_URL={public_url(url, server.host)}")
        if server.auth:  # the secret itself is never printed
            announce("API authentication: on (PREFECT_SERVER_API_AUTH_STRING); clients need "
                     "export PREFECT_API_AUTH_STRING=<the same user:password>")
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
