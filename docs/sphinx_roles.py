"""Griffe extension: the docstrings' Sphinx roles (:class:`X`, :func:`~a.b`) read as code in the API pages.

The code's docstrings are plain prose with a Google-style ``Args:`` now and then, and name other objects the
Sphinx way; Markdown would print the role's name. This turns each role into a code span of its target (the
last part after ``~``, as Sphinx shows it), leaving the docstrings themselves as they are.
"""

import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")


def _shown(match: re.Match[str]) -> str:
    target = match.group(1)
    return f"`{target.rsplit('.', 1)[-1]}`" if match.group(0).count("`~") else f"`{target}`"


class SphinxRoles(Extension):
    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_shown, obj.docstring.value)
