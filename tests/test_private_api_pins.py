"""What the rooms of Prefect's and Ray's internals rely on beyond the public API (`chatlearn/runtime/prefect/`,
`chatlearn/runtime/cluster/ray_private.py`), checked against what is installed, with no server and no Ray started:
the versions they were checked with are pyproject's pins and the installed ones, and each private function or
attribute in their `PRIVATE_USES` is there with the parameters they pass. A failure is one line naming the file
to port; `tests/test_layers.py` keeps such uses out of every other module."""

import importlib
import importlib.metadata
import inspect
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from chatlearn.runtime import prefect as prefect_room
from chatlearn.runtime.cluster import ray_private
from tests.conftest import REPO

ROWS = [*prefect_room.PRIVATE_USES, *ray_private.PRIVATE_USES]
VERIFIED = {**prefect_room.VERIFIED_WITH, **ray_private.VERIFIED_WITH}
TABLES = {"prefect": "chatlearn/runtime/prefect/__init__.py", "prefect-ray": "chatlearn/runtime/prefect/__init__.py",
          "ray": "chatlearn/runtime/cluster/ray_private.py"}
_DISTRIBUTION = {"prefect": "prefect", "prefect_ray": "prefect-ray", "ray": "ray"}


def distribution(uses: str) -> str:
    """The package a row's use belongs to (``logger prefect._internal``: prefect)."""
    return _DISTRIBUTION[uses.removeprefix("logger ").split(".")[0].split("(")[0]]


def pinned_in_pyproject(package: str) -> str | None:
    for dependency in tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(dependency)
        if req.name == package:
            exact = [s.version for s in req.specifier if s.operator == "=="]
            return exact[0] if exact else None
    return None


def resolve(dotted: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes. Raises LookupError naming
    the part that is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, name in enumerate(parts[i:], start=i):
            if not hasattr(obj, name):
                raise LookupError(f"{'.'.join(parts[:j])} has no {name}")
            obj = getattr(obj, name)
        return obj
    raise LookupError(f"{parts[0]} cannot be imported")


def _set_in_source(owner: Any, name: str) -> bool:
    """Whether ``name`` is assigned as an attribute (``x.name = ...``) in the source of ``owner``'s module, or of
    the module of a class in its MRO: an instance attribute that exists once an object is made."""
    classes = inspect.getmro(owner) if inspect.isclass(owner) else ()
    modules = [owner] if isinstance(owner, ModuleType) else [sys.modules[k.__module__] for k in classes]
    pattern = re.compile(rf"\.{re.escape(name)}\s*(?::[^=\n]+)?=(?!=)")
    for module in modules:
        try:
            if pattern.search(inspect.getsource(module)):
                return True
        except (OSError, TypeError):  # a built-in or compiled module: nothing to read
            continue
    return False


def _names(signature: inspect.Signature) -> list[str]:
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [prefix.get(p.kind, "") + p.name for p in signature.parameters.values()]


def problem(uses: str) -> str | None:
    """What is wrong with one row's use in what is installed; None when it is there as the room relies on it."""
    if uses.startswith("logger "):
        import prefect  # the logging configuration Prefect ships

        name = uses.removeprefix("logger ")
        config = yaml.safe_load((Path(prefect.__file__).parent / "logging" / "logging.yml").read_text())
        return None if name in config.get("loggers", {}) else f"Prefect's logging configuration has no logger {name}"
    target, _, params = uses.partition("(")
    owner_path, _, name = target.rpartition(".")
    try:
        owner = resolve(owner_path)
    except LookupError as exc:
        return str(exc)
    if not params:  # an attribute
        fields = getattr(owner, "model_fields", {}) if inspect.isclass(owner) else {}
        if hasattr(owner, name) or name in fields or _set_in_source(owner, name):
            return None
        return f"{owner_path} has no {name}"
    if not hasattr(owner, name):
        return f"{owner_path} has no {name}"
    fn = getattr(owner, name)
    try:  # a pydantic model (Prefect's contexts) is made from its fields
        have = list(fn.model_fields) if inspect.isclass(fn) and hasattr(fn, "model_fields") else \
            _names(inspect.signature(fn))
    except (TypeError, ValueError) as exc:
        return f"{target} has no signature to check ({exc})"
    expected = [p.strip() for p in params.removesuffix(")").split(",") if p.strip()]
    if "..." not in expected:
        return None if have == expected else f"{target} now takes ({', '.join(have)})"
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = ""
    missing = [p for p in expected if p != "..." and p not in have
               and not (any(h.startswith("**") for h in have) and re.search(rf"[\"']{re.escape(p)}[\"']", source))]
    return None if not missing else f"{target} takes no {', '.join(missing)} (it takes ({', '.join(have)}))"


@pytest.mark.parametrize("package", sorted(VERIFIED))
def test_the_installed_versions_are_the_ones_the_rooms_were_checked_with(package):
    installed = importlib.metadata.version(package)
    pinned = pinned_in_pyproject(package)
    files = sorted({file for uses, file in ROWS if distribution(uses) == package})
    checked = VERIFIED[package]
    if installed != checked or pinned != checked:
        what = (f"{package} {installed} is installed" if installed != checked
                else f"pyproject.toml pins {package} {pinned}")
        pytest.fail(f"{what}, not {checked} that the private API was checked with: port {', '.join(files)} (what "
                    f"they rely on: PRIVATE_USES in {TABLES[package]}), then set VERIFIED_WITH there", pytrace=False)


@pytest.mark.parametrize(("uses", "file"), ROWS, ids=[f"{u.split('(')[0]}@{Path(f).stem}" for u, f in ROWS])
def test_each_private_use_is_there_as_the_room_relies_on_it(uses, file):
    found = problem(uses)
    if found is not None:
        pytest.fail(f"{distribution(uses)} {importlib.metadata.version(distribution(uses))}: {found}: port {file} "
                    f"(uses {uses})", pytrace=False)


def test_every_room_file_named_exists_and_every_package_has_its_version():
    assert sorted({file for _, file in ROWS if not (Path(REPO) / file).is_file()}) == []
    assert sorted({distribution(uses) for uses, _ in ROWS}) == sorted(VERIFIED)


def test_the_check_sees_a_moved_private_use():
    # the checker itself, on a module that does not change: json.dumps(obj, *, skipkeys, ...)
    assert problem("json.dumps(obj, ...)") is None
    assert problem("json.dumps(obj, skipkeys, ...)") is None
    assert problem("json.dumps(obj)") == ("json.dumps now takes (obj, skipkeys, ensure_ascii, check_circular, "
                                          "allow_nan, cls, indent, separators, default, sort_keys, **kw)")
    assert problem("json.dumps(obj, _sorted, ...)").startswith("json.dumps takes no _sorted")
    assert problem("json._encode_basestring") == "json has no _encode_basestring"
    assert problem("json.decoder.no_such_module.x") == "json.decoder has no no_such_module"
    assert problem("json.JSONDecoder.parse_object") is None  # set in JSONDecoder.__init__: self.parse_object = ...
    assert problem("logger prefect._internal") is None
    assert problem("logger prefect._no_such_logger") == "Prefect's logging configuration has no logger " \
                                                        "prefect._no_such_logger"
