"""A local Ray the run started ends with the run, a SIGKILLed driver included.

`ray.init` starts the local Ray's GCS server, raylet and monitors as children of the driver, tied to it by the
kernel (``PR_SET_PDEATHSIG``: they get SIGKILL when it dies), and a worker exits when its raylet does. The
raylet's agents (dashboard agent, runtime env agent) are not tied: once their raylet is gone they report that to
the GCS, which is gone too, and wait for it up to 60 s (Ray 2.60). After a SIGKILLed driver they lived on for
65 s here, and the soak found both alive 30 s after every driver kill (bench/results/soak.json).

`Reaper` is a small process started with the local Ray (this file, run by path: the standard library only). It
holds the read end of a pipe whose write end only the driver has, and every `NOTE_S` notes the Ray's processes
(`descendants`: the ones `ray.init` started and everything below them). When the pipe ends, whatever ended the
driver, it SIGKILLs what it noted that still runs. It runs in a session of its own, so a signal to the driver's
process group does not end it first. `end` is the same kill, used by the driver itself when its local Ray's head
went away (chatlearn.runtime.cluster.head).

A process is known by its pid and start time (``/proc/PID/stat``), so a pid the system gave to another process
since is left alone. Linux only (``/proc``); elsewhere no reaper is started.
"""

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterable

NOTE_S = 1.0  # how often the reaper notes the Ray's processes (a worker started since dies with its raylet)

Ident = tuple[int, int]  # (pid, start time in clock ticks since boot)


def supported() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self")


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), int(fields[19]), fields[0]


def descendants(roots: Iterable[int]) -> set[Ident]:
    """The live processes ``roots`` and everything below them, as (pid, start time)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[int, int, str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            stats[int(name)] = st
            children.setdefault(st[0], []).append(int(name))
    out: set[Ident] = set()
    todo = [pid for pid in roots if pid in stats]
    while todo:
        pid = todo.pop()
        if stats[pid][2] != "Z":  # a zombie is dead already, only not waited for
            out.add((pid, stats[pid][1]))
        todo += children.get(pid, [])
    return out


def end(processes: Iterable[Ident]) -> list[int]:
    """SIGKILL each process that still runs as the one noted (same pid, same start time); returns their pids."""
    killed = []
    for pid, started in processes:
        st = _stat(pid)
        if st is None or st[1] != started or st[2] == "Z":
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:  # gone meanwhile, or not ours to end
            pass
    return killed


class Reaper:
    """The reaper of the processes under ``roots`` (the pids `ray.init` started), for as long as it is open."""

    def __init__(self, roots: Iterable[int]) -> None:
        self._proc = subprocess.Popen([sys.executable, "-I", __file__, *(str(p) for p in roots)],
                                      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self, timeout_s: float = 10.0) -> None:
        """The driver is done with its Ray (`ray.shutdown`): the reaper ends what is left of it, and exits."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def main(roots: list[int]) -> None:
    """The reaper process: note the processes under ``roots`` until stdin ends, then end them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's Ctrl-C is the driver's to handle
    noted: set[Ident] = set()
    while True:
        noted |= descendants(roots)
        ready, _, _ = select.select([0], [], [], NOTE_S)
        if ready and not os.read(0, 4096):  # end of file: the driver closed it, or is gone
            break
    end(noted)


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]])
