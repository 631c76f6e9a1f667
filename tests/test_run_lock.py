"""One run per run directory: `run_dir/.lock` (fcntl.flock) refuses a second run with the first one's pid, start
time and host; the same process may take it again (the CLI, then its train flow); a SIGKILLed holder leaves
no stale lock; processes the holder starts (Prefect server, Ray) do not inherit it."""

import importlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from chatlearn.runtime.records.run_lock import lock_run_dir, read_holder
from chatlearn.utils.errors import RunError
from tests.conftest import REPO

TAKE = ("import sys, time\nfrom chatlearn.runtime.records.run_lock import lock_run_dir\n"
        "lock_run_dir(sys.argv[1])\nprint('locked', flush=True)\ntime.sleep(float(sys.argv[2]))\n")


def take(run_dir, hold: float = 0.0) -> subprocess.CompletedProcess:
    """Another process trying to take the lock (and holding it for `hold` seconds)."""
    return subprocess.run([sys.executable, "-c", TAKE, str(run_dir), str(hold)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def wait_for_holder(run_dir, pid: int, proc: subprocess.Popen, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        holder = read_holder(run_dir)
        if holder is not None and holder["pid"] == pid:
            return holder
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{run_dir}/.lock never named pid {pid}")


def test_a_second_process_is_refused_with_the_holders_pid_time_and_host(tmp_path):
    run_dir = tmp_path / "out" / "exp"
    with lock_run_dir(run_dir):
        holder = read_holder(run_dir)
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        refused = take(run_dir)
        assert refused.returncode == 1
        assert (f"RunError: run directory {run_dir} is in use by pid {os.getpid()} (started {holder['started']} "
                f"on host {socket.gethostname()}); wait for it or use another runtime.exp_name") in refused.stderr
        with lock_run_dir(run_dir):  # the same process again (the CLI, then its train flow): no deadlock
            pass
        assert take(run_dir).returncode == 1  # still held by the outer holder
    assert take(run_dir).returncode == 0
    assert read_holder(run_dir)["pid"] != os.getpid()


def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", TAKE, str(tmp_path), "60"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_holder(tmp_path, proc.pid, proc)
        with pytest.raises(RunError, match=f"in use by pid {proc.pid} "):
            lock_run_dir(tmp_path)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with lock_run_dir(tmp_path):  # the kernel dropped the dead process's lock; its details are overwritten
        assert read_holder(tmp_path)["pid"] == os.getpid()


def test_children_of_the_holder_do_not_inherit_the_lock(tmp_path):
    lock = lock_run_dir(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
    try:
        lock.release()
        assert take(tmp_path).returncode == 0  # the child lives on without holding it
    finally:
        child.kill()
        child.wait()


def test_an_eval_of_a_run_directory_in_use_is_refused_naming_the_holder(tiny_model_dir, tmp_path, monkeypatch):
    """The eval flow takes the run directory's lock as train does: a direct eval of a run directory a train holds,
    and the eval a finished train run triggers (it reads that run's final policy and writes into its directory),
    are refused naming the holder, before any model process starts; once the holder is gone both go ahead."""
    eval_flow = importlib.import_module("flows.eval_flow")  # the module (`flows` exports the flow by this name)

    def launched(*_args, **_kwargs):
        raise AssertionError("launched")

    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    monkeypatch.setattr(eval_flow, "launch", launched)
    run_dir = tmp_path / "out" / "exp"
    monkeypatch.setattr(eval_flow, "outputs_of_run",
                        lambda run: {"run_dir": str(run_dir), "final_policy": tiny_model_dir})
    direct = {"overrides": [f"runtime.output_dir={tmp_path / 'out'}", "runtime.exp_name=exp"]}
    triggered = {"train_run": "prefect.flow-run.00000000-0000-0000-0000-000000000001"}
    train = subprocess.Popen([sys.executable, "-c", TAKE, str(run_dir), "60"], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        holder = wait_for_holder(run_dir, train.pid, train)
        for kwargs in (direct, triggered):
            with pytest.raises(RunError) as err:
                eval_flow.eval_flow.fn(**kwargs)
            assert str(err.value) == (
                f"run directory {run_dir} is in use by pid {train.pid} (started {holder['started']} on host "
                f"{socket.gethostname()}); wait for it or use another runtime.exp_name")
    finally:
        train.kill()
        train.wait()
    for kwargs in (direct, triggered):
        with pytest.raises(AssertionError, match="launched"):
            eval_flow.eval_flow.fn(**kwargs)
    assert take(run_dir).returncode == 0  # and the evals left no lock behind
