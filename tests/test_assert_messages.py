"""Every visible assert in a lab's test cells tells the student what was expected and got.

A bare `assert x == 3` fails with only `AssertionError:`; the course's rule is that every visible
assert carries a message. Hidden tests are exempt: feedback never shows them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(REPO.glob("solutions/*/*.ipynb"))
HIDDEN = re.compile(
    r"^[ \t]*### BEGIN HIDDEN TESTS.*?^[ \t]*### END HIDDEN TESTS[^\n]*", re.M | re.S
)
IPYTHON_LINE = re.compile(r"^[ \t]*[%!].*$", re.M)  # magics and shell escapes are not Python


def visible_source(source: str) -> str:
    """The test cell as students see it: hidden tests blanked, line numbers kept."""
    blank = HIDDEN.sub(lambda region: "\n" * region[0].count("\n"), source)
    return IPYTHON_LINE.sub("", blank)


def asserts_without_message(source: str) -> list[str]:
    tree = ast.parse(visible_source(source))
    return [
        f"line {node.lineno}: {ast.get_source_segment(visible_source(source), node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Assert) and node.msg is None
    ]


def test_visible_source_drops_only_hidden_tests() -> None:
    source = "\n".join(
        ["assert a == 1, a", "### BEGIN HIDDEN TESTS", "assert b == 2", "### END HIDDEN TESTS",
         "assert c"]
    )
    assert asserts_without_message(source) == ["line 5: assert c"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.parent.name)
def test_every_visible_assert_has_a_message(notebook: Path) -> None:
    missing = []
    for cell in nbformat.read(notebook, as_version=nbformat.NO_CONVERT).cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade"):
            found = asserts_without_message(cell.source)
            missing += [f"{meta['grade_id']} {line}" for line in found]
    assert not missing, (
        f"{notebook.relative_to(REPO)}: give these asserts a message saying what was expected and "
        "what was got:\n" + "\n".join(missing)
    )
