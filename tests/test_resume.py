"""Exact resume: a real `chatlearn train` process SIGKILLed at two different moments, then started again with
the same command, ends with the uninterrupted run's final policy, bit for bit, and the same metrics rows.

The kills come from `CHATLEARN_CRASH_AT` (chatlearn/utils/faults.py): the process SIGKILLs itself at an
exact point: one run is killed (1) halfway through writing the data checkpoint record of episode 2, after the
model checkpoints were written, then, started again, (2) while episode 3 is being scored and trained. Relay is
on, so its window must resume too. The last start is given another Prefect API, which goes away for good while it
trains: the run finishes, and equal.

Every model of the default config is the tiny Qwen2 of configs/tiny_qwen2.yaml (tied input/output embeddings,
grouped-query attention, as Qwen2.5-0.5B): the tied weight trains, is checkpointed once per checkpoint and must
come back tied for the resumed run to match (issue 21). The default's Llama resumes by the same code.
"""

import contextlib
import json
import os
import re
import signal
import threading
import time

import pandas as pd
import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from chatlearn.runtime.cluster import reaper
from chatlearn.runtime.records import prefect_server
from chatlearn.runtime.records.traces import read_traces
from tests.conftest import chatlearn_train, train_here

pytestmark = pytest.mark.integration

ARGS = [
    "runtime.num_episode=4", "runtime.sample_per_episode=32", "runtime.generation_batch_size=16",
    "runtime.train_micro_batch_size=8", "runtime.train_global_batch_size=16", "runtime.save_episode_interval=1",
    "runtime.eval_episode_interval=2", "runtime.max_relay_episode=2",
    "runtime.relay_sample_fn=chatlearn.data.relay:concat_all",
    *(f"models.{m}.model_config_file=tiny_qwen2.yaml" for m in ("policy", "reference", "value", "ppo_policy",
                                                               "ppo_value")),
]
TIMING = ("episode_seconds", "stage_seconds", "peak_memory_mb", "startup_seconds")


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tiny_qwen2_dir):
    return tiny_model_dir, tiny_qwen2_dir


def train(out, exp, model_dirs, crash=None, kill=None, extra=(), api_url="", **variables):
    # crash: SIGKILL the driver at a point; kill: SIGKILL a model's worker process (chatlearn.runtime.calls.recovery)
    tiny_model_dir, tiny_qwen2_dir = model_dirs
    return chatlearn_train([*ARGS, *extra, f"runtime.exp_name={exp}"], out, tiny_model_dir, api_url=api_url,
                           CHATLEARN_TINY_QWEN2_DIR=tiny_qwen2_dir, CHATLEARN_CRASH_AT=crash,
                           CHATLEARN_KILL_AT=kill, **variables)


def comparable_rows(run_dir):
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if k not in TIMING}
        row["checkpoint_paths"] = {k: os.path.relpath(v, run_dir) for k, v in row["checkpoint_paths"].items()}
        if "relay_checkpoint" in row:
            row["relay_checkpoint"] = os.path.relpath(row["relay_checkpoint"], run_dir)
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def reference_run(prefect_api, ray_session, model_dirs, tmp_path_factory):
    """The uninterrupted run every disturbed one must reproduce: (its weights, its comparable rows). It runs in
    this process, on the session's Ray: the disturbed runs are the command's own processes."""
    out = tmp_path_factory.mktemp("reference")
    tiny_model_dir, tiny_qwen2_dir = model_dirs
    with pytest.MonkeyPatch.context() as monkeypatch:
        train_here([*ARGS, "runtime.exp_name=ref"], out, tiny_model_dir, monkeypatch,
                   CHATLEARN_TINY_QWEN2_DIR=tiny_qwen2_dir)
    rows = comparable_rows(out / "ref")
    assert [r["episode"] for r in rows] == [1, 2, 3, 4]
    # each checkpoint holds the tied weight once (its other name an alias), and the exported policy is tied
    last = sorted((out / "ref" / "checkpoints" / "ppo_policy").iterdir())[-1]
    with safe_open(str(last / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"lm_head.weight": "model.embed_tokens.weight"}
    final = AutoModelForCausalLM.from_pretrained(out / "ref" / "final" / "policy")
    assert final.lm_head.weight.data_ptr() == final.model.embed_tokens.weight.data_ptr()
    traces = read_traces(out / "ref")
    assert list(traces.groupby("episode").size()) == [32] * 4
    return load_file(str(out / "ref" / "final" / "policy" / "model.safetensors")), rows, traces


def assert_same_as_reference(run_dir, reference_run):
    expected_weights, expected_rows, expected_traces = reference_run
    weights = load_file(str(run_dir / "final" / "policy" / "model.safetensors"))
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights), run_dir
    assert comparable_rows(run_dir) == expected_rows, run_dir
    # the samples' tables too: each episode's once, equal to the uninterrupted run's (issue 47)
    pd.testing.assert_frame_equal(read_traces(run_dir), expected_traces)
    assert sorted(p.name for p in (run_dir / "traces").iterdir()) == [f"episode_{e:06d}.parquet" for e in range(1, 5)]


def test_sigkill_at_two_moments_then_a_rerun_whose_prefect_api_goes_away_gives_the_uninterrupted_run(
        reference_run, model_dirs, tmp_path, monkeypatch):
    # one run killed twice: halfway through writing episode 2's record (it resumes after episode 1), then, resumed,
    # while episode 3 is scored and trained (it resumes after episode 2); the third start ends as undisturbed.
    # No process of a start outlives it by more than seconds, a SIGKILLed one's Ray included (its agents lived
    # on for a minute: chatlearn.runtime.cluster.reaper).
    # The third start is given another API (a cluster's server), killed during episode 4 and never back: the run
    # finishes on its own, says so in one line, and exits (Prefect's queues drained in bounded time)
    exp = "killed-twice"
    monkeypatch.setenv("CHATLEARN_PREFECT_HOME", str(tmp_path / "other-server"))
    (tmp_path / "other-server").mkdir()
    pid, url = prefect_server._start_server(timeout=120)
    killer, killed = _kill_server_after_episodes(tmp_path / exp, 3, lambda: pid)
    try:
        with RunProcesses() as processes:
            for crash, resumed_after in [("data_checkpoint_write:1", None), ("after_generate:2", 1), (None, 2)]:
                # a call in flight when the server dies retries 2 + 4 s instead of Prefect's 2 + 4 + ... + 32 s
                api = dict(api_url=url, PREFECT_CLIENT_MAX_RETRIES="2") if crash is None else {}
                res = train(tmp_path, exp, model_dirs, crash=crash, **api)
                assert processes.left_after(OUTLIVE_S, processes.take()) == [], res.stderr[-3000:]
                if resumed_after is not None:
                    assert f"resuming after episode {resumed_after} " in res.stdout + res.stderr, res.stderr[-3000:]
                if crash is not None:
                    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
                    assert not (tmp_path / exp / "final").exists()
    finally:
        killer.join(timeout=5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    assert killed and res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count(f"the Prefect API at {url} ") == 2, res.stderr[-3000:]  # gone, and still gone at the end
    assert "training goes on without it" in res.stderr and "still does not answer" in res.stderr
    assert _no_traceback(res.stderr), res.stderr[-3000:]
    assert_same_as_reference(tmp_path / exp, reference_run)


def _rows_done(run_dir):
    """How many episode rows the run has written so far."""
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def _kill_server_after_episodes(run_dir, episodes, server_pid):
    """A thread that SIGKILLs the Prefect server (its process group) once ``episodes`` rows are in the run's
    metrics: the server dies while the next episode runs. Returns (thread, killed pids)."""
    killed = []

    def kill():
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline:
            if _rows_done(run_dir) >= episodes:
                pid = server_pid()
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread, killed


def _no_traceback(stderr):
    return "Traceback" not in stderr and "ConnectError" not in stderr and "Error logging to API" not in stderr


# -- the processes of a run, and its local Ray's head going away (chatlearn.runtime.cluster.head, .reaper) -------

OUTLIVE_S = 10.0  # how long a process of a run may outlive it (a SIGKILLed driver's Ray agents lived 65 s)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class RunProcesses:
    """Notes, every 0.2 s while in use, every process of each `chatlearn train` this test process starts: the
    command and everything below it, with their command lines."""

    def __init__(self):
        self.noted = {}  # (pid, start time) -> command line
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._note, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    def drivers(self):
        return [pid for pid, _ in reaper.descendants([os.getpid()])
                if pid != os.getpid() and "chatlearn.cli train" in _cmdline(pid)]

    def _note(self):
        while not self._done.wait(0.2):
            for ident in reaper.descendants(self.drivers()):
                if ident not in self.noted:
                    self.noted[ident] = _cmdline(ident[0])

    def take(self):
        """Every process noted so far, forgotten here."""
        noted, self.noted = set(self.noted), {}
        return noted

    def left_after(self, seconds, idents):
        """Of ``idents``, those still running ``seconds`` on."""
        deadline = time.monotonic() + seconds
        while True:
            live = reaper.descendants(pid for pid, _ in idents)  # each alone: a root of its own
            left = [f"{pid} {self.noted.get((pid, st), '')[:80]}" for pid, st in idents if (pid, st) in live]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def _ours(cmdline):
    """The run's own helpers in its tree that are not Ray's: its reaper, and the Prefect server it started again."""
    return "reaper.py" in cmdline or "prefect server start" in cmdline


def test_a_model_process_the_prefect_server_and_the_rays_head_killed_in_one_run_end_as_undisturbed(
        reference_run, model_dirs, tmp_path, monkeypatch):
    """One run, three faults, each recovered by its own mechanism, and the undisturbed run's weights and rows:

    1. the worker process hosting ppo_policy (the default colocates all six models in it) is SIGKILLed while
       episode 2 is scored and trained: the run recreates it and resumes from episode 1's checkpoint record;
    2. the local Prefect server is SIGKILLed once two episodes are done: training goes on, the run starts the
       server again on the same port and database, and the UI catches up (the finished run, its metrics table);
    3. the GCS server of the Ray the run started is SIGKILLed once three episodes are done: within a second the
       run ends what is left of that Ray (nothing of it outlives it 10 s), starts a fresh local Ray and resumes
       from the last checkpoint, before Ray's client would have ended the process (60 s after the GCS went).

    No PREFECT_API_URL: the command uses the local server of CHATLEARN_PREFECT_HOME, which this test joins first
    (as `chatlearn server` would), so that it is still up after the run to read the run back from it."""
    exp = "disturbed"
    run_dir = tmp_path / exp
    home = tmp_path / "prefect-home"
    monkeypatch.setenv("CHATLEARN_PREFECT_HOME", str(home))
    url, _ = prefect_server._join_local_server(timeout=120)
    pid_of = lambda: json.loads((home / "server.json").read_text())["pid"]  # noqa: E731
    killed = {}

    def kill_the_gcs(processes, server_killed):
        deadline = time.monotonic() + 500
        while time.monotonic() < deadline and "gcs" not in killed:
            if server_killed and _rows_done(run_dir) >= 3:
                for driver in processes.drivers():
                    tree = reaper.descendants([driver])
                    gcs = [pid for pid, _ in tree if _cmdline(pid).split(" ")[0].endswith("/gcs_server")]
                    if gcs:  # the dead Ray's raylet, agents and workers must go within seconds
                        ray = {ident for ident in tree if ident[0] != driver and not _ours(_cmdline(ident[0]))}
                        os.kill(gcs[0], signal.SIGKILL)
                        killed.update(gcs=gcs[0], left=processes.left_after(OUTLIVE_S, ray))
            time.sleep(0.2)

    try:
        with RunProcesses() as processes:
            server_killer, server_killed = _kill_server_after_episodes(run_dir, 2, pid_of)
            killer = threading.Thread(target=kill_the_gcs, args=(processes, server_killed), daemon=True)
            killer.start()
            res = train(tmp_path, exp, model_dirs, kill="ppo_policy:after_generate:1", api_url=None,
                        CHATLEARN_PREFECT_HOME=str(home))
            server_killer.join(timeout=5)
            killer.join(timeout=5)
            assert "gcs" in killed and killed["left"] == [], res.stderr[-3000:]
            # nor anything of the fresh Ray; the Prefect server the run started again stays (this test joined it)
            names = dict(processes.noted)
            run = {ident for ident in processes.take() if "prefect server start" not in names.get(ident, "")}
            assert processes.left_after(OUTLIVE_S, run) == []
        assert res.returncode == 0, res.stderr[-3000:]
        err = res.stderr
        # 1. the model process: one warning line; Prefect's tracebacks of Ray's ActorDiedError are in the run's log
        assert "died during episode 2" in err and "restart 1 of at most 3" in err, err[-3000:]
        assert "resuming after episode 1 " in err
        assert "ActorDiedError" not in err and "ActorDiedError" in (run_dir / "chatlearn.log").read_text()
        # 2. the Prefect server: gone and back, one line each
        assert err.count(f"the Prefect API at {url} does not answer") == 1, err[-3000:]
        assert f"the Prefect API at {url} answers again" in err
        # 3. the Ray head: in episode 4, or just before episode 3's checkpoint record is committed
        warned = re.search(r"chatlearn: warning: the head of the local Ray went away during episode (\d) \(its "
                           rf"gcs_server, pid {killed['gcs']}, killed by SIGKILL\); starting a fresh local Ray; "
                           r"recreating the model processes and resuming from the last checkpoint \(restart 2 of at "
                           r"most 3\)", err)
        assert warned and warned[1] in "34", err[-3000:]
        assert f"resuming after episode {int(warned[1]) - 1} " in err
        assert _no_traceback(err) and "Failed to connect to GCS" not in err, err[-3000:]
        assert_same_as_reference(run_dir, reference_run)
        # the server was started again on the same port and database: the UI shows the run, finished, with all
        # its episodes
        assert pid_of() != server_killed[0] and prefect_server.healthy(url)
        with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
            train_run = [r for r in client.read_flow_runs() if r.name != "" and r.parent_task_run_id is None
                         and r.state.name == "Completed"]
            assert len(train_run) == 1, [(r.name, r.state.name) for r in client.read_flow_runs()]
            table = client.read_latest_artifacts()
            rows = [a for a in table if a.key == f"{exp}-metrics"]
            assert len(json.loads(rows[0].data)) == 4  # the metrics table caught up
    finally:
        prefect_server._leave_local_server()
