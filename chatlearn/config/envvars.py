"""``${VAR}`` and ``${VAR:default}`` in config values, and how a text value becomes a Python value.

As ChatLearn: a whole-value reference is replaced by the variable, else its default, else ``None``, and the
text is read as a literal (``4``, ``True``, ``1e-5``, ``[1,2]``, ``None``, ``'quoted'`` -> ``quoted``). Better
than ChatLearn 1.0.2: references inside longer text (``runs/${USER:me}/x``) and inside lists are substituted
too, and a default may contain ``:`` (ChatLearn cuts it there). A reference with no value and no default is
recorded with the dotted path of the value, so the loader can name both when the field cannot be ``None``.
"""

import ast
import os
import re
import warnings
from typing import Any

import yaml

from chatlearn.config.errors import ConfigWarning

__all__ = ["YamlLoader", "Missing", "parse_value", "substitute_env_vars", "warn_missing"]

# (variable name, dotted path of the value that referenced it)
Missing = list[tuple[str, str]]


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` / ``2E3`` / ``1.0e5`` as floats (YAML 1.2 style)."""


YamlLoader.add_implicit_resolver(
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
    """Read a string the way ChatLearn reads env-var values: ints, floats, booleans, null, quoted text,
    lists, dicts.

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
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        try:  # ChatLearn's ast.literal_eval: ${X:'recompute'} is the text recompute
            value = ast.literal_eval(stripped)
        except (ValueError, SyntaxError):
            return stripped[1:-1]
        return value if isinstance(value, str) else text
    if stripped[:1] in ("[", "{"):
        try:
            return yaml.load(stripped, Loader=YamlLoader)
        except yaml.YAMLError:
            return text
    return text


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def substitute(value: Any, path: str, missing: Missing) -> Any:
    """``value`` with every reference replaced (a new object); unset references go into ``missing``."""
    if isinstance(value, dict):
        return {k: substitute(v, _join(path, k), missing) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, _join(path, i), missing) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        return substitute_text(value, path, missing)
    return value


def substitute_text(value: str, path: str, missing: Missing) -> Any:
    """One string: a whole-value reference becomes a parsed value, embedded ones are replaced as text."""
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


def warn_missing(missing: Missing) -> None:
    """One warning listing the unset variables that became ``None`` (or ``''`` inside text)."""
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
    missing: Missing = []
    result = substitute(data, "", missing)
    warn_missing(missing)
    return result
