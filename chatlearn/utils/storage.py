"""Storage faults as one-line errors: a write that fails (disk full, read-only, a file where a directory should
be) becomes a `RunError` naming the path and the OS error, e.g.
``cannot write checkpoint to output/x/checkpoints/policy/iter_0000004: [Errno 28] No space left on device``.

The libraries that write a run's files do not all say "OSError": safetensors raises its own error with
``(os error 28)`` in the text, Ray wraps an actor's error in a `RayTaskError` (the original in ``.cause``).
`os_error_of` finds the OS error in any of those, so the writer can report it the same way wherever it
happened. `ensure_writable_dir` is the up-front check (before Ray or Prefect start): a directory the run will
write into can be created and written, so "path is a file" or "read-only" fails at once, not after the first
episode.
"""

import contextlib
import errno as errno_codes
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

from chatlearn.utils.errors import RunError

# how safetensors' Rust error (and Rust's io::Error in general) names the errno
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_text(exc: OSError) -> str:
    """``[Errno 28] No space left on device``: the OS error without the file name (the message names it)."""
    if exc.errno is None:
        return str(exc)
    return f"[Errno {exc.errno}] {exc.strerror or os.strerror(exc.errno)}"


def os_error_of(exc: BaseException | None) -> OSError | None:
    """The OS error behind ``exc``: itself, the ``.cause`` of a Ray ``RayTaskError``, the errno in a
    safetensors error's text, or one in its ``__cause__`` chain; None when there is none (or when a RunError
    already explains the failure: that message is kept as it is)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)  # Ray: a RayTaskError is also an instance of its cause's class
        if isinstance(cause, BaseException) and cause is not exc:
            return os_error_of(cause)
        if isinstance(exc, RunError):
            return None
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        if type(exc).__name__ == "SafetensorError" and (m := _RUST_OS_ERROR.search(str(exc))):
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
        exc = exc.__cause__  # only an explicit `raise ... from`: a context is a different failure
    return None


def write_error(what: str, path: str | os.PathLike, exc: OSError) -> RunError:
    """``cannot write <what> to <path>: [Errno N] <reason>`` as a RunError."""
    return RunError(f"cannot write {what} to {os.fspath(path)}: {os_error_text(exc)}")


@contextlib.contextmanager
def writing(what: str, path: str | os.PathLike, cleanup: str | os.PathLike | None = None) -> Iterator[None]:
    """Around a write of ``what`` at ``path``: an OS error inside (also one wrapped by Ray or safetensors)
    becomes `write_error`; ``cleanup`` (a temporary file or directory of the write) is removed first, so no
    half-written leftover stays behind. Any other error passes unchanged."""
    try:
        yield
    except BaseException as exc:
        os_error = os_error_of(exc)
        if os_error is None:
            raise
        if cleanup is not None:
            remove_quietly(cleanup)
        raise write_error(what, path, os_error) from exc


def remove_quietly(path: str | os.PathLike) -> None:
    """Remove a file or directory tree if it is there; a failure to clean up must not hide the real error."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def ensure_writable_dir(path: str | os.PathLike, what: str) -> None:
    """Create directory ``path`` if needed and prove it is writable (a probe file, removed again).

    Raises a RunError naming ``what`` (e.g. "run directory"), the path and the OS error: a file in the way
    (``[Errno 17] File exists``, or ``[Errno 20] Not a directory`` for a file higher up), no permission, a
    read-only filesystem, a full disk."""
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        hint = " (a file is in the way)" if exc.errno in (errno_codes.EEXIST, errno_codes.ENOTDIR) else ""
        raise RunError(f"cannot create the {what} {path}: {os_error_text(exc)}{hint}") from exc
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(probe)
    except OSError as exc:
        raise RunError(f"cannot write to the {what} {path}: {os_error_text(exc)}") from exc
