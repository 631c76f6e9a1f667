"""Flows that prepare their run before a flow run exists, and the config parameter they take.

A direct call (`train_flow(cfg)`, `engine.learn()`, `chatlearn train`) loads the config with the engine's
checks (all problems in one error) and prepares the run (`chatlearn.runtime.prepared`: engine, model files,
data) first, so an invalid config or a bad record never shows up in the UI as a failed run; the flow body
gets that prepared run. A caller that prepared the run already (the CLI) passes the `PreparedRun` itself.
Deployment runs skip `__call__`: Prefect validates the parameter against the config's schema (server side,
then in the flow run), and the flow body prepares the run before any actor exists.

A direct call with no Prefect API configured runs against the shared local server that `chatlearn train`
uses (`chatlearn.runtime.records.prefect_server.local_prefect_api`, announced on stderr), not in Prefect's
ephemeral mode: that temporary API is gone when the call returns (the UI never shows the run) and is broken
with Ray (every worker starts its own). Inside a flow run (a subflow, or a deployment run executed by a
worker) the call changes nothing: its runs belong with the parent's, on the parent's API.

`PrevalidatedFlow` subclasses Prefect's `Flow` to run before Flow's own `__call__` (relying on how that call
and Flow's constructor take their arguments), so it lives in Prefect's room (`chatlearn.runtime.prefect`, whose
`PRIVATE_USES` lists what it relies on); the flows in `flows/` import it from here.
"""

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Annotated, Any

from prefect import Flow
from prefect.context import FlowRunContext, TaskRunContext
from pydantic import BeforeValidator

from chatlearn.config import ChatLearnConfig, ConfigError, EngineChecks, load_config
from chatlearn.runtime.prefect import api_link
from chatlearn.runtime.prepared import PreparedRun, handing_down, prepare_run
from chatlearn.runtime.records.prefect_server import configured_api_url, local_prefect_api


def _load_if_not_config(value: Any) -> Any:
    return value if isinstance(value, ChatLearnConfig) else load_config(value)


# A config object, a YAML path or a dict: what a flow's `config` parameter accepts.
ConfigParam = Annotated[ChatLearnConfig, BeforeValidator(_load_if_not_config)]


def config_of(config: Any = None, config_path: str | None = None, overrides: Sequence[str] | None = None,
              engine: str | None = None, modules: dict[str, Any] | None = None) -> ChatLearnConfig:
    """The config a flow's parameters name: `config` (a typed config, dict or path: the deployment's run
    form) or `config_path` (a YAML file, default: the embedded default), with dotted `overrides` on top,
    checked for `engine` (default `runtime.engine`) with the `modules` given in code: one ConfigError lists
    every problem."""
    if config is not None and config_path:
        raise ConfigError("config_path: give either config or config_path, not both")
    return load_config(config if config is not None else config_path, list(overrides or ()),
                       [EngineChecks(engine, modules or {})])


class PrevalidatedFlow(Flow):
    """A flow whose direct calls prepare the run (config checks, engine, data) before a flow run exists.

    `engine` fixes the engine (the eval flow); otherwise the call's `engine` argument or `runtime.engine`.
    `prepares_inside_with`: an argument that, when given, makes the flow body prepare the run itself (the eval
    of a train run reads the policy to evaluate inside the flow); the config is still checked before. (A name,
    not a callable: the flow object travels with its task runs to Ray workers, which cannot import a function
    of a flow file a deployment loaded by path.)
    """

    def __init__(self, fn: Any, engine: str | None = None, prepares_inside_with: str | None = None, **kwargs: Any):
        super().__init__(fn=fn, **kwargs)
        self.fixed_engine = engine
        self.prepares_inside_with = prepares_inside_with

    def __call__(self, config: Any = None, modules: dict[str, Any] | None = None, *, config_path: str | None = None,
                 overrides: Sequence[str] | None = None, **kwargs: Any) -> Any:
        engine = self.fixed_engine or kwargs.get("engine")
        if isinstance(config, PreparedRun):
            if config_path or overrides:
                raise ConfigError("config: a prepared run takes no config_path or overrides")
            prepared: PreparedRun | None = config
        else:
            cfg = config_of(config, config_path, overrides, engine, modules)
            inside = self.prepares_inside_with is not None and kwargs.get(self.prepares_inside_with) is not None
            prepared = None if inside else prepare_run(cfg, modules, engine)
        handing = handing_down(prepared) if prepared is not None else contextlib.nullcontext()
        # watched: the Prefect API going away does not stop the run, nor lose its result when the flow run's
        # final state cannot be recorded (chatlearn.runtime.prefect.api_link)
        with _api_for_direct_call(), handing, api_link.watch(configured_api_url()):
            return api_link.call_flow(self, (prepared.cfg if prepared is not None else cfg,),
                                      dict(modules=modules, **kwargs), invoke=super().__call__)


def _announce(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def in_flow_run() -> bool:
    """True inside a flow or task run: a subflow, or a deployment run (the worker sets the flow run id)."""
    return bool(FlowRunContext.get() or TaskRunContext.get() or os.environ.get("PREFECT__FLOW_RUN_ID"))


def _api_for_direct_call() -> contextlib.AbstractContextManager[Any]:
    """The shared local server when no API is configured (`local_prefect_api` yields a configured one as is);
    nothing inside a flow run."""
    return contextlib.nullcontext() if in_flow_run() else local_prefect_api(announce=_announce)
