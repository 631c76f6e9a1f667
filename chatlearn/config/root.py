"""The whole config (``runtime_env``, ``runtime``, ``models``) and how it is validated: section by section,
every problem collected into one :class:`~chatlearn.config.errors.ConfigError`.

Checks that need more than the config (an engine's models and modules, hooks to import) are passed in
explicitly as :class:`ConfigCheck` objects; a config remembers which checks it passed, so the same check is
not run twice on it in one command (the CLI, ``engine.learn()`` and the flow may all ask for it).
"""

import json
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, model_validator

from chatlearn.config.checks import check_sections
from chatlearn.config.deployment import DeploymentConfig
from chatlearn.config.errors import (
    ConfigError,
    ConfigWarning,
    closest_name,
    did_you_mean,
    problems_from_validation_error,
)
from chatlearn.config.model import ModelConfig
from chatlearn.config.runtime import RuntimeConfig, RuntimeEnvConfig

__all__ = ["ChatLearnConfig", "ConfigCheck", "collect_problems", "run_checks"]

# Context flag: the sectional validation in ChatLearnConfig.model_validate already ran all checks.
_CHECKED = "_chatlearn_config_checked"


@runtime_checkable
class ConfigCheck(Protocol):
    """A check beyond the config's own: ``check(cfg)`` returns problems as ``"dotted.path: message"``."""

    def __call__(self, cfg: "ChatLearnConfig") -> list[str]: ...


class ChatLearnConfig(BaseModel):
    """A whole ChatLearn config: ``runtime_env``, ``runtime`` and the ``models`` (name -> ModelConfig).

    ``ChatLearnConfig.model_validate(dict)`` validates each section separately and raises one
    :class:`ConfigError` listing every problem (type errors and cross-field checks). Validating an already
    resolved dump again gives an equal config.
    """

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    runtime_env: RuntimeEnvConfig = Field(
        default_factory=RuntimeEnvConfig, description="Ray runtime env (pip, py_modules, working_dir, ...)"
    )
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig,
        description="training related configs (episodes, batch sizes, colocation, checkpoints, ...)",
    )
    models: dict[str, ModelConfig] = Field(
        default_factory=dict, description="the models of the job, by name, in the order they were given"
    )
    deployment: DeploymentConfig = Field(
        default_factory=DeploymentConfig,
        description="how `chatlearn deploy`/`serve` register this config with Prefect (name, cron, overlap)",
    )
    _validated: bool = PrivateAttr(default=False)  # its own checks passed (Prefect validates parameters again)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return _normalize_top_level(data, None)
        return data

    @model_validator(mode="after")
    def _resolve_and_check(self, info: ValidationInfo) -> "ChatLearnConfig":
        private = self.__pydantic_private__ or {}
        if private.get("_validated"):  # an instance passed in again (a flow's parameter): checked already
            return self
        _resolve_generation_batch_size(self.runtime, self.models)
        if not (info.context or {}).get(_CHECKED):
            _warn_unknown_keys(self.runtime_env, self.runtime, self.models)
            problems = collect_problems(self)
            if problems:
                raise ValueError("\n".join(problems))
        self._validated = True
        return self

    @classmethod
    def model_validate(
        cls,
        obj: Any,
        *,
        strict: bool | None = None,
        from_attributes: bool | None = None,
        context: Any | None = None,
        **kwargs: Any,
    ) -> "ChatLearnConfig":
        """Validate a dict section by section and raise one :class:`ConfigError` with every problem."""
        if not isinstance(obj, Mapping):
            return super().model_validate(
                obj, strict=strict, from_attributes=from_attributes, context=context, **kwargs
            )
        return validate_config(obj, (), strict=strict, context=context, **kwargs)

    @classmethod
    def _from_parsed(cls, sections: dict[str, Any], **kwargs: Any) -> "ChatLearnConfig":
        """Assemble already validated sections (pydantic's own model_validate, no sectional pass)."""
        return super().model_validate(sections, **kwargs)

    @classmethod
    def model_validate_json(
        cls,
        json_data: str | bytes | bytearray,
        *,
        strict: bool | None = None,
        context: Any | None = None,
        **kwargs: Any,
    ) -> "ChatLearnConfig":
        """Parse JSON, then validate like :meth:`model_validate` (one ConfigError with every problem)."""
        return cls.model_validate(json.loads(json_data), strict=strict, context=context, **kwargs)


def collect_problems(cfg: ChatLearnConfig, checks: Iterable[ConfigCheck] = ()) -> list[str]:
    """All cross-field problems of a parsed config, then those of ``checks``."""
    problems = check_sections(cfg.runtime, cfg.models, list(cfg.models))
    problems += _run(checks, cfg)
    return list(dict.fromkeys(problems))


def run_checks(cfg: ChatLearnConfig, checks: Iterable[ConfigCheck]) -> ChatLearnConfig:
    """Run the ``checks``; raise one ConfigError listing every problem."""
    problems = _run(checks, cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _run(checks: Iterable[Callable[[ChatLearnConfig], list[str]]], cfg: ChatLearnConfig) -> list[str]:
    problems: list[str] = []
    for check in checks:
        try:
            problems += list(check(cfg) or [])
        except ConfigError as exc:
            problems += exc.problems
        except Exception as exc:  # a broken check must not hide the other problems
            name = getattr(check, "__qualname__", None) or type(check).__name__
            problems.append(f"config: check {name} failed: {type(exc).__name__}: {exc}")
    return problems


def validate_config(
    obj: Mapping[str, Any], checks: Iterable[ConfigCheck] = (), *, context: Any | None = None, **kwargs: Any
) -> ChatLearnConfig:
    """Validate a config dict section by section, then ``checks``; one ConfigError lists every problem.

    A section with bad keys is validated again without them (their defaults used), so cross-field checks
    still run on what did parse; checks reading a failed key are skipped. ``checks`` see only the models
    that parsed completely (a partly parsed one holds defaults).
    """
    checks = list(checks)
    problems: list[str] = []
    data = _normalize_top_level(obj, problems)

    def section(model_cls: type[BaseModel], raw: Any, prefix: str) -> tuple[Any, set[str]]:
        if raw is None:
            raw = {}
        if isinstance(raw, model_cls):
            return raw, set()
        if not isinstance(raw, Mapping):
            problems.append(f"{prefix}: must be a mapping, got {type(raw).__name__} {raw!r}")
            return None, set()
        result, errors, dropped = _validate_partially(model_cls, raw, prefix, context=context, **kwargs)
        problems.extend(errors)
        return result, dropped

    runtime_env, _ = section(RuntimeEnvConfig, data.get("runtime_env"), "runtime_env")
    runtime, rt_dropped = section(RuntimeConfig, data.get("runtime"), "runtime")
    deployment, _ = section(DeploymentConfig, data.get("deployment"), "deployment")
    models_raw = data.get("models") or {}
    models: dict[str, ModelConfig] = {}
    models_dropped: dict[str, set[str]] = {}
    if not isinstance(models_raw, Mapping):
        problems.append(f"models: must be a mapping of model name to model config, got {models_raw!r}")
        models_raw = {}
    for name, raw in models_raw.items():
        model, dropped = section(ModelConfig, raw, f"models.{name}")
        if model is not None:
            models[str(name)] = model
            models_dropped[str(name)] = dropped
    if runtime is not None and "generation_batch_size" not in rt_dropped:
        _resolve_generation_batch_size(runtime, models)
    _warn_unknown_keys(runtime_env, runtime, models)
    problems += check_sections(runtime, models, [str(n) for n in models_raw], rt_dropped, models_dropped)
    if checks and runtime is not None and runtime_env is not None and not rt_dropped:
        complete = {n: m for n, m in models.items() if not models_dropped[n]}
        partial = ChatLearnConfig.model_construct(runtime_env=runtime_env, runtime=runtime, models=complete)
        problems += _run(checks, partial)
    if problems:
        raise ConfigError(problems)
    ctx = dict(context) if isinstance(context, Mapping) else {}
    ctx[_CHECKED] = True
    cfg = ChatLearnConfig._from_parsed(
        {"runtime_env": runtime_env, "runtime": runtime, "models": models, "deployment": deployment},
        context=ctx, **kwargs,
    )
    return cfg


def _validate_partially(
    model_cls: type[BaseModel], raw: Mapping[str, Any], prefix: str, **kwargs: Any
) -> tuple[Any, list[str], set[str]]:
    """Validate a section; on errors, also validate it without the bad keys (their defaults used).

    Returns (object or None, problems, keys that failed).
    """
    try:
        return model_cls.model_validate(raw, **kwargs), [], set()
    except ValidationError as exc:
        problems = problems_from_validation_error(exc, prefix, model_cls)
        error = exc
    dropped: set[str] = set()
    data = dict(raw)
    for _ in range(3):
        bad = {e["loc"][0] for e in error.errors() if e["loc"] and isinstance(e["loc"][0], str)}
        if not bad or bad <= dropped:
            break
        dropped |= bad
        data = {k: v for k, v in data.items() if k not in dropped}
        try:
            return model_cls.model_validate(data, **kwargs), problems, dropped
        except ValidationError as exc:
            error = exc
    return None, problems, dropped


def _resolve_generation_batch_size(runtime: RuntimeConfig, models: Mapping[str, ModelConfig]) -> None:
    for model in models.values():
        if model.generation_batch_size is None or model.generation_batch_size <= 0:
            model.generation_batch_size = runtime.generation_batch_size


# A user extra of runtime / runtime_env is warned about only when this close to a field (a misspelling, not
# one of the keys ChatLearn's own configs add: eval_data_num_limit, query_key, ...).
EXTRA_CUTOFF = 0.8


def _warn_unknown_keys(
    runtime_env: RuntimeEnvConfig | None, runtime: RuntimeConfig | None, models: Mapping[str, ModelConfig]
) -> None:
    """Unknown keys the sections keep (see :mod:`chatlearn.config.sections`), named with the nearest field.

    ``runtime`` / ``runtime_env``: ChatLearn keeps them as user extras for ``get(key)``, so only a key that
    looks like a misspelt field is a warning (``runtime.num_episodes`` -> ``num_episode``); ``models.<name>``:
    ChatLearn logs "unknown argument" for each, so each is a warning, with the nearest field when one is close.
    """
    for prefix, sec in (("runtime_env", runtime_env), ("runtime", runtime)):
        for key in (sec.model_extra or {}) if sec is not None else {}:
            match = closest_name(key, type(sec).model_fields, EXTRA_CUTOFF)
            if match:
                warnings.warn(
                    f"{prefix}.{key}: unknown key, kept as a user extra (read with {prefix}.get({key!r})); "
                    f"did you mean {match}?",
                    ConfigWarning,
                    stacklevel=4,
                )
    for name, model in models.items():
        for key in model.model_extra or {}:
            hint = did_you_mean(key, ModelConfig.model_fields) or "; a backend hyper-parameter goes in args_dict"
            warnings.warn(
                f"models.{name}.{key}: unknown argument, kept but not used by ChatLearn{hint}",
                ConfigWarning,
                stacklevel=4,
            )


def _normalize_top_level(data: Mapping[str, Any], problems: list[str] | None) -> dict[str, Any]:
    """Apply the deprecated ``rlhf`` alias, drop ``runtime.save_interval`` (an error) and unknown keys."""
    data = dict(data)
    if "rlhf" in data:
        warnings.warn("rlhf: deprecated top-level key, use 'runtime' instead", ConfigWarning, stacklevel=5)
        legacy = data.pop("rlhf")
        current = data.get("runtime")
        if isinstance(legacy, Mapping) and isinstance(current, Mapping):
            data["runtime"] = {**legacy, **current}
        elif current is None:
            data["runtime"] = legacy
    runtime = data.get("runtime")
    if isinstance(runtime, Mapping) and "save_interval" in runtime:
        message = "runtime.save_interval: no longer supported, use save_episode_interval instead"
        if problems is None:
            raise ValueError(message)
        problems.append(message)
        data["runtime"] = {k: v for k, v in runtime.items() if k != "save_interval"}
    for key in list(data):
        if key not in ChatLearnConfig.model_fields:
            warnings.warn(
                f"{key}: unknown top-level key ignored (known: runtime_env, runtime, models, deployment)"
                f"{did_you_mean(key, ChatLearnConfig.model_fields)}",
                ConfigWarning,
                stacklevel=5,
            )
            del data[key]
    return data
