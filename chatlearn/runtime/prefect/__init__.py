"""Prefect's internals in one room: every module of ChatLearn that goes beyond Prefect's or prefect-ray's public API.

The rule: only the modules of this package import `prefect._internal`, `prefect_ray._...` or a `_`-prefixed name
from Prefect, read a private attribute of a Prefect object, or subclass a Prefect class to change how it runs
(`tests/test_layers.py` holds everything else to it). What each module relies on is a row of `PRIVATE_USES` below,
which `tests/test_private_api_pins.py` checks against the installed Prefect and prefect-ray, so an upgrade that
moves one fails there in one line naming the file to port, not mid-run. Code that uses only the public API (the
artifacts in `chatlearn.runtime.records.reporting`, the deployments in `flows/`) lives where its idea does.

- `task_runs`: an episode's task runs recorded from state events, without Prefect's task engine;
- `subflows`: calls of a flow as subflow runs whose records never hold the caller up;
- `api_link`: the run's link to the Prefect API, so that training goes on while the API is away;
- `prevalidated`: flows whose direct calls check the config and prepare the run before a flow run exists;
- `ray_tasks`: prefect-ray's task runner with Prefect's settings and API client kept warm between tasks.

Ray's own private API has its room in `chatlearn.runtime.cluster.ray_private`.
"""

# The versions this package was last checked against: a new one is ported (the rows below), then written here.
VERIFIED_WITH = {"prefect": "3.9.1", "prefect-ray": "0.6.0"}

# (what a module of this package relies on, the file to port when it moves). A callable is written with its
# parameters' names, in order (``*args``/``**kwargs`` as such); with a ``...`` among them, the names are the ones
# relied on, each a parameter or read from ``**kwargs`` by the callable's code. Anything else is an attribute that
# exists (on the object, or set in the source of its class or module); ``logger NAME``: a logger Prefect's logging
# configuration sets up. A new private use is one new row.
PRIVATE_USES: list[tuple[str, str]] = [
    # task_runs: the task engine's bookkeeping without the engine, on ThreadPoolTaskRunner's pool
    ("prefect.task_engine._create_task_run_locally(task, id, parameters, flow_run_context, parent_task_run_context, "
     "wait_for, extra_task_inputs)", "chatlearn/runtime/prefect/task_runs.py"),
    ("prefect._internal.engine.resolve_custom_task_run_name(task, parameters)",
     "chatlearn/runtime/prefect/task_runs.py"),
    ("prefect.utilities.engine.emit_task_run_state_change_event(task_run, initial_state, validated_state, follows)",
     "chatlearn/runtime/prefect/task_runs.py"),
    ("prefect.context.TaskRunContext(task, task_run, parameters, client, result_store, persist_result, log_prints, "
     "...)", "chatlearn/runtime/prefect/task_runs.py"),
    ("prefect.task_runners.ThreadPoolTaskRunner.__init__(self, max_workers)", "chatlearn/runtime/prefect/task_runs.py"),
    ("prefect.task_runners.ThreadPoolTaskRunner.submit(self, task, parameters, wait_for, dependencies)",
     "chatlearn/runtime/prefect/task_runs.py"),
    ("prefect.task_runners.ThreadPoolTaskRunner._started", "chatlearn/runtime/prefect/task_runs.py"),
    ("prefect.task_runners.ThreadPoolTaskRunner._executor", "chatlearn/runtime/prefect/task_runs.py"),
    ("prefect.task_runners.ThreadPoolTaskRunner._max_workers", "chatlearn/runtime/prefect/task_runs.py"),
    # subflows: a subflow's flow run context made by hand, its result store without the engine's async switch
    ("prefect.context.FlowRunContext(flow, flow_run, parameters, client, result_store, task_runner, persist_result, "
     "log_prints, ...)", "chatlearn/runtime/prefect/subflows.py"),
    ("prefect.results.ResultStore.update_for_flow(self, flow)", "chatlearn/runtime/prefect/subflows.py"),
    # called with ``_sync=True``: the switch of the async_dispatch wrapper, which gives the method its ``aio``
    ("prefect.results.ResultStore.update_for_flow.aio", "chatlearn/runtime/prefect/subflows.py"),
    # api_link: the task runner's pool size, Prefect's internal logger, the log and event workers' queues
    ("prefect.task_runners.ThreadPoolTaskRunner._max_workers", "chatlearn/runtime/prefect/api_link.py"),
    ("logger prefect._internal", "chatlearn/runtime/prefect/api_link.py"),
    ("prefect.logging.handlers.APILogWorker._instances", "chatlearn/runtime/prefect/api_link.py"),
    ("prefect.logging.handlers.APILogWorker.drain_all(timeout, at_exit)", "chatlearn/runtime/prefect/api_link.py"),
    ("prefect.logging.handlers.APILogWorker._done_event", "chatlearn/runtime/prefect/api_link.py"),
    ("prefect.logging.handlers.APILogWorker._loop", "chatlearn/runtime/prefect/api_link.py"),
    ("prefect.events.worker.EventsWorker._instances", "chatlearn/runtime/prefect/api_link.py"),
    ("prefect.events.worker.EventsWorker.drain_all(timeout, at_exit)", "chatlearn/runtime/prefect/api_link.py"),
    ("prefect.events.worker.EventsWorker._done_event", "chatlearn/runtime/prefect/api_link.py"),
    ("prefect.events.worker.EventsWorker._loop", "chatlearn/runtime/prefect/api_link.py"),
    # prevalidated: a Flow whose __call__ checks and prepares first, then calls Flow's own
    ("prefect.flows.Flow.__init__(self, fn, ...)", "chatlearn/runtime/prefect/prevalidated.py"),
    ("prefect.flows.Flow.__call__(self, *args, return_state, wait_for, **kwargs)",
     "chatlearn/runtime/prefect/prevalidated.py"),
    # ray_tasks: prefect-ray 0.6.0's submit, copied with the settings serialized once; its task body, wrapped
    ("prefect_ray.task_runners.RayTaskRunner.submit(self, task, parameters, wait_for, dependencies)",
     "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect_ray.task_runners.RayTaskRunner._started", "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect_ray.task_runners.RayTaskRunner._run_prefect_task(*upstream_ray_obj_refs, task, task_run_id, context, "
     "parameters, wait_for, dependencies)", "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect_ray.task_runners.RayTaskRunner._exchange_prefect_for_ray_futures(self, kwargs_prefect_futures)",
     "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect_ray.context.RemoteOptionsContext.current_remote_options", "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect.context.serialize_context(asset_ctx_kwargs)", "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect.context.SettingsContext.serialize(self, include_secrets)", "chatlearn/runtime/prefect/ray_tasks.py"),
    # the parents' flow, task and parameters in a serialized context, replaced by stand-ins before it travels
    ("prefect.context.EngineContext.serialize(self, include_secrets)", "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect.context.TaskRunContext.serialize(self, include_secrets)", "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect.context.hydrated_context(serialized_context, client)", "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect.context.SyncClientContext.__var__", "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect.utilities.engine.collect_task_run_inputs_sync(expr, future_cls, max_depth)",
     "chatlearn/runtime/prefect/ray_tasks.py"),
    ("prefect.client.orchestration.SyncPrefectClient.raise_for_api_version_mismatch_once(self)",
     "chatlearn/runtime/prefect/ray_tasks.py"),
]
