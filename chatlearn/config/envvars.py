"""``${VAR}`` and ``${VAR:default}`` in config values, and how a text value becomes a Python value.

As ChatLearn: a whole-value reference is replaced by the variable, else its default, else ``None``, and the
text is read as a literal (``4``, ``True``, ``1e-5``, ``[1,2]``, ``None``, ``'quoted'`` -> ``quoted``). Better
than ChatLearn 1.0.2: references inside longer text (``runs/${USER:me}/x``) and inside lists are substituted
too, and a default may contain ``:`` (ChatLearn cuts it there). A reference with no value and no default is
recorded with the dotted path of the value, so the loader can name both: a whole value becomes ``None``,
accepted where ChatLearn accepts it (a field whose default is ``None``, a backend key of ``args_dict``) with a
warning, an error everywhere else (ChatLearn refuses those too); a reference inside longer text is always an
error, never an empty string (``${OUT}/out`` would silently become ``/out``).
"""

import ast
import os
import re
import warnings
from typing import Any, NamedTuple

import yaml

from chatlearn.config.errors import ConfigError, ConfigWarning

__all__ = ["Missing", "Unset", "YamlLoader", "parse_value", "substitute_env_vars", "unset_problem", "warn_missing"]


class Unset(NamedTuple):
    """A ``${VAR}`` with no value and no default: the variable, the dotted path of the value that named it, and
    whether it stood inside longer text (then the text is kept as written and the loader refuses it)."""

    name: str
    path: str
    in_text: bool = False


Missing = list[Unset]


def unset_problem(unset: Unset) -> str:
    """``"path: ${VAR} is not set and has no default"`` (the line a ConfigError gives for it)."""
    where = " (inside text)" if unset.in_text else ""
    return f"{unset.path or 'config'}: ${{{unset.name}}} is not set and has no default{where}"


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
        except Exception:  # anything literal_eval refuses is the text between the quotes
            return stripped[1:-1]
        return value if isinstance(value, str) else text
    if stripped[:1] in ("[", "{"):
        try:
            return yaml.load(stripped, Loader=YamlLoader)
        except Exception:  # not a YAML list/dict (a syntax error, a bad date, a deep nest): text
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
        missing.append(Unset(name, path))
        return None

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        missing.append(Unset(name, path, in_text=True))
        return match.group(0)

    return _EMBEDDED_VAR.sub(replace, value)


def warn_missing(missing: Missing) -> None:
    """One warning listing the unset variables that became ``None`` (those inside text are errors)."""
    missing = [m for m in missing if not m.in_text]
    if not missing:
        return
    by_name: dict[str, list[str]] = {}
    for name, path, _ in missing:
        by_name.setdefault(name, []).append(path)
    parts = []
    for name, paths in by_name.items():
        shown = ", ".join(paths[:3]) + (f", ... ({len(paths)} places)" if len(paths) > 3 else "")
        parts.append(f"${{{name}}} at {shown}")
    warnings.warn(
        "environment variables not set and without a default (values set to None): "
        + "; ".join(parts),
        ConfigWarning,
        stacklevel=3,
    )


def substitute_env_vars(data: Any) -> Any:
    """Replace ``${VAR}`` / ``${VAR:default}`` in every string of ``data`` (returns a new object); an unset
    reference inside longer text is a ConfigError naming it, an unset whole value becomes None (a warning)."""
    missing: Missing = []
    result = substitute(data, "", missing)
    in_text = [unset_problem(m) for m in missing if m.in_text]
    if in_text:
        raise ConfigError(in_text)
    warn_missing(missing)
    return result
