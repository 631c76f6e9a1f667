"""The README stays true where a test can tell cheaply: the tests it names exist, and its Layout lists every
module (the field table is tests/test_engine_checks.py's)."""

import ast
import re
from pathlib import Path

from tests.conftest import REPO

ROOT = Path(REPO)
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_every_test_the_readme_names_exists():
    named = set(re.findall(r"\b(test_\w+\.py)(?:::(test_\w+))?", README))
    assert named, "the README names its tests"
    missing = []
    for file, function in sorted(named):
        path = ROOT / "tests" / file
        if not path.is_file():
            missing.append(file)
        elif function:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if function not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
                missing.append(f"{file}::{function}")
    assert missing == []


def test_the_failure_table_names_a_test_on_every_row():
    table = README.split("## When things go wrong", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| what happens")]
    assert len(rows) >= 15
    assert [r for r in rows if not re.search(r"test_\w+\.py::test_\w+", r)] == []


def test_the_layout_lists_every_module():
    layout = README.split("## Layout", 1)[1]
    block = layout.split("```", 2)[1]
    modules = sorted(p for d in ("chatlearn", "flows") for p in (ROOT / d).rglob("*.py") if p.name != "__init__.py")
    assert modules
    assert [str(p.relative_to(ROOT)) for p in modules if p.name not in block] == []
