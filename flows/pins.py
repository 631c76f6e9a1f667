"""A deployment's code is pinned when it is deployed: no run of it can change the config fields that name code
to import or packages to install (`chatlearn.config.user_code.CODE_FIELDS`: the engine, the relay and eval
hooks, each model's module class and reward function, the Ray runtime env), whatever starts the run: the UI's
run form, `prefect deployment run --param`, a trigger, the API.

Two guards, one record:

- **the server**: `chatlearn deploy` / `serve` write each pinned value into the deployment's parameter schema as
  the only value allowed (`enum`, `readOnly`: how Prefect marks its own frozen parameters), an override that
  reaches one is refused by pattern, and `engine` / `modules` (Python callers' parameters) are pinned to none.
  With `enforce_parameter_schema` the server refuses such a run before it exists, naming the field
  (`config.runtime.relay_sample_fn`).
- **the flow**, first thing, before the config's checks import anything: the run's config (form, `config_path`
  and `overrides` resolved, model files merged) is compared with the record `chatlearn deploy` wrote on the
  deploying machine, `CHATLEARN_PREFECT_HOME/pins/<deployment id>.json`; any difference is a ConfigError naming
  the field. This guard holds where the first does not: a client may ask the server to skip the schema for its
  run (`enforce_parameter_schema=false`), and `config_path` or a model's `model_config_file` can bring code in
  through a file. The record is out of reach of every run parameter and API call. A deployment without one
  (`prefect deploy` of `deployments/prefect.yaml`) is held to the config of its own default parameters, as the
  server keeps them.

Neither guards against someone who may create or edit deployments or work pools (a deployment's pull steps,
a work pool's job template run commands on the worker): see `flows.deployments.ensure_work_pool`.
"""

import copy
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext

from chatlearn.config import ChatLearnConfig, ConfigError, load_config
from chatlearn.config.user_code import CODE_FIELDS, code_fields
from chatlearn.runtime.records.prefect_server import prefect_home

__all__ = ["check_run", "pin_file", "pin_schema", "pinned_values", "record"]


def pin_file(deployment_id: Any) -> Path:
    """Where `chatlearn deploy` records a deployment's pinned fields (the deploying machine's Prefect home)."""
    return prefect_home() / "pins" / f"{UUID(str(deployment_id))}.json"


def pinned_values(cfg: ChatLearnConfig, engine: str | None = None) -> dict[str, Any]:
    """The config's code fields as a run would use them: the flow's `engine` parameter, when given, is its
    `runtime.engine`."""
    values = code_fields(cfg)
    values["runtime.engine"] = engine or cfg.runtime.engine
    return json.loads(json.dumps(values))


def record(deployment_id: Any, deployment: str, cfg: ChatLearnConfig) -> Path:
    """Write the record of `deployment` (``flow/name``) that its runs are checked against."""
    path = pin_file(deployment_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"deployment": deployment, "pinned": pinned_values(cfg)}, indent=1))
    os.replace(tmp, path)  # never half a record
    return path


def _pin(schema: dict[str, Any], value: Any) -> None:
    schema.update(enum=[value], readOnly=True)


def _ref(definition: str) -> str:
    """A ``$ref`` to ``definitions/<definition>`` (JSON pointer escapes, then URI escapes)."""
    return "#/definitions/" + quote(definition.replace("~", "~0").replace("/", "~1"), safe="")


def _override_pattern() -> str:
    """An override key (``a.b.c=``) that sets a code field, one of its parents or anything inside one."""
    sep = r"\s*\.\s*"
    alternatives = []
    for field in CODE_FIELDS:
        parts = [r"[^.=]+" if p == "*" else re.escape(p) for p in field.split(".")]
        nested = rf"(?:{sep}[^=]*)?"
        for part in reversed(parts[1:]):
            nested = f"(?:{sep}{part}{nested})?"
        alternatives.append(parts[0] + nested)
    return r"^\s*(?:" + "|".join(alternatives) + r")\s*="


def pin_schema(schema: dict[str, Any], cfg: ChatLearnConfig) -> dict[str, Any]:
    """A flow's parameter schema (Prefect's, with ``definitions``) with `cfg`'s code fields pinned: each the only
    value allowed, models the config does not have without a module or reward function of their own, no
    runtime_env key the config does not have, no override of any of them, and no `engine` / `modules`."""
    schema = copy.deepcopy(schema)
    defs, props = schema["definitions"], schema["properties"]
    models: dict[str, dict[str, Any]] = {}
    for path, value in pinned_values(cfg).items():
        section, _, rest = path.partition(".")
        if section == "runtime":
            _pin(defs["RuntimeConfig"]["properties"].setdefault(rest, {}), value)
        elif section == "runtime_env":
            _pin(defs["RuntimeEnvConfig"]["properties"].setdefault(rest, {}), value)
        else:  # models.<name>.args_dict.<key>
            name, _, key = rest.rpartition(".args_dict.")
            models.setdefault(name, {})[key] = value
    defs["RuntimeEnvConfig"]["additionalProperties"] = False
    model_map = defs["ChatLearnConfig"]["properties"]["models"]
    model_map["properties"] = {}
    model_keys = [p.rsplit(".", 1)[1] for p in CODE_FIELDS if p.startswith("models.")]
    # the config's models each get a copy of ModelConfig with their values; ModelConfig itself (any other
    # model) allows none of its own
    for name, values in [*models.items(), ("", dict.fromkeys(model_keys))]:
        title = f"ModelConfig.{name}" if name else "ModelConfig"
        own = defs[title] = copy.deepcopy(defs["ModelConfig"])
        args = own["properties"]["args_dict"]
        args["properties"] = {key: {} for key in values}
        for key, value in values.items():
            _pin(args["properties"][key], value)
        args["required"] = [key for key, value in values.items() if value is not None]
        own["required"] = [*own.get("required", []), "args_dict"] if args["required"] else own.get("required", [])
        if name:
            model_map["properties"][name] = {"$ref": _ref(title)}
    model_map["required"] = [name for name, values in models.items() if any(v is not None for v in values.values())]
    for name in ("engine", "modules"):
        if name in props:
            _pin(props[name], None)
    if "overrides" in props:
        for option in props["overrides"].get("anyOf", [props["overrides"]]):
            if option.get("type") == "array":
                option["items"] = {"type": "string", "not": {"pattern": _override_pattern()}}
    return schema


def _deployment_id() -> Any:
    """The deployment whose run this is, else None (a direct call, a subflow)."""
    ctx = FlowRunContext.get()
    flow_run = ctx.flow_run if ctx is not None else None
    return flow_run.deployment_id if flow_run is not None else None


def _load(config: Any, config_path: str | None, overrides: Sequence[str] | None) -> ChatLearnConfig:
    """The run's config without the engine's checks (they import the code named in it)."""
    if config is not None and config_path:
        raise ConfigError("config_path: give either config or config_path, not both")
    return load_config(config if config is not None else config_path, list(overrides or ()))


def _record_of(deployment_id: Any) -> tuple[str, dict[str, Any]]:
    """(deployment name, pinned values): the record on this machine, else the deployment's default parameters."""
    path = pin_file(deployment_id)
    if path.is_file():
        data = json.loads(path.read_text())
        return data["deployment"], data["pinned"]
    with get_client(sync_client=True) as client:
        dep = client.read_deployment(deployment_id)
        flow = client.read_flow(dep.flow_id)
    params = dep.parameters or {}
    cfg = _load(params.get("config"), params.get("config_path"), params.get("overrides"))
    return f"{flow.name}/{dep.name}", pinned_values(cfg, params.get("engine"))


def check_run(config: Any = None, config_path: str | None = None, overrides: Sequence[str] | None = None,
              engine: str | None = None, modules: dict[str, Any] | None = None) -> None:
    """In a run of a deployment, refuse (ConfigError naming each field) parameters that change its pinned code
    fields; nothing is imported before. Outside a deployment's run (a direct call, a subflow): nothing."""
    deployment_id = _deployment_id()
    if deployment_id is None:
        return
    if modules:
        raise ConfigError("modules: model objects are given by Python callers; a deployment's run takes none")
    name, pinned = _record_of(deployment_id)
    current = pinned_values(_load(config, config_path, overrides), engine)
    problems = [f"{path}: {current.get(path)!r} differs from {pinned.get(path)!r}, pinned when {name} was "
                "deployed: a run cannot change the code it runs or installs (deploy it again to change it)"
                for path in dict.fromkeys([*pinned, *current]) if current.get(path) != pinned.get(path)]
    if problems:
        raise ConfigError(problems)
