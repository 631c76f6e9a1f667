"""The environment a process was started with, as opposed to ``os.environ`` as the process has changed it since.

A library that ran in the process may have rewritten a variable for processes of its own (vLLM writes torch's
libgomp into ``LD_PRELOAD``); a decision about the process itself reads what it started with.
"""

import os


def started_with(name: str) -> str:
    """The value of environment variable ``name`` this process was started with ("" if unset)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:  # not Linux: the environment as it is now
        return os.environ.get(name, "")
    prefix = name.encode() + b"="
    return next((item[len(prefix):].decode() for item in items if item.startswith(prefix)), "")
