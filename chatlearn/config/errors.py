"""How config problems are reported: one error listing every problem as ``"dotted.path: message"``."""

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["ConfigError", "ConfigWarning", "problems_from_validation_error"]


class ConfigError(ValueError):
    """Every problem found in a config, each as ``"dotted.path: message"``; ``str()`` lists one per line."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = list(dict.fromkeys(problems))
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        return "\n".join(self.problems)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the problem list when pickled (Ray / Prefect ship exceptions between processes).
        return (type(self), (self.problems,))


class ConfigWarning(UserWarning):
    """Config accepted but something deserves attention (unknown key, deprecated alias, a knob that only
    tunes speed and is not implemented yet)."""


# Union members add their type to an error's location ("data_path.str"): recognised so they can be dropped.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|tuple\[.*\]|[a-z-]+\[.*\])$")


def _owner_name(model_cls: type[BaseModel], loc: Sequence[Any]) -> str:
    cls: Any = model_cls
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        ann = field.annotation if field is not None else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:
            return cls.__name__
    return cls.__name__


def problems_from_validation_error(err: ValidationError, prefix: str, model_cls: type[BaseModel]) -> list[str]:
    """Turn pydantic's errors into ``"dotted.path: message"`` lines (messages of one path merged)."""
    by_path: dict[str, list[str]] = {}
    for item in err.errors(include_url=False):
        loc = list(item["loc"])
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = f"unknown key, not defined in {_owner_name(model_cls, loc[:-1])}"
        else:
            loc = [p for p in loc if not (isinstance(p, str) and _UNION_TAG.match(p))]
            for lead in ("Value error, ", "Assertion failed, "):
                msg = msg.removeprefix(lead)
        path = ".".join([prefix] * bool(prefix) + [str(p) for p in loc]) or "config"
        messages = by_path.setdefault(path, [])
        if msg not in messages:
            messages.append(msg)
    return [f"{path}: {'; or: '.join(messages)}" for path, messages in by_path.items()]
