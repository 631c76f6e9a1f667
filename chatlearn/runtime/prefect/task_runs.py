"""An episode's task runs, recorded from state events instead of run by Prefect's task engine.

The stage and call tasks of an episode only dispatch to Ray and wait; what Prefect adds around their bodies is
bookkeeping. Its task engine spends about 5 ms of driver CPU a task run (states, result store, hooks, a client,
three events) and the server about 7 ms recording it, on the two cores the model processes train on: at 13-18
task runs an episode, most of the orchestration share left (`bench/overhead.py`, `bench/task_run_cost.py`).

`RecordedTaskRunner` runs each task's function in a thread, as Prefect's `ThreadPoolTaskRunner` does, and
records its task run as the engine does, from state events the server's task run recorder turns into the run:
Running when the body starts, then Completed, Failed (with the exception's message) or Crashed. A run that
ends within `RUNNING_AFTER_S` is sent as its final state alone (with its start and end times): the UI could
not have shown it running, and it halves the server's work for the short task runs of a small episode. The UI shows the
same task runs (names, states, times, the task's inputs as the graph's edges, the task run they were submitted
from as their parent) and the task's log lines; the body runs in a `TaskRunContext`, so what it submits or logs
is recorded under its task run. What the engine offers beyond that (retries, timeouts, caching, result
persistence, hooks) the episode's tasks do not use; a task that asks for one is refused.

With ``record=False`` the runner records nothing: while the Prefect API is away there is nowhere to record a
task run (`api_link._inline`). Futures behave as the thread pool's (`result`, `wait`); arguments that are futures
are waited for first, and a task whose upstream failed does not run (its run shows NotReady, and its future
raises Prefect's `UnfinishedRun`, as under the engine).

It does the engine's bookkeeping with the engine's private parts (`_create_task_run_locally`,
`resolve_custom_task_run_name`, the thread pool's `_executor`), so it lives in Prefect's room,
`chatlearn.runtime.prefect`, whose `PRIVATE_USES` lists each for `tests/test_private_api_pins.py`.
"""

import contextvars
import heapq
import itertools
import logging
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

from prefect._internal.engine import resolve_custom_task_run_name
from prefect.context import FlowRunContext, TaskRunContext
from prefect.events.schemas.events import Event
from prefect.exceptions import UnfinishedRun
from prefect.futures import PrefectConcurrentFuture, PrefectFuture
from prefect.logging.loggers import task_run_logger
from prefect.states import Completed, Crashed, Failed, Pending, Running, State
from prefect.task_engine import _create_task_run_locally
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import opaque, quote
from prefect.utilities.collections import visit_collection
from prefect.utilities.engine import emit_task_run_state_change_event


def _resolved(value: Any) -> Any:
    return value.result() if isinstance(value, PrefectFuture) else value


def plain(value: Any) -> Any:
    """A task argument as the task's function gets it: quoted and opaque ones (`flows.model_calls.unwalked`)
    unwrapped, futures waited for."""
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, (quote, opaque)):
        return _resolved(value.unwrap())
    return visit_collection(value, visit_fn=_resolved, return_data=True)


def _refuse_engine_options(task: Any) -> None:
    """The engine's options this runner does not provide: a task asking for one is a bug to see at once."""
    asked = [name for name, on in (("retries", task.retries), ("timeout_seconds", task.timeout_seconds),
                                   ("on_completion/on_failure hooks", task.on_completion_hooks
                                    or task.on_failure_hooks), ("persist_result", task.persist_result))
             if on]
    if asked or task.isasync:
        raise NotImplementedError(f"task {task.name!r}: {', '.join(asked) or 'async'} is not supported by "
                                  "RecordedTaskRunner (chatlearn/runtime/prefect/task_runs.py)")


RUNNING_AFTER_S = 1.0  # a Running state no one could see in the UI (it refreshes every few seconds) is not sent


class _StateEvents:
    """One task run's states, sent as the events the server's task run recorder reads (`set`), in order: each
    event names the one before it, so the server orders them whatever order they arrive in.

    A Running state set with ``defer`` goes out only if the run is still running ``defer`` seconds later; a run
    that ends sooner is recorded from its final state alone, which carries its start and end times (one event
    instead of two: half the server's work for the short task runs of a small episode)."""

    def __init__(self, task_run: Any):
        self.task_run = task_run
        self.last: Event | None = None
        self._lock = threading.Lock()  # the deferred Running goes out from the announcer's thread
        # a deferred state, with the context to send it in: dropped as soon as a later state overtakes it (the
        # context holds the episode's flow run context, whose parameters hold Ray handles)
        self._unsent: tuple[State | None, State, contextvars.Context] | None = None

    def set(self, state: State, defer: float | None = None) -> None:
        with self._lock:
            run = self.task_run
            previous = run.state
            if previous is not None and previous.timestamp >= state.timestamp:  # two states in one clock tick
                state.timestamp = previous.timestamp + timedelta(microseconds=1)
            state.state_details.task_run_id = run.id
            state.state_details.flow_run_id = run.flow_run_id
            if previous is not None and previous.is_running():
                run.total_run_time += state.timestamp - previous.timestamp
            if state.is_running():
                run.run_count += 1
                run.start_time = state.timestamp
            if state.is_final() and run.start_time is not None:
                run.end_time = state.timestamp
            run.state, run.state_id, run.state_type, run.state_name = state, state.id, state.type, state.name
            self._unsent = None  # a state not sent yet is overtaken by this one
            if defer is not None:
                self._unsent = (previous, state, contextvars.copy_context())
                _announcer.after(defer, self)
                return
            self._emit(previous, state)

    def _emit(self, previous: State | None, state: State) -> None:
        self.last = emit_task_run_state_change_event(task_run=self.task_run, initial_state=previous,
                                                     validated_state=state, follows=self.last)

    def send_deferred(self) -> None:
        """Send the deferred state, if no later one overtook it, in the context it was set in (the event takes
        its flow run from it)."""
        with self._lock:
            if self._unsent is not None:
                previous, state, context = self._unsent
                self._unsent = None
                context.run(self._emit, previous, state)


class _Announcer:
    """Sends deferred states when they are due, from one thread for the process."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, _StateEvents]] = []
        self._cv = threading.Condition()
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def after(self, seconds: float, record: _StateEvents) -> None:
        with self._cv:
            heapq.heappush(self._due, (time.monotonic() + seconds, next(self._order), record))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="task-run-states", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._due:
                    self._cv.wait()
                wait = self._due[0][0] - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                _, _, record = heapq.heappop(self._due)
            try:
                record.send_deferred()
            except Exception:  # a state that could not be sent must not stop the others
                logging.getLogger("chatlearn").debug("a deferred task run state was not sent", exc_info=True)


_announcer = _Announcer()


class RecordedTaskRunner(ThreadPoolTaskRunner):
    """Each task's function in a thread of its own; its task run recorded from state events (the module's doc),
    or not at all (``record=False``)."""

    def __init__(self, max_workers: int | None = None, record: bool = True):
        super().__init__(max_workers=max_workers)
        self.record = record

    def duplicate(self) -> "RecordedTaskRunner":
        return type(self)(max_workers=self._max_workers, record=self.record)

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Any = None,
               dependencies: Any = None) -> PrefectConcurrentFuture:
        if not self._started or self._executor is None:
            raise RuntimeError("Task runner is not started")
        flow_run = FlowRunContext.get() if self.record else None
        if flow_run is None or flow_run.flow_run is None:
            future = self._executor.submit(contextvars.copy_context().run, _run_plain, task, parameters, wait_for)
            return PrefectConcurrentFuture(task_run_id=uuid.uuid4(), wrapped_future=future)
        _refuse_engine_options(task)
        # its inputs (the futures among the arguments, ``wait_for``) and its parent (the task run submitting it)
        task_run = _create_task_run_locally(task, parameters=parameters, flow_run_context=flow_run,
                                            wait_for=wait_for, extra_task_inputs=dependencies)
        task_run.flow_run_run_count = flow_run.flow_run.run_count
        future = self._executor.submit(contextvars.copy_context().run, _run_recorded, task, _StateEvents(task_run),
                                       parameters, wait_for, flow_run)
        return PrefectConcurrentFuture(task_run_id=task_run.id, wrapped_future=future)


def _run_plain(task: Any, parameters: dict[str, Any], wait_for: Any) -> Any:
    for future in wait_for or ():
        future.wait()
    return task.fn(**{k: plain(v) for k, v in parameters.items()})


def _run_recorded(task: Any, record: _StateEvents, parameters: dict[str, Any], wait_for: Any,
                  flow_run: FlowRunContext) -> Any:
    run = record.task_run
    logger = task_run_logger(task_run=run, task=task)
    upstream = None
    try:
        for future in wait_for or ():
            upstream = future.task_run_id
            future.result()
        upstream = None
        kwargs = {k: plain(v) for k, v in parameters.items()}
    except Exception as exc:  # an upstream task failed: this one does not run, as under Prefect's task engine
        which = f" {str(upstream)!r}" if upstream is not None else ""
        record.set(Pending(name="NotReady", message=f"Upstream task run{which} did not reach a 'COMPLETED' state."))
        logger.error("Finished in state %s", run.state)
        raise UnfinishedRun(f"Run is in PENDING state, its result is not available: {run.state.message}") from exc
    if task.task_run_name:
        run.name = resolve_custom_task_run_name(task, kwargs)
        logger = task_run_logger(task_run=run, task=task)
    record.set(Running(), defer=RUNNING_AFTER_S)
    context = TaskRunContext(task=task, task_run=run, parameters=kwargs, client=flow_run.client,
                             result_store=flow_run.result_store, persist_result=False, log_prints=False)
    try:
        with context:
            value = task.fn(**kwargs)
    except Exception as exc:
        record.set(Failed(message=f"Task run encountered an exception {type(exc).__name__}: {exc}"))
        logger.error("Task run failed with exception: %r", exc, exc_info=True)
        logger.error("Finished in state %s", run.state)
        raise
    except BaseException as exc:  # a stop (SIGTERM, KeyboardInterrupt): the process is going away
        record.set(Crashed(message=f"Execution was interrupted by {type(exc).__name__}"))
        raise
    record.set(Completed())
    # Prefect's engine logs this at INFO: a line on the terminal and in the UI for every call of every episode
    # (and 1 ms of the driver's CPU, most of it the terminal); its state says as much
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("Finished in state %s", run.state)
    return value
