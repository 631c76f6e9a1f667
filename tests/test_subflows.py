"""Subflow runs recorded in the background (chatlearn/runtime/prefect/subflows.py), on the session's Prefect API:
what the API shows is what Prefect's own subflow call shows (a flow run under a task run of the parent, its
parameters, states, and the task runs of its body under it), the caller never waits for the API, a failure is
recorded as one, a flow run created ahead and not run is cancelled, and while the API is away the body runs
inline. The train flow's episodes run through it in every integration run (tests/test_train_flow.py checks the
episodes' subflows, stage and call task runs)."""

import time

import pytest
from prefect import flow, get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL
from prefect.task_runners import ThreadPoolTaskRunner

from chatlearn.runtime.prefect import api_link, subflows
from chatlearn.runtime.prefect.subflows import Subflows, started_hook

pytestmark = pytest.mark.integration


@task(name="double", cache_policy=NO_CACHE)
def double(x: int) -> int:
    return 2 * x


@flow(name="piece", task_runner=ThreadPoolTaskRunner(max_workers=2), validate_parameters=False)
def piece(x: int, fail: bool = False, seconds: float = 0.0) -> int:
    started_hook()()  # as an episode once generated: the next call's flow run is created from here on
    time.sleep(seconds)  # what an episode's stages take
    first = double.submit(x)
    second = double.submit(first)
    if fail:
        raise ValueError(f"piece {x} failed")
    return second.result()


def _read(parent_id):
    with get_client(sync_client=True) as client:
        subs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(
            any_=[parent_id, *(s.id for s in subs)])))
    return {s.name: s for s in subs}, tasks


def _wait_for(check, timeout=30.0):
    deadline = time.time() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def test_subflow_runs_show_as_prefects_own_and_the_caller_never_waits(prefect_api, monkeypatch):
    slow_api = []
    real_set_states = subflows._set_states

    def set_states_late(prepared, state):  # an API that records states half a second late
        time.sleep(0.5)
        slow_api.append(state.type.value)
        real_set_states(prepared, state)

    monkeypatch.setattr(subflows, "_set_states", set_states_late)

    @flow(name="parent", validate_parameters=False)
    def parent() -> dict:
        runs = Subflows(piece)
        try:
            timings = []
            values = []
            for x in (1, 2):
                t0 = time.perf_counter()
                values.append(runs(f"piece-{x}", {"x": x, "seconds": 1.5}, next_name=f"piece-{x + 1}"))
                timings.append(time.perf_counter() - t0)
            with pytest.raises(ValueError, match="piece 3 failed"):
                runs("piece-3", {"x": 3, "fail": True}, next_name="piece-4")
        finally:
            runs.close()  # piece-4 was created ahead and never ran
        return {"id": FlowRunContext.get().flow_run.id, "values": values, "timings": timings}

    with api_link.watch(PREFECT_API_URL.value()) as link:
        out = parent()
        link.flush(timeout=30)
    assert out["values"] == [4, 8]
    # each call's two states reached the API half a second late each: the calls did not wait for them (the next
    # call's flow run is created meanwhile, behind them)
    assert slow_api[:4] == ["RUNNING", "COMPLETED", "RUNNING", "COMPLETED"]
    assert max(out["timings"]) < 1.5 + 0.4, out["timings"]

    def recorded():
        subs, tasks = _read(out["id"])
        assert {name: s.state.type.value for name, s in subs.items()} == {
            "piece-1": "COMPLETED", "piece-2": "COMPLETED", "piece-3": "FAILED", "piece-4": "CANCELLED"}
        by_flow = {s.name: sorted(t.name.rsplit("-", 1)[0] for t in tasks if t.flow_run_id == s.id)
                   for s in subs.values()}
        assert by_flow["piece-1"] == by_flow["piece-2"] == ["double", "double"] and by_flow["piece-4"] == []
        return subs, tasks

    subs, tasks = _wait_for(recorded)
    assert "ValueError: piece 3 failed" in subs["piece-3"].state.message
    # under a task run of the parent named as the subflow, in the parent's state
    parents = {t.id: t for t in tasks if t.flow_run_id == out["id"]}
    for name, sub in subs.items():
        assert parents[sub.parent_task_run_id].name == name
        assert parents[sub.parent_task_run_id].state.type == sub.state.type
    assert subs["piece-2"].parameters == {"x": 2, "seconds": 1.5}
    assert subs["piece-1"].start_time is not None and subs["piece-1"].end_time >= subs["piece-1"].start_time
    # the second task of a piece reads the first: its input links them, as in Prefect's subflows
    second = [t for t in tasks if t.flow_run_id == subs["piece-1"].id and t.task_inputs["x"]]
    assert len(second) == 1


def test_while_the_api_is_away_the_body_runs_inline_with_no_subflow(prefect_api):
    @flow(name="parent-offline", validate_parameters=False)
    def parent() -> dict:
        runs = Subflows(piece)
        api_link.current().down("is made unreachable by the test")
        try:
            return {"id": FlowRunContext.get().flow_run.id, "value": runs("piece-5", {"x": 5})}
        finally:
            api_link.current()._back()
            runs.close()

    with api_link.watch(PREFECT_API_URL.value()) as link:
        link.say = lambda msg: None
        out = parent()
        link.flush(timeout=30)
    assert out["value"] == 20
    time.sleep(2)  # what would have been recorded has reached the server
    subs, tasks = _read(out["id"])
    assert subs == {} and [t for t in tasks if t.flow_run_id == out["id"]] == []


@flow(name="late-start", validate_parameters=False)
def late_start(parent_id, wait: float) -> dict:
    """Reads whether the next call's flow run exists before and after it calls the started hook."""
    def names():
        return set(_read(parent_id)[0])

    def created():
        now = names()
        assert "late-2" in now
        return now

    time.sleep(wait)  # a creation posted at the start would have landed by now
    before = names()
    started_hook()()
    return {"before": before, "after": _wait_for(created)}


def test_the_next_flow_run_is_created_once_the_body_says_it_started(prefect_api):
    @flow(name="parent-late", validate_parameters=False)
    def parent() -> dict:
        runs = Subflows(late_start)
        me = FlowRunContext.get().flow_run.id
        try:
            return runs("late-1", {"parent_id": me, "wait": 1.5}, next_name="late-2")
        finally:
            runs.close()

    with api_link.watch(PREFECT_API_URL.value()) as link:
        out = parent()
        link.flush(timeout=30)
    assert out["before"] == {"late-1"} and out["after"] >= {"late-1", "late-2"}
