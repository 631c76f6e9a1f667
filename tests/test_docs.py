"""The documentation site builds strictly: no broken link, anchor or API reference, no docstring the API pages
cannot read, no page left out of the navigation (docs/mkdocs.yml's `validation`, every warning an error)."""

import importlib.util
import os
import subprocess
import sys

from tests.conftest import REPO

CONFIG = os.path.join(REPO, "docs", "mkdocs.yml")


def test_the_site_builds_strictly(tmp_path):
    missing = [m for m in ("mkdocs", "mkdocstrings_handlers.python", "material") if importlib.util.find_spec(m) is None]
    assert missing == [], "the docs extra is not installed (make setup installs it: pip install -e '.[docs]')"
    # NO_MKDOCS_2_WARNING: Material prints a banner about MkDocs 2 on every build, which is not about this site
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", CONFIG, "-d", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if not line.startswith("INFO"))
    for page in ("index.html", "architecture/index.html", "api/engines/index.html", "results/async.png"):
        assert (tmp_path / page).is_file(), page
    api = (tmp_path / "api" / "engines" / "index.html").read_text(encoding="utf-8")
    assert "set_parameter_sync" in api  # the API pages are read from the code's docstrings
