"""The terminal of `chatlearn train` / `eval`: a failure that is a user error (`chatlearn.utils.errors`: a config,
data, a placement, a `RunError`) reads as its line there, and its traceback goes to the run's log file,
`run_dir/chatlearn.log`. So does a lost model process: the train flow recovers from it with one warning line
(`chatlearn.runtime.calls.recovery`), or ends with one error line once it gave up.

Prefect logs a failed task run and each flow run it fails (the episode subflow, the train flow) with the whole
traceback, through the console handler it puts on the root logger: one reward hook that raised would print
three tracebacks, and three "Finished in state Failed(...)" lines, before the CLI's own
``chatlearn: error: <message>``; a model process killed mid-episode, 15-40 lines of Ray's ``ActorDiedError``
before the recovery's warning. While `run_log` is active, every log record of the process also goes to the
log file, and a filter on the console handlers drops the records of such a failure: those that carry it
(``exc_info``: a user error, or Ray's word that an actor, a worker or a node died) and, after one did, Prefect's
"Finished in state Failed / NotReady" lines. Everything else (progress, warnings, the traceback of any other
exception, which is a bug of ours and must show) reaches the terminal as before. (A lost process that the run
does not recover from, e.g. in `chatlearn eval`, still ends with its traceback on the terminal, from the CLI.)
A filter rather than a Prefect logging config of our own (PREFECT_LOGGING_SETTINGS_PATH): the user's Prefect
logging settings keep working, and nothing changes outside the CLI's train and eval.
"""

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from chatlearn.runtime.calls.stopping import stopping
from chatlearn.utils.errors import find_error, find_user_error

LOG_NAME = "chatlearn.log"
LOG_FORMAT = "%(asctime)s | %(levelname)-7s | %(name)s - %(message)s"

logger = logging.getLogger("chatlearn")


def process_died(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or holds, Ray's word that an actor, a worker process or a node died (or the objects
    one owned were lost with it): how a lost model process fails the calls that were waiting on it."""
    rex = sys.modules.get("ray.exceptions")  # never imported here: an exception of Ray's means Ray is loaded
    if rex is None:
        return False
    return find_error(exc, (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError,
                            rex.ObjectLostError)) is not None


class FailureConsoleFilter(logging.Filter):
    """Drops, on a console handler, what Prefect logs about a failure the CLI or the train flow reports in one
    line (a user error, a lost model process); the log file keeps the records."""

    def __init__(self) -> None:
        super().__init__()
        self.failure_seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if stopping():  # SIGTERM / Ctrl-C: what fails on the way out is the stop (the CLI says so in one line)
            prefect = record.name.startswith("prefect")
            return exc is None and not (prefect and (record.levelno >= logging.ERROR
                                                     or record.getMessage().startswith("Finished in state")))
        if exc is not None and (find_user_error(exc) is not None or process_died(exc)):
            self.failure_seen = True
            return False
        # Prefect's summary of each failed run (Failed) and of the tasks that then never ran (NotReady) come after
        # the traceback record, in the same thread
        if self.failure_seen and record.name.startswith("prefect"):
            message = record.getMessage()
            return not (message.startswith("Finished in state") and not message.startswith("Finished in state Comp"))
        return True


class QuietConsoleFilter(logging.Filter):
    """Keeps Prefect's INFO lines (a flow or task run began or finished, where to view it) and ours (how the
    weights travel, start-up seconds) off the terminal, where they would scroll through the progress bar: they
    are in the UI and the log file. Warnings and errors still show; `chatlearn train --verbose` shows
    everything."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(("prefect", "chatlearn"))


class _LogFormatter(logging.Formatter):
    """LOG_FORMAT, with the flow or task run a Prefect record is about, as Prefect's console shows it."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        task, flow = getattr(record, "task_run_name", None), getattr(record, "flow_run_name", None)
        run = f"Task run {task!r}" if task else f"Flow run {flow!r}" if flow else None
        return text.replace(f"{record.name} - ", f"{record.name} - {run} - ", 1) if run else text


def _open_log(run_dir: str | os.PathLike) -> logging.FileHandler:
    """A handler appending to ``run_dir/chatlearn.log``; a file in the temporary directory when the run
    directory cannot hold it (the run then fails on that directory with its own error)."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        handler = logging.FileHandler(Path(run_dir) / LOG_NAME, encoding="utf-8")
    except OSError:
        fd, path = tempfile.mkstemp(prefix="chatlearn-", suffix=".log")
        os.close(fd)
        handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(_LogFormatter(LOG_FORMAT))
    return handler


def _console_handlers(root: logging.Logger) -> list[logging.Handler]:
    """The root logger's handlers that write to a terminal stream (Prefect's console handler, or the user's)."""
    return [h for h in root.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


@contextlib.contextmanager
def run_log(run_dir: str | os.PathLike, verbose: bool = False) -> Iterator[Path]:
    """While the block runs: every log record also goes to ``run_dir/chatlearn.log`` (yielded), and the console
    drops what Prefect logs about a user error's failure or a lost model process, and (unless ``verbose``) its
    INFO lines. An exception holding a user
    error that leaves the block is logged there with its whole traceback (chain included: the user's hook, the
    Ray task, the stage) before it goes on to the CLI, which prints its one line."""
    # lazy: Prefect loads only for the commands that run something. Its logging is set up first: set up after
    # our file handler is on the root logger, Prefect would take that for the user's and add no console handler
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()
    root = logging.getLogger()
    handler = _open_log(run_dir)
    filters: list[logging.Filter] = [FailureConsoleFilter()] + ([] if verbose else [QuietConsoleFilter()])
    consoles = _console_handlers(root)
    root.addHandler(handler)
    # our INFO lines for the file (and the terminal when verbose): the root's level (Prefect's WARNING) would
    # stop them at our logger
    level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    for console in consoles:
        for f in filters:
            console.addFilter(f)
    try:
        yield Path(handler.baseFilename)
    except Exception as exc:
        if find_user_error(exc) is not None:
            # the console filter drops this record (it carries the user error); the file gets the traceback
            logger.error("the run stopped: %s", find_user_error(exc), exc_info=exc)
        raise
    finally:
        for console in consoles:
            for f in filters:
                console.removeFilter(f)
        root.removeHandler(handler)
        handler.close()
        logger.setLevel(level)
