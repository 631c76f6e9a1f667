"""The README and the docs stay true where a test can tell cheaply: the tests they name exist, the README's links
reach the docs, the architecture page's Layout lists every module, every row of the failure table names its test,
and the configuration page holds the field table the code makes. (tests/test_docs.py builds the site strictly:
the links and references between the pages.)"""

import ast
import re
from pathlib import Path

import pytest

from chatlearn.config.support import markdown_table
from tests.conftest import REPO

ROOT = Path(REPO)
PAGES = ROOT / "docs" / "pages"
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in sorted(PAGES.rglob("*.md"))}
TEXTS = {"README.md": README, **DOCS}


def _page(name: str) -> str:
    return DOCS[f"docs/pages/{name}"]


def _section(text: str, heading: str) -> str:
    """The text under a `## heading` up to the next heading of its level or above."""
    assert f"\n{heading}\n" in text, f"no {heading!r}"
    return re.split(r"\n#{1,2} ", text.split(f"\n{heading}\n", 1)[1], maxsplit=1)[0]


def test_the_docs_have_their_pages():
    assert {"index.md", "configuration.md", "faults.md", "architecture.md", "performance.md"} <= {
        Path(p).name for p in DOCS}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_every_test_a_page_names_exists(name):
    named = set(re.findall(r"\b(test_\w+\.py)(?:::(test_\w+))?", TEXTS[name]))
    missing = []
    for file, function in sorted(named):
        path = ROOT / "tests" / file
        if not path.is_file():
            missing.append(file)
        elif function:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if function not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
                missing.append(f"{file}::{function}")
    assert missing == [], f"{name} names tests that do not exist"


def test_the_readme_and_the_docs_name_their_tests():
    assert re.search(r"test_\w+\.py", README), "the README names its tests"
    assert any(re.search(r"test_\w+\.py::test_\w+", text) for text in DOCS.values()), "the docs name their tests"


def test_the_readme_stays_a_first_page_and_its_links_reach_their_files():
    assert len(README.splitlines()) <= 300, "the README is the newcomer's first page: the rest goes to docs/pages"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/pages/") for link in local), "the README points at the docs"
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_failure_table_names_a_test_on_every_row():
    table = _page("faults.md").split("| what happens |", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) >= 15
    assert [r for r in rows if not re.search(r"test_\w+\.py::test_\w+", r)] == []


def test_the_layout_lists_every_module():
    block = _section(_page("architecture.md"), "## Layout").split("```", 2)[1]
    modules = sorted(p for d in ("chatlearn", "flows") for p in (ROOT / d).rglob("*.py") if p.name != "__init__.py")
    assert modules
    assert [str(p.relative_to(ROOT)) for p in modules if p.name not in block] == []


def test_the_configuration_page_has_the_field_table():
    assert markdown_table() in _section(_page("configuration.md"), "## What every field does here")
