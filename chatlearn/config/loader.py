"""Load ChatLearn YAML configs into a validated :class:`~chatlearn.config.root.ChatLearnConfig`.

Follows ChatLearn 1.0.x's loader so its YAML files work unchanged, and fixes its rough edges:

* ``includes:`` (a list, or one name) in any file, found by the one rule for file names a config gives
  (:func:`find_config_file`: beside the *main* config, ChatLearn's rule, then beside the file that names it,
  then, for a name without a folder such as ``default.yaml``, among the packaged configs), recursive,
  deep-merged so that later includes override earlier ones and the including file overrides all of them;
  cycles are errors.
* ``${VAR}`` / ``${VAR:default}`` values (:mod:`chatlearn.config.envvars`), substituted file by file as
  ChatLearn does, and in override values too. A reference with no value and no default becomes ``None``:
  fine where ChatLearn takes ``None`` (a field whose default is ``None``, a backend key in ``args_dict``, a
  user extra; a warning lists them), an error ``"runtime.num_episode: ${NUM_EPISODE} is not set and has no
  default"`` everywhere else (ChatLearn refuses those too; a whole section set to ``None`` would otherwise
  silently take every default), and always inside longer text (``${OUT}/out`` is not ``/out``).
* Unquoted numbers like ``1e-5`` are floats (YAML 1.1 would read them as strings).
* ``models.<name>.model_config_file`` is found by the same rule (so ``tiny_qwen2.yaml`` in one's own config is
  the packaged one unless a file of that name sits beside it) and parsed the same way into the model's
  ``args_dict`` (inline ``args_dict`` keys win); tensor/pipeline parallel sizes and ``zero_size`` found there
  override the model's fields.
* A relative prompt path written in an *included* file is looked up next to that file when it is not found
  from the working directory, so ``includes: [path/to/configs/default.yaml]`` works from any folder.
* ``dotted.key=value`` overrides win over everything in the files.
* A config named without a folder (``grpo``, ``grpo.yaml``) that is not a file here is the packaged one
  (:func:`packaged_configs`: the repository's ``configs/``, shipped in the wheel as ``chatlearn/configs``), so
  an installed package runs its configs from any directory; a file not found lists the packaged names.
* Every problem (bad override, missing model file, type errors, cross-field checks, the explicit
  ``checks``) comes back in one :class:`~chatlearn.config.errors.ConfigError`.
"""

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from chatlearn.config.deployment import DeploymentConfig
from chatlearn.config.envvars import (
    Missing,
    YamlLoader,
    parse_value,
    substitute,
    substitute_text,
    unset_problem,
    warn_missing,
)
from chatlearn.config.errors import ConfigError
from chatlearn.config.model import PARALLEL_KEYS, BatchGenerationConfig, LoraConfig, ModelConfig
from chatlearn.config.root import ChatLearnConfig, ConfigCheck, run_checks, validate_config
from chatlearn.config.runtime import RuntimeConfig, RuntimeEnvConfig

__all__ = [
    "config_path",
    "configs_dir",
    "deep_merge",
    "default_config_path",
    "find_config_file",
    "load_config",
    "load_config_dict",
    "load_yaml_with_includes",
    "packaged_configs",
    "resolve_data_paths",
]


def configs_dir() -> Path:
    """The packaged configs (the embedded default, one per engine, the tiny model's spec and their data).

    In an installed wheel ``chatlearn/configs`` (pyproject.toml maps the repository's top-level ``configs/``
    there); in a source checkout or an editable install the repository's ``configs/`` itself. (Not found with
    ``importlib.resources``: setuptools' editable finder cannot import a mapped folder without ``__init__.py``.)
    """
    package = Path(__file__).resolve().parents[1]
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


def default_config_path() -> Path:
    """The embedded default: ``default.yaml`` of :func:`configs_dir`."""
    return configs_dir() / "default.yaml"


def packaged_configs() -> dict[str, Path]:
    """The packaged run configs by name (``grpo`` -> ``.../grpo.yaml``): the YAML files of :func:`configs_dir`
    with a ``models`` or ``runtime`` section (not ``tiny_llama.yaml``, a model config file they include)."""
    found = {}
    for path in sorted(configs_dir().glob("*.yaml")):
        try:
            top = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(top, dict) and ("models" in top or "runtime" in top):
            found[path.stem] = path
    return found


def config_path(name: "str | os.PathLike[str]") -> str:
    """The file a CONFIG argument names. One rule: a path that exists is that file; otherwise a name without a
    folder (``grpo`` or ``grpo.yaml``) is the packaged config of that name (:func:`packaged_configs`).
    Anything else is a ConfigError that lists the packaged names."""
    path = os.fspath(name)
    if os.path.isfile(path):
        return path
    packaged = packaged_configs()
    stem = path[: -len(".yaml")] if path.endswith(".yaml") else path
    if os.path.basename(path) == path and stem in packaged:
        return str(packaged[stem])
    hint = ""
    base = os.path.basename(stem)
    if base in packaged and base != path:
        hint = f"; did you mean the packaged {base!r}?"
    names = ", ".join(packaged) or "none found"
    raise ConfigError(f"{path}: config file not found{hint} (packaged configs, named without a folder: {names})")


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """New dict: ``override`` merged into ``base``, recursing into dicts present in both."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc}") from None
    try:
        data = yaml.load(text, Loader=YamlLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown line"
        problem = " ".join(p for p in (exc.context, exc.problem) if p) or str(exc)
        raise ConfigError(f"{path}: invalid YAML at {where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except (ValueError, TypeError, OverflowError) as exc:  # a constructor's: !!int x, a date 2024-13-01
        raise ConfigError(f"{path}: invalid YAML value: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    try:
        size = _expanded_size(data, set(), {})
    except (_SelfReference, RecursionError):
        raise ConfigError(f"{path}: invalid YAML: an alias (*name) is used inside the value its anchor (&name) "
                          "marks, so the value would contain itself") from None
    if size > MAX_VALUES:
        raise ConfigError(f"{path}: invalid YAML: its aliases expand to {size} values (at most {MAX_VALUES})")
    return data


# A YAML file's aliases share one object; expanded (as each later step copies them) a few nested ones multiply.
MAX_VALUES = 1_000_000


class _SelfReference(Exception):
    """A YAML alias inside the value its own anchor marks."""


def _expanded_size(value: Any, ancestors: set[int], sizes: dict[int, int]) -> int:
    """How many values ``value`` holds once its shared (aliased) parts are copied; each object counted once,
    so a file of nested aliases is measured in linear time. Raises :class:`_SelfReference` on a cycle."""
    if not isinstance(value, dict | list):
        return 1
    key = id(value)
    if key in sizes:
        return sizes[key]
    if key in ancestors:
        raise _SelfReference
    ancestors.add(key)
    children = value.values() if isinstance(value, dict) else value
    sizes[key] = 1 + sum(_expanded_size(v, ancestors, sizes) for v in children)
    ancestors.discard(key)
    return sizes[key]


def _text_problems(value: Any, path: str) -> list[str]:
    """Text that cannot be written out as UTF-8 (JSON for ``chatlearn config``, Prefect parameters): a lone
    surrogate (a ``"\\ud800"`` escape, a non-UTF-8 environment variable) or ``!!binary`` data that is not
    text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return [f"{path or 'config'}: {value!r} is not valid text (a lone surrogate: a \\ud800-style escape or "
                    "a non-UTF-8 environment variable)"]
    elif isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return [f"{path or 'config'}: binary data (!!binary) that is not UTF-8 text"]
    elif isinstance(value, dict):
        found = []
        for key, item in value.items():
            name = str(key) if str(key).strip() else repr(key)  # a blank key is still a place to name
            found += _text_problems(key, f"{path}.<key>" if path else "<key>")
            found += _text_problems(item, f"{path}.{name}" if path else name)
        return found
    elif isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _text_problems(item, f"{path}.{i}" if path else str(i))]
    return []


def _beside(path: Any, folder: str) -> Any:
    """``folder/path`` when ``path`` is relative, not found from the working directory, and found there."""
    if not isinstance(path, str) or not path or os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = os.path.normpath(os.path.join(folder, os.path.expanduser(path)))
    return candidate if os.path.exists(candidate) else path


def find_config_file(name: str, main_dir: str, own_dir: str) -> tuple[str | None, list[str]]:
    """The one rule for a file name a config gives (an ``includes`` entry, a ``model_config_file``): absolute as
    written; else beside the main config (ChatLearn's rule), then beside the file that names it, then, for a name
    without a folder, among the packaged configs (:func:`configs_dir`). The file found (None if none) and the
    places looked, in order."""
    if os.path.isabs(name):
        candidates = [name]
    else:
        candidates = [os.path.normpath(os.path.join(main_dir, name))]
        if os.path.abspath(own_dir) != os.path.abspath(main_dir):
            candidates.append(os.path.normpath(os.path.join(own_dir, name)))
        if os.path.basename(name) == name:
            candidates.append(str(configs_dir() / name))
    return next((c for c in candidates if os.path.isfile(c)), None), candidates


def _anchor_included_paths(data: dict[str, Any], own_dir: str, main_dir: str) -> None:
    """Relative file names written in an included file, made absolute where they are found: prompt paths beside
    it (when not found from the working directory), model config files by :func:`find_config_file`."""
    runtime = data.get("runtime")
    if isinstance(runtime, dict):
        for key in ("data_path", "eval_data_path"):
            value = runtime.get(key)
            runtime[key] = [_beside(p, own_dir) for p in value] if isinstance(value, list) else _beside(value, own_dir)
    models = data.get("models")
    if isinstance(models, dict):
        for model in models.values():
            if isinstance(model, dict) and isinstance(model.get("model_config_file"), str):
                found, _ = find_config_file(os.path.expanduser(model["model_config_file"]), main_dir, own_dir)
                if found is not None:
                    model["model_config_file"] = found


def _expand_includes(
    data: dict[str, Any],
    source: str,
    config_dir: str,
    own_dir: str,
    stack: list[str],
    missing: Missing,
    prefix: str = "",
) -> dict[str, Any]:
    """Merge the files named by ``data['includes']`` under ``data`` (which wins); ``prefix`` is the dotted
    path the files' values land under (a model config file's: ``models.<name>.args_dict``)."""
    includes = data.pop("includes", None)
    if includes is None:
        return data
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{source}: includes: must be a file name or a list of file names, got {includes!r}")
    merged: dict[str, Any] = {}
    for name in includes:
        expanded = os.path.expanduser(substitute_text(name, "includes", []) if "${" in name else name)
        found, candidates = find_config_file(expanded, config_dir, own_dir)
        if found is None:
            raise ConfigError(
                f"{source}: includes: file '{name}' not found (looked for {', '.join(candidates)}), "
                f"included from {source}"
            )
        real = os.path.realpath(found)
        if real in stack:
            chain = " -> ".join([*stack[stack.index(real) :], real])
            raise ConfigError(f"{source}: includes: include cycle: {chain}")
        included = _load_tree(found, config_dir, [*stack, real], prefix, missing)
        _anchor_included_paths(included, os.path.dirname(found), config_dir)
        merged = deep_merge(merged, included)
    return deep_merge(merged, data)


def _refuse_unset_includes(source: str, unset: Missing, prefix: str) -> None:
    """``includes: ${VAR}`` (or a list item) with the variable unset: an error, not a silently skipped file."""
    key = f"{prefix}.includes" if prefix else "includes"
    for m in unset:
        if m.path == key or m.path.startswith(key + "."):
            raise ConfigError(f"{source}: includes: ${{{m.name}}} is not set and has no default")


def _load_tree(path: str, config_dir: str, stack: list[str], prefix: str, missing: Missing) -> dict[str, Any]:
    """One file, ``${VAR}`` substituted (as ChatLearn does, file by file), its includes merged under it."""
    unset: Missing = []
    data = substitute(_read_yaml(path), prefix, unset)
    _refuse_unset_includes(path, unset, prefix)
    missing += unset
    return _expand_includes(data, path, config_dir, os.path.dirname(path), stack, missing, prefix)


def _load_file(path: str, config_dir: str | None, prefix: str, missing: Missing) -> dict[str, Any]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    if config_dir is None:
        config_dir = os.path.dirname(os.path.abspath(path))
    return _load_tree(path, config_dir, [os.path.realpath(path)], prefix, missing)


def load_yaml_with_includes(path: str | os.PathLike, config_dir: str | None = None) -> dict[str, Any]:
    """One YAML file with its ``includes:`` merged in and ``${VAR}`` values substituted.

    ``config_dir`` (default: the file's directory) is where relative include paths are looked up, as
    ChatLearn resolves them against the main config's directory.
    """
    missing: Missing = []
    data = _load_file(os.fspath(path), config_dir, "", missing)
    in_text = [unset_problem(m) for m in missing if m.in_text]
    if in_text:
        raise ConfigError(in_text)
    warn_missing(missing)
    return data


Override = tuple[list[str], Any, str]


def _parse_overrides(overrides: Sequence[str], problems: list[str], missing: Missing) -> list[Override]:
    """``dotted.key=value`` items, values read like an env var's (``${VAR}`` in them substituted)."""
    if isinstance(overrides, str):
        overrides = [overrides]
    parsed = []
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            problems.append(f"overrides: {item!r} is not of the form dotted.key=value")
            continue
        key, _, raw = item.partition("=")
        keys = [k.strip() for k in key.strip().split(".")]
        if not all(keys):
            problems.append(f"overrides: {item!r} has an empty key; expected dotted.key=value")
            continue
        value = substitute_text(raw, ".".join(keys), missing) if "${" in raw else parse_value(raw)
        parsed.append((keys, value, item))
    return parsed


def _apply_overrides(data: dict[str, Any], parsed: list[Override], problems: list[str] | None) -> None:
    for keys, value, item in parsed:
        node = data
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                if problems is not None:
                    problems.append(
                        f"overrides: {item!r}: {'.'.join(keys[: i + 1])} is a {type(child).__name__}, not a mapping"
                    )
                break
            node = child
        else:
            node[keys[-1]] = copy.deepcopy(value)


def _merge_model_config_files(
    data: dict[str, Any], config_dir: str | None, problems: list[str], missing: Missing
) -> None:
    models = data.get("models")
    if not isinstance(models, dict):
        return
    base_dir = config_dir if config_dir is not None else os.getcwd()
    for name, model in models.items():
        if not isinstance(model, dict):
            continue
        if config_dir is not None and not model.get("config_dir"):
            model["config_dir"] = config_dir
        file_name = model.get("model_config_file")
        if not file_name or not isinstance(file_name, str):
            continue
        # a dict without a directory of its own (a resolved dump: a deployment's run form) looks next to the
        # config it was resolved from, which the model's config_dir names
        own = (model.get("config_dir") if config_dir is None else None) or base_dir
        path, looked = find_config_file(os.path.expanduser(file_name), own, own)
        if path is None:
            problems.append(f"models.{name}.model_config_file: file not found: "
                            f"{looked[0]}{' (nor ' + ', '.join(looked[1:]) + ')' if looked[1:] else ''}")
            continue
        try:
            file_args = _load_file(path, config_dir, f"models.{name}.args_dict", missing)
        except ConfigError as exc:
            problems.extend(f"models.{name}.model_config_file: {p}" for p in exc.problems)
            continue
        inline = model.get("args_dict")
        if inline is None:
            inline = {}
        if isinstance(inline, dict):
            model["args_dict"] = deep_merge(file_args, inline)


def _sync_parallel_sizes(data: dict[str, Any], parsed: list[Override]) -> None:
    """Parallel sizes in ``args_dict`` (from the model config file) override the model's fields,
    unless the field itself was given as an override; both end up equal.

    Not for a CPU-only model: its file describes the GPU backend it shares with other models (ChatLearn's
    rule reward reads the policy's Megatron file), and here a CPU model's TP x PP splits its processes into
    replicas, so a file's TP 2 would halve a rule reward's replicas. Its own fields still set the split."""
    models = data.get("models")
    if not isinstance(models, dict):
        return
    overridden = {(k[1], k[2]) for k, _, _ in parsed if len(k) == 3 and k[0] == "models"}
    for name, model in models.items():
        if not isinstance(model, dict) or not isinstance(model.get("args_dict"), dict):
            continue
        args = model["args_dict"]
        if not (model.get("num_gpu") or model.get("num_device")) and model.get("num_cpu"):
            continue
        for key in PARALLEL_KEYS:
            if args.get(key) is None:
                continue
            if (str(name), key) in overridden:
                args[key] = model.get(key)
            else:
                model[key] = args[key]


def _name_missing_variables(problems: list[str], missing: Missing) -> list[str]:
    """A value that got an unset ``${VAR}`` and failed validation: say which variable, not "not an int"."""
    by_path = {m.path: m for m in missing}
    return [unset_problem(by_path[p.split(": ", 1)[0]]) if p.split(": ", 1)[0] in by_path else p for p in problems]


_SECTIONS: dict[str, Any] = {"runtime": RuntimeConfig, "runtime_env": RuntimeEnvConfig, "deployment": DeploymentConfig}
_MODEL_SECTIONS: dict[str, Any] = {"lora": LoraConfig, "batch_generation": BatchGenerationConfig}


def _may_be_none(parts: list[str]) -> bool:
    """Whether ChatLearn takes ``None`` at this dotted path (from an unset ``${VAR}``): a field whose default is
    ``None``, a user extra, a backend key inside ``args_dict``, an ignored top-level key; not a section, a
    model, or a field with another default (there ChatLearn refuses it, and here the default would
    silently replace it)."""
    if parts[0] in _SECTIONS:
        cls, rest = _SECTIONS[parts[0]], parts[1:]
    elif parts[0] == "models":
        if len(parts) < 3:
            return False
        cls, rest = ModelConfig, parts[2:]
        if rest[0] == "args_dict":
            return len(rest) > 1
        if rest[0] in _MODEL_SECTIONS:
            cls, rest = _MODEL_SECTIONS[rest[0]], rest[1:]
    else:
        return parts[0] not in ChatLearnConfig.model_fields
    if not rest:
        return False
    field = cls.model_fields.get(rest[0])
    return field is None or len(rest) > 1 or (field.default is None and field.default_factory is None)


def _unset_problems(missing: Missing) -> list[str]:
    """The unset references that are errors (see :func:`_may_be_none`), as ``"path: ${VAR} ..."`` lines."""
    return [unset_problem(m) for m in missing if m.in_text or not _may_be_none(m.path.split("."))]


def _build(
    data: dict[str, Any],
    config_dir: str | None,
    overrides: Sequence[str],
    missing: Missing,
    checks: Iterable[ConfigCheck],
) -> ChatLearnConfig:
    problems: list[str] = []
    override_missing: Missing = []
    parsed = _parse_overrides(overrides, problems, override_missing)
    # Once before reading model config files (an override may name another file), once after (so
    # overrides win over the files' values).
    _apply_overrides(data, parsed, problems)
    _merge_model_config_files(data, config_dir, problems, missing)
    _apply_overrides(data, parsed, None)
    _sync_parallel_sizes(data, parsed)
    overridden = {".".join(keys) for keys, _, _ in parsed}
    # what an override replaced no longer matters; the deprecated `rlhf` section is validated as `runtime`
    missing[:] = [m for m in missing if m.path not in overridden] + override_missing
    missing[:] = [m._replace(path="runtime" + m.path[4:]) if m.path.split(".")[0] == "rlhf" else m for m in missing]
    problems += _unset_problems(missing)
    problems += _text_problems(data, "")
    try:
        config = validate_config(data, checks)
    except ConfigError as exc:
        raise ConfigError(problems + _name_missing_variables(exc.problems, missing)) from None
    if problems:
        raise ConfigError(problems)
    warn_missing(missing)
    return config


def load_config_dict(
    data: Mapping[str, Any],
    config_dir: str | None = None,
    overrides: Sequence[str] = (),
    checks: Iterable[ConfigCheck] = (),
) -> ChatLearnConfig:
    """Validate a config given as a dict (``includes``, ``${VAR}``, model files and overrides applied).

    ``config_dir`` is where relative ``includes`` / ``model_config_file`` paths are looked up (default:
    the current directory). ``data`` is not modified.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: must be a mapping, got {type(data).__name__}")
    missing: Missing = []
    try:
        tree = substitute(copy.deepcopy(dict(data)), "", missing)
    except RecursionError:  # a dict that contains itself, or nested a thousand deep
        raise ConfigError("config: nested too deeply (or contains itself)") from None
    _refuse_unset_includes("<config>", missing, "")
    if "includes" in tree:
        base = config_dir if config_dir is not None else os.getcwd()
        tree = _expand_includes(tree, "<config>", base, base, [], missing)
    return _build(tree, config_dir, overrides, missing, checks)


def load_config(
    source: "str | os.PathLike | Mapping[str, Any] | ChatLearnConfig | None" = None,
    overrides: Sequence[str] = (),
    checks: Iterable[ConfigCheck] = (),
) -> ChatLearnConfig:
    """A validated config from a YAML path (default: the embedded default), a dict, or a config object.

    ``overrides`` are ``dotted.key=value`` strings; ``checks`` are run in the same pass (an engine's checks,
    see :mod:`chatlearn.config.engine_checks`), so one ConfigError lists every problem. A config object is
    checked again (the entry point of a run loads its config once: `chatlearn.runtime.prepared`).
    """
    checks = list(checks)
    if isinstance(source, ChatLearnConfig):
        if not overrides:
            return run_checks(source, checks)
        return load_config_dict(source.model_dump(mode="json"), None, overrides, checks)
    if isinstance(source, Mapping):
        return load_config_dict(source, None, overrides, checks)
    path = config_path(source if source is not None else default_config_path())
    config_dir = os.path.dirname(os.path.abspath(path))
    missing: Missing = []
    data = _load_file(path, config_dir, "", missing)
    return resolve_data_paths(_build(data, config_dir, overrides, missing, checks), config_dir)


def resolve_data_paths(cfg: ChatLearnConfig, config_dir: str) -> ChatLearnConfig:
    """Relative prompt paths are relative to the working directory (as in ChatLearn); when a file is not
    there but is next to the config, use that one, so a config runs from any directory."""
    rt = cfg.runtime
    for key in ("data_path", "eval_data_path"):
        value = getattr(rt, key)
        fixed = [_beside(p, config_dir) for p in value] if isinstance(value, list) else _beside(value, config_dir)
        setattr(rt, key, fixed)
    return cfg
