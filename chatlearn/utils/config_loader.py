"""Load ChatLearn YAML configs into a validated :class:`~chatlearn.utils.arguments.ChatLearnConfig`.

Follows ChatLearn 1.0.x's loader so its YAML files work unchanged, and fixes its rough edges:

* ``includes:`` (a list, or one name) in any file, resolved against the *main* config's directory unless
  absolute (falling back to the including file's own directory), recursive, deep-merged so that later
  includes override earlier ones and the including file overrides all of them; cycles are errors.
* ``${VAR}`` / ``${VAR:default}`` in string values anywhere (dicts and lists). A whole-value reference
  becomes the env var, else the default (which may contain ``:``), else ``None`` (one warning lists all
  unset variables), then is read as a literal (``4``, ``True``, ``1e-5``, ``[1,2]``, ``null``/``None``).
  A reference inside a longer string (``runs/${USER:me}/x``) is substituted as text.
* Unquoted numbers like ``1e-5`` are floats (YAML 1.1 would read them as strings).
* ``models.<name>.model_config_file`` is parsed the same way into the model's ``args_dict`` (inline
  ``args_dict`` keys win); tensor/pipeline parallel sizes and ``zero_size`` found there override the model's
  fields.
* ``dotted.key=value`` overrides win over everything in the files.
* Every problem (bad override, missing model file, type errors, cross-field checks) comes back in one
  :class:`~chatlearn.utils.arguments.ConfigError`.
"""

import copy
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from chatlearn.utils.arguments import PARALLEL_KEYS, ChatLearnConfig, ConfigError, ConfigWarning

__all__ = [
    "deep_merge",
    "load_config",
    "load_config_dict",
    "load_yaml_with_includes",
    "parse_value",
    "substitute_env_vars",
]


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` / ``2E3`` / ``1.0e5`` as floats (YAML 1.2 style)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+|[-+]?\.[0-9_]+[eE][-+]?[0-9]+)$"),
    list("-+0123456789."),
)

_VAR_NAME = r"[A-Za-z_][A-Za-z0-9_.-]*"
_EMBEDDED_VAR = re.compile(r"\$\{(" + _VAR_NAME + r")(?::([^}]*))?\}")
_WHOLE_VAR = re.compile(r"^\$\{(" + _VAR_NAME + r")(?::(.*))?\}$", re.S)
_NULL_WORDS = {"null", "Null", "NULL", "~", "None"}
_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[-+]?(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)")


def parse_value(text: str) -> Any:
    """Read a string the way ChatLearn reads env-var values: ints, floats, booleans, null, lists, dicts.

    Anything else (and anything YAML 1.1 would surprise you with: ``yes``, ``012``, ``1:30``) stays text.
    """
    stripped = text.strip()
    if stripped in _NULL_WORDS:
        return None
    if _INT.fullmatch(stripped):
        return int(stripped)
    if _FLOAT.fullmatch(stripped):
        return float(stripped)
    if stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if stripped[:1] in ("[", "{"):
        try:
            return yaml.load(stripped, Loader=_Loader)
        except yaml.YAMLError:
            return text
    return text


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _substitute(value: Any, path: str, missing: list[tuple[str, str]]) -> Any:
    if isinstance(value, dict):
        return {k: _substitute(v, _join(path, k), missing) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, _join(path, i), missing) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        return _substitute_str(value, path, missing)
    return value


def _substitute_str(value: str, path: str, missing: list[tuple[str, str]]) -> Any:
    whole = _WHOLE_VAR.match(value.strip())
    if whole and "${" not in (whole.group(2) or ""):
        name, default = whole.group(1), whole.group(2)
        if name in os.environ:
            return parse_value(os.environ[name])
        if default is not None:
            return parse_value(default)
        missing.append((name, path))
        return None

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        missing.append((name, path))
        return ""

    return _EMBEDDED_VAR.sub(replace, value)


def _warn_missing(missing: list[tuple[str, str]]) -> None:
    if not missing:
        return
    by_name: dict[str, list[str]] = {}
    for name, path in missing:
        by_name.setdefault(name, []).append(path)
    parts = []
    for name, paths in by_name.items():
        shown = ", ".join(paths[:3]) + (f", ... ({len(paths)} places)" if len(paths) > 3 else "")
        parts.append(f"${{{name}}} at {shown}")
    warnings.warn(
        "environment variables not set and without a default (values set to None, or '' inside text): "
        + "; ".join(parts),
        ConfigWarning,
        stacklevel=3,
    )


def substitute_env_vars(data: Any) -> Any:
    """Replace ``${VAR}`` / ``${VAR:default}`` in every string of ``data`` (returns a new object)."""
    missing: list[tuple[str, str]] = []
    result = _substitute(data, "", missing)
    _warn_missing(missing)
    return result


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
        data = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown line"
        problem = " ".join(p for p in (exc.context, exc.problem) if p) or str(exc)
        raise ConfigError(f"{path}: invalid YAML at {where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _expand_includes(
    data: dict[str, Any], source: str, config_dir: str, own_dir: str, stack: list[str]
) -> dict[str, Any]:
    """Merge the files named by ``data['includes']`` under ``data`` (which wins)."""
    includes = data.pop("includes", None)
    if includes is None:
        return data
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(
            f"{source}: includes: must be a file name or a list of file names, got {includes!r}"
        )
    merged: dict[str, Any] = {}
    for name in includes:
        expanded = os.path.expanduser(_substitute_str(name, "includes", []) if "${" in name else name)
        candidates = [expanded] if os.path.isabs(expanded) else [os.path.join(config_dir, expanded)]
        if not os.path.isabs(expanded) and os.path.abspath(own_dir) != os.path.abspath(config_dir):
            candidates.append(os.path.join(own_dir, expanded))
        found = next((c for c in candidates if os.path.isfile(c)), None)
        if found is None:
            raise ConfigError(
                f"{source}: includes: file '{name}' not found (looked for {', '.join(candidates)}), "
                f"included from {source}"
            )
        real = os.path.realpath(found)
        if real in stack:
            chain = " -> ".join([*stack[stack.index(real) :], real])
            raise ConfigError(f"{source}: includes: include cycle: {chain}")
        merged = deep_merge(merged, _load_tree(found, config_dir, [*stack, real]))
    return deep_merge(merged, data)


def _load_tree(path: str, config_dir: str, stack: list[str]) -> dict[str, Any]:
    return _expand_includes(_read_yaml(path), path, config_dir, os.path.dirname(path), stack)


def _load_file(path: str, config_dir: str | None, prefix: str, missing: list[tuple[str, str]]) -> dict:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    if config_dir is None:
        config_dir = os.path.dirname(os.path.abspath(path))
    tree = _load_tree(path, config_dir, [os.path.realpath(path)])
    return _substitute(tree, prefix, missing)


def load_yaml_with_includes(path: str | os.PathLike, config_dir: str | None = None) -> dict[str, Any]:
    """One YAML file with its ``includes:`` merged in and ``${VAR}`` values substituted.

    ``config_dir`` (default: the file's directory) is where relative include paths are looked up, as
    ChatLearn resolves them against the main config's directory.
    """
    missing: list[tuple[str, str]] = []
    data = _load_file(os.fspath(path), config_dir, "", missing)
    _warn_missing(missing)
    return data


def _parse_overrides(overrides: Sequence[str], problems: list[str]) -> list[tuple[list[str], Any, str]]:
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
        parsed.append((keys, parse_value(raw), item))
    return parsed


def _apply_overrides(
    data: dict[str, Any], parsed: list[tuple[list[str], Any, str]], problems: list[str] | None
) -> None:
    for keys, value, item in parsed:
        node = data
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                if problems is not None:
                    problems.append(
                        f"overrides: {item!r}: {'.'.join(keys[: i + 1])} is a {type(child).__name__}, "
                        "not a mapping"
                    )
                break
            node = child
        else:
            node[keys[-1]] = copy.deepcopy(value)


def _merge_model_config_files(
    data: dict[str, Any], config_dir: str | None, problems: list[str], missing: list[tuple[str, str]]
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
        path = os.path.expanduser(file_name)
        if not os.path.isabs(path):
            path = os.path.join(base_dir, path)
        if not os.path.isfile(path):
            problems.append(f"models.{name}.model_config_file: file not found: {path}")
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


def _sync_parallel_sizes(data: dict[str, Any], parsed: list[tuple[list[str], Any, str]]) -> None:
    """Parallel sizes in ``args_dict`` (from the model config file) override the model's fields,
    unless the field itself was given as an override; both end up equal."""
    models = data.get("models")
    if not isinstance(models, dict):
        return
    overridden = {(k[1], k[2]) for k, _, _ in parsed if len(k) == 3 and k[0] == "models"}
    for name, model in models.items():
        if not isinstance(model, dict) or not isinstance(model.get("args_dict"), dict):
            continue
        args = model["args_dict"]
        for key in PARALLEL_KEYS:
            if args.get(key) is None:
                continue
            if (str(name), key) in overridden:
                args[key] = model.get(key)
            else:
                model[key] = args[key]


def _build(
    data: dict[str, Any],
    config_dir: str | None,
    overrides: Sequence[str],
    missing: list[tuple[str, str]],
) -> ChatLearnConfig:
    problems: list[str] = []
    parsed = _parse_overrides(overrides, problems)
    # Once before reading model config files (an override may name another file), once after (so
    # overrides win over the files' values).
    _apply_overrides(data, parsed, problems)
    _merge_model_config_files(data, config_dir, problems, missing)
    _apply_overrides(data, parsed, None)
    _sync_parallel_sizes(data, parsed)
    _warn_missing(missing)
    try:
        config = ChatLearnConfig.model_validate(data)
    except ConfigError as exc:
        raise ConfigError(list(dict.fromkeys(problems + exc.problems))) from None
    if problems:
        raise ConfigError(problems)
    return config


def load_config_dict(
    data: Mapping[str, Any], config_dir: str | None = None, overrides: Sequence[str] = ()
) -> ChatLearnConfig:
    """Validate a config given as a dict (``includes``, ``${VAR}``, model files and overrides applied).

    ``config_dir`` is where relative ``includes`` / ``model_config_file`` paths are looked up (default:
    the current directory). ``data`` is not modified.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: must be a mapping, got {type(data).__name__}")
    tree = copy.deepcopy(dict(data))
    if "includes" in tree:
        base = config_dir if config_dir is not None else os.getcwd()
        tree = _expand_includes(tree, "<config>", base, base, [])
    missing: list[tuple[str, str]] = []
    tree = _substitute(tree, "", missing)
    return _build(tree, config_dir, overrides, missing)


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> ChatLearnConfig:
    """Load, resolve and validate a ChatLearn YAML config file; raises ConfigError listing every problem."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: config file not found")
    config_dir = os.path.dirname(os.path.abspath(path))
    missing: list[tuple[str, str]] = []
    data = _load_file(path, config_dir, "", missing)
    return resolve_data_paths(_build(data, config_dir, overrides, missing), config_dir)


def resolve_data_paths(cfg: ChatLearnConfig, config_dir: str) -> ChatLearnConfig:
    """Relative prompt paths are relative to the working directory (as in ChatLearn); when a file is not
    there but is next to the config, use that one, so a config runs from any directory."""
    rt = cfg.runtime

    def fix(path: str) -> str:
        if os.path.isabs(path) or os.path.exists(path):
            return path
        beside = os.path.join(config_dir, path)
        return beside if os.path.exists(beside) else path

    if isinstance(rt.data_path, str):
        rt.data_path = fix(rt.data_path)
    elif isinstance(rt.data_path, list):
        rt.data_path = [fix(p) for p in rt.data_path]
    if isinstance(rt.get("eval_data_path"), str):
        rt.eval_data_path = fix(rt.get("eval_data_path"))
    return cfg

