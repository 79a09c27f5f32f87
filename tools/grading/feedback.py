"""Feedback for students (`nbgrader generate_feedback`): no hidden tests, math read offline.

Autograding puts each test cell's full source back, hidden tests included, and
`nbgrader generate_feedback` shows the autograded notebook as it is: the hidden tests, and
tracebacks that quote them. `HideHiddenTests` runs in GenerateFeedback (see
nbgrader_config.py) and, in every test cell:

* deletes the region between `### BEGIN HIDDEN TESTS` and `### END HIDDEN TESTS`;
* for an error output that quotes a hidden line, keeps the traceback of a failed visible test
  without the hidden lines IPython printed around it, and replaces anything else with
  "A hidden test failed: <ErrorName>".

nbgrader's feedback page loads MathJax from a CDN, so a student reading it offline sees raw
LaTeX. `MathToMathML` turns the markdown cells' `$...$` and `$$...$$` into MathML, which
browsers draw themselves, and the `scaling_lab_feedback` template (templates/) loads no script.

`hidden_lines`, `quotes_hidden` and `failed_statement` are the rules HideHiddenTests applies;
tools/grade.py (`make grade`, for self-learners) prints failures by the same rules.
"""

from __future__ import annotations

import re
from pathlib import Path

from latex2mathml.converter import convert
from nbconvert.exporters.exporter import ResourcesDict
from nbconvert.preprocessors import Preprocessor
from nbformat.notebooknode import NotebookNode
from nbgrader import utils
from nbgrader.preprocessors import ClearHiddenTests
from traitlets import Bool, List

__all__ = [
    "FEEDBACK_TEMPLATE", "TEMPLATES", "HideHiddenTests", "MathToMathML", "failed_statement",
    "hidden_lines", "markdown_with_mathml", "quotes_hidden",
]

# The feedback template's folder: GenerateFeedback's HTMLExporter looks here first.
TEMPLATES = Path(__file__).resolve().parent / "templates"
FEEDBACK_TEMPLATE = "scaling_lab_feedback"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# IPython marks the line each frame was executing with an arrow: "----> 7 assert x == 1".
_EXECUTING_LINE = re.compile(r"^\s*-+>\s*\d+\s?(.*)$")


class HideHiddenTests(ClearHiddenTests):
    """Remove hidden tests from autograded test cells, and error output quoting any of them
    from every cell: a helper defined in one cell's hidden tests may fail in another's."""

    # The feedback's HTML exporter configures this (unused) trait for every preprocessor;
    # declared configurable, as nbgrader's own GetGrades does, so traitlets doesn't warn.
    display_data_priority = List().tag(config=True)

    def preprocess(self, nb: NotebookNode, resources: ResourcesDict
                   ) -> tuple[NotebookNode, ResourcesDict]:
        self._notebook_hidden = [line for cell in nb.cells if utils.is_grade(cell)
                                 for line in self._hidden_lines(cell.source)]
        return super().preprocess(nb, resources)

    def preprocess_cell(
        self, cell: NotebookNode, resources: ResourcesDict, cell_index: int
    ) -> tuple[NotebookNode, ResourcesDict]:
        own = self._hidden_lines(cell.source) if utils.is_grade(cell) else []
        hidden = [*own, *getattr(self, "_notebook_hidden", [])]
        if utils.is_grade(cell):
            self._remove_hidden_test_region(cell)
        if hidden and cell.cell_type == "code":
            cell.outputs = [_redact(output, hidden) for output in cell.outputs]
        return cell, resources

    def _hidden_lines(self, source: str) -> list[str]:
        return hidden_lines(source, self.begin_test_delimeter, self.end_test_delimeter)


def hidden_lines(
    source: str,
    begin: str = ClearHiddenTests.begin_test_delimeter.default_value,
    end: str = ClearHiddenTests.end_test_delimeter.default_value,
) -> list[str]:
    """A test cell's hidden region's lines, delimiters included, that could give anything
    away (stripped). Text that contains one of them quotes the hidden tests."""
    lines, inside = [], False
    for line in source.splitlines():
        if begin in line:
            inside = True
        if inside and any(char.isalnum() for char in line):  # skip lines like ")"
            lines.append(line.strip())
        if end in line:
            inside = False
    return lines


def quotes_hidden(text: str, hidden: list[str]) -> bool:
    """Whether `text` quotes one of the `hidden_lines`."""
    return any(line in text for line in hidden)


def failed_statement(output: NotebookNode) -> str | None:
    """The statement of the test cell that raised an error output: IPython's first arrow in
    the traceback, which is in the cell's own frame; None if the traceback shows none."""
    lines = _ANSI.sub("", "\n".join(output.traceback)).splitlines()
    return next((m[1] for m in map(_EXECUTING_LINE.match, lines) if m), None)


def _redact(output: NotebookNode, hidden: list[str]) -> NotebookNode:
    if output.output_type != "error":
        return output
    lines = _ANSI.sub("", "\n".join(output.traceback)).splitlines()
    if not quotes_hidden("\n".join(lines), hidden) and not quotes_hidden(output.evalue, hidden):
        return output
    failed = failed_statement(output)
    if failed is not None and not quotes_hidden(failed, hidden):
        output.traceback = [line for line in lines if not quotes_hidden(line, hidden)]
        return output
    # The assert's message says what was expected without the hidden inputs (every hidden
    # assert has one, tests/test_assert_messages.py); it stays unless it quotes them.
    message = "" if quotes_hidden(output.evalue, hidden) else output.evalue
    return NotebookNode(
        output_type="error",
        ename=output.ename,
        evalue=message,
        traceback=[f"A hidden test failed: {output.ename}" + (f": {message}" if message else "")],
    )


# Code is left as written: fenced blocks and `inline code` may hold dollar signs.
_CODE = re.compile(r"(^```.*?^```|^~~~.*?^~~~|`[^`\n]*`)", re.M | re.S)
# $$display$$, then $inline$ (pandoc's rule: no space just inside the dollars, no digit after).
_MATH = re.compile(
    r"\$\$(?P<display>.+?)\$\$|(?<![\\$])\$(?P<inline>[^\s$](?:[^$]*?[^\s\\$])?)\$(?!\d)", re.S
)
_XMLNS = re.compile(r' xmlns="[^"]*"')  # HTML5 knows <math> without a namespace


class MathToMathML(Preprocessor):
    """Replace the LaTeX in markdown cells with MathML, so feedback renders math offline."""

    enabled = Bool(True, help="nbconvert's preprocessors are off unless enabled").tag(config=True)

    def preprocess_cell(
        self, cell: NotebookNode, resources: ResourcesDict, cell_index: int
    ) -> tuple[NotebookNode, ResourcesDict]:
        if cell.cell_type == "markdown":
            cell.source = markdown_with_mathml(cell.source)
        return cell, resources


def markdown_with_mathml(markdown: str) -> str:
    """`markdown` with every `$...$` and `$$...$$` outside code as inline MathML."""
    parts = _CODE.split(markdown)
    # split() with one group alternates text and code: the odd parts are code.
    return "".join(part if index % 2 else _MATH.sub(_to_mathml, part)
                   for index, part in enumerate(parts))


def _to_mathml(match: re.Match[str]) -> str:
    display = match["display"] is not None
    latex = match["display"] if display else match["inline"]
    return _XMLNS.sub("", convert(latex.strip(), display="block" if display else "inline"))
