"""Calls of a flow as subflow runs of the current flow run, recorded without the caller waiting on the API.

Prefect's own subflow call makes seven API round trips around its body, one after the other: the parent's task
run standing for the subflow, a search for an earlier one, the flow run, its read-back, its name, Running,
then Completed. At the embedded default that was 0.3-0.4 s of a 2-3 s episode (`bench/overhead.py`). Here
the subflow's records are the same (a flow run named ``episode-N`` under a task run of the parent, its
parameters, Running and a final state with their times, its stage and call task runs under it, its logs), but
the caller never waits for them:

- the flow run of call N+1 is created while call N runs (the API assigns a flow run's id, and task runs can
  only be recorded under a flow run that exists);
- its body runs in a flow-run context of that run, so the task runs it submits record under it as they do in
  a Prefect subflow;
- its states go to the API through the link's background poster (`api_link.post`), ahead of the artifacts
  there. The API stamps a flow run's state when it receives it, so the subflow's start and end times in the UI
  are late by the poster's queue and the API's answer (`bench/overhead.py` reports it as the subflow's entry);
  the API gives the parent's task run for it the same states. The task runs of its body are recorded from
  events with their own times (`chatlearn.runtime.prefect.task_runs`).

Prefect's engine does more around a subflow (retries, timeouts, hooks, pause/suspend, result persistence);
the flows run here use none of them. While the API is away the body runs inline in the parent's flow run, with
no task runs (`api_link`), as before; a flow run created ahead and never run is cancelled.

It makes a subflow's flow run context by hand and asks for the result store without the engine's async switch
(`_sync=True`), beyond Prefect's public API, so it lives in Prefect's room (`chatlearn.runtime.prefect`, whose
`PRIVATE_USES` lists what it relies on).
"""

import concurrent.futures
import contextvars
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect import Flow, Task
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext
from prefect.logging.loggers import flow_run_logger
from prefect.results import get_result_store
from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.states import Cancelled, Completed, Crashed, Failed, Pending, Running, State

from chatlearn.runtime.prefect import api_link

_PREPARE_WAIT_S = 30.0  # a created-ahead flow run not there by then: the call runs inline (the API is slow or away)


@dataclass
class _Prepared:
    name: str
    flow_run: FlowRun


class Subflows:
    """Calls of ``flow`` as subflow runs of the flow run current at each call, each flow run named by its
    caller (see the module's doc)."""

    def __init__(self, flow: Flow):
        self.flow = flow
        self._ahead: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()  # pipelined episodes call from several threads
        self._taken: set[str] = set()  # names whose flow run a call took: never created again
        self._serialized: dict[int, tuple[Any, Any]] = {}  # id -> (object, its JSON form)

    def prepare(self, name: str, parent_id: UUID | None = None) -> None:
        """Create the flow run of a later call named ``name``, in the background, under the flow run
        ``parent_id`` (default: the current one)."""
        if parent_id is None:
            parent = FlowRunContext.get()
            parent_id = parent.flow_run.id if parent is not None and parent.flow_run is not None else None
        link = api_link.current()
        if parent_id is None or link is None or not link.up:
            return
        with self._lock:
            if name in self._ahead or name in self._taken:
                return
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._ahead[name] = future
        link.post(self._create, parent_id, name, future, urgent=True)

    def __call__(self, name: str, parameters: dict[str, Any], next_name: str | None = None) -> Any:
        """Run the flow's body with ``parameters`` as the subflow run ``name``; ``next_name``: the next call's,
        whose flow run is then created while this one runs."""
        parent = FlowRunContext.get()
        link = api_link.current()
        if parent is None or link is None:  # outside a watched flow run: Prefect's own (sub)flow call, with no
            # heartbeat thread of its own (a sync subflow joins it on exit: up to 1 s, prefect_ray.md)
            with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                return self.flow.with_options(flow_run_name=name)(**parameters)
        self.prepare(name)
        prepared = self._take(name)
        if prepared is None or not link.up:
            if next_name is not None:
                self.prepare(next_name)
            return api_link._inline(self.flow, parent, (), parameters)
        return self._run(parent, prepared, parameters, next_name)

    def close(self) -> None:
        """Cancel the flow runs created ahead that no call ran (the run stopped or failed first)."""
        with self._lock:
            ahead, self._ahead = list(self._ahead.values()), {}
        for future in ahead:
            api_link.post(_cancel, future, urgent=True)  # posted after its creation: done by then, or it failed
        self._serialized.clear()

    # ---- inside ----

    def _take(self, name: str) -> _Prepared | None:
        with self._lock:
            future = self._ahead.pop(name, None)
            self._taken.add(name)
        if future is None:
            return None
        try:
            return future.result(timeout=_PREPARE_WAIT_S)
        except concurrent.futures.TimeoutError:
            logging.getLogger("chatlearn").warning("the Prefect API took over %.0f s to create %s's flow run; it "
                                                   "runs inside the parent flow run", _PREPARE_WAIT_S, name)
            return None

    def _create(self, parent_id: UUID, name: str, future: concurrent.futures.Future) -> None:
        """In the poster thread: the parent's task run for the subflow, then the subflow's flow run."""
        try:
            client = _client()
            tracking = Task(name=self.flow.name, fn=self.flow.fn, version=self.flow.version)
            task_run = client.create_task_run(tracking, flow_run_id=parent_id, dynamic_key=name, name=name,
                                              state=Pending())
            flow_run = client.create_flow_run(self.flow, name=name, parameters={}, parent_task_run_id=task_run.id,
                                              state=Pending())
            future.set_result(_Prepared(name, flow_run))
        except BaseException as exc:
            future.set_result(None)
            raise exc

    def _run(self, parent: FlowRunContext, prepared: _Prepared, parameters: dict[str, Any],
             next_name: str | None) -> Any:
        flow_run = prepared.flow_run
        api_link.post(self._start, prepared, parameters, Running(), urgent=True)
        # the next call's flow run: once the body says its start is over (`started`), else when it ends
        parent_id = parent.flow_run.id
        started = _Once(lambda: self.prepare(next_name, parent_id) if next_name is not None else None)
        logger = flow_run_logger(flow_run=flow_run, flow=self.flow)
        logger.info("Beginning subflow run %r for flow %r", flow_run.name, self.flow.name)
        token = _started.set(started)
        try:
            with self.flow.task_runner.duplicate() as runner, FlowRunContext(
                    flow=self.flow, flow_run=flow_run, parameters=parameters, client=parent.client,
                    result_store=get_result_store().update_for_flow(self.flow, _sync=True),
                    task_runner=runner, persist_result=False, log_prints=parent.log_prints):
                result = self.flow.fn(**parameters)
        except Exception as exc:
            state: State = Failed(message=f"Flow run encountered an exception: {type(exc).__name__}: {exc}")
            api_link.post(_set_states, prepared, state, urgent=True)
            logger.error("Finished in state %s", state)
            raise
        except BaseException as exc:  # a stop (SIGTERM, KeyboardInterrupt): the process is going away
            state = Crashed(message=f"Execution was interrupted: {type(exc).__name__}")
            api_link.post(_set_states, prepared, state, urgent=True)
            raise
        finally:
            _started.reset(token)
        started()
        state = Completed()
        api_link.post(_set_states, prepared, state, urgent=True)
        logger.info("Finished in state %s", state)
        return result

    def _start(self, prepared: _Prepared, parameters: dict[str, Any], running: State) -> None:
        """In the poster thread: the parameters (a flow run created ahead has none yet), then Running."""
        _client().update_flow_run(prepared.flow_run.id, parameters={k: self._json(v) for k, v in parameters.items()})
        _set_states(prepared, running)

    def _json(self, value: Any) -> Any:
        """``value`` as the flow run's parameters show it; an object passed again (one per run, e.g. the run's
        context) is serialized once."""
        if isinstance(value, (int, float, str, bool, type(None))):
            return value
        kept = self._serialized.get(id(value))
        if kept is None or kept[0] is not value:
            # an object that holds live handles says what the UI shows of it (the run's context: its spec)
            shown = value.as_parameter() if hasattr(value, "as_parameter") else value
            kept = self._serialized[id(value)] = (value, self.flow.serialize_parameters({"v": shown})["v"])
        return kept[1]


class _Once:
    def __init__(self, fn: Callable[[], Any]):
        self._fn: Callable[[], Any] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


# Why a ContextVar: the stage code that calls `started_hook` runs inside Prefect's flow engine, which passes
# nothing of ours to it; the subflow's own call sets this around its body.
_started: contextvars.ContextVar[_Once | None] = contextvars.ContextVar("chatlearn_subflow_started", default=None)


def started_hook() -> Callable[[], None]:
    """For the body of a subflow run: a callable to call (from any thread, e.g. as a future's done callback)
    once the part of its work that a busy CPU slows most is over. The next call's flow run is created then:
    about 60 ms of the local server's CPU, which taken from an episode's generation (small decode steps on
    every core, each stalled by a core taken from it) cost it twice that, and from training much less
    (`bench/overhead.py`). Not called, the flow run is created when the body ends. Outside a subflow run: a
    no-op. It runs in the context it was made in: a done callback runs in the bare context of the thread that
    finished the future, where the run's Prefect settings (its API) are not."""
    once = _started.get()
    if once is None:
        return lambda: None
    context = contextvars.copy_context()
    return lambda: context.run(once)


_local = threading.local()


def _client() -> Any:
    """The poster thread's API client for the API current in this context, kept between calls (a client is an
    HTTP connection pool and a TLS context: about 15 ms to make)."""
    url = PREFECT_API_URL.value()
    kept = getattr(_local, "client", None)
    if kept is None or kept[0] != url:
        if kept is not None:
            kept[1].__exit__(None, None, None)
        client = get_client(sync_client=True)
        client.__enter__()
        _local.client = kept = (url, client)
    return kept[1]


def _cancel(future: concurrent.futures.Future) -> None:
    prepared = future.result(timeout=0) if future.done() else None
    if prepared is not None:
        _set_states(prepared, Cancelled(message="not run: the parent run ended first"))


def _set_states(prepared: _Prepared, state: State) -> None:
    """The subflow's flow run to ``state``; the API sets the parent's task run standing for it to the same
    (Prefect's `UpdateSubflowParentTask` rule)."""
    _client().set_flow_run_state(prepared.flow_run.id, state, force=True)
