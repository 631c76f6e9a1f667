"""Which flow run owns a run directory, so a re-run can mark a SIGKILLed predecessor Crashed in Prefect.

A run killed with SIGKILL (or a lost machine) never tells the Prefect API it ended: its flow run, the episode
subflow it was in and that subflow's task runs stay "Running" in the UI forever. Nothing else notices for a
direct or CLI run (a worker would mark a deployment run it started Crashed, but nobody watches these). The
re-run of the same config is the natural moment: it resumes in the same `run_dir`, so the train flow calls
`claim_run_dir` first. That reads `run_dir/.flow_run.json` (flow run id, pid, host of the last run there),
and if that process is dead (same host: a pid on another host cannot be checked, so it is left alone) while
its flow run is still non-final, sets it and its non-final subflows and task runs to Crashed with a message
naming the pid and the run that resumed it. Then it records the current flow run in the file.
"""

import json
import os
import socket
import sys
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectNotFound
from prefect.states import Crashed

from chatlearn.config import load_config
from chatlearn.runtime.records.prefect_server import _alive

RECORD_NAME = ".flow_run.json"
# what a run whose process died can be left in; everything else is final (or a Crashed we must not redo)
NOT_FINAL = [StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED, StateType.PAUSED, StateType.CANCELLING]
_PAGE = 200  # the API's default page size


def train_run_name() -> str:
    """The name of a train flow run in the UI: its ``exp_name`` and start time (``grpo-demo-20261204-051002``),
    not Prefect's random pair of words. Called by Prefect inside the new flow run, with its parameters: a
    config object, the run form's dict, or a path with overrides."""
    params = FlowRunContext.get().parameters if FlowRunContext.get() else {}
    source = params.get("config") if params.get("config") is not None else params.get("config_path")
    try:
        exp_name = load_config(source, list(params.get("overrides") or ())).runtime.exp_name
    except Exception:  # noqa: BLE001 - a bad config fails the run itself, with its own message; not its name
        exp_name = "chatlearn-train"
    return f"{exp_name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def record_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / RECORD_NAME


def read_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The last recorded owner of `run_dir`, or None (no file, or one that is not a record)."""
    try:
        rec = json.loads(record_path(run_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) and rec.get("flow_run_id") and rec.get("pid") else None


def record_flow_run(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """Write the current flow run id, pid and host to `run_dir/.flow_run.json` (atomically: a reader never
    sees half a file). Returns the record, or None outside a flow run (nothing to record)."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None
    rec = {"flow_run_id": str(ctx.flow_run.id), "flow_run_name": ctx.flow_run.name, "pid": os.getpid(),
           "hostname": socket.gethostname()}
    path = record_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{RECORD_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, path)
    return rec


def _owner_is_gone(rec: dict[str, Any]) -> bool:
    """Only a dead pid on this host counts; the same pid as ours is this process (e.g. a second call)."""
    return rec.get("hostname") == socket.gethostname() and rec["pid"] != os.getpid() and not _alive(rec["pid"])


def mark_previous_run_crashed(run_dir: str | os.PathLike, resumed_by: str | None = None) -> list[str]:
    """Set the flow run recorded in `run_dir` Crashed, with its non-final subflows and task runs, if its process
    died (same host) and Prefect still shows it non-final. Returns the ids marked (flow runs first, the
    recorded one leading; task runs after), [] when there is nothing to do.

    `resumed_by` names the run that takes over in the message (default: the current flow run, if any).
    Never raises: an unreachable API or a run unknown to this API only costs the marking (said on stderr).
    """
    rec = read_record(run_dir)
    if rec is None or not _owner_is_gone(rec):
        return []
    ctx = FlowRunContext.get()
    current = ctx.flow_run if ctx is not None else None
    if current is not None and str(current.id) == str(rec["flow_run_id"]):
        return []  # our own flow run (a retry in a new process keeps the id): not a predecessor
    if resumed_by is None and current is not None:
        resumed_by = f"{current.name} ({current.id})"
    message = f"the process running it (pid {rec['pid']} on {rec['hostname']}) died"
    if resumed_by:
        message += f"; resumed by flow run {resumed_by}"
    try:
        marked = _mark_crashed(UUID(str(rec["flow_run_id"])), message)
    except Exception as exc:  # bookkeeping of an earlier run must never stop this one
        sys.stderr.write(f"could not mark the earlier flow run {rec['flow_run_id']} Crashed: {exc!r}\n")
        return []
    if marked:
        sys.stderr.write(f"marked the earlier flow run {rec.get('flow_run_name') or ''} {rec['flow_run_id']} "
                         f"Crashed ({message}): {len(marked)} flow/task run(s)\n")
    return marked


def _mark_crashed(root: UUID, message: str) -> list[str]:
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(root)
        except ObjectNotFound:  # recorded against another API (another server, the test harness)
            return []
        if run.state is None or run.state.type not in NOT_FINAL:
            return []
        flow_runs, frontier = [root], [root]
        while frontier:  # non-final subflows, level by level (a finished subflow has no live children)
            children = _all(lambda offset, ids=frontier: client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=ids),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=NOT_FINAL))),
                limit=_PAGE, offset=offset))
            frontier = [c.id for c in children if c.id not in flow_runs]
            flow_runs += frontier
        task_runs = _all(lambda offset: client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=flow_runs),
                                          state=TaskRunFilterState(type=TaskRunFilterStateType(any_=NOT_FINAL))),
            limit=_PAGE, offset=offset))
        for task_run in task_runs:
            client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
        for flow_run_id in reversed(flow_runs):  # innermost first, the recorded run last
            client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
    return [str(i) for i in flow_runs] + [str(t.id) for t in task_runs]


def _all(read_page: Any) -> list[Any]:
    """Every row of a paged read (`read_page(offset)` returns at most `_PAGE` rows)."""
    rows: list[Any] = []
    while True:
        page = read_page(len(rows))
        rows += page
        if len(page) < _PAGE:
            return rows


def claim_run_dir(run_dir: str | os.PathLike) -> list[str]:
    """At the start of a train flow: mark a dead predecessor's leftovers Crashed, then record this flow run
    as the owner of `run_dir`. Returns the ids marked Crashed (see `mark_previous_run_crashed`)."""
    marked = mark_previous_run_crashed(run_dir)
    record_flow_run(run_dir)
    return marked
