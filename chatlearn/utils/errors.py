"""Errors a user can act on: each one reads as one line (a config's: one per problem) on the terminal, without a
traceback, whichever layer raises it (the CLI, the train flow, a stage task, a Ray actor).

They are all `UserError`s. `ConfigError` (chatlearn.config), `DataError` (chatlearn.data.prompts),
`PlacementError` (chatlearn.runtime.cluster.placement) and `CheckpointError` (chatlearn.checkpoint) are mostly found
before a run starts. `RunError` is everything found once it runs: a user hook that raised or returned a
non-number, a non-finite reward or loss, a stage past its timeout, a checkpoint that cannot be written, a model
process lost more often than the retries allow, a run directory that holds another run. The message says where
(episode, stage, model, sample, hook, path) and what; the traceback, when there is one, goes to the run's log
file, not to the terminal. The CLI prints ``chatlearn: error: <message>`` and exits 1 (2 for what was refused
before anything started: a config, data, a placement).

A name the user misspelt (a config key, a registered piece, an import path) gets the nearest known one:
`did_you_mean`.
"""

import difflib
from collections.abc import Iterable
from typing import Any


class UserError(Exception):
    """An error meant for the user, with a message that says what to do (see the module docstring)."""


class _Message:
    """An exception that is its message, kept through pickling (Ray and Prefect ship exceptions between
    processes)."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))


class RunError(_Message, UserError, RuntimeError):
    """A failure of a running run, with a message that names where it happened and what to do."""


class RunCrashed(_Message, BaseException):
    """The run cannot go on for a cause outside it (the Ray head of the cluster it joined went away): one line,
    exit 1. A BaseException, as a stop is: Prefect marks the flow run Crashed, as for a killed run, not Failed,
    and retries nothing; a re-run resumes from the last checkpoint."""


def find_error(exc: BaseException | None,
               kind: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException | None:
    """The ``kind`` of error inside ``exc``: itself, one a Ray ``RayTaskError`` wraps (``.cause``), or one in its
    ``__cause__`` / ``__context__`` chain; None when there is none."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        # first what Ray wraps: a RayTaskError is also an instance of its cause's class, but its str() is the
        # remote traceback
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            found = find_error(cause, kind)
            if found is not None:
                return found
        if isinstance(exc, kind):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def find_user_error(exc: BaseException | None, kind: type[UserError] = UserError) -> UserError | None:
    """The ``kind`` of user error inside ``exc`` (see `find_error`); None when there is none."""
    found = find_error(exc, kind)
    return found if isinstance(found, UserError) else None


def find_run_error(exc: BaseException | None) -> RunError | None:
    """The RunError inside ``exc`` (see `find_user_error`)."""
    found = find_user_error(exc, RunError)
    return found if isinstance(found, RunError) else None


# How alike a misspelt key and a known name must be (difflib's ratio) for "did you mean X?": low enough for a
# dropped or swapped letter (num_episodes, temprature: 0.95), high enough that an unrelated key gets no guess.
SUGGEST_CUTOFF = 0.7


def closest_name(key: Any, known: Iterable[Any], cutoff: float = SUGGEST_CUTOFF) -> str | None:
    """The known name nearest to a misspelt ``key`` (None when nothing is close, or ``key`` is not text)."""
    if not isinstance(key, str) or not key:
        return None
    names = [k for k in known if isinstance(k, str) and k != key]
    matches = difflib.get_close_matches(key, names, n=1, cutoff=cutoff)
    return matches[0] if matches else None


def did_you_mean(key: Any, known: Iterable[Any], cutoff: float = SUGGEST_CUTOFF) -> str:
    """``"; did you mean X?"`` for the known name nearest to ``key``, else ``""`` (appended to a message)."""
    match = closest_name(key, known, cutoff)
    return f"; did you mean {match}?" if match else ""
