"""Flows that validate their config before a flow run exists, and the config parameter they take.

A direct call (`train_flow(cfg)`, `engine.learn()`, `chatlearn train`) loads the config and runs the engine's
checks first, all problems in one error, so an invalid config never shows up in the UI as a failed run.
Deployment runs skip `__call__`: Prefect validates the parameter against the config's schema (server side,
then in the flow run), and the flow body runs the engine's checks before any actor exists. A config checks
each engine's checks once (it remembers what it passed), however many of these layers ask.
"""

from typing import Annotated, Any

from prefect import Flow
from pydantic import BeforeValidator

from chatlearn.config import ChatLearnConfig, EngineChecks, load_config


def _load_if_not_config(value: Any) -> Any:
    return value if isinstance(value, ChatLearnConfig) else load_config(value)


# A config object, a YAML path or a dict: what a flow's `config` parameter accepts.
ConfigParam = Annotated[ChatLearnConfig, BeforeValidator(_load_if_not_config)]


class PrevalidatedFlow(Flow):
    """A flow whose direct calls validate the config, engine checks included, before a flow run exists.

    `engine` fixes the engine (the eval flow); otherwise the call's `engine` argument or `runtime.engine`.
    """

    def __init__(self, fn: Any, engine: str | None = None, **kwargs: Any):
        super().__init__(fn=fn, **kwargs)
        self.fixed_engine = engine

    def __call__(self, config: Any, modules: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        engine = self.fixed_engine or kwargs.get("engine")
        cfg = load_config(config, (), [EngineChecks(engine, modules or {})])
        return super().__call__(cfg, modules=modules, **kwargs)
