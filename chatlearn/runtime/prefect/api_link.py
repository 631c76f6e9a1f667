"""Training never waits on the Prefect API or fails because it went away.

Prefect is the run's control plane and dashboard, not its training. Without care, a server that dies mid-run
ends the run: the next episode subflow cannot be created, an artifact call retries for about 70 s and raises,
the flow engine prints its tracebacks, and Prefect's log and event queues keep the process from exiting. So
while a run is watched (`watch`, entered by the train flow):

- a thread asks the API's ``/health`` every second. If the run started the local server itself
  (`chatlearn.runtime.records.prefect_server`), a dead one is started again on the same port and database, and
  the UI catches up; otherwise the run goes on without the API until it answers again;
- an episode (`chatlearn.runtime.prefect.subflows`) runs as a subflow while the API answers, and inline in the
  parent's flow run (the same body and tasks, no subflow of its own: `_inline`) while it does not; its records
  are posted (below), so the API going away mid-episode costs them, never the episode's result. A flow called
  through `call_flow` (the train and eval flows) keeps its body's result when the API fails to record its final
  state: nothing is run twice, so the run ends with the undisturbed run's weights, bit for bit;
- `send` makes the calls that only inform (artifacts): skipped while the API is down, dropped if they fail
  with it; `post` queues such a call for one background thread that sends them in order, so the episode loop
  never waits on the API for them (each runs in the context it was posted from: its flow run, its settings);
- one warning line says the API is gone and one that it is back. What Prefect itself says about the outage
  stays off the terminal: the flow engine's tracebacks of connection errors (`chatlearn train` keeps them in
  ``run_dir/chatlearn.log``), the events worker's failures and the log worker's "Error logging to API";
- on the way out, Prefect's log and event queues get a bounded time to drain; what they could not send is
  dropped, so the command never hangs at exit.

Everything the run writes (metrics.jsonl, checkpoints, the final policy, summary.json) is in its run
directory whatever the API did.

Quieting and draining Prefect reaches its internals (the `prefect._internal` logger, the log and event workers'
private queues, a task runner's pool size), so this module lives in Prefect's room (`chatlearn.runtime.prefect`,
whose `PRIVATE_USES` lists what it relies on).
"""

import contextlib
import contextvars
import functools
import itertools
import logging
import queue
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from prefect.context import FlowRunContext
from prefect.events.worker import EventsWorker
from prefect.exceptions import PrefectHTTPStatusError
from prefect.logging.handlers import APILogWorker

_POLL_S = 1.0
_HEALTH_TIMEOUT_S = 5.0
_DRAIN_S = 10.0


def healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether the Prefect API at ``url`` answers its health check."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except Exception:
        return False


def unreachable(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it was raised from) says the API could not be reached or answered
    with a server error: a dead server, a network blip, a restart in progress."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, httpx.TransportError):
            return True
        if isinstance(exc, PrefectHTTPStatusError) and exc.response.status_code >= 500:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _OutageFilter(logging.Filter):
    """On the terminal's handlers: drops what Prefect logs about the outage, and its events socket's complaints
    (kept in the run's log file)."""

    def __init__(self, link: "ApiLink") -> None:
        super().__init__()
        self.link = link

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and unreachable(record.exc_info[1]):
            return False
        if record.name.startswith("websockets"):
            return False  # Prefect's events client's socket (a keepalive ping late on a busy machine): it reconnects
        prefect_internal = record.name.startswith(("prefect._internal", "prefect.events"))
        return not (prefect_internal and self.link.outages)  # from the first outage on


class ApiLink:
    """The watched link to one Prefect API: `up`, the outage lines, and the restart of a local server."""

    def __init__(self, url: str, restart: Callable[[], bool] | None = None,
                 say: Callable[[str], Any] | None = None) -> None:
        self.url = url
        self.restart = restart
        self.say = say if say is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.up = True
        self.outages = 0
        self.skipped = 0  # informing calls dropped during outages
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="prefect-api-link", daemon=True)
        self._posts: queue.PriorityQueue[Any] = queue.PriorityQueue()
        self._posted = itertools.count()  # order within a lane
        self._poster: threading.Thread | None = None
        self._filter = _OutageFilter(self)
        self._raise_exceptions = logging.raiseExceptions

    def start(self) -> "ApiLink":
        for handler in _console_handlers():
            handler.addFilter(self._filter)
        self._thread.start()
        return self

    def stop(self, drain_s: float = _DRAIN_S) -> None:
        self.flush(drain_s)
        self._stop.set()
        self._thread.join(timeout=5)
        for handler in _console_handlers():
            handler.removeFilter(self._filter)
        if not self.up:
            self.say(f"chatlearn: warning: the Prefect API at {self.url} still does not answer; the flow run's "
                     "last states and logs were not recorded there (the run directory has everything)")
        logging.raiseExceptions = self._raise_exceptions

    def down(self, why: str = "does not answer") -> None:
        """The API failed a call or a health check: say so once per outage."""
        with self._lock:
            if not self.up:
                return
            self.up = False
            self.outages += 1
        # the log worker writes its send failures straight to stderr unless logging.raiseExceptions is off
        logging.raiseExceptions = False
        restart = (", and the local server this run uses is started again on the same database if it died"
                   if self.restart is not None else "")
        self.say(f"chatlearn: warning: the Prefect API at {self.url} {why}; training goes on without it{restart} "
                 "(episodes run inside the train flow run; states, logs and artifacts that cannot be sent are "
                 "dropped; the run directory has everything)")

    def _back(self) -> None:
        with self._lock:
            if self.up:
                return
            self.up = True
        logging.raiseExceptions = self._raise_exceptions
        self.say(f"chatlearn: the Prefect API at {self.url} answers again; episodes are subflows again")

    def _watch(self) -> None:
        failures = 0
        while not self._stop.wait(_POLL_S):
            # a loaded machine can keep a live server from answering in time: two misses in a row make an outage
            if healthy(self.url, timeout=_HEALTH_TIMEOUT_S):
                failures = 0
                if not self.up:
                    self._back()
                continue
            failures += 1
            if self._stop.is_set() or failures < 2:
                continue
            self.down()
            if self.restart is not None:
                try:
                    if self.restart():
                        self._back()
                except Exception as exc:  # the next poll tries again; the run goes on meanwhile
                    logging.getLogger("chatlearn").warning("restarting the Prefect server failed: %s", exc)

    def send(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)`` when the API answers; None (dropped) while it does not or when it fails
        with the API."""
        if not self.up:
            self.skipped += 1
            return None
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            if not unreachable(exc):
                raise
            self.down(f"failed a call ({type(exc).__name__})")
            self.skipped += 1
            return None

    def post(self, call: Callable[..., Any], *args: Any, urgent: bool = False, **kwargs: Any) -> None:
        """`send` ``call`` from the poster thread, in this context, after what was posted before in its lane:
        ``urgent`` calls (the states of runs: the API stamps a state when it gets it) before the others
        (artifacts)."""
        with self._lock:
            if self._poster is None:
                self._poster = threading.Thread(target=self._post_loop, name="prefect-api-post", daemon=True)
                self._poster.start()
        self._posts.put((0 if urgent else 1, next(self._posted), (contextvars.copy_context(), call, args, kwargs)))

    def flush(self, timeout: float = _DRAIN_S) -> bool:
        """Wait up to ``timeout`` s for what was posted to be sent (or dropped); True when nothing is left."""
        done = threading.Event()
        if self._poster is None:
            return True
        self._posts.put((2, next(self._posted), done))
        return done.wait(timeout)

    def _post_loop(self) -> None:
        while True:
            _, _, item = self._posts.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            ctx, call, args, kwargs = item
            try:
                ctx.run(self.send, call, *args, **kwargs)
            except Exception as exc:  # an informing call's own bug: one line, the run goes on
                logging.getLogger("chatlearn").warning("a Prefect API call failed: %s: %s", type(exc).__name__, exc)
            finally:
                # let go of what the call held (a flow run's context, Ray handles in it) here and now: released
                # after Ray shut down, from this thread, a Ray handle ends the process (exit status 1, no message)
                del item, ctx, call, args, kwargs


# Why process-wide: Prefect's own clients and log handlers are process-wide, and so is the link that watches
# their API for the run this process drives.
_current: ApiLink | None = None


def current() -> ApiLink | None:
    return _current


def send(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """An informing Prefect call (an artifact) through the watched link, or as is outside a watched run."""
    return _current.send(call, *args, **kwargs) if _current is not None else call(*args, **kwargs)


def flush(timeout: float = _DRAIN_S) -> bool:
    """Wait up to ``timeout`` s for the posted calls of the watched run (see `ApiLink.flush`)."""
    return _current.flush(timeout) if _current is not None else True


def post(call: Callable[..., Any], *args: Any, urgent: bool = False, **kwargs: Any) -> None:
    """An informing Prefect call that nothing waits for: sent in the background, in order, through the watched
    link (`ApiLink.post`); made at once outside a watched run."""
    if _current is not None:
        _current.post(call, *args, urgent=urgent, **kwargs)
    else:
        call(*args, **kwargs)


@contextlib.contextmanager
def watch(url: str | None, restart: Callable[[], bool] | None = None) -> Iterator[ApiLink | None]:
    """Watch the API at ``url`` for the block (nested: the outer link is kept). Yields the link."""
    global _current
    if _current is not None or not url:
        yield _current
        return
    link = ApiLink(url, restart).start()
    _current = link
    try:
        yield link
    finally:
        _current = None
        if not link.up:  # before stop(): the log worker's failures stay off the terminal meanwhile
            drain_prefect(timeout=_DRAIN_S)
        link.stop()


@dataclass
class _Box:
    """What a flow body did, kept outside Prefect's engine: its result survives a failed final state."""

    started: bool = False
    done: bool = False
    result: Any = None
    error: BaseException | None = None


_box: contextvars.ContextVar[_Box | None] = contextvars.ContextVar("chatlearn_flow_box", default=None)


def keeps_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a flow's function so that `call_flow` gets its result even when Prefect fails to record it."""

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        # all in a module-level function: Ray pickles this closure by value with the flow run's context, and a
        # ContextVar cannot be pickled
        return _kept(fn, args, kwargs)

    return body


def _kept(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    box = _box.get()
    if box is not None:
        _box.set(None)  # a subflow called from this body has its own box
        box.started = True
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        if box is not None:
            box.error = exc
        raise
    if box is not None:
        box.result, box.done = result, True
    return result


def call_flow(flow: Any, args: tuple = (), kwargs: dict[str, Any] | None = None,
              invoke: Callable[..., Any] | None = None) -> Any:
    """Call a flow whose function is decorated with `keeps_result` (through ``invoke``, default the flow
    itself) so that the Prefect API going away never loses or repeats its work: inline in the parent flow run
    while the API is down, its result kept when the API fails around a body that finished. Outside a watched
    run: a plain call."""
    kwargs = kwargs or {}
    invoke = invoke or flow
    link = _current
    if link is None:
        return invoke(*args, **kwargs)
    parent = FlowRunContext.get()
    if not link.up and parent is not None:
        return _inline(flow, parent, args, kwargs)
    box = _Box()
    token = _box.set(box)
    try:
        return invoke(*args, **kwargs)
    except Exception as exc:
        if box.error is not None and box.error is not exc and not unreachable(box.error):
            raise box.error from None  # the body's own failure, whatever Prefect then failed to record
        if not unreachable(exc):
            raise
        link.down(f"failed a call ({type(exc).__name__})")
        if box.done:
            return box.result
        if not box.started and parent is not None:
            return _inline(flow, parent, args, kwargs)
        raise
    finally:
        _box.reset(token)


def _inline(flow: Any, parent: FlowRunContext, args: tuple, kwargs: dict) -> Any:
    """The flow's body in the parent flow run, its tasks' functions run in threads with no task run (there is
    nowhere to record one; Prefect's task engine would also ask the API for the state of every future it is
    passed)."""
    from chatlearn.runtime.prefect.task_runs import RecordedTaskRunner  # it imports this module's callers

    workers = getattr(flow.task_runner, "_max_workers", None) or 8
    with RecordedTaskRunner(max_workers=workers, record=False) as runner, \
            parent.model_copy(update={"task_runner": runner}):
        return flow.fn(*args, **kwargs)


def _console_handlers() -> list[logging.Handler]:
    """The terminal's handlers: the root logger's, and those of Prefect's internal logger (it does not propagate:
    the events worker's failures go through its own)."""
    handlers = [*logging.getLogger().handlers, *logging.getLogger("prefect._internal").handlers]
    return [h for h in handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


def drain_prefect(timeout: float = _DRAIN_S) -> bool:
    """Give Prefect's log and event queues ``timeout`` seconds (together) to send what they hold; then drop the
    rest, so that their exit handlers return at once. True when everything was sent."""
    services = (APILogWorker, EventsWorker)
    instances = [instance for service in services for instance in list(service._instances.values())]
    for service in services:  # stops each instance and starts its drain; the wait is ours, below
        with contextlib.suppress(Exception):
            service.drain_all(timeout=0)
    deadline = time.monotonic() + timeout
    complete = True
    for instance in instances:
        # the exit handler waits on this event (Prefect's QueueService.drain): set, it returns at once
        done, loop = getattr(instance, "_done_event", None), getattr(instance, "_loop", None)
        if done is None or loop is None:
            continue
        while not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not done.is_set():
            complete = False
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done.set)
    return complete
