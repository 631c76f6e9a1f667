"""Objects named in configs as "package.module:name" (hooks, reward functions, module classes)."""

import importlib
from collections.abc import Callable
from typing import Any


def import_object(spec: str, what: str = "name") -> Any:
    """Import `spec`; the attribute path after the colon may be dotted. Errors name the spec.

    `what` only words the message for the kind of object expected ("function", "Class", ...).
    """
    parts = spec.split(":") if isinstance(spec, str) else []
    module_name, attr_path = (p.strip() for p in parts) if len(parts) == 2 else ("", "")
    if not module_name or not attr_path or any(not a for a in attr_path.split(".")):
        raise ValueError(f"{spec!r} must look like 'package.module:{what}': it is not of the form module:attribute")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"{spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as exc:
            raise ValueError(f"{spec!r}: {module_name!r} has no attribute {attr_path!r}") from exc
    return obj


def import_callable(spec: str, what: str = "function") -> Callable[..., Any]:
    """`import_object` for hooks and functions named in configs: the object must be callable."""
    obj = import_object(spec, what)
    if not callable(obj):
        raise ValueError(f"{spec!r} is a {type(obj).__name__}, not a callable")
    return obj
