"""Every assert in a lab's test cells says what was expected and what was got.

A bare `assert x == 3` fails with only `AssertionError:`; the course's rule is that every assert
carries a message. In the hidden tests too: the instructor reads it in the autograded notebook,
and it must be a sentence (a string or an f-string), not a tuple or a bare value, so that it says
what was wrong without printing the hidden test's code or inputs.
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


def hidden_asserts_without_message(source: str) -> list[str]:
    """Asserts inside the hidden tests whose message is missing or is not a string."""
    code = IPYTHON_LINE.sub("", source)
    hidden_lines = {
        code.count("\n", 0, region.start()) + 1 + k
        for region in HIDDEN.finditer(code) for k in range(region[0].count("\n") + 1)
    }
    return [
        f"line {node.lineno}: {ast.get_source_segment(code, node)}"
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Assert) and node.lineno in hidden_lines
        and not (isinstance(node.msg, ast.JoinedStr)
                 or (isinstance(node.msg, ast.Constant) and isinstance(node.msg.value, str)))
    ]


def test_hidden_asserts_are_found() -> None:
    source = "\n".join(
        ["assert a == 1, a", "### BEGIN HIDDEN TESTS", "assert b == 2", "assert c, (c, 1)",
         'assert d, f"d: {d}"', "### END HIDDEN TESTS", "assert e"]
    )
    assert hidden_asserts_without_message(source) == ["line 3: assert b == 2",
                                                      "line 4: assert c, (c, 1)"]


def test_visible_source_drops_only_hidden_tests() -> None:
    source = "\n".join(
        ["assert a == 1, a", "### BEGIN HIDDEN TESTS", "assert b == 2", "### END HIDDEN TESTS",
         "assert c"]
    )
    assert asserts_without_message(source) == ["line 5: assert c"]


def graded_asserts_without_message(notebook: Path, find) -> list[str]:
    """`find`'s asserts without a message in every graded cell of `notebook`."""
    missing = []
    for cell in nbformat.read(notebook, as_version=nbformat.NO_CONVERT).cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade"):
            missing += [f"{meta['grade_id']} {line}" for line in find(cell.source)]
    return missing


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.parent.name)
def test_every_visible_assert_has_a_message(notebook: Path) -> None:
    missing = graded_asserts_without_message(notebook, asserts_without_message)
    assert not missing, (
        f"{notebook.relative_to(REPO)}: give these asserts a message saying what was expected and "
        "what was got:\n" + "\n".join(missing)
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.parent.name)
def test_every_hidden_assert_has_a_message(notebook: Path) -> None:
    missing = graded_asserts_without_message(notebook, hidden_asserts_without_message)
    assert not missing, (
        f"{notebook.relative_to(REPO)}: give these hidden asserts a message (a string or an "
        "f-string) saying what was expected and what was got, without the hidden inputs:\n"
        + "\n".join(missing)
    )
