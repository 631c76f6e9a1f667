"""How config problems are reported: one error listing every problem as ``"dotted.path: message"``."""

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from chatlearn.utils.errors import UserError, closest_name, did_you_mean

__all__ = ["ConfigError", "ConfigWarning", "closest_name", "did_you_mean", "problems_from_validation_error"]


class ConfigError(UserError, ValueError):
    """Every problem found in a config, each as ``"dotted.path: message"``; ``str()`` lists one per line."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        if isinstance(problems, str):
            problems = [problems]
        # one line each: the CLI prints a problem per line, so a message with line breaks (a hook's error, a
        # YAML parser's) is folded onto its line
        self.problems: list[str] = list(dict.fromkeys(_one_line(str(p)) for p in problems))
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the problem list when pickled (Ray / Prefect ship exceptions between processes).
        return (type(self), (self.problems,))


class ConfigWarning(UserWarning):
    """Config accepted but something deserves attention (unknown key, deprecated alias, a knob that only
    tunes speed and is not implemented yet)."""


def _one_line(problem: str) -> str:
    """One printable line: line breaks folded, text that is not UTF-8 (a lone surrogate) escaped."""
    return re.sub(r"\s*\n\s*", " ", problem.strip()).encode("utf-8", "backslashreplace").decode("utf-8")


# Union members add their type to an error's location ("data_path.str"): recognised so they can be dropped.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|tuple\[.*\]|[a-z-]+\[.*\])$")


def _owner(model_cls: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel]:
    """The section class that holds the key at ``loc`` (nested sections followed down from ``model_cls``)."""
    cls: Any = model_cls
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field is not None else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:
            return cls
    return cls


def problems_from_validation_error(err: ValidationError, prefix: str, model_cls: type[BaseModel]) -> list[str]:
    """Turn pydantic's errors into ``"dotted.path: message"`` lines (messages of one path merged)."""
    by_path: dict[str, list[str]] = {}
    for item in err.errors(include_url=False):
        loc = list(item["loc"])
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            owner = _owner(model_cls, loc[:-1])
            known = [n for n, f in owner.model_fields.items() if not f.exclude]
            msg = f"unknown key, not defined in {owner.__name__}{did_you_mean(loc[-1] if loc else None, known)}"
        else:
            loc = [p for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p))]
            for lead in ("Value error, ", "Assertion failed, "):
                msg = msg.removeprefix(lead)
        path = ".".join([prefix] * bool(prefix) + [str(p) for p in loc]) or "config"
        messages = by_path.setdefault(path, [])
        if msg not in messages:
            messages.append(msg)
    return [f"{path}: {'; or: '.join(messages)}" for path, messages in by_path.items()]
