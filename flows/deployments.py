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
- with `--evaluate`, **an eval deployment that an automation starts when a run of this train deployment
  completes** (an event trigger on `prefect.flow-run.Completed`), evaluating that run's `final/policy`: the
  continuous-evaluation pattern.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import Flow
from prefect import serve as prefect_serve
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.client.schemas.schedules import CronSchedule
from prefect.events import DeploymentEventTrigger
from prefect.exceptions import ObjectNotFound

from chatlearn.config import ChatLearnConfig
from flows.eval_flow import eval_flow
from flows.train_flow import train_flow

__all__ = ["DeploymentSpec", "deploy", "deployment_spec", "eval_trigger", "serve"]

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


def ensure_work_pool(name: str) -> bool:
    """Create the process work pool if missing; True when it was created."""
    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            return True
        if pool.type != "process":
            raise ValueError(f"deployment.work_pool: work pool {name!r} is of type {pool.type!r}; chatlearn deploys "
                             "to a process work pool (name another pool, or let chatlearn create one)")
        return False


def _source(entry: str) -> Any:
    """The flow loaded from this package's file, with the current directory as the run's working directory
    (where a worker runs it: relative paths of the config mean the same as here)."""
    return Flow.from_source(source=os.getcwd(), entrypoint=f"{_FLOWS_DIR / (entry + '.py')}:{entry}")


def deploy(cfg: ChatLearnConfig, spec: DeploymentSpec, evaluate: bool = False) -> dict[str, str]:
    """Register the train deployment (and the triggered eval one) on `spec.work_pool`; name -> deployment id."""
    ensure_work_pool(spec.work_pool)
    params = {"config": form_defaults(cfg)}
    common = dict(work_pool_name=spec.work_pool, build=False, push=False, print_next_steps=False,
                  enforce_parameter_schema=True, ignore_warnings=True, tags=["chatlearn"])
    train_id = _source("train_flow").deploy(
        name=spec.name, parameters=params, concurrency_limit=spec.concurrency(), **spec.schedule_kwargs(),
        description=f"train {cfg.runtime.exp_name}: the run form is the config", **common)
    ids = {f"{TRAIN_FLOW}/{spec.name}": str(train_id)}
    if evaluate:
        eval_id = _source("eval_flow").deploy(
            name=spec.eval_name, parameters=params, triggers=[eval_trigger(train_id)],
            description=f"evaluate the final policy of each completed run of {TRAIN_FLOW}/{spec.name}", **common)
        ids[f"{EVAL_FLOW}/{spec.eval_name}"] = str(eval_id)
    return ids


def serve(cfg: ChatLearnConfig, spec: DeploymentSpec, evaluate: bool = False) -> None:
    """Serve the train deployment (and the triggered eval one) from this process until it is stopped."""
    params = {"config": form_defaults(cfg)}
    train = train_flow.to_deployment(name=spec.name, parameters=params, concurrency_limit=spec.concurrency(),
                                     enforce_parameter_schema=True, tags=["chatlearn"], **spec.schedule_kwargs())
    deployments = [train]
    if evaluate:
        train_id = train.apply()
        deployments.append(eval_flow.to_deployment(name=spec.eval_name, parameters=params, tags=["chatlearn"],
                                                   triggers=[eval_trigger(train_id)], enforce_parameter_schema=True))
    prefect_serve(*deployments, print_starting_message=False)
