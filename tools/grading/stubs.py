"""The student's stub of an exercise says which exercise it is and how to go on past it.

nbgrader's ClearSolutions replaces each solution with `raise NotImplementedError()`. Run All then
stops at the first check that calls an unwritten exercise with a bare NotImplementedError, and a
newcomer is left at the top of the notebook without knowing which exercise is missing or how to
see the demos below it. `name_unwritten_exercises(ClearSolutions)` makes ClearSolutions also
give each stub a message (so nbgrader's checksums are of the named stub): the exercise's
heading, its cell, and how to run the cells below it.
"""

from __future__ import annotations

import re

from nbconvert.preprocessors import Preprocessor

__all__ = ["NameUnwrittenExercises", "name_unwritten_exercises", "plain", "stub_message"]

BARE_STUB = "raise NotImplementedError()"


def plain(heading: str) -> str:
    """A heading as the stub's text shows it: its LaTeX as the letters it typesets
    ("$\\bar g$" as "ḡ"), since a Python string in a code cell is not rendered."""
    heading = re.sub(r"\\bar\s*\{?(\w)\}?", "\\1\u0304", heading)
    return re.sub(r"\\[a-zA-Z]+\s*", "", heading).replace("$", "")


def stub_message(heading: str, grade_id: str) -> str:
    """What an unwritten exercise's (or question's) stub says."""
    question = grade_id.startswith(("answer-", "prediction-"))
    what, yours = ("the answer to the question", "answer") if question else ("the exercise", "code")
    return (f"{what} under '{plain(heading)}' (cell {grade_id}) is not written yet: "
            f"write your {yours} in place of this raise. Run All stops at the first check that "
            "calls an unwritten exercise; to run the cells below it anyway, click the next cell "
            "and choose Run > Run Selected Cell and All Below.")


def _stub(indent: str, message: str, width: int = 88) -> str:
    """`raise NotImplementedError(message)`, its message split over lines of at most `width`."""
    words, lines, line = message.split(" "), [], ""
    for word in words:
        if line and len(indent) + 8 + len(line) + len(word) > width:
            lines.append(line)
            line = ""
        line += word + " "
    lines.append(line.rstrip())
    body = "\n".join(f"{indent}    {chunk!r}" for chunk in lines)
    return f"{indent}raise NotImplementedError(\n{body})"


class NameUnwrittenExercises(Preprocessor):
    """Give every `raise NotImplementedError()` stub in a solution cell the message of
    `stub_message`, naming the exercise by the last heading above its cell."""

    def preprocess(self, nb, resources):
        heading = "This exercise"
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                titles = re.findall(r"^#+\s*(.+?)\s*$", cell.source, flags=re.M)
                heading = titles[-1] if titles else heading
                continue
            grading = cell.metadata.get("nbgrader", {})
            if cell.cell_type == "code" and grading.get("solution") and BARE_STUB in cell.source:
                message = stub_message(heading, grading.get("grade_id", "?"))
                cell.source = re.sub(rf"^([ \t]*){re.escape(BARE_STUB)}",
                                     lambda match, message=message: _stub(match[1], message),
                                     cell.source, flags=re.M)
        return nb, resources


def name_unwritten_exercises(clear_solutions: type) -> None:
    """Make nbgrader's ClearSolutions name each stub it writes (once, however often the course's
    config is loaded)."""
    clear = clear_solutions.preprocess
    if getattr(clear, "names_exercises", False):
        return

    def clear_and_name(self, nb, resources):
        nb, resources = clear(self, nb, resources)
        return NameUnwrittenExercises().preprocess(nb, resources)

    clear_and_name.names_exercises = True
    clear_solutions.preprocess = clear_and_name
