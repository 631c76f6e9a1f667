"""Named crash points for testing resume: `CHATLEARN_CRASH_AT=<point>:<episode>` SIGKILLs the train process.

A real SIGKILL at an exactly chosen moment (mid-episode, between the model and data checkpoints, halfway
through writing a record) is what proves that a crash costs nothing; polling from outside could not hit
those windows reliably. Unset, the points cost one environment lookup.
"""

import os
import signal


def crash_point(point: str, episode: int, pid: int | None = None) -> None:
    """SIGKILL process `pid` (default: this one) if `CHATLEARN_CRASH_AT` names this point and episode."""
    if os.environ.get("CHATLEARN_CRASH_AT") == f"{point}:{episode}":
        os.kill(pid or os.getpid(), signal.SIGKILL)
