"""What every field of ChatLearn's config does here, and the check that keeps a knob from doing nothing.

Each seed field has a status:

* ``acts``: does what the reference says;
* ``refused``: a value other than the default would change results (LoRA, colocation, offloading) and is not
  implemented yet: an error naming the field;
* ``warned``: a value other than the default would only tune speed or diagnostics and is not implemented
  yet: one warning naming the field, and the run goes on;
* ``inert``: has no effect by design here (stated in the table).

The table itself is ``support.yaml`` next to this file; the field table of the docs' configuration page
(``docs/pages/configuration.md``) is :func:`markdown_table`, and a test keeps the two equal. The refusal and the
warnings are part of an engine's checks (:mod:`chatlearn.config.engine_checks`), so ``chatlearn config``
still prints such a config.
"""

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import BaseModel

from chatlearn.config.deployment import DeploymentConfig
from chatlearn.config.errors import ConfigWarning
from chatlearn.config.model import BatchGenerationConfig, LoraConfig, ModelConfig
from chatlearn.config.root import ChatLearnConfig
from chatlearn.config.runtime import RuntimeConfig, RuntimeEnvConfig

__all__ = ["FIELDS", "Support", "markdown_table", "unsupported_values"]

Status = Literal["acts", "refused", "warned", "inert"]


class Support(NamedTuple):
    status: Status
    what: str


def _read_table() -> dict[str, dict[str, Support]]:
    table = yaml.safe_load((Path(__file__).parent / "support.yaml").read_text(encoding="utf-8"))
    return {kind: {name: Support(*entry) for name, entry in fields.items()} for kind, fields in table.items()}


# section kind ("runtime", "models.X.lora", ...) -> field -> Support; the table lives in support.yaml
FIELDS: dict[str, dict[str, Support]] = _read_table()

_SET_BY_FREE_MEMORY = ("offload_weights", "free_grad_buffers", "offload_optimizer_states")

_CLASSES: dict[str, type[BaseModel]] = {
    "runtime_env": RuntimeEnvConfig,
    "runtime": RuntimeConfig,
    "models.X": ModelConfig,
    "models.X.lora": LoraConfig,
    "models.X.batch_generation": BatchGenerationConfig,
    "deployment": DeploymentConfig,
}


def _default(cls: type[BaseModel], name: str) -> Any:
    field = cls.model_fields[name]
    return field.default_factory() if field.default_factory is not None else field.default


def _given(section: BaseModel, cls: type[BaseModel], statuses: dict[str, Support], wanted: Status) -> list[str]:
    return [n for n, s in statuses.items() if s.status == wanted and getattr(section, n) != _default(cls, n)]


def _sections(cfg: ChatLearnConfig, models: Iterable[str]) -> list[tuple[str, str, BaseModel]]:
    out: list[tuple[str, str, BaseModel]] = [("runtime_env", "runtime_env", cfg.runtime_env),
                                              ("runtime", "runtime", cfg.runtime),
                                              ("deployment", "deployment", cfg.deployment)]
    for name in models:
        m = cfg.models[name]
        out += [(f"models.{name}", "models.X", m), (f"models.{name}.lora", "models.X.lora", m.lora),
                (f"models.{name}.batch_generation", "models.X.batch_generation", m.batch_generation)]
    return out


def unsupported_values(cfg: ChatLearnConfig, models: Iterable[str]) -> list[str]:
    """Problems for values that would change results and are not implemented; warns (ConfigWarning) once
    per speed-only knob set away from its default. ``models`` are the models the engine runs."""
    problems: list[str] = []
    for prefix, kind, section in _sections(cfg, models):
        cls, statuses = _CLASSES[kind], FIELDS[kind]
        refused = _given(section, cls, statuses, "refused")
        if "free_memory" in refused:  # the switch sets the three others: name the switch only
            refused = [n for n in refused if n not in _SET_BY_FREE_MEMORY]
        for name in refused:
            problems.append(f"{prefix}.{name}: {getattr(section, name)!r} is not supported yet "
                            f"({statuses[name].what}); leave it at {_default(cls, name)!r}")
        for name in _given(section, cls, statuses, "warned"):
            warnings.warn(f"{prefix}.{name}={getattr(section, name)!r} has no effect here: {statuses[name].what}",
                          ConfigWarning, stacklevel=2)
    return problems


def markdown_table() -> str:
    """The docs' field table: every seed field, its status and what it does here."""
    rows = ["| field | here | what it does here |", "|---|---|---|"]
    for kind, statuses in FIELDS.items():
        for name, support in statuses.items():
            rows.append(f"| `{kind}.{name}` | {support.status} | {support.what} |")
    return "\n".join(rows) + "\n"
