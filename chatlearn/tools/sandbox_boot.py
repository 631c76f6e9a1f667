"""The sandbox's first process: it isolates itself, then becomes the untrusted Python.

Run by `chatlearn.tools.sandbox` as ``python -I -S sandbox_boot.py CONFIG_JSON`` (standard library only, no
project imports: it runs before anything is trusted). Steps, each tried and reported, never assumed:

1. new namespaces: mount, network, PID, IPC, UTS (plus a user namespace when not root);
2. fork: the child is PID 1 of the new PID namespace, so when it exits every process it started dies;
3. the child builds a new root on a small tmpfs: read-only binds of /usr (and the /bin, /lib symlinks) and the
   interpreter's prefix, /dev/null, /dev/zero, /dev/urandom, a fresh /proc (this namespace's processes only),
   a size-capped /tmp, and the scratch directory at /scratch; ``pivot_root`` into it and detach the old root;
4. resource limits (CPU seconds, address space, processes, file size, open files, no core dumps);
5. drops to the unprivileged uid/gid (no capabilities), sets no_new_privs and a parent-death SIGKILL;
6. writes what held as one JSON line on the report fd, and execs the interpreter on /scratch/main.py.

The parent stays outside, waits for the child and writes its exit status as a second JSON line. On SIGTERM (the
driver's wall-clock timeout or output cap) it SIGKILLs the child and reaps it; the child's exit kills the rest of
its PID namespace. Should the parent itself be killed, the child dies of its parent-death signal.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
NAMESPACES = {"mount": CLONE_NEWNS, "network": CLONE_NEWNET, "pid": CLONE_NEWPID, "ipc": CLONE_NEWIPC,
              "uts": CLONE_NEWUTS}

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()

    _check(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def enter_namespaces(held: dict, notes: list) -> None:
    """unshare() every namespace at once; where that fails, each one alone (report which held)."""
    uid, gid = os.geteuid(), os.getegid()
    extra = 0
    if uid != 0:  # not root: a user namespace in which we are root gives the others (if the kernel allows it)
        if libc.unshare(CLONE_NEWUSER) == 0:
            try:
                _write("/proc/self/setgroups", "deny")
                _write("/proc/self/uid_map", f"0 {uid} 1")
                _write("/proc/self/gid_map", f"0 {gid} 1")
                held["user_namespace"] = True
            except OSError as e:
                notes.append(f"user namespace maps: {e}")
        else:
            notes.append(f"user namespace: {os.strerror(ctypes.get_errno())}")
    all_flags = sum(NAMESPACES.values()) | extra
    if libc.unshare(all_flags) == 0:
        for name in NAMESPACES:
            held[f"{name}_namespace"] = True
        return
    for name, flag in NAMESPACES.items():
        ok = libc.unshare(flag) == 0
        held[f"{name}_namespace"] = ok
        if not ok:
            notes.append(f"{name} namespace: {os.strerror(ctypes.get_errno())}")


def build_root(cfg: dict, held: dict, notes: list) -> None:
    """A new root with only the interpreter's files (read-only), /scratch, /tmp, a few devices and /proc."""
    root = cfg["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.makedirs(root + "/tmp")  # first: a read-only bind asked for under /tmp lands inside this one
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmp_bytes']},mode=1777")
    for path in cfg["ro_binds"]:
        if not os.path.lexists(path):
            continue
        dest = root + path
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), dest)
            continue
        if os.path.isdir(path):
            os.makedirs(dest, exist_ok=True)
        else:
            open(dest, "w").close()
        _mount(path, dest, None, MS_BIND | MS_REC)
        _mount(None, dest, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in ("null", "zero", "urandom", "random", "full"):
        dest = f"{root}/dev/{dev}"
        open(dest, "w").close()
        _mount(f"/dev/{dev}", dest, None, MS_BIND)
        _mount(None, dest, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NOEXEC)
    os.makedirs(root + "/scratch", exist_ok=True)
    _mount(cfg["scratch"], root + "/scratch", None, MS_BIND)
    _mount(None, root + "/scratch", None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV)
    os.makedirs(root + "/proc", exist_ok=True)
    if held.get("pid_namespace"):
        try:  # this PID namespace's processes only: the driver's /proc/<pid> is not there
            _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            held["private_proc"] = True
        except OSError as e:
            notes.append(str(e))
    os.chdir(root)
    os.mkdir(".oldroot")
    if SYS_PIVOT_ROOT is None:
        raise OSError(0, "pivot_root: unknown syscall number on this machine")
    _check(libc.syscall(SYS_PIVOT_ROOT, b".", b".oldroot"), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.oldroot", MNT_DETACH), "umount old root")
    os.rmdir("/.oldroot")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    held["private_root"] = True


def set_limits(cfg: dict) -> None:
    limits = [(resource.RLIMIT_CPU, cfg["cpu_seconds"]), (resource.RLIMIT_AS, cfg["memory_bytes"]),
              (resource.RLIMIT_NPROC, cfg["max_processes"]), (resource.RLIMIT_FSIZE, cfg["file_size_bytes"]),
              (resource.RLIMIT_NOFILE, cfg["max_open_files"]), (resource.RLIMIT_CORE, 0)]
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def drop_privileges(cfg: dict, held: dict, notes: list) -> None:
    if os.geteuid() == 0 and not held.get("user_namespace"):
        try:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
            held["unprivileged_uid"] = os.getuid() == cfg["uid"] and os.geteuid() == cfg["uid"]
        except OSError as e:
            notes.append(f"dropping to uid {cfg['uid']}: {e}")
    elif held.get("user_namespace"):
        notes.append("not root outside: runs as the driver's uid mapped to root inside a user namespace")
    held["no_new_privs"] = libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0


def child(cfg: dict, held: dict, notes: list, report_fd: int, alive_r: int | None) -> None:
    if held.get("mount_namespace"):
        try:
            build_root(cfg, held, notes)
        except OSError as e:
            notes.append(f"private root: {e}")
    os.chdir("/scratch" if held.get("private_root") else cfg["scratch"])
    set_limits(cfg)
    drop_privileges(cfg, held, notes)
    # set after the uid change (a credential change clears it): the boot parent dying kills this process
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if alive_r is not None:  # the parent died before the line above: its pipe reads EOF at once
        os.set_blocking(alive_r, False)
        try:
            if os.read(alive_r, 1) == b"":
                os._exit(137)
        except BlockingIOError:
            pass
        os.close(alive_r)
    missing = [name for name in cfg["require"] if not held.get(name)]
    os.write(report_fd, (json.dumps({"held": held, "notes": notes, "missing": missing}) + "\n").encode())
    os.close(report_fd)
    if missing:
        os.write(2, f"sandbox refused to run: not enforceable here: {', '.join(missing)}\n".encode())
        os._exit(126)
    script = "/scratch/main.py" if held.get("private_root") else os.path.join(cfg["scratch"], "main.py")
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", "-B", script], cfg["env"])


def main() -> None:
    cfg = json.loads(sys.argv[1])
    report_fd = cfg["report_fd"]
    held: dict = {}
    notes: list = []
    if cfg["namespaces"]:
        enter_namespaces(held, notes)
    if not held.get("pid_namespace"):  # no PID namespace: become the interpreter directly
        child(cfg, held, notes, report_fd, None)
        return
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        try:
            child(cfg, held, notes, report_fd, alive_r)
        except BaseException as e:  # noqa: BLE001 - the driver reads it as the sandbox's own failure
            os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        os._exit(127)
    os.close(alive_r)

    def stop(signum, frame):  # the driver's timeout: kill the namespace's init (so all of it), then reap it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, stop)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    final = {"exit_code": code if code >= 0 else None, "signal": -code if code < 0 else None}
    os.write(report_fd, (json.dumps(final) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
