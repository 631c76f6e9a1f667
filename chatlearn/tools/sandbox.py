"""A Python sandbox for tool calls: untrusted code in a separate, limited, isolated process per call.

Every call gets a fresh scratch directory (owned by the sandbox's uid, removed afterwards) and a new process
started by `sandbox_boot.py` (read it for the steps). What always holds, on any Linux:

- CPU time (RLIMIT_CPU, hard: SIGKILL), address space (RLIMIT_AS: a big allocation is a MemoryError),
  processes (RLIMIT_NPROC), file size (RLIMIT_FSIZE), open files, no core dumps;
- a wall-clock timeout that kills the whole process group (and, with a PID namespace, everything inside it);
- output (stdout and stderr together) capped at ``output_bytes``: past it the process is killed and the text
  is marked truncated; the driver never buffers more than the cap;
- an empty environment (the driver's variables are not passed), ``python -I -S -B`` (no site-packages, no
  PYTHON* variables, no user site, no script directory on sys.path).

What holds only where the kernel and privileges allow it (checked on every call, reported in
``SandboxResult.isolation`` and ``Sandbox.isolation``; ``require=`` refuses to run code without them):

- ``network_namespace``: no network at all (no interfaces up, not even loopback; abstract Unix sockets are
  per namespace too);
- ``private_root``: the file system is a new root holding only /usr (read-only), the interpreter's prefix
  (read-only), /scratch, a small /tmp and /dev/null, zero, urandom, random, full: the driver's files, the
  repository, /root, /home, /etc and the host's /tmp are not there at all;
- ``pid_namespace`` + ``private_proc``: /proc shows the sandbox's processes only (not the driver's
  /proc/<pid>/environ), and every process the code started dies with it;
- ``unprivileged_uid``: the code runs as ``uid``/``gid`` (65534, nobody) with no capabilities, so even the
  files it could reach are protected by their permissions (a 0600 file of the driver's is unreadable);
- ``no_new_privs``; ``ipc_namespace``, ``uts_namespace``, ``mount_namespace``.

Caveat: RLIMIT_NPROC counts every process of the uid on the machine, so concurrent sandboxes share it.
"""

import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py")
ISOLATION = ("network_namespace", "private_root", "pid_namespace", "private_proc", "unprivileged_uid",
             "no_new_privs", "mount_namespace", "ipc_namespace", "uts_namespace", "user_namespace")


@dataclasses.dataclass
class SandboxResult:
    output: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    truncated: bool
    seconds: float
    isolation: dict[str, bool]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.truncated

    def observation(self) -> str:
        """The text the model sees: the output, then what stopped the process if it did not end normally."""
        text = self.output.rstrip("\n")
        if self.truncated:
            text += "\n[output truncated: over the sandbox's output limit]"
        if self.timed_out:
            text += "\n[stopped: wall-clock timeout]"
        elif self.signal == signal.SIGKILL and not self.truncated:
            text += "\n[killed: CPU time or resource limit]"
        elif self.signal is not None and not self.truncated:
            text += f"\n[killed by signal {signal.Signals(self.signal).name}]"
        elif self.exit_code not in (0, None) and not self.truncated:
            # cut off, a program may exit on its own first (Python's 120: stdout could not be flushed): the cap
            # stopped it either way
            text += f"\n[exit code {self.exit_code}]"
        return text.strip("\n") or "[no output]"


class Sandbox:
    """Runs Python source in a fresh isolated process per call (see the module docstring)."""

    def __init__(self, *, cpu_seconds: int = 5, memory_bytes: int = 512 << 20, max_processes: int = 32,
                 file_size_bytes: int = 16 << 20, output_bytes: int = 16 << 10, timeout: float = 10.0,
                 max_open_files: int = 64, tmp_bytes: int = 16 << 20, uid: int = 65534, gid: int = 65534,
                 namespaces: bool = True, require: tuple[str, ...] = (), extra_ro_binds: tuple[str, ...] = ()):
        unknown = set(require) - set(ISOLATION)
        if unknown:
            raise ValueError(f"unknown isolation names {sorted(unknown)}; known: {list(ISOLATION)}")
        self.cpu_seconds, self.memory_bytes, self.max_processes = cpu_seconds, memory_bytes, max_processes
        self.file_size_bytes, self.output_bytes, self.timeout = file_size_bytes, output_bytes, timeout
        self.max_open_files, self.tmp_bytes, self.uid, self.gid = max_open_files, tmp_bytes, uid, gid
        self.namespaces, self.require = namespaces, tuple(require)
        self.extra_ro_binds = tuple(extra_ro_binds)  # more host paths visible read-only inside the private root
        self._isolation: dict[str, bool] | None = None
        # the real interpreter (a venv's python is a link to it); -S keeps site-packages out anyway
        self.python = os.path.realpath(sys.executable)
        self.prefix = os.path.realpath(sys.base_prefix)

    @property
    def isolation(self) -> dict[str, bool]:
        """What this machine enforces, measured once by running an empty program."""
        if self._isolation is None:
            self._isolation = self.run("").isolation
        return self._isolation

    def _ro_binds(self) -> list[str]:
        binds = ["/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32", "/sbin", "/etc/ld.so.cache"]
        for path in (self.prefix, os.path.dirname(self.python), *self.extra_ro_binds):
            if not any(path == b or path.startswith(b + "/") for b in binds):
                binds.append(path)
        return binds

    def run(self, code: str) -> SandboxResult:
        base = tempfile.mkdtemp(prefix="chatlearn-sandbox-")
        try:
            return self._run(code, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _run(self, code: str, base: str) -> SandboxResult:
        os.chmod(base, 0o755)
        scratch, root = os.path.join(base, "scratch"), os.path.join(base, "root")
        os.mkdir(scratch, 0o700)
        os.mkdir(root, 0o755)
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if os.geteuid() == 0:
            for path in (scratch, os.path.join(scratch, "main.py")):
                os.chown(path, self.uid, self.gid)
        report_r, report_w = os.pipe()
        cfg = {"report_fd": report_w, "root": root, "scratch": scratch, "python": self.python,
               "ro_binds": self._ro_binds(), "env": {}, "namespaces": self.namespaces, "require": self.require,
               "cpu_seconds": self.cpu_seconds, "memory_bytes": self.memory_bytes,
               "max_processes": self.max_processes, "file_size_bytes": self.file_size_bytes,
               "max_open_files": self.max_open_files, "tmp_bytes": self.tmp_bytes, "uid": self.uid,
               "gid": self.gid}
        start = time.monotonic()
        try:
            proc = subprocess.Popen([self.python, "-I", "-S", "-B", BOOT, json.dumps(cfg)], env={}, cwd=scratch,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    pass_fds=(report_w,), start_new_session=True)
        finally:
            os.close(report_w)
        out, truncated, timed_out = self._read(proc, start)
        self._kill(proc)
        report = self._read_report(report_r)
        seconds = time.monotonic() - start
        first = report[0] if report else {"held": {}, "notes": ["the sandbox process reported nothing"]}
        final = report[1] if len(report) > 1 else None
        if final is not None:
            exit_code, sig = final["exit_code"], final["signal"]
        else:  # no PID namespace: the boot process became the interpreter itself
            rc = proc.returncode
            exit_code, sig = (rc, None) if rc >= 0 else (None, -rc)
        held = {name: bool(first["held"].get(name)) for name in ISOLATION}
        text = out.decode("utf-8", errors="replace")
        return SandboxResult(text, exit_code, sig, timed_out, truncated, seconds, held, first.get("notes", []))

    def _read(self, proc: subprocess.Popen, start: float) -> tuple[bytes, bool, bool]:
        """Output up to the cap; kills the process group at the cap or the deadline."""
        chunks, size = [], 0
        fd = proc.stdout.fileno()
        deadline = start + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), False, True
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            data = os.read(fd, 65536)
            if not data:
                return b"".join(chunks), False, False
            chunks.append(data)
            size += len(data)
            if size > self.output_bytes:
                return b"".join(chunks)[: self.output_bytes], True, False

    def _kill(self, proc: subprocess.Popen) -> None:
        """Stop the boot process (it kills and reaps its namespace), then SIGKILL whatever is left in its group."""
        proc.stdout.close()
        if not self._exited(proc.pid):
            os.kill(proc.pid, signal.SIGTERM)
            until = time.monotonic() + 2.0
            while not self._exited(proc.pid) and time.monotonic() < until:
                time.sleep(0.01)
        try:  # the leader is not reaped yet, so its group id cannot have been reused
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    @staticmethod
    def _exited(pid: int) -> bool:
        """Whether the process has exited, without reaping it."""
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return info is not None

    @staticmethod
    def _read_report(fd: int) -> list[dict]:
        data = b""
        while chunk := os.read(fd, 65536):
            data += chunk
        os.close(fd)
        return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
