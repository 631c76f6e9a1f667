"""One real local `chatlearn train`, as a user starts it (no Prefect API configured, Ray's auth mode unset),
watched from outside while it runs:

* every socket its processes listen on (the Prefect server it starts, Ray's GCS, raylet, agents, workers,
  actors) is bound to a loopback address, and Ray's token authentication is on;
* a second `chatlearn train` of the same run directory is refused before it starts anything, naming the first
  run's pid, start time and host;
* SIGTERM stops it within seconds with one line, stops the Prefect server it started, and leaves the last
  committed checkpoint the resume point;
* the same command again, stopped by SIGTERM during its start-up (while its local Ray starts, then while its
  model processes are being created), stops the same way and leaves none of its processes running.

One run for the first three (each costs a Prefect server and a Ray start on this 2-core machine); the two
restarts are stopped before they train.
"""

import contextlib
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, command_here

pytestmark = pytest.mark.integration

ARGS = ["runtime.num_episode=50", "runtime.sample_per_episode=32", "runtime.generation_batch_size=16",
        "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.save_episode_interval=1",
        "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false", "runtime.exp_name=local"]


def listening(root: psutil.Process) -> dict[tuple[str, int], str]:
    """(address, port) -> process, for every listening TCP socket of ``root`` and its descendants."""
    try:
        procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in procs:
            try:
                name = " ".join(procs[conn.pid].cmdline()[:3])[:80]
            except psutil.Error:
                name = "?"
            out[(conn.laddr.ip, conn.laddr.port)] = name
    return out


def descendants(root: psutil.Process) -> dict[psutil.Process, str]:
    """Every live descendant of ``root`` with its command line."""
    try:
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for child in children:
        try:
            out[child] = " ".join(child.cmdline())[:120]
        except psutil.Error:
            pass
    return out


def ray_starting(names: list[str]) -> bool:
    """The raylet started its agents: `ray.init` is still waiting for the node (or connecting), no reaper yet."""
    return any(n.startswith("ray::RuntimeEnvAgent") or "dashboard/agent.py" in n for n in names)


def model_processes_starting(names: list[str]) -> bool:
    """A Ray worker became one of the run's actors (its title names the class, not IDLE): the model processes are
    being created."""
    return any(n.startswith(("ray::Worker", "ray::StreamDataset")) for n in names)


def stop_during_start_up(cmd: list[str], env: dict, moment) -> dict:
    """Run ``cmd``, SIGTERM it at the first sample of its process tree where ``moment`` holds; what it printed,
    how it exited, and which of its processes outlived it."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[psutil.Process, str] = {}
    reached = False
    try:
        root = psutil.Process(proc.pid)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and not reached:
            now = descendants(root)
            seen.update(now)
            reached = moment(list(now.values()))
            if not reached:
                time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        stop_seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 20  # processes being stopped as the command exits get a moment to go
    while time.monotonic() < deadline and any(gone(p) is False for p in seen):
        time.sleep(0.2)
    left = {p.pid: name for p, name in seen.items() if gone(p) is False}
    for p in left:  # not to disturb the tests that follow
        with contextlib.suppress(psutil.Error):
            psutil.Process(p).kill()
    print(f"stopped {stop_seconds:.1f} s after SIGTERM during start-up ({moment.__name__}): exit {proc.returncode}, "
          f"{len(seen)} processes seen, {len(left)} left")
    return dict(returncode=proc.returncode, err=err, stop_seconds=stop_seconds, seen=set(seen.values()), left=left,
                reached=reached)


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE  # is_running: False for a reused pid
    except psutil.NoSuchProcess:
        return True


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def local_run(tiny_model_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("local-run")
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_AUTH_MODE", "RAY_ADDRESS")}
    env.update(CHATLEARN_OUTPUT_DIR=str(tmp / "out"), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               CHATLEARN_PREFECT_HOME=str(tmp / "prefect"), HOME=str(tmp / "home"))
    cmd = [sys.executable, "-m", "chatlearn.cli", "train", *ARGS]
    run_dir = tmp / "out" / "local"
    metrics = run_dir / "metrics.jsonl"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        root = psutil.Process(proc.pid)
        seen: dict[tuple[str, int], str] = {}
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:  # two episodes done: a checkpoint exists
            seen.update(listening(root))
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        seen.update(listening(root))
        # asked in this process: the run directory's lock is checked before anything starts
        second = command_here(["train", *ARGS], REPO, CHATLEARN_OUTPUT_DIR=env["CHATLEARN_OUTPUT_DIR"],
                              CHATLEARN_TINY_MODEL_DIR=tiny_model_dir)
        holder = json.loads((run_dir / ".lock").read_text())
        server = json.loads((tmp / "prefect" / "server.json").read_text())["pid"]
        server_alive_before = alive(server)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)  # a hang guard, not a benchmark: it stops in a few seconds
        stop_seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for _ in range(50):
        if not alive(server):
            break
        time.sleep(0.1)
    print(f"stopped {stop_seconds:.1f} s after SIGTERM")
    # the same command again (it would resume), stopped while its Ray starts (its agents up), then while its
    # model processes start
    start_up_stops = [stop_during_start_up(cmd, env, moment) for moment in (ray_starting, model_processes_starting)]
    return dict(env=env, tmp=tmp, run_dir=run_dir, pid=proc.pid, seen=seen, second=second, holder=holder,
                server=server, server_alive_before=server_alive_before, returncode=proc.returncode, err=err,
                stop_seconds=stop_seconds, start_up_stops=start_up_stops)


def test_a_local_run_listens_on_loopback_only_with_ray_token_auth(local_run):
    seen = local_run["seen"]
    names = set(seen.values())
    assert any("prefect" in n for n in names) and any("raylet" in n or "ray::" in n for n in names), seen
    assert len(seen) >= 5, seen  # the Prefect server, GCS, raylet, agents and workers were all sampled
    exposed = {addr: name for addr, name in seen.items() if not is_loopback(addr[0])}
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert (local_run["tmp"] / "home" / ".ray" / "auth_token").is_file(), "token authentication was not on"


def test_a_second_run_of_the_same_run_directory_is_refused_before_it_starts(local_run):
    second, holder = local_run["second"], local_run["holder"]
    assert second.returncode == 1, second.stderr[-3000:]
    assert second.stderr.strip().splitlines()[-1] == (
        f"chatlearn: error: run directory {local_run['run_dir']} is in use by pid {local_run['pid']} (started "
        f"{holder['started']} on host {socket.gethostname()}); wait for it or use another runtime.exp_name")
    assert "Prefect UI" not in second.stderr  # refused before the Prefect server or Ray


def test_sigterm_during_start_up_stops_the_same_way_and_leaves_nothing_running(local_run):
    for stop in local_run["start_up_stops"]:  # while Ray started, while the model processes were created
        assert stop["reached"] and any("prefect server start" in n for n in stop["seen"]), stop["seen"]
        assert not stop["left"], f"still running after the command exited: {stop['left']}"
        assert stop["returncode"] == 128 + signal.SIGTERM, stop["err"][-3000:]
        assert stop["err"].strip().splitlines()[-1] == ("chatlearn: stopped by SIGTERM; re-run the same command to "
                                                        "resume from the last checkpoint"), stop["err"][-3000:]
        assert "Traceback" not in stop["err"], stop["err"][-3000:]
        assert "ready to train" not in stop["err"]  # stopped before the run trained


def test_sigterm_stops_the_run_and_its_prefect_server_and_keeps_the_last_checkpoint(local_run, monkeypatch):
    assert local_run["returncode"] == 128 + signal.SIGTERM, local_run["err"][-3000:]
    err = local_run["err"]
    assert err.strip().splitlines()[-1] == ("chatlearn: stopped by SIGTERM; re-run the same command to resume from "
                                            "the last checkpoint")
    assert "Traceback" not in err, err[-3000:]
    assert local_run["server_alive_before"] and not alive(local_run["server"]), "the Prefect server is still up"

    # the last committed checkpoint is intact: it is the resume point, and its model files pass their checksums
    from chatlearn.checkpoint.resume import resume_point
    from chatlearn.config import load_config

    for key in ("CHATLEARN_OUTPUT_DIR", "CHATLEARN_TINY_MODEL_DIR"):
        monkeypatch.setenv(key, local_run["env"][key])
    rows = [json.loads(line) for line in (local_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    resumed = resume_point(load_config(None, ARGS))
    # the stop may land between an episode's metrics row and its checkpoint record: then the one before (the
    # rows count episodes from 1, the record's index from 0)
    assert resumed is not None and resumed.episode + 1 in (rows[-1]["episode"], rows[-1]["episode"] - 1), resumed
    assert resumed.episode >= 1
    row = next(r for r in rows if r["episode"] == resumed.episode + 1)
    assert all(Path(p).is_dir() for p in row["checkpoint_paths"].values())
