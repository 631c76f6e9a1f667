"""Deployments of a config: `chatlearn deploy` (a process work pool's worker runs them) and `chatlearn serve`
(this process runs them, no worker), Prefect's two ways of running a flow on a schedule or from the UI.

What a deployment holds:

- **the config as the run form.** The train flow's `config` parameter is the typed ChatLearnConfig; the
  deployment's default is this config resolved, so the UI's run form shows every field with the reference's
  description, pre-filled, and the server refuses a value of the wrong type (`enforce_parameter_schema`)
  naming the field path (`config.runtime.num_episode`). Relative paths are made absolute first, so a run
  started by a worker writes where the config says, whatever the worker's directory.
- **the schedule** (`--cron`, or the config's own `deployment.cron`);
- **the overlap rule**: a deployment concurrency limit of one, so a scheduled run that finds the previous
  run still going is cancelled (`skip`) or waits (`queue`), never two runs writing one run directory;
- **its code, pinned**: the fields that name code to import or packages to install (hooks, module classes,
  the engine, runtime_env) are fixed when it is deployed; no run of it can change them (`flows.pins`);
- with `--evaluate`, **an eval deployment that an automation starts when a run of this train deployment
  completes** (an event trigger on `prefect.flow-run.Completed`), evaluating that run's `final/policy`: the
  continuous-evaluation pattern;
- with `--alert-on EXPR` (`runtime.alerts`), **an automation per alert that pauses the deployment** when one of
  its runs emits the alert's event (`chatlearn.config.alerts`): a run whose reward collapsed stops the schedule.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import Flow
from prefect import serve as prefect_serve
from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.client.schemas.schedules import CronSchedule
from prefect.deployments.runner import RunnerDeployment
from prefect.deployments.runner import deploy as prefect_deploy
from prefect.events import DeploymentEventTrigger, EventTrigger
from prefect.events.actions import PauseDeployment
from prefect.events.schemas.automations import Posture
from prefect.exceptions import ObjectNotFound
from prefect.utilities.callables import ParameterSchema
from prefect.workers.process import ProcessWorker

from chatlearn.config import ChatLearnConfig
from chatlearn.config.alerts import ALERT, parse_alert
from flows import pins
from flows.eval_flow import eval_flow
from flows.train_flow import train_flow

__all__ = ["DeploymentSpec", "alert_automation", "deploy", "deployment_spec", "eval_trigger", "serve"]

TRAIN_FLOW = "chatlearn-train"
EVAL_FLOW = "chatlearn-eval"
_FLOWS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class DeploymentSpec:
    """Name, schedule and overlap rule of one config's deployment (the command line over the config)."""
    name: str
    cron: str | None
    timezone: str | None
    on_overlap: str
    work_pool: str

    @property
    def eval_name(self) -> str:
        return f"{self.name}-eval"

    def concurrency(self) -> ConcurrencyLimitConfig:
        """One run at a time: `skip` cancels a run that finds one going, `queue` makes it wait."""
        skip = self.on_overlap == "skip"
        strategy = ConcurrencyLimitStrategy.CANCEL_NEW if skip else ConcurrencyLimitStrategy.ENQUEUE
        return ConcurrencyLimitConfig(limit=1, collision_strategy=strategy)

    def schedule_kwargs(self) -> dict[str, Any]:
        if not self.cron:
            return {}
        return {"schedules": [CronSchedule(cron=self.cron, timezone=self.timezone or "UTC")]}


def deployment_spec(cfg: ChatLearnConfig) -> DeploymentSpec:
    """The config's `deployment` section (the command line's flags are overrides of it), defaults filled."""
    d = cfg.deployment
    return DeploymentSpec(name=d.name or cfg.runtime.exp_name, cron=d.cron, timezone=d.timezone,
                          on_overlap=d.on_overlap, work_pool=d.work_pool)


def _absolute(path: Any) -> Any:
    if isinstance(path, str) and path and not os.path.isabs(path) and "://" not in path:
        return os.path.abspath(path)
    return path


def form_defaults(cfg: ChatLearnConfig) -> dict[str, Any]:
    """The config as the deployment's `config` parameter, with relative paths made absolute (a worker runs
    the flow in its own directory; the run must write and read where the config says from here)."""
    data = cfg.model_dump(mode="json")
    rt = data["runtime"]
    for key in ("output_dir", "data_checkpoint_path", "profiler_dir"):
        rt[key] = _absolute(rt[key])
    for key in ("data_path", "eval_data_path"):
        value = rt.get(key)
        rt[key] = [_absolute(p) for p in value] if isinstance(value, list) else _absolute(value)
    logs = rt["log_args_dict"]
    for key in ("log_dir", "tensorboard_dir", "wandb_dir"):
        logs[key] = _absolute(logs[key])
    for model in data["models"].values():
        model["config_dir"] = _absolute(model.get("config_dir"))
        args = model.get("args_dict") or {}
        for key in args:
            if key.endswith("_path") or key in ("load", "save"):
                args[key] = _absolute(args[key])
    return data


def eval_trigger(train_deployment_id: Any) -> DeploymentEventTrigger:
    """An event trigger: a run of the train deployment reached Completed; the eval gets that run's id."""
    return DeploymentEventTrigger(
        name="evaluate the final policy when a train run completes",
        expect={"prefect.flow-run.Completed"},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.id": f"prefect.deployment.{train_deployment_id}"},
        parameters={"train_run": "{{ event.resource.id }}"},
    )


def alert_automation(deployment_id: Any, deployment_name: str, text: str) -> Automation:
    """An automation that pauses the deployment when one of its runs emits alert ``text``'s event (registered
    again, it replaces the one of the same name)."""
    alert = parse_alert(text)
    name = f"{deployment_name}: pause when {alert.text}"
    for old in get_client(sync_client=True).read_automations_by_name(name=name):
        Automation(**old.model_dump()).delete()
    return Automation(
        name=name, description=f"runtime.alerts of {deployment_name} (chatlearn deploy --alert-on)",
        trigger=EventTrigger(expect={ALERT}, match={"prefect.resource.id": "chatlearn.alert.*",
                                                    "chatlearn.alert": alert.text},
                             match_related={"prefect.resource.id": f"prefect.deployment.{deployment_id}"},
                             posture=Posture.Reactive, threshold=1),
        actions=[PauseDeployment(source="selected", deployment_id=deployment_id)],
    ).create()


# Job variables of Prefect's process work pool that let a run's parameters choose what the worker executes (its
# shell command, its environment, its directory): left out of the pool chatlearn creates, so a run started from
# the UI or the API cannot run a command of its choice. The worker's own environment still reaches its runs.
RUN_CHOSEN_JOB_VARIABLES = ("command", "env", "working_dir")


def locked_job_template() -> dict[str, Any]:
    """Prefect's process work pool template without RUN_CHOSEN_JOB_VARIABLES (and no others: the server refuses
    a run or deployment that sets one). `deployments/work-pool.json` holds the same for `prefect work-pool
    create --base-job-template`."""
    template = ProcessWorker.get_default_base_job_template()
    for key in RUN_CHOSEN_JOB_VARIABLES:
        template["job_configuration"].pop(key, None)
        template["variables"]["properties"].pop(key, None)
    template["variables"]["additionalProperties"] = False
    return template


def ensure_work_pool(name: str) -> list[str]:
    """Create the process work pool if missing, with `locked_job_template`; the job variables of
    RUN_CHOSEN_JOB_VARIABLES that the (existing) pool lets a run set."""
    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=locked_job_template()))
            return []
        if pool.type != "process":
            raise ValueError(f"deployment.work_pool: work pool {name!r} is of type {pool.type!r}; chatlearn deploys "
                             "to a process work pool (name another pool, or let chatlearn create one)")
        variables = (pool.base_job_template or {}).get("variables", {})
        if not variables:  # no schema: the server checks no job variable
            return list(RUN_CHOSEN_JOB_VARIABLES)
        return [key for key in RUN_CHOSEN_JOB_VARIABLES if key in variables.get("properties", {})
                or variables.get("additionalProperties", True) is not False]


def _source(entry: str) -> Any:
    """The flow loaded from this package's file, with the current directory as the run's working directory
    (where a worker runs it: relative paths of the config mean the same as here)."""
    return Flow.from_source(source=os.getcwd(), entrypoint=f"{_FLOWS_DIR / (entry + '.py')}:{entry}")


def _pinned(deployment: RunnerDeployment, cfg: ChatLearnConfig) -> RunnerDeployment:
    """The deployment with the config's code fields pinned in its parameter schema (`flows.pins`)."""
    schema = pins.pin_schema(deployment._parameter_openapi_schema.model_dump_for_openapi(), cfg)
    deployment._parameter_openapi_schema = ParameterSchema(**schema)
    return deployment


def deploy(cfg: ChatLearnConfig, spec: DeploymentSpec, evaluate: bool = False) -> tuple[dict[str, str], list[str]]:
    """Register the train deployment (and the triggered eval one) on `spec.work_pool`, their code pinned
    (`flows.pins`): (name -> deployment id, the job variables of RUN_CHOSEN_JOB_VARIABLES its runs may set)."""
    open_variables = ensure_work_pool(spec.work_pool)
    common = dict(work_pool_name=spec.work_pool, parameters={"config": form_defaults(cfg)},
                  enforce_parameter_schema=True, tags=["chatlearn"])

    def register(full_name: str, deployment: RunnerDeployment) -> str:
        (dep_id,) = prefect_deploy(_pinned(deployment, cfg), work_pool_name=spec.work_pool, build=False,
                                   push=False, print_next_steps_message=False, ignore_warnings=True)
        pins.record(dep_id, full_name, cfg)
        return str(dep_id)

    train_name = f"{TRAIN_FLOW}/{spec.name}"
    ids = {train_name: register(train_name, _source("train_flow").to_deployment(
        name=spec.name, concurrency_limit=spec.concurrency(), **spec.schedule_kwargs(),
        description=f"train {cfg.runtime.exp_name}: the run form is the config", **common))}
    for text in cfg.runtime.alerts:
        alert_automation(ids[train_name], train_name, text)
    if evaluate:
        eval_name = f"{EVAL_FLOW}/{spec.eval_name}"
        ids[eval_name] = register(eval_name, _source("eval_flow").to_deployment(
            name=spec.eval_name, triggers=[eval_trigger(ids[train_name])],
            description=f"evaluate the final policy of each completed run of {train_name}", **common))
    return ids, open_variables


def serve(cfg: ChatLearnConfig, spec: DeploymentSpec, evaluate: bool = False) -> None:
    """Serve the train deployment (and the triggered eval one) from this process until it is stopped, their
    code pinned (`flows.pins`)."""
    params = {"config": form_defaults(cfg)}
    train = _pinned(train_flow.to_deployment(name=spec.name, parameters=params, concurrency_limit=spec.concurrency(),
                                             enforce_parameter_schema=True, tags=["chatlearn"],
                                             **spec.schedule_kwargs()), cfg)
    train_id = train.apply()
    pins.record(train_id, f"{TRAIN_FLOW}/{spec.name}", cfg)
    for text in cfg.runtime.alerts:
        alert_automation(train_id, f"{TRAIN_FLOW}/{spec.name}", text)
    deployments = [train]
    if evaluate:
        evaluation = _pinned(eval_flow.to_deployment(name=spec.eval_name, parameters=params, tags=["chatlearn"],
                                                     triggers=[eval_trigger(train_id)], enforce_parameter_schema=True),
                             cfg)
        pins.record(evaluation.apply(), f"{EVAL_FLOW}/{spec.eval_name}", cfg)
        deployments.append(evaluation)
    prefect_serve(*deployments, print_starting_message=False)
