"""One prepared run: the checked config, its engine and its data, built once by the entry point.

Every way to start a run (`chatlearn train`, `engine.learn()`, a direct `train_flow(...)` call, a deployment
run) loads the config with the engine's checks (one ConfigError listing every problem), then calls
:func:`prepare_run` once: the engine's modules and plan, the model files and the data checked, read and cut to
fit. The run is launched from that object; nothing downstream checks or reads again.

A flow's parameters go to the Prefect API as JSON, so a direct call hands its prepared run to the flow body
through :func:`handing_down` (a context variable, set around the call in the caller's thread, where Prefect
runs a sync flow); a deployment run has no caller and prepares its own.
"""

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from chatlearn.config import ChatLearnConfig
from chatlearn.data.preflight import PreparedData, preflight
from chatlearn.runtime.engines import resolve_engine
from chatlearn.runtime.plan import ResolvedEngine


@dataclass(frozen=True)
class PreparedRun:
    """A run ready to launch. ``cfg`` passed the engine's checks; ``engine`` holds its modules and plan;
    ``data`` the train and eval records, checked."""

    cfg: ChatLearnConfig
    engine: ResolvedEngine
    data: PreparedData

    def with_config(self, cfg: ChatLearnConfig) -> "PreparedRun":
        """The same run under a changed runtime (a restart resuming from its own checkpoints)."""
        return replace(self, cfg=cfg)


def prepare_run(cfg: ChatLearnConfig, modules: Mapping[str, Any] | None = None, engine: str | None = None, *,
                resolved: ResolvedEngine | None = None) -> PreparedRun:
    """The run of a checked config (`load_config(..., [EngineChecks(...)])`): its engine (modules given in
    code, the rest built from the config; or ``resolved``, when the caller needed it first) and its data.
    Raises ConfigError (model files) or DataError (the first bad record, by file and line) before anything
    starts."""
    eng = resolved if resolved is not None else resolve_engine(cfg, modules, engine)
    if cfg.runtime.engine != eng.name:
        # the run records the engine it runs: an engine built in code or named by the flow's `engine` wins over
        # the config's runtime.engine
        cfg = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"engine": eng.name})})
    return PreparedRun(cfg, eng, preflight(cfg, eng))


# Why a ContextVar: a flow's parameters are JSON (the UI and deployments show and resend them); an engine built in
# code (modules, datasets) is not, so a direct call hands its prepared run to its own flow body through this.
_HANDED: contextvars.ContextVar[PreparedRun | None] = contextvars.ContextVar("chatlearn_prepared_run", default=None)


@contextlib.contextmanager
def handing_down(prepared: PreparedRun) -> Iterator[None]:
    """While a flow called directly runs, its body finds ``prepared`` (:func:`handed_down`)."""
    token = _HANDED.set(prepared)
    try:
        yield
    finally:
        _HANDED.reset(token)


def handed_down() -> PreparedRun | None:
    """The run the caller of this flow prepared, taken once (a subflow or a retry inside it prepares its own)."""
    prepared = _HANDED.get()
    _HANDED.set(None)
    return prepared
