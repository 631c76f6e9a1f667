"""Prefect tasks on Ray for an episode's stateless work, at about 10 ms a task instead of 100-150 ms.

The six stage tasks run in threads of the flow process (they only dispatch to the model actors). Stateless
work (rule rewards now; verifiers, sandboxed code, environment steps later) runs where Ray has room for it,
as Prefect tasks on prefect-ray's `RayTaskRunner` with their own resources (``remote_options(num_cpus=...)``),
so each batch is a task run in the UI with its state and logs.

Where a task's time went with prefect-ray 0.6.0 and Prefect 3.9.1 (`bench/overhead.py`, rule-reward task on a
2-CPU machine, about 115 ms a task, 80-160 ms):

- driver, per submit (about 25 ms): `serialize_context` dumps the whole Prefect settings model with secrets
  rendered (`SettingsContext.serialize`, about 18 ms); `ray.remote(...)` wraps the task function anew, and
  Ray pickles and exports it again (about 3-5 ms);
- Ray worker, per task (about 85 ms): `hydrated_context` rebuilds the settings from that dump
  (pydantic-settings reads the environment and dotenv sources for each of ~54 nested models, 40-60 ms) and
  creates an API client twice (`hydrated_context`, then the engine's `SyncClientContext`), each one a new
  TLS context loading the certifi CA bundle (about 20 ms each); the task engine's own states, events and
  logs are a few ms.

`WarmRayTaskRunner` keeps what does not change between tasks: the driver serializes the settings once per
distinct settings and keeps one Ray remote function per resource set; each Ray worker process hydrates those
settings once and keeps one API client. Everything else is prefect-ray's and Prefect's own code: the task
engine runs in the worker as before, so task runs, states, retries and logs reach the API as they did.

It copies prefect-ray's `submit`, wraps its private `_run_prefect_task` and sets Prefect's client context
directly, so it lives in Prefect's room (`chatlearn.runtime.prefect`, whose `PRIVATE_USES` lists what it relies
on, checked against the installed versions).
"""

import threading
import uuid
from typing import Any

import ray
from prefect import Flow, Task
from prefect.context import SettingsContext, SyncClientContext, serialize_context
from prefect.utilities.engine import collect_task_run_inputs_sync
from prefect_ray import RayTaskRunner
from prefect_ray.context import RemoteOptionsContext
from prefect_ray.task_runners import PrefectRayFuture

from chatlearn.runtime.prefect.api_link import unreachable

_LOCK = threading.Lock()


class _SerializedSettings(SettingsContext):
    """The current settings, serialized once: `serialize_context` reads the current SettingsContext."""

    def serialize(self, include_secrets: bool = True) -> dict[str, Any]:
        return _DRIVER_SETTINGS["serialized"]


# driver: the last settings serialized (settings, profile, key, serialized); compared by value, since
# `temporary_settings` makes equal copies (the episode subflow's)
_DRIVER_SETTINGS: dict[str, Any] = {}
_REMOTES: dict[str, Any] = {}  # driver: one Ray remote function per set of remote options
# a Ray worker process: the hydrated settings and the API client for the driver's settings key
_WORKER: dict[str, tuple[SettingsContext, SyncClientContext]] = {}


def _settings_key() -> str:
    """A key of the current settings, serializing them only when they changed since the last call."""
    current = SettingsContext.get()
    seen = _DRIVER_SETTINGS.get("settings")
    if seen is None or not (seen is current.settings or (seen == current.settings
                                                          and _DRIVER_SETTINGS["profile"] == current.profile)):
        _DRIVER_SETTINGS.update(settings=current.settings, profile=current.profile, key=uuid.uuid4().hex,
                                serialized=current.serialize())
    return _DRIVER_SETTINGS["key"]


def _light_parent(context: dict[str, Any]) -> None:
    """A task's context carries its parent flow run's flow and parameters, and its parent task run's task and
    parameters (the stage task it was submitted from), which a Ray worker unpickles before the task runs: for
    an episode's rule reward, the episode flow and the score stage (their modules import the run's machinery,
    transformers included: about 5 CPU-s in every new worker, so a run's first score stage took 7 s where the
    next took 0.2 s) and the episode's `RunContext`; for a deployment's flow loaded from a file path as a
    top-level module (``eval_flow``), a module the worker cannot import at all. In the worker the task engine
    reads of them only their names and versions (its loggers, `prefect.runtime`), the flow's task runner (for
    tasks the task submits: none here) and the parent task run (the nesting in the UI), none of the parameters
    (they key a cache policy's cache: a task of ours has none). So the context carries stand-ins of the same
    names and versions, the flow on Prefect's default runner, and empty parameters."""
    for part, kind in (("flow_run_context", "flow"), ("task_run_context", "task")):
        parent = context.get(part) or {}
        original = parent.get(kind)
        if original is not None:
            key = (kind, original.name, original.version)
            if key not in _STAND_INS:
                _STAND_INS[key] = (Flow(fn=_stand_in_body, name=original.name, version=original.version,
                                        validate_parameters=False) if kind == "flow" else
                                   Task(fn=_stand_in_body, name=original.name, version=original.version))
            parent[kind] = _STAND_INS[key]
        if "parameters" in parent:
            parent["parameters"] = {}


def _stand_in_body() -> None:
    """The body of a stand-in parent flow or task: never run."""


_STAND_INS: dict[tuple[str, str, str | None], Any] = {}  # driver: one stand-in per parent's kind, name and version


def _worker_prefect(key: str, serialized: dict[str, Any]) -> tuple[SettingsContext, SyncClientContext]:
    """This worker process's settings and API client for the driver's settings ``key``, made on first use."""
    if key not in _WORKER:
        for _, old in _WORKER.values():  # settings of an earlier run of the driver
            old.client.__exit__(None, None, None)
        _WORKER.clear()
        settings = SettingsContext(**serialized)
        with settings:  # the client talks to these settings' API
            client = SyncClientContext()
            client.client.__enter__()
            if settings.settings.client.server_version_check_enabled:
                try:
                    client.client.raise_for_api_version_mismatch_once()
                except RuntimeError as exc:  # "Failed to reach API": the API is away (a server SIGKILLed, ...)
                    # the task's records are events, which wait or are dropped while it is away; the run goes
                    # on without it (`api_link`), so the task does too (the driver checked the version at start)
                    if not unreachable(exc):
                        raise
        _WORKER[key] = (settings, client)
    return _WORKER[key]


class WarmRayTaskRunner(RayTaskRunner):
    """`RayTaskRunner` whose driver serializes Prefect's settings once and whose Ray workers keep the hydrated
    settings and one API client between tasks (see the module docstring for what that saves)."""

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Any = None,
               dependencies: dict[str, Any] | None = None) -> PrefectRayFuture:
        # prefect-ray 0.6.0's submit, with the settings serialized once and the remote function kept
        if not self._started:
            raise RuntimeError("The task runner must be started before submitting work.")
        task_run_id = uuid.uuid4()
        task_inputs = {k: collect_task_run_inputs_sync(v, future_cls=PrefectRayFuture) for k, v in parameters.items()}
        with _LOCK:
            key = _settings_key()
            current = SettingsContext.get()
            with _SerializedSettings(profile=current.profile, settings=current.settings):
                context = serialize_context(asset_ctx_kwargs={"task": task, "task_run_id": task_run_id,
                                                              "task_inputs": task_inputs, "copy_to_child_ctx": True})
            _light_parent(context)
            options = RemoteOptionsContext.get().current_remote_options
            remote = _REMOTES.get(repr(sorted(options.items())))
            if remote is None:
                wrap = ray.remote(**options) if options else ray.remote
                remote = _REMOTES[repr(sorted(options.items()))] = wrap(self._run_prefect_task)
        context["settings_key"] = key
        parameters, upstream = self._exchange_prefect_for_ray_futures(parameters)
        ref = remote.options(name=task.name).remote(*upstream, task=task, task_run_id=task_run_id,
                                                    parameters=parameters, wait_for=wait_for,
                                                    dependencies=dependencies, context=context)
        return PrefectRayFuture(task_run_id=task_run_id, wrapped_future=ref)

    @staticmethod
    def _run_prefect_task(*upstream_ray_obj_refs: Any, task: Any, task_run_id: uuid.UUID, context: dict[str, Any],
                          parameters: dict[str, Any], wait_for: Any = None,
                          dependencies: dict[str, Any] | None = None) -> Any:
        # in the Ray worker: prefect-ray's own task body, under this process's settings and client
        settings, client = _worker_prefect(context.pop("settings_key"), context["settings_context"])
        context["settings_context"] = {}  # hydrated already: `hydrated_context` skips it
        token = SyncClientContext.__var__.set(client)  # `get_client` and the task engine find this client
        try:
            with settings.model_copy():
                return RayTaskRunner._run_prefect_task(*upstream_ray_obj_refs, task=task, task_run_id=task_run_id,
                                                       context=context, parameters=parameters, wait_for=wait_for,
                                                       dependencies=dependencies)
        finally:
            SyncClientContext.__var__.reset(token)


# Why process-wide: see `ray_task_runner` (the episode's task pool holds no runner of ours to hand it).
_RUNNER: list[WarmRayTaskRunner] = []


def ray_task_runner() -> WarmRayTaskRunner:
    """The flow process's runner for an episode's stateless Prefect tasks, started on first use.

    One per process rather than one per flow: the stage tasks that submit to it run in the episode's thread
    pool, whose flow context holds that pool, not a Ray runner. It joins the Ray the run's driver already
    joined (`chatlearn.runtime.cluster.launch`) and holds nothing of its own (prefect-ray only shuts down a Ray it
    started), so it is never stopped.
    """
    with _LOCK:
        if not _RUNNER:
            if not ray.is_initialized():
                raise RuntimeError("Prefect tasks on Ray need the run's Ray: join or start it first")
            _RUNNER.append(WarmRayTaskRunner().__enter__())
        return _RUNNER[0]
