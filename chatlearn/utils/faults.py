"""Named crash points for testing resume: `CHATLEARN_CRASH_AT=<point>:<episode>` SIGKILLs the train process.

A real SIGKILL at an exactly chosen moment (mid-episode, between the model and data checkpoints, halfway
through writing a record) is what proves that a crash costs nothing; polling from outside could not hit
those windows reliably. Unset, the points cost one environment lookup.
"""

import errno
import os
import signal


def crash_point(point: str, episode: int, pid: int | None = None) -> None:
    """SIGKILL process `pid` (default: this one) if `CHATLEARN_CRASH_AT` names this point and episode."""
    if os.environ.get("CHATLEARN_CRASH_AT") == f"{point}:{episode}":
        os.kill(pid or os.getpid(), signal.SIGKILL)


def fault_point(point: str, index: int) -> None:
    """Raise OSError(ENOSPC) if `CHATLEARN_FAULT_AT` is `<point>:<index>`: a full disk at an exact write.

    The storage-fault counterpart of `crash_point`, for proving that a write that fails is one clear error and
    leaves the previous checkpoint the resume point. `checkpoint_write:<iteration>` fails a model checkpoint
    of that trainer iteration (its `iter_<N>` directory) halfway, after the weights file is written. It is
    read in whichever process writes (the model actors inherit the driver's environment)."""
    if os.environ.get("CHATLEARN_FAULT_AT") == f"{point}:{index}":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
