"""One run per run directory: an OS file lock on `run_dir/.lock`, held for the run's lifetime.

Two runs of the same `output_dir/exp_name` at once would append to the same `metrics.jsonl` and race on the
same checkpoints. The first takes `fcntl.flock` on `run_dir/.lock` and writes its pid, host and start time
into the file; a second one fails to take the lock and is refused with a `RunError` naming them:

    run directory output/default is in use by pid 1234 (started 2026-12-01 20:41:07 UTC on host x); wait
    for it or use another runtime.exp_name

The kernel drops a flock when its holder's last descriptor closes, so a SIGKILLed run leaves no stale lock:
the re-run that resumes it takes the lock at once (its file still names the dead pid, which is only read
while someone holds the lock, so it is never shown). The descriptor is close-on-exec, so the Prefect server
and Ray processes the run starts never inherit it.

`chatlearn train` takes the lock before the Prefect server starts and the train flow takes it again in the
same process (a deployment run has no CLI around it). A second flock on a new descriptor of the same file
would fail even in the same process, so holders are counted per process in `_HELD`: re-entry from the same
process only counts up, and the lock goes when the last holder releases it. (So two threads of one process
may share a run directory; a process runs one run at a time.)
"""

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType

from chatlearn.utils.errors import RunError
from chatlearn.utils.storage import ensure_writable_dir, os_error_text

LOCK_NAME = ".lock"
# how long a refused run waits for the holder's details to appear (it may have just taken the lock)
_DETAILS_WAIT_S = 1.0


@dataclass
class _Held:
    fd: int
    count: int


# Why process-wide: POSIX record locks belong to the process, so who holds one is counted per process.
_HELD: dict[str, _Held] = {}  # lock file (real path) -> its descriptor in this process and how many hold it
_GUARD = threading.Lock()


class RunDirLock:
    """One holder's share of the lock on a run directory; `release` (or leaving the `with`) gives it back."""

    def __init__(self, run_dir: str, lock_path: str) -> None:
        self.run_dir = run_dir
        self.lock_path = lock_path
        self._released = False

    def release(self) -> None:
        """Give this share back (idempotent); the last share in the process truncates the file and unlocks."""
        with _GUARD:
            if self._released:
                return
            self._released = True
            held = _HELD.get(self.lock_path)
            if held is None:
                return
            held.count -= 1
            if held.count > 0:
                return
            del _HELD[self.lock_path]
            with contextlib.suppress(OSError):
                os.ftruncate(held.fd, 0)  # no holder details left behind after a clean exit
            os.close(held.fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def lock_path(run_dir: str | os.PathLike) -> str:
    return os.path.join(os.fspath(run_dir), LOCK_NAME)


def read_holder(run_dir: str | os.PathLike) -> dict | None:
    """The details the current holder wrote (pid, host, started, command), or None (none, or half written)."""
    try:
        with open(lock_path(run_dir)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("pid"), int) else None


def lock_run_dir(run_dir: str | os.PathLike, writable: Iterable[tuple[str, str]] = ()) -> RunDirLock:
    """Take the lock on ``run_dir`` (created if missing) for this process, or raise a RunError naming the
    process that holds it. ``writable`` are further (directory, what) pairs, e.g. the checkpoint directories,
    checked to be creatable and writable once the lock is held, so a bad path fails before anything starts.

    Also raises a RunError when ``run_dir`` itself cannot be created or written (a file in the way,
    read-only)."""
    run_dir = os.fspath(run_dir)
    ensure_writable_dir(run_dir, "run directory")
    path = os.path.realpath(lock_path(run_dir))
    with _GUARD:
        held = _HELD.get(path)
        if held is not None:
            held.count += 1
        else:
            _HELD[path] = _Held(_acquire(run_dir, path), 1)
    lock = RunDirLock(run_dir, path)
    try:
        for directory, what in writable:
            ensure_writable_dir(directory, what)
    except BaseException:
        lock.release()
        raise
    return lock


def _acquire(run_dir: str, path: str) -> int:
    """A descriptor holding the flock on ``path``, with this process's details written into the file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunError(f"cannot write the lock file {path}: {os_error_text(exc)}") from exc
    deadline = time.monotonic() + _DETAILS_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = read_holder(run_dir)
            if holder is not None or time.monotonic() >= deadline:
                os.close(fd)
                raise RunError(_in_use(run_dir, holder)) from None
            time.sleep(0.05)  # the holder has just taken the lock and not written its details yet
        except OSError as exc:  # e.g. a filesystem without locks
            os.close(fd)
            raise RunError(f"cannot lock {path}: {os_error_text(exc)}") from exc
    details = {"pid": os.getpid(), "host": socket.gethostname(),
               "started": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"), "command": " ".join(sys.argv)}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(details).encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise RunError(f"cannot write the lock file {path}: {os_error_text(exc)}") from exc
    return fd


def _in_use(run_dir: str, holder: dict | None) -> str:
    who = "another process"
    if holder is not None:
        who = f"pid {holder['pid']} (started {holder.get('started', '?')} on host {holder.get('host', '?')})"
    return f"run directory {run_dir} is in use by {who}; wait for it or use another runtime.exp_name"
