"""Objects named in configs (hooks, reward functions, module classes): ``package.module:name`` or the file form
``path/to/file.py:name``.

A name that is not an installed module is looked up as a file or package in the user's code folders: the
current directory, then the folders in ``CHATLEARN_CODE_PATH`` (the config file's folder and the folders of
file-form hooks; the run sets it for itself and for its Ray workers, see `chatlearn.config.user_code`). So a
``myreward.py`` next to the config or the command works without ``PYTHONPATH``, as it would with
``python -m``. The folder found is appended to ``sys.path`` (an installed module of the same name wins), so the
file's own imports of its neighbours work too. A file-form hook is imported under its file name (``myreward``),
so objects defined there pickle by reference to the Ray workers, which have the same folders on their path.
"""

import importlib
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from chatlearn.utils.errors import did_you_mean

CODE_PATH_VAR = "CHATLEARN_CODE_PATH"


def code_dirs() -> list[str]:
    """Where user code is looked up besides the installed packages, in order: the current directory, then
    ``CHATLEARN_CODE_PATH``."""
    dirs = [os.getcwd(), *os.environ.get(CODE_PATH_VAR, "").split(os.pathsep)]
    return list(dict.fromkeys(os.path.abspath(d) for d in dirs if d))


def code_dirs_on_path() -> None:
    """Append the code folders to ``sys.path`` (after the installed packages): the Ray workers' setup hook, so
    objects of the user's modules (a module class given by ``args_dict.module``) unpickle there by reference."""
    for folder in code_dirs():
        _on_path(folder)


def is_file_form(module_part: str) -> bool:
    """``path/to/file.py`` (verl's ``custom_reward_function.path``) rather than a dotted module name."""
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def _looked_in(dirs: list[str]) -> str:
    cwd = os.path.abspath(os.getcwd())
    return ", ".join(f"{d} (the current directory)" if d == cwd else d for d in dirs)


def _on_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.append(folder)
        importlib.invalidate_caches()


def module_source(top: str, dirs: list[str]) -> str | None:
    """The file ``top.py`` or package folder ``top/`` in the first of ``dirs`` holding one, else None."""
    for folder in dirs:
        for candidate in (os.path.join(folder, f"{top}.py"), os.path.join(folder, top)):
            if os.path.isfile(candidate) or os.path.isdir(candidate):
                return candidate
    return None


def file_source(path: str, dirs: list[str]) -> str | None:
    """The file ``path`` (absolute, or relative to the first of ``dirs`` holding it), else None."""
    candidates = [path] if os.path.isabs(path) else [os.path.join(d, path) for d in dirs]
    return next((os.path.abspath(c) for c in candidates if os.path.isfile(c)), None)


def _import_module(name: str) -> ModuleType:
    """``name`` from the installed packages, else from the first code folder holding it (``top.py`` or ``top/``)."""
    top = name.split(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != top:  # something the module itself imports is missing: that is its error to report
            raise
    dirs = code_dirs()
    found = module_source(top, dirs)
    if found is not None:
        _on_path(os.path.dirname(found))
        return importlib.import_module(name)
    raise ModuleNotFoundError(f"no module named {top!r}: not installed, and no {top}.py or {top}/ in "
                              f"{_looked_in(dirs)}", name=top)


def _import_file(path: str) -> ModuleType:
    """The module of the file ``path`` (absolute, or relative to a code folder), imported as its file name."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if not stem.isidentifier():
        raise ModuleNotFoundError(f"{os.path.basename(path)!r} is not a Python module name (letters, digits, _)")
    dirs = code_dirs()
    found = file_source(path, dirs)
    if found is None:
        if stem in sys.modules or importlib.util.find_spec(stem) is not None:
            return importlib.import_module(stem)  # shipped to this Ray worker (runtime_env py_modules)
        raise ModuleNotFoundError(f"no file {path}" + ("" if os.path.isabs(path) else
                                                        f" in {_looked_in(dirs)}"), name=stem)
    loaded = sys.modules.get(stem)
    if loaded is None:
        spec = importlib.util.find_spec(stem)
        if spec is None or spec.origin is None or os.path.abspath(spec.origin) == found:
            _on_path(os.path.dirname(found))
            return importlib.import_module(stem)
        where = spec.origin
    else:
        where = getattr(loaded, "__file__", None) or "built in"
        if where != "built in" and os.path.abspath(where) == found:
            return loaded
    raise ModuleNotFoundError(f"{found} would be imported as module {stem!r}, but another module of that name "
                              f"is importable ({where}); rename the file", name=stem)


def import_object(spec: str, what: str = "name") -> Any:
    """Import `spec`; the attribute path after the colon may be dotted. Errors name the spec and, for code not
    found, where it was looked for.

    `what` only words the message for the kind of object expected ("function", "Class", ...).
    """
    parts = spec.rsplit(":", 1) if isinstance(spec, str) else []
    module_part, attr_path = (p.strip() for p in parts) if len(parts) == 2 else ("", "")
    if not module_part or not attr_path or any(not a for a in attr_path.split(".")) or ":" in module_part:
        raise ValueError(f"{spec!r} must look like 'package.module:{what}' or 'path/to/file.py:{what}': it is not "
                         "of the form module:attribute")
    try:
        obj: Any = _import_file(module_part) if is_file_form(module_part) else _import_module(module_part)
    except Exception as exc:
        hint = _sibling_hint(module_part) if isinstance(exc, ModuleNotFoundError) and exc.name == module_part else ""
        raise ValueError(f"{spec!r}: cannot import module {module_part!r}: {exc}{hint}") from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as exc:
            public = [a for a in dir(obj) if not a.startswith("_")]
            raise ValueError(f"{spec!r}: {module_part!r} has no attribute {attr_path!r}"
                             f"{did_you_mean(attr, public)}") from exc
    return obj


def _sibling_hint(name: str) -> str:
    """``"; did you mean package.other?"`` for a dotted module not found, from the modules of its package."""
    parent, _, last = name.rpartition(".")
    try:
        package = importlib.import_module(parent) if parent else None
    except Exception:  # noqa: BLE001 - only a hint: the error being reported is the missing module
        return ""
    paths = getattr(package, "__path__", None)
    if paths is None:
        return ""
    hint = did_you_mean(last, [m.name for m in pkgutil.iter_modules(paths)])
    return hint.replace(" mean ", f" mean {parent}.", 1) if hint else ""


def import_callable(spec: str, what: str = "function") -> Callable[..., Any]:
    """`import_object` for hooks and functions named in configs: the object must be callable."""
    obj = import_object(spec, what)
    if not callable(obj):
        raise ValueError(f"{spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def import_class(spec: str, methods: tuple[str, ...], kind: str) -> type:
    """`import_object` for a class named in a config that must have ``methods`` (e.g. an environment's ``reset``
    and ``step``). Import errors are ValueErrors as `import_object`'s; an object that is no such class is a
    TypeError naming the spec, ``kind`` (e.g. "an environment class") and what it lacks."""
    obj = import_object(spec, "Class")
    needs = " and ".join(f"{m}()" for m in methods)
    if not isinstance(obj, type):
        raise TypeError(f"{spec} is not {kind} ({needs}): it is a {type(obj).__name__}")
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(f"{spec} is not {kind} ({needs}): it has no {' and no '.join(missing)} method")
    return obj
