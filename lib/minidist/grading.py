"""Keep hidden tests out of the feedback that students get back.

Autograding puts each test cell's full source back, hidden tests included, and
`nbgrader generate_feedback` shows the autograded notebook as it is: the hidden tests, and
tracebacks that quote them. `HideHiddenTests` runs in GenerateFeedback (see
nbgrader_config.py) and, in every test cell:

* deletes the region between `### BEGIN HIDDEN TESTS` and `### END HIDDEN TESTS`;
* for an error output that quotes a hidden line, keeps the traceback of a failed visible test
  without the hidden lines IPython printed around it, and replaces anything else with
  "A hidden test failed: <ErrorName>".
"""

from __future__ import annotations

import re

from nbconvert.exporters.exporter import ResourcesDict
from nbformat.notebooknode import NotebookNode
from nbgrader import utils
from nbgrader.preprocessors import ClearHiddenTests
from traitlets import List

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# IPython marks the line each frame was executing with an arrow: "----> 7 assert x == 1".
_EXECUTING_LINE = re.compile(r"^\s*-+>\s*\d+\s?(.*)$")


class HideHiddenTests(ClearHiddenTests):
    """Remove hidden tests, and error output quoting them, from autograded test cells."""

    # The feedback's HTML exporter configures this (unused) trait for every preprocessor;
    # declared configurable, as nbgrader's own GetGrades does, so traitlets doesn't warn.
    display_data_priority = List().tag(config=True)

    def preprocess_cell(
        self, cell: NotebookNode, resources: ResourcesDict, cell_index: int
    ) -> tuple[NotebookNode, ResourcesDict]:
        if not utils.is_grade(cell):
            return cell, resources
        hidden = self._hidden_lines(cell.source)
        self._remove_hidden_test_region(cell)
        if hidden and cell.cell_type == "code":
            cell.outputs = [_redact(output, hidden) for output in cell.outputs]
        return cell, resources

    def _hidden_lines(self, source: str) -> list[str]:
        """The hidden region's lines, delimiters included, that could give anything away."""
        lines, inside = [], False
        for line in source.splitlines():
            if self.begin_test_delimeter in line:
                inside = True
            if inside and any(char.isalnum() for char in line):  # skip lines like ")"
                lines.append(line.strip())
            if self.end_test_delimeter in line:
                inside = False
        return lines


def _redact(output: NotebookNode, hidden: list[str]) -> NotebookNode:
    if output.output_type != "error":
        return output

    def quotes_hidden(text: str) -> bool:
        return any(line in text for line in hidden)

    lines = _ANSI.sub("", "\n".join(output.traceback)).splitlines()
    if not quotes_hidden("\n".join(lines)) and not quotes_hidden(output.evalue):
        return output
    # The first arrow is in the test cell's own frame: the test statement that failed.
    failed = next((m[1] for m in map(_EXECUTING_LINE.match, lines) if m), None)
    if failed is not None and not quotes_hidden(failed):
        output.traceback = [line for line in lines if not quotes_hidden(line)]
        return output
    return NotebookNode(
        output_type="error",
        ename=output.ename,
        evalue="",
        traceback=[f"A hidden test failed: {output.ename}"],
    )
