"""The local Prefect server that `chatlearn train` starts: shared by overlapping runs, stopped by the last;
kept up by `chatlearn server`; used by direct Python calls too; and telling its UI where the API is."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from chatlearn.runtime.records.prefect_server import _alive, healthy
from tests.conftest import REPO

HOLD = """
import sys, time
from chatlearn.runtime.records.prefect_server import local_prefect_api
with local_prefect_api(announce=lambda m: print(m, flush=True)) as url:
    print("URL", url, flush=True)
    while not __import__("os").path.exists(sys.argv[1]):
        time.sleep(0.1)
print("DONE", flush=True)
"""


def start_holder(home, release, tmp_path, name, **variables):
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", **variables)
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


@pytest.mark.integration
def test_overlapping_runs_share_one_server_a_killed_ones_is_adopted_and_the_last_stops_it(tmp_path):
    """One server's life (each start costs seconds here): run A starts it and tells its UI the served API (unset,
    /ui-settings says port 4200 and the UI shows "Can't connect to Server API"); B reuses it; A ends and the
    server stays for B; B is SIGKILLed (no cleanup: the server stays up with a dead user); C adopts it, and C,
    the last user out, stops it."""
    home = tmp_path / "home"
    a = start_holder(home, tmp_path / "release-a", tmp_path, "a")
    url = wait_for_url(tmp_path / "a.log")
    assert url.startswith("http://127.0.0.1:") and healthy(url) and not url.endswith(":4200/api")
    with urllib.request.urlopen(url.removesuffix("/api") + "/ui-settings", timeout=10) as resp:
        assert json.loads(resp.read())["api_url"] == url
    b = start_holder(home, tmp_path / "never", tmp_path, "b")
    assert wait_for_url(tmp_path / "b.log") == url
    assert "reusing" in (tmp_path / "b.log").read_text()
    server_pid = json.loads((home / "server.json").read_text())["pid"]

    # the first run ends while the second still uses the server: the server must stay up
    (tmp_path / "release-a").touch()
    assert a.wait(60) == 0
    assert healthy(url) and _alive(server_pid)

    b.kill()
    b.wait()
    assert healthy(url)
    c = start_holder(home, tmp_path / "release-c", tmp_path, "c")
    assert wait_for_url(tmp_path / "c.log") == url

    # the last user out stops it
    (tmp_path / "release-c").touch()
    assert c.wait(60) == 0
    assert stopped(server_pid)
    assert not healthy(url)


AUTH = "chatlearn:pinned-7f3a9c"  # the test's basic-auth user:password; its password must be printed nowhere


@pytest.mark.integration
def test_chatlearn_server_with_authentication_serves_runs_refuses_strangers_and_stops_on_sigterm(tmp_path):
    """`chatlearn server` with PREFECT_SERVER_API_AUTH_STRING: a client without the credentials (or with others)
    is refused, Prefect's own client with them is served; a run with them joins it and leaves it up, one without
    them is told what to set; the secret is printed and written nowhere; SIGTERM stops it."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.exceptions import PrefectHTTPStatusError

    from chatlearn.runtime.records.prefect_server import authorized

    home = tmp_path / "home"
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_API_AUTH_STRING=AUTH)
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_API_AUTH_STRING", None)
    log = tmp_path / "serve.log"
    serve = subprocess.Popen([sys.executable, "-m", "chatlearn.cli", "server"], env=env, stdout=open(log, "w"),
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while "serving until Ctrl-C" not in log.read_text():
            assert serve.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        url = text.split("export PREFECT_API_URL=")[1].split()[0]
        assert f"Prefect UI (started local server): {url.removesuffix('/api')}" in text
        assert "API authentication: on" in text
        assert healthy(url)  # the health check needs no credentials (Prefect's, for probes)
        server_pid = json.loads((home / "server.json").read_text())["pid"]

        # strangers are refused, at the HTTP level and through Prefect's client; the credentials are served
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url + "/admin/version", timeout=10)
        assert refused.value.code == 401
        assert not authorized(url, None) and not authorized(url, "chatlearn:guess") and authorized(url, AUTH)
        with SyncPrefectClient(url) as client, pytest.raises(PrefectHTTPStatusError, match="401"):
            client.read_flows()
        with SyncPrefectClient(url, auth_string=AUTH) as client:
            assert client.read_flows() == []

        # a run with the credentials joins the served server and leaves it up when it ends
        b = start_holder(home, tmp_path / "release-b", tmp_path, "b", PREFECT_API_AUTH_STRING=AUTH)
        assert wait_for_url(tmp_path / "b.log") == url
        (tmp_path / "release-b").touch()
        assert b.wait(60) == 0
        assert healthy(url) and _alive(server_pid)
        # one without them is told what to set, and the server stays as it is
        c = start_holder(home, tmp_path / "release-c", tmp_path, "c")
        assert c.wait(60) != 0
        assert (f"the local Prefect server {url} requires authentication, and this process sends none: set "
                "PREFECT_API_AUTH_STRING") in (tmp_path / "c.log").read_text()
        assert healthy(url) and _alive(server_pid)

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
        assert stopped(server_pid)
        assert not healthy(url)
        secret = AUTH.split(":")[1]
        for written in (log, tmp_path / "b.log", tmp_path / "c.log", home / "server.json", home / "server.log"):
            assert secret not in written.read_text(), written
    finally:
        if serve.poll() is None:
            serve.kill()


def test_chatlearn_server_refuses_an_api_open_to_other_machines(tmp_path, monkeypatch, capsys):
    """--host other than 127.0.0.1 needs authentication; a malformed auth string is refused unseen; nothing
    starts."""
    from prefect.settings import PREFECT_SERVER_API_AUTH_STRING, temporary_settings

    from chatlearn.cli import main

    monkeypatch.setenv("CHATLEARN_PREFECT_HOME", str(tmp_path))
    with temporary_settings({PREFECT_SERVER_API_AUTH_STRING: None}):
        assert main(["server", "--host", "0.0.0.0", "--port", "4200"]) == 2
    assert capsys.readouterr().err.startswith(
        "chatlearn: error: --host 0.0.0.0 would open the Prefect API to every machine that reaches this one, "
        "without authentication: set PREFECT_SERVER_API_AUTH_STRING=user:password")
    with temporary_settings({PREFECT_SERVER_API_AUTH_STRING: "no-colon-secret"}):
        assert main(["server"]) == 2
    err = capsys.readouterr().err
    assert "must be user:password" in err and "no-colon-secret" not in err
    assert not (tmp_path / "server.json").exists()  # no server was started


DIRECT = """
import sys
from chatlearn.config import load_config
from flows import train_flow
result = train_flow(load_config("configs/dpo.yaml", sys.argv[1:]))
print("RESULT", sorted(result), flush=True)
"""


@pytest.mark.integration
def test_a_python_train_flow_call_uses_the_shared_local_server(tmp_path, tiny_model_dir):
    """`train_flow(cfg)` with no API configured: not Prefect's ephemeral API (gone when the call returns), but
    the local server `chatlearn train` uses, announced on stderr; the run stays in its database."""
    home = tmp_path / "home"
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               CHATLEARN_TINY_MODEL_DIR=tiny_model_dir, CHATLEARN_OUTPUT_DIR=str(tmp_path / "out"))
    for name in ("PREFECT_API_URL", "RAY_ADDRESS"):
        env.pop(name, None)
    args = ["runtime.num_episode=1", "runtime.sample_per_episode=16", "runtime.generation_batch_size=16",
            "runtime.train_micro_batch_size=16", "runtime.train_global_batch_size=16",
            "runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false", "runtime.exp_name=direct"]
    res = subprocess.run([sys.executable, "-c", DIRECT, *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "RESULT" in res.stdout
    assert "Prefect UI (started local server): http://127.0.0.1:" in res.stderr
    assert not (home / "server.json").exists() or not json.loads((home / "server.json").read_text())
    assert (home / "prefect.db").is_file()  # the history lives in CHATLEARN_PREFECT_HOME

    # the same home again (a later run, `chatlearn server`): the finished run is in the UI's database
    flow_run_id = json.loads((tmp_path / "out" / "direct" / ".flow_run.json").read_text())["flow_run_id"]
    holder = start_holder(home, tmp_path / "release", tmp_path, "holder")
    try:
        url = wait_for_url(tmp_path / "holder.log")
        body = json.dumps({"flows": {"name": {"any_": ["chatlearn-train"]}}}).encode()
        req = urllib.request.Request(url + "/flow_runs/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            runs = json.loads(resp.read())
        assert [(r["id"], r["state_type"]) for r in runs] == [(flow_run_id, "COMPLETED")]
    finally:
        (tmp_path / "release").touch()
        assert holder.wait(60) == 0


def test_a_configured_api_is_used_as_is_and_nesting_is_harmless(tmp_path, monkeypatch):
    """"Configured" is Prefect's effective setting (here temporary_settings, as the pytest harness does), and
    an API set in the environment after Prefect read it is made visible to Prefect's clients."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from chatlearn.runtime.records.prefect_server import configured_api_url, local_prefect_api

    monkeypatch.setenv("CHATLEARN_PREFECT_HOME", str(tmp_path))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings({PREFECT_API_URL: "http://elsewhere:1/api"}):
        assert configured_api_url() == "http://elsewhere:1/api"
        with local_prefect_api(announce=pytest.fail) as url, local_prefect_api(announce=pytest.fail) as inner:
            assert url == inner == "http://elsewhere:1/api"
    monkeypatch.setenv("PREFECT_API_URL", "http://late:2/api")
    with local_prefect_api(announce=pytest.fail) as url:
        assert url == PREFECT_API_URL.value() == "http://late:2/api"
    assert not (tmp_path / "server.json").exists()  # no local server was started


def test_inside_a_flow_run_a_direct_call_changes_nothing(monkeypatch):
    from chatlearn.runtime.prefect.prevalidated import _api_for_direct_call, in_flow_run

    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
    assert not in_flow_run()
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "00000000-0000-0000-0000-000000000001")  # a worker's run
    assert in_flow_run()
    with _api_for_direct_call() as url:
        assert url is None


def test_a_stop_while_the_server_starts_takes_the_server_down(tmp_path, monkeypatch):
    """SIGTERM while `chatlearn train` waits for the Prefect server it started (here a stand-in that never gets
    healthy): the stop goes on (Stopped), and the server process, in a session of its own, does not outlive it."""
    import chatlearn.runtime.records.prefect_server as prefect_server
    from chatlearn.runtime.calls.stopping import Stopped, stop_on_signals

    real_popen = subprocess.Popen
    started: list[subprocess.Popen] = []

    def server_stand_in(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "prefect", "server", "start"], cmd
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs))
        return started[-1]

    checks = []

    def unhealthy(url, timeout=2.0):
        checks.append(url)
        if len(checks) == 2:  # the server is starting: the command is stopped
            os.kill(os.getpid(), signal.SIGTERM)
        return False

    monkeypatch.setenv("CHATLEARN_PREFECT_HOME", str(tmp_path))
    monkeypatch.setattr(prefect_server, "configured_api_url", lambda: None)
    monkeypatch.setattr(prefect_server, "healthy", unhealthy)
    monkeypatch.setattr(subprocess, "Popen", server_stand_in)
    with stop_on_signals(), pytest.raises(Stopped):
        with prefect_server.local_prefect_api(announce=pytest.fail):
            pytest.fail("the API was yielded")
    monkeypatch.undo()
    try:
        assert len(started) == 1 and stopped(started[0].pid), "the server outlived the stop"
    finally:
        for proc in started:
            proc.kill()
            proc.wait(5)
