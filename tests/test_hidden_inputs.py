"""Hidden tests use inputs the notebook never showed (issue 38): a static check over every
solution notebook, no notebook runs.

A hidden block *checks an implementation* when, outside its asserts, it calls a function or
class the notebook defines at top level elsewhere (the student's exercise, or a checking helper
of the lab). Quizzes and
predictions, whose hidden blocks compare a value, are not about inputs and are left out.

Such a block must build at least one **input the student notebook never shows**: an *input
expression* (a call, dict, list or tuple with a number in it, or a call of a notebook function)
that appears nowhere in the student's release of the lab (compared as Python writes the
expression back, `ast.unparse`, and as text, whitespace aside); asserts and their messages are
left out. A block whose inputs are drawn per submission (seeded from the student's own code,
`zlib.crc32(f.__code__.co_code)`) passes as it is.

What this catches: a hidden test that repeats the visible test's call (`check_zero1(2, 5)`), or
that only reads results the notebook computed, which a precomputed table or a formula fitted to
the notebook's values would pass. What it cannot see: whether the new input differs in a way that
matters (a new size that keeps a split dimension at 1); the hidden tests' own comments say what
each new input is for, and the fakes in tests/fakes/ are the runtime check.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LABS = sorted(path.parent.name for path in (REPO / "solutions").glob("[0-9][0-9]_*/*.ipynb"))
HIDDEN = ("BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
SEEDED_PER_SUBMISSION = "zlib.crc32("


def cell_source(cell: dict) -> str:
    source = cell["source"]
    return "".join(source) if isinstance(source, list) else source


def without_magics(source: str) -> str:
    return "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))


def split_hidden(source: str) -> tuple[str, str]:
    """(the hidden block, the rest of the cell)."""
    hidden, rest, inside = [], [], False
    for line in source.splitlines():
        if HIDDEN[0] in line or HIDDEN[1] in line:
            inside = HIDDEN[0] in line
            continue
        (hidden if inside else rest).append(line)
    return "\n".join(hidden), "\n".join(rest)


def squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def has_number(node: ast.AST) -> bool:
    parts = ([*node.args, *(k.value for k in node.keywords)] if isinstance(node, ast.Call)
             else [*node.keys, *node.values] if isinstance(node, ast.Dict) else node.elts)
    return any(isinstance(part, ast.Constant) and isinstance(part.value, (int, float))
               and not isinstance(part.value, bool) for part in parts if part is not None)


def called_name(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else None


def outside_asserts(block: ast.Module) -> list[ast.AST]:
    asserts = {id(node) for statement in ast.walk(block) if isinstance(statement, ast.Assert)
               for node in ast.walk(statement)}
    return [node for node in ast.walk(block) if id(node) not in asserts]


def calls_outside_asserts(block: ast.Module) -> set[str | None]:
    return {called_name(node) for node in outside_asserts(block) if isinstance(node, ast.Call)}


def defined_in(block: ast.Module) -> set[str]:
    return {node.name for node in block.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def input_expressions(block: ast.Module, notebook_names: set[str]) -> list[str]:
    """The text of every input expression of a hidden block, asserts left out."""
    found = []
    for node in outside_asserts(block):
        if not isinstance(node, (ast.Call, ast.Dict, ast.List, ast.Tuple)):
            continue
        if has_number(node) or (isinstance(node, ast.Call) and called_name(node) in notebook_names):
            found.append(ast.unparse(node))
    return found


def code_cells(folder: str, lab: str) -> list[dict]:
    """The code cells of `folder`/`lab`/`lab`.ipynb (folder: "solutions" or "labs")."""
    notebook = json.loads((REPO / folder / lab / f"{lab}.ipynb").read_text())
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def parsed(source: str) -> ast.Module | None:
    """A cell's source, magics left out, as Python; None if it does not parse."""
    try:
        return ast.parse(without_magics(source))
    except SyntaxError:
        return None


def notebook_names(lab: str) -> set[str]:
    """Functions and classes the solution notebook defines at top level (hidden blocks too)."""
    names = set()
    for cell in code_cells("solutions", lab):
        tree = parsed(cell_source(cell).replace(f"### {HIDDEN[0]}", "")
                      .replace(f"### {HIDDEN[1]}", ""))
        names |= {node.name for node in (tree.body if tree else [])
                  if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    return names


def released_shown(lab: str) -> tuple[set[str], str]:
    """What a student's copy of the lab shows: every expression of its code, as the hidden
    blocks' are written out (`ast.unparse`), and all of its text; both squeezed."""
    notebook = json.loads((REPO / "labs" / lab / f"{lab}.ipynb").read_text())
    expressions = set()
    for cell in code_cells("labs", lab):
        tree = parsed(cell_source(cell))
        expressions |= {squeezed(ast.unparse(node)) for node in ast.walk(tree or ast.Module([], []))
                        if isinstance(node, ast.expr)}
    return expressions, squeezed("\n".join(cell_source(cell) for cell in notebook["cells"]))


def is_shown(text: str, shown: tuple[set[str], str]) -> bool:
    expressions, all_text = shown
    return squeezed(text) in expressions or squeezed(text) in all_text


def implementation_checks(lab: str) -> list[tuple[str, str, str]]:
    """(grade id, hidden block, the rest of the cell) of each hidden block that checks an
    implementation."""
    names = notebook_names(lab)
    found = []
    for cell in code_cells("solutions", lab):
        if HIDDEN[0] in cell_source(cell):
            hidden, rest = split_hidden(cell_source(cell))
            block = ast.parse(without_magics(hidden))
            if calls_outside_asserts(block) & (names - defined_in(block)):
                found.append((cell["metadata"].get("nbgrader", {}).get("grade_id", "?"),
                              hidden, rest))
    return found


def only_shown_inputs(source: str, names: set[str], shown: tuple[set[str], str]) -> list[str]:
    """The block's inputs when every one of them is shown in the student notebook, else []."""
    if SEEDED_PER_SUBMISSION in source:
        return []
    inputs = input_expressions(ast.parse(without_magics(source)), names)
    return (inputs or ["no input expression at all"]) if all(
        is_shown(text, shown) for text in inputs) else []


@pytest.mark.parametrize("lab", LABS)
def test_every_implementation_check_uses_an_input_the_notebook_never_showed(lab: str) -> None:
    names, shown = notebook_names(lab), released_shown(lab)
    checks = implementation_checks(lab)
    only_seen = [f"{grade_id}: every input is in the student notebook: {inputs[:4]}"
                 for grade_id, hidden, _ in checks
                 if (inputs := only_shown_inputs(hidden, names, shown))]
    assert not only_seen, (
        f"solutions/{lab}: hidden tests that only use inputs the notebook shows (give each one "
        f"a size, shape, world size, group layout or parameter the notebook never uses):\n  "
        + "\n  ".join(only_seen))
    assert checks or lab == "02_memory_math", (
        f"solutions/{lab}: no hidden test calls a function the notebook defines; expected at "
        f"least one implementation check")


@pytest.mark.parametrize("lab", LABS)
def test_the_check_refuses_a_hidden_block_that_repeats_the_visible_one(lab: str) -> None:
    """The check is not vacuous: each cell's visible tests, put in place of its hidden block,
    fail it (they are in the student notebook by definition)."""
    names, shown = notebook_names(lab), released_shown(lab)
    passed = [grade_id for grade_id, _, visible in implementation_checks(lab)
              if not only_shown_inputs(visible, names, shown)]
    assert not passed, (f"solutions/{lab}: the visible tests of {passed} pass the unseen-input "
                        f"check although the student notebook shows them")
