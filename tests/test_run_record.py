"""A run killed with SIGKILL stays "Running" in Prefect; the re-run in the same run_dir marks it Crashed."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from prefect import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)

from chatlearn.runtime.records import run_record
from chatlearn.runtime.records.run_record import mark_previous_run_crashed, read_record, record_flow_run
from tests.conftest import REPO

KILLED = """
import sys, time
from pathlib import Path
from prefect import flow, task
from chatlearn.runtime.records.run_record import record_flow_run

@task
def stage(ready):
    Path(ready).touch()
    time.sleep(600)

@flow(name="episode")
def episode(ready):
    stage(ready)

@flow(name="killed-train")
def train(run_dir, ready):
    record_flow_run(run_dir)
    episode(ready)

train(sys.argv[1], sys.argv[2])
"""


def _write(run_dir, **rec):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / run_record.RECORD_NAME).write_text(json.dumps(rec))


def _no_api(*args, **kwargs):
    raise AssertionError("the API must not be asked")


def test_a_live_process_or_another_host_is_never_marked(tmp_path, monkeypatch):
    monkeypatch.setattr(run_record, "get_client", _no_api)
    live = subprocess.Popen(["sleep", "60"])
    try:
        _write(tmp_path, flow_run_id=str(uuid.uuid4()), pid=live.pid, hostname=socket.gethostname())
        assert mark_previous_run_crashed(tmp_path) == []
        _write(tmp_path, flow_run_id=str(uuid.uuid4()), pid=os.getpid(), hostname=socket.gethostname())
        assert mark_previous_run_crashed(tmp_path) == []  # this very process (a second call in it)
    finally:
        live.kill()
        live.wait()
    _write(tmp_path, flow_run_id=str(uuid.uuid4()), pid=live.pid, hostname="another-host")
    assert mark_previous_run_crashed(tmp_path) == []  # dead here means nothing about a pid over there
    (tmp_path / run_record.RECORD_NAME).write_text("{half a rec")
    assert read_record(tmp_path) is None and mark_previous_run_crashed(tmp_path) == []
    assert mark_previous_run_crashed(tmp_path / "fresh") == []
    assert record_flow_run(tmp_path / "fresh") is None  # outside a flow run there is nothing to record


def test_an_unreachable_api_only_costs_the_marking(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise ConnectionError("no API here")

    monkeypatch.setattr(run_record, "get_client", broken)
    dead = subprocess.Popen(["true"])
    dead.wait()
    _write(tmp_path, flow_run_id=str(uuid.uuid4()), pid=dead.pid, hostname=socket.gethostname())
    assert mark_previous_run_crashed(tmp_path) == []
    assert "could not mark the earlier flow run" in capsys.readouterr().err


def _runs(flow_run_id):
    async def read():
        async with get_client() as client:
            root = await client.read_flow_run(flow_run_id)
            subs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[root.id])))
            tasks = await client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[root.id, *(s.id for s in subs)])))
            return root, subs, tasks

    return asyncio.run(read())


@pytest.mark.integration
def test_a_sigkilled_run_and_its_subflow_and_task_are_marked_crashed(prefect_api, tmp_path):
    from prefect.settings import PREFECT_API_URL

    run_dir, ready = tmp_path / "run", tmp_path / "ready"
    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value())
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(run_dir), str(ready)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "timeout"
            time.sleep(0.2)
        rec = read_record(run_dir)
        assert rec["pid"] == proc.pid and rec["hostname"] == socket.gethostname()
        # task runs reach the API as events, written in batches: wait until the stage (not the parent's task run
        # for the subflow, which the API records at once) shows Running there
        while not [t for t in _runs(rec["flow_run_id"])[2] if t.state_type.value == "RUNNING"
                   and t.name.startswith("stage")]:
            assert time.time() < deadline
            time.sleep(0.2)
        assert mark_previous_run_crashed(run_dir) == []  # alive: left alone
        assert _runs(rec["flow_run_id"])[0].state_type.value == "RUNNING"
    finally:
        proc.kill()  # SIGKILL: nothing tells the API
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    marked = mark_previous_run_crashed(run_dir, resumed_by="the-rerun")
    root, subs, tasks = _runs(rec["flow_run_id"])
    # two task runs: the stage, and the one that stands for the subflow call in the parent run
    assert len(subs) == 1 and sorted(t.flow_run_id for t in tasks) == sorted([root.id, subs[0].id])
    assert marked[:2] == [str(root.id), str(subs[0].id)] and sorted(marked[2:]) == sorted(str(t.id) for t in tasks)
    for run in (root, *subs, *tasks):
        assert run.state.type.value == "CRASHED", run
        assert run.state.message == (f"the process running it (pid {proc.pid} on {socket.gethostname()}) died; "
                                     "resumed by flow run the-rerun")
    assert mark_previous_run_crashed(run_dir) == []  # Crashed is final: nothing to do the second time
