"""Task runs recorded from events (chatlearn/runtime/prefect/task_runs.py), on the session's Prefect API: one flow
run on Prefect's own ThreadPoolTaskRunner and one on RecordedTaskRunner record the same task runs (names, states,
the inputs that draw the graph's edges, the parent task run of a nested one, state messages), the body sees the
same values, and a failure and its downstream show as they do under Prefect's task engine. The train flow's
episodes run on it in every integration run (tests/test_train_flow.py reads their stage and call task runs)."""

import time

import pytest
from prefect import flow, get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId
from prefect.context import FlowRunContext, TaskRunContext
from prefect.exceptions import UnfinishedRun
from prefect.task_runners import ThreadPoolTaskRunner

from chatlearn.runtime.prefect.task_runs import RecordedTaskRunner
from flows.model_calls import unwalked

pytestmark = pytest.mark.integration


@task(name="leaf", cache_policy=NO_CACHE)
def leaf(x: int) -> int:
    return x + 1


@task(name="named", task_run_name="named-{label}", cache_policy=NO_CACHE)
def named(label: str, value: int) -> dict:
    # submitted from inside a task run: its run's parent is this one
    inner = leaf.submit(value).result()
    return {"inner": inner, "in_task_run": TaskRunContext.get().task_run.name}


@task(name="boom", cache_policy=NO_CACHE)
def boom(x: int) -> int:
    raise ValueError(f"boom on {x}")


def _body() -> dict:
    first = leaf.submit(*unwalked([1]))
    second = named.submit(*unwalked(["b", first]))
    failed = boom.submit(*unwalked([first]))
    after = leaf.submit(*unwalked([5]), wait_for=[failed])
    out = {"id": FlowRunContext.get().flow_run.id, "second": second.result()}
    with pytest.raises(ValueError, match="boom on 2"):
        failed.result()
    with pytest.raises(UnfinishedRun):
        after.result()
    return out


@flow(name="recorded-runs", task_runner=RecordedTaskRunner(max_workers=4), validate_parameters=False)
def recorded_flow() -> dict:
    return _body()


@flow(name="engine-runs", task_runner=ThreadPoolTaskRunner(max_workers=4), validate_parameters=False)
def engine_flow() -> dict:
    return _body()


def _runs(flow_run_id, expect: int, timeout: float = 30.0) -> list:
    deadline = time.monotonic() + timeout
    while True:  # the server writes task runs from events in batches (flushed every second)
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])))
        if (len(runs) >= expect and all(r.state.is_final() or r.state.name == "NotReady" for r in runs)) \
                or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def _shape(runs: list) -> list:
    """Each run (sorted): its name with the dynamic suffix dropped, state type, state name, the start of its
    state message, and the names of the runs each of its inputs (the parent among them) reads."""
    names = {r.id: r.name if r.name.startswith("named-") else r.name.rsplit("-", 1)[0] for r in runs}
    shape = []
    for r in runs:
        inputs = {k: sorted(names[i.id] for i in v if hasattr(i, "id")) for k, v in r.task_inputs.items()}
        shape.append((names[r.id], r.state.type.value, r.state.name, (r.state.message or "").split(" ")[0],
                      sorted((k, v) for k, v in inputs.items() if v)))
    return sorted(shape)


def test_recorded_task_runs_show_as_prefects_task_engine_records_them(prefect_api):
    engine, recorded = engine_flow(), recorded_flow()
    assert recorded["second"] == engine["second"] == {"inner": 3, "in_task_run": "named-b"}
    engine_runs, recorded_runs = _runs(engine["id"], 5), _runs(recorded["id"], 5)
    assert _shape(recorded_runs) == _shape(engine_runs)
    assert _shape(recorded_runs) == [
        ("boom", "FAILED", "Failed", "Task", [("x", ["leaf"])]),
        ("leaf", "COMPLETED", "Completed", "", []),
        ("leaf", "COMPLETED", "Completed", "", [("__parents__", ["named-b"])]),  # submitted inside named-b
        ("leaf", "PENDING", "NotReady", "Upstream", [("wait_for", ["boom"])]),
        ("named-b", "COMPLETED", "Completed", "", [("value", ["leaf"])]),  # the edge from the future it read
    ]
    failed = next(r for r in recorded_runs if r.state.is_failed())
    assert "ValueError: boom on 2" in failed.state.message
    for r in recorded_runs:  # times as the engine records them: a run that ran has a start, an end, a run count
        if r.state.is_final():
            assert r.start_time is not None and r.end_time >= r.start_time and r.run_count == 1
            assert r.total_run_time.total_seconds() >= 0


@task(name="slow", cache_policy=NO_CACHE)
def slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@flow(name="recorded-slow", task_runner=RecordedTaskRunner(max_workers=2), validate_parameters=False)
def slow_flow(seconds: float) -> dict:
    """A long task run shows Running in the API while it runs; a short one is recorded from its final state."""
    quick = slow.submit(0.0)
    running = slow.submit(seconds)
    flow_run_id = FlowRunContext.get().flow_run.id
    seen = []
    while not running.wrapped_future.done():
        with get_client(sync_client=True) as client:
            # a run the server's recorder has inserted but not yet given its state reads with state None
            seen += [r.state.type.value for r in client.read_task_runs(task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]))) if r.state is not None]
        time.sleep(0.3)
    return {"id": flow_run_id, "seen": seen, "ids": (quick.task_run_id, running.task_run_id),
            "values": (quick.result(), running.result())}


def test_a_long_task_run_shows_running_and_a_short_one_is_sent_once(prefect_api, monkeypatch):
    from chatlearn.runtime.prefect import task_runs

    monkeypatch.setattr(task_runs, "RUNNING_AFTER_S", 0.5)
    out = slow_flow(4.0)
    assert out["values"] == (0.0, 4.0) and "RUNNING" in out["seen"]
    runs = {r.id: r for r in _runs(out["id"], 2)}
    quick, long = runs[out["ids"][0]], runs[out["ids"][1]]
    with get_client(sync_client=True) as client:
        history = {i: [s.type.value for s in client.read_task_run_states(i)] for i in out["ids"]}
    assert history[quick.id] == ["COMPLETED"] and history[long.id] == ["RUNNING", "COMPLETED"]
    for r, seconds in ((quick, 0.0), (long, 4.0)):  # start and end times whichever way it was sent
        assert r.start_time is not None and r.end_time >= r.start_time
        assert seconds <= (r.end_time - r.start_time).total_seconds() < seconds + 0.5
        assert abs(r.total_run_time.total_seconds() - (r.end_time - r.start_time).total_seconds()) < 1e-3
