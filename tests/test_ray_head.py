"""The Ray head going away and a local Ray outliving its driver, without Ray (chatlearn.runtime.cluster.head,
chatlearn.runtime.cluster.reaper): the reaper on a real process tree whose "driver" is SIGKILLed, what each kind of
head loss raises, and the one line the CLI prints. The real kills (a run's GCS server mid-episode, a joined
cluster's head, SIGKILLed drivers) are in tests/test_resume.py and tests/test_placement_runs.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from chatlearn.runtime.calls import recovery
from chatlearn.runtime.cluster import head, reaper
from chatlearn.utils.errors import RunCrashed
from tests.conftest import REPO


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


DRIVER = textwrap.dedent("""
    import json, subprocess, sys, time
    from chatlearn.runtime.cluster.reaper import Reaper

    sleep = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "time.sleep(600)"]
    parent = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)",
              *sleep]
    root = subprocess.Popen(parent)  # a root with a child of its own (as the raylet and its agents)
    other = subprocess.Popen(sleep, start_new_session=True)  # not under the roots: none of the reaper's business
    r = Reaper([root.pid])
    time.sleep(1.5)
    late = subprocess.Popen(parent)  # not a root: below none of them
    print(json.dumps({"root": root.pid, "other": other.pid, "late": late.pid, "reaper": r.pid}), flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.skipif(not reaper.supported(), reason="the reaper reads /proc (Linux)")
def test_the_reaper_ends_the_tree_of_a_sigkilled_driver_and_nothing_else():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    started = json.loads(driver.stdout.readline())
    tree = [pid for pid, _ in reaper.descendants([started["root"]])]
    try:
        assert len(tree) == 2, tree  # the root and its child
        time.sleep(reaper.NOTE_S + 0.5)  # noted at least once since the child started
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 5
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in tree if alive(p)], "the killed driver's tree outlived it"
        while alive(started["reaper"]) and time.monotonic() < deadline + 5:  # it kills, then exits: a race
            time.sleep(0.1)
        assert not alive(started["reaper"])  # done, it exits
        assert alive(started["other"]) and alive(started["late"])  # never under the roots: left alone
    finally:
        for pid in [*tree, started["other"], started["late"], *[p for p, _ in reaper.descendants([started["late"]])]]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_end_leaves_a_pid_that_now_names_another_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (ident,) = reaper.descendants([proc.pid])
        assert reaper.end([(proc.pid, ident[1] + 1)]) == []  # another start time: another process
        assert alive(proc.pid)
        assert reaper.end([ident]) == [proc.pid]
        proc.wait(timeout=5)
    finally:
        proc.kill()


class FakeWatch:
    def __init__(self, gone):
        self.gone = gone


@pytest.fixture
def watching(monkeypatch):
    """Make the run's head watch report ``gone`` (a head.Gone, or None while the head is there)."""
    watches: list = []
    monkeypatch.setattr(recovery, "WATCHES", watches)
    return lambda gone: watches.append(FakeWatch(gone))


def test_a_local_heads_loss_is_a_lost_process_and_nothing_asks_the_dead_ray(watching):
    watching(head.Gone(True, "127.0.0.1:6379", "its gcs_server, pid 4242, killed by SIGKILL"))

    class NoActor:  # the model processes must not be pinged: without a GCS the answer may never come
        def __getattr__(self, name):
            raise AssertionError(f"asked the dead Ray: {name}")

    lost = recovery.process_loss(RuntimeError("an actor call failed"), {"0-w0": NoActor()}, set(), 4)
    assert isinstance(lost, recovery.HeadLost) and isinstance(lost, recovery.ProcessLost)
    assert lost.message == ("the head of the local Ray went away during episode 5 (its gcs_server, pid 4242, "
                            "killed by SIGKILL); starting a fresh local Ray")
    with pytest.raises(recovery.HeadLost):
        recovery.check_head(-1)  # a wait outside the episodes (setup, export) raises it too


def test_a_joined_clusters_head_loss_names_the_address_and_ends_the_run_as_crashed(watching):
    watching(head.Gone(False, "10.0.0.7:6379", "its GCS has not answered for 30 s"))
    lost = recovery.process_loss(RuntimeError("x"), {}, set(), 2)
    assert isinstance(lost, recovery.HeadLost) and not lost.local  # `launch` turns it into RayHeadGone
    assert lost.message == ("the Ray head at 10.0.0.7:6379 went away during episode 3 (its GCS has not answered for "
                            "30 s); the run's model processes end with it. Re-run the same command once the cluster "
                            "is back to resume from the last checkpoint")
    ended = head.RayHeadGone(lost.message)
    assert isinstance(ended, RunCrashed) and not isinstance(ended, Exception)  # Prefect: Crashed, not retried
    assert str(ended) == lost.message


def test_while_the_head_is_there_nothing_is_raised(watching):
    recovery.check_head(3)  # nothing watched
    watching(None)
    recovery.check_head(3)
    assert recovery.head_loss(3) is None


def test_a_joined_clusters_grace_is_half_of_rays_own_reconnect_window(monkeypatch):
    monkeypatch.delenv(head.RECONNECT_VAR, raising=False)
    assert head.grace_s() == 30.0  # Ray ends the process after 60 s: half to ride out a GCS restart, half to end
    monkeypatch.setenv(head.RECONNECT_VAR, "600")  # a cluster with GCS fault tolerance
    assert head.grace_s() == 300.0
    monkeypatch.setenv(head.RECONNECT_VAR, "not a number")
    assert head.grace_s() == 30.0


def test_the_cli_prints_a_crashed_run_as_one_line(monkeypatch, capsys):
    from chatlearn import cli

    def train(items, verbose=False):
        raise head.RayHeadGone("the Ray head at 10.0.0.7:6379 went away during episode 3 (...)")

    monkeypatch.setattr(cli, "cmd_train", train)
    assert cli.main(["train"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "chatlearn: error: the Ray head at 10.0.0.7:6379 went away during episode 3 (...)"]
