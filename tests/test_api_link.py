"""The Prefect API going away (chatlearn.runtime.prefect.api_link), in the small: what counts as the API being
unreachable, informing calls dropped while it is, and a flow body whose result survives the API failing around
it without being run twice. The real runs (a killed server, restarted or not) are in tests/test_resume.py."""

import logging

import httpx
import pytest

from chatlearn.runtime.prefect import api_link
from chatlearn.runtime.prefect.api_link import ApiLink, call_flow, keeps_result, unreachable


def _connect_error() -> httpx.ConnectError:
    return httpx.ConnectError("[Errno 111] Connection refused")


def test_unreachable_follows_the_chain_and_knows_only_transport_errors():
    assert unreachable(_connect_error())
    assert unreachable(httpx.ReadTimeout("slow"))
    try:
        try:
            raise _connect_error()
        except httpx.ConnectError as inner:
            raise RuntimeError("set_flow_run_state failed") from inner
    except RuntimeError as outer:
        assert unreachable(outer)
    assert not unreachable(ValueError("a reward hook's own error"))
    assert not unreachable(RuntimeError("no cause"))


class _Said(list):
    def __call__(self, msg):
        self.append(msg)


@pytest.fixture
def link(monkeypatch):
    said = _Said()
    link = ApiLink("http://127.0.0.1:9/api", say=said)  # not started: no watcher thread, `up` set by hand
    monkeypatch.setattr(api_link, "_current", link)
    yield link, said
    logging.raiseExceptions = True


def test_informing_calls_are_dropped_while_down_and_when_they_fail_with_the_api(link):
    link, said = link
    calls = []
    assert api_link.send(lambda x: calls.append(x) or "id", 1) == "id"

    def dies():
        raise _connect_error()

    assert api_link.send(dies) is None  # dropped: the API failed it
    assert not link.up and link.skipped == 1
    assert len(said) == 1 and "does not answer" not in said[0] and "failed a call (ConnectError)" in said[0]
    assert api_link.send(lambda: calls.append(2)) is None  # not even tried while down
    assert calls == [1] and link.skipped == 2
    link.down()  # one line per outage
    assert len(said) == 1

    def bug():
        raise KeyError("ours")

    link._back()
    with pytest.raises(KeyError):  # an error of ours is never swallowed
        api_link.send(bug)


def test_a_flow_body_that_finished_keeps_its_result_when_the_api_fails_to_record_it(link):
    link, said = link
    runs = []

    @keeps_result
    def body(x):
        runs.append(x)
        return {"episode": x}

    def engine_fails_after(*args, **kwargs):  # as Prefect's engine: the body runs, then set_state raises
        body(*args, **kwargs)
        raise _connect_error()

    assert call_flow(body, (3,), invoke=engine_fails_after) == {"episode": 3}
    assert runs == [3]  # run once, never again
    assert not link.up and len(said) == 1


def test_the_bodys_own_error_wins_over_the_api_failing_to_record_it(link):
    link, _ = link

    @keeps_result
    def body():
        raise ValueError("the reward hook raised")

    def engine(*args, **kwargs):
        try:
            body()
        except ValueError:
            raise _connect_error() from None

    with pytest.raises(ValueError, match="reward hook"):
        call_flow(body, invoke=engine)


def test_a_top_level_flow_that_could_not_start_fails_with_the_api_error(link):
    link, _ = link

    @keeps_result
    def body():
        raise AssertionError("never runs")

    def engine(*args, **kwargs):
        raise _connect_error()

    with pytest.raises(httpx.ConnectError):  # no parent flow run to run it in
        call_flow(body, invoke=engine)


def test_outside_a_watched_run_a_flow_is_a_plain_call(monkeypatch):
    monkeypatch.setattr(api_link, "_current", None)

    @keeps_result
    def body(x):
        return x + 1

    assert call_flow(body, (1,)) == 2
    with pytest.raises(httpx.ConnectError):
        call_flow(body, invoke=lambda: (_ for _ in ()).throw(_connect_error()))


def test_posted_calls_run_in_order_in_the_posting_context_and_never_hold_the_caller(link):
    import contextvars
    import threading
    import time

    link, said = link
    where = contextvars.ContextVar("where", default="none")
    gate, seen = threading.Event(), []

    def slow(tag):
        gate.wait(5)  # an API that answers late
        seen.append((tag, where.get(), threading.current_thread().name))

    where.set("episode 1")
    t0 = time.perf_counter()
    api_link.post(slow, "a")
    where.set("episode 2")
    api_link.post(lambda tag: seen.append((tag, where.get(), threading.current_thread().name)), "b")
    assert time.perf_counter() - t0 < 0.5 and seen == []  # the caller went on
    assert not link.flush(timeout=0.2)  # still held by the slow call
    gate.set()
    assert link.flush(timeout=5)
    assert seen == [("a", "episode 1", "prefect-api-post"), ("b", "episode 2", "prefect-api-post")]

    def dies():
        raise _connect_error()

    api_link.post(dies)  # the API failing a posted call: an outage, as for `send`
    api_link.post(lambda: seen.append("skipped while down"))
    assert link.flush(timeout=5)
    assert not link.up and link.skipped == 2 and "failed a call (ConnectError)" in said[0]
    assert seen[-1] != "skipped while down"


def test_the_unrecorded_task_runner_hands_the_function_values_not_annotations():
    from prefect import task
    from prefect.utilities.annotations import opaque, quote

    from chatlearn.runtime.prefect.task_runs import RecordedTaskRunner
    from flows.model_calls import unwalked

    @task
    def add(a, b, items):
        return a["x"] + b + sum(items)

    with RecordedTaskRunner(max_workers=2, record=False) as runner:
        first = runner.submit(add, {"a": quote({"x": 1}), "b": 2, "items": [3]})
        args = unwalked([{"x": 10}, first, [first, 4]])
        assert isinstance(args[0], quote) and isinstance(args[1], opaque) and isinstance(args[2][0], opaque)
        second = runner.submit(add, dict(zip(["a", "b", "items"], args, strict=True)))
        assert first.result() == 6 and second.result() == 10 + 6 + 6 + 4


def test_the_terminal_drops_prefects_outage_records_and_its_event_sockets_complaints(link):
    link, _ = link

    def record(name, level=logging.ERROR):
        return logging.LogRecord(name, level, __file__, 1, "msg", None, None)

    terminal = api_link._OutageFilter(link)
    assert not terminal.filter(record("websockets.client"))  # a keepalive ping late on a busy machine
    assert terminal.filter(record("prefect.events.clients")) and terminal.filter(record("chatlearn"))
    link.down()
    assert not terminal.filter(record("prefect.events.clients"))  # once the API went away
    assert terminal.filter(record("chatlearn"))


def test_a_ray_task_worker_started_while_the_api_is_away_runs_its_task():
    """A rule-reward task's worker checks the API's version when it first hydrates its settings: started while
    the server is gone (SIGKILLed, not back yet), it goes on without the check, as the run goes on without the
    API (tests/test_resume.py's third start once failed here); any other failure of the check still raises."""
    import socket

    from prefect.context import serialize_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from chatlearn.runtime.prefect import ray_tasks

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
        serialized = serialize_context()["settings_context"]
    try:
        settings, client = ray_tasks._worker_prefect("api-away", serialized)
        assert settings.settings.api.url == f"http://127.0.0.1:{port}/api"
        assert ray_tasks._worker_prefect("api-away", serialized)[1] is client  # kept for the next task
    finally:
        for _, old in ray_tasks._WORKER.values():
            old.client.__exit__(None, None, None)
        ray_tasks._WORKER.clear()
