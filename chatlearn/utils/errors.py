"""Errors a user can act on, raised while a run is going: each one reads as one line on the terminal.

`ConfigError` (chatlearn.config) and `DataError` (chatlearn.data.prompts) are found before a run starts;
`RunError` is everything found once it runs: a user hook that raised or returned a non-number, a non-finite
reward or loss, a stage past its timeout, a checkpoint that cannot be written, a model process lost more often
than the retries allow. The message says where (episode, stage, model, sample, hook, path) and what; the
traceback, when there is one, goes to the run's log file, not to the terminal. The CLI prints
``chatlearn: error: <message>`` and exits 1.
"""

from typing import Any


class RunError(RuntimeError):
    """A failure of a running run, with a message that names where it happened and what to do."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # the message survives pickling (Ray and Prefect ship exceptions between processes)
        return (type(self), (self.message,))


def find_run_error(exc: BaseException | None) -> RunError | None:
    """The RunError inside ``exc``: itself, a Ray ``RayTaskError`` wrapping one (``.cause``), or one in its
    ``__cause__`` / ``__context__`` chain; None when there is none."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        # first what Ray wraps: a RayTaskError is also an instance of its cause's class, but its str() is the
        # remote traceback
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            found = find_run_error(cause)
            if found is not None:
                return found
        if isinstance(exc, RunError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
