"""SIGTERM and Ctrl-C stop a run within seconds and leave things clean.

Without this, SIGTERM lands in Ray's C++ failure handler (installed by `ray.init`), which prints a stack and
aborts the driver: the Prefect server the run started is orphaned and the flow run stays Running. Python's
default SIGINT raises KeyboardInterrupt in the main thread only, while the episode's stage threads stay
blocked on their actors, and Prefect's thread-pool runner waits for them on the way out.

So `chatlearn train` / `eval` install `stop_on_signals()`: SIGTERM and SIGINT set the stop flag, kill the
run's model processes (registered by `launch` with `on_stop`; every blocked stage call then fails at once)
and raise `Stopped` (a KeyboardInterrupt) in the main thread. `launch` tears the rest down, the local
Prefect server is left (and stopped when this was its last user), and the CLI prints one line naming the
checkpoint a re-run resumes from. Checkpoints are written to a temporary name and renamed, so a stop in the
middle of one leaves the previous checkpoint the resume point. `ray.init` installs its own handler again:
`keep_handlers()` puts ours back around it. The CLI installs them before anything starts, so a stop during
start-up (the Prefect server or Ray starting, the model processes being created) reads the same and leaves
nothing running either: each starter tears down what it started when a stop interrupts it.

While a flow runs, Prefect replaces the SIGTERM handler with its own (it raises TerminationSignal to mark the
flow run Crashed, then re-sends the signal to ours), and the episode subflow's thread pool waits for its stage
threads before that happens. So the model processes are killed from a watcher thread instead, woken through
`signal.set_wakeup_fd`, which sees every signal whichever Python handler is installed.
"""

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

# Why process-wide: a signal is delivered to the process; every wait of the driver asks these.
_STOP = threading.Event()
_SIGNAME: list[str] = []
_ON_STOP: list[Callable[[], Any]] = []
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(KeyboardInterrupt):
    """The run was asked to stop (SIGTERM or Ctrl-C)."""

    def __init__(self, signame: str = "SIGTERM") -> None:
        super().__init__(signame)
        self.signame = signame


def stop_signal() -> str | None:
    """The name of the signal that stopped the run (None: none did)."""
    return _SIGNAME[-1] if _SIGNAME else None


def stopping() -> bool:
    """Whether a stop signal arrived (a dead model process is then not a fault to recover from)."""
    return _STOP.is_set()


_FIRE_LOCK = threading.Lock()


def _fire(signame: str) -> None:
    """Set the stop flag and run the stop callbacks, once."""
    with _FIRE_LOCK:
        if _STOP.is_set():
            return
        _SIGNAME.append(signame)
        _STOP.set()
        callbacks = list(_ON_STOP)
    for callback in callbacks:
        with contextlib.suppress(Exception):
            callback()


def _handler(signum: int, frame: Any) -> None:
    _fire(signal.Signals(signum).name)
    raise Stopped(signal.Signals(signum).name)


def _watch(read_fd: int) -> None:
    """Wake on every signal byte the interpreter writes to the wakeup fd; stop on SIGTERM / SIGINT."""
    wanted = {int(sig) for sig in _SIGNALS}
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:  # the write end closed: the run is over
            return
        for byte in data:
            if byte in wanted:
                _fire(signal.Signals(byte).name)
                break


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGTERM/SIGINT stop the run as the module says. Main thread only (elsewhere: a no-op).

    Whatever escapes a stopped scope is the stop (`Stopped`: an actor killed for it, Prefect's wrapper around
    it), and the stop ends with the scope: a later run in the same process (a second `chatlearn.cli.main` in a
    notebook, the next test) starts unstopped, where a stop flag left set would stop it at its first stage."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP.clear()
    _SIGNAME.clear()
    previous = {sig: signal.signal(sig, _handler) for sig in _SIGNALS}
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_fd,), name="chatlearn-stop-watcher", daemon=True)
    watcher.start()
    try:
        yield
    except Exception as exc:
        if _STOP.is_set():
            raise Stopped(stop_signal() or "SIGTERM") from exc
        raise
    finally:
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)
        watcher.join(timeout=5)
        os.close(read_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _STOP.clear()
        _SIGNAME.clear()


@contextlib.contextmanager
def keep_handlers() -> Iterator[None]:
    """Around `ray.init`: put back the Python handlers it replaces with Ray's (which aborts the process).

    While `ray.init` runs, SIGTERM meets the handler it installs first, ``sys.exit(signum)``: that SystemExit
    is the stop it is (`Stopped`), so a run stopped while Ray starts ends as one stopped at any other time."""
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.getsignal(sig) for sig in _SIGNALS} if main else {}
    try:
        yield
    except SystemExit as exc:
        if not main or exc.code != signal.SIGTERM:
            raise
        _fire("SIGTERM")
        raise Stopped("SIGTERM") from None
    finally:
        for sig, handler in before.items():
            if callable(handler) or handler in (signal.SIG_IGN, signal.SIG_DFL):
                signal.signal(sig, handler)


@contextlib.contextmanager
def on_stop(callback: Callable[[], Any]) -> Iterator[None]:
    """Within: a stop signal calls ``callback`` (e.g. kill the run's model processes) before raising."""
    _ON_STOP.append(callback)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _ON_STOP.remove(callback)
