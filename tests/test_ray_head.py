"""A local Ray outliving its driver, without Ray (chatlearn.runtime.cluster.reaper): the reaper on a real process
tree whose "driver" is SIGKILLed."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from chatlearn.runtime.cluster import reaper
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
