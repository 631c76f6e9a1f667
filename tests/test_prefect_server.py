"""The local Prefect server that `chatlearn train` starts: shared by overlapping runs, stopped by the last."""

import json
import os
import subprocess
import sys
import time

import pytest

from chatlearn.runtime.prefect_server import _alive, healthy

pytestmark = pytest.mark.integration

HOLD = """
import sys, time
from chatlearn.runtime.prefect_server import local_prefect_api
with local_prefect_api(announce=lambda m: print(m, flush=True)) as url:
    print("URL", url, flush=True)
    while not __import__("os").path.exists(sys.argv[1]):
        time.sleep(0.1)
print("DONE", flush=True)
"""


def start_holder(home, release, tmp_path, name):
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    out = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-c", HOLD, str(release)], env=env, stdout=out,
                            stderr=subprocess.STDOUT, text=True)


def wait_for_url(log, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("URL "):
                return line.split()[1]
        time.sleep(0.2)
    raise AssertionError(f"no URL in {log}: {log.read_text()}")


def stopped(pid, timeout=5.0):
    deadline = time.time() + timeout
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def test_overlapping_runs_share_one_server_and_the_last_stops_it(tmp_path):
    home = tmp_path / "home"
    a = start_holder(home, tmp_path / "release-a", tmp_path, "a")
    url_a = wait_for_url(tmp_path / "a.log")
    assert url_a.startswith("http://127.0.0.1:") and healthy(url_a)
    b = start_holder(home, tmp_path / "release-b", tmp_path, "b")
    url_b = wait_for_url(tmp_path / "b.log")
    assert url_b == url_a
    assert "reusing" in (tmp_path / "b.log").read_text()
    server_pid = json.loads((home / "server.json").read_text())["pid"]

    # the first run ends while the second still uses the server: the server must stay up
    (tmp_path / "release-a").touch()
    assert a.wait(60) == 0
    assert healthy(url_b) and _alive(server_pid)

    # the last user out stops it
    (tmp_path / "release-b").touch()
    assert b.wait(60) == 0
    assert stopped(server_pid)
    assert not healthy(url_b)


def test_a_server_left_by_a_killed_run_is_adopted(tmp_path):
    home = tmp_path / "home"
    a = start_holder(home, tmp_path / "never", tmp_path, "a")
    url = wait_for_url(tmp_path / "a.log")
    a.kill()  # SIGKILL: no cleanup, the server stays up with a dead user
    a.wait()
    server_pid = json.loads((home / "server.json").read_text())["pid"]
    assert healthy(url)
    b = start_holder(home, tmp_path / "release-b", tmp_path, "b")
    assert wait_for_url(tmp_path / "b.log") == url
    (tmp_path / "release-b").touch()
    assert b.wait(60) == 0
    assert stopped(server_pid)
