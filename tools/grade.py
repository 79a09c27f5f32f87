"""Grade your own copy of a lab, as a graded class's autograde would (`make grade LAB=03`).

    python tools/grade.py 03                grade my-labs/03_data_parallel/, hidden tests included
    python tools/grade.py 03_data_parallel  the same
    python tools/grade.py --check-lab 03    only check that 03 names a lab (stdlib only: make
                                            runs it before installing anything)

In this repository (solutions/, nbgrader_config.py and tools/grading/ present) it grades the
way the instructor guide's autograde does (solutions/README.md), in a scratch course in a
temporary folder: the course's nbgrader_config.py, tools/ and solutions/<lab>, then
`nbgrader generate_assignment` and `nbgrader autograde` of the learner's lab folder as a
submission. It prints each graded cell's points from the scratch gradebook and, for a failed
cell, the error's type and message, never a line of the hidden tests (tools/grading/feedback.py's
rules). In the student release, which has no hidden tests, it runs the notebook's visible
tests in a scratch copy instead and says so. Either way my-labs/ is only read.

Exit status: 0 when grading ran, whatever the score; 1 when it could not run (no such lab, no
copy in my-labs/, nbgrader failed); 2 for a usage error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from my_labs import COURSE, IGNORED, MINE, ROOT, labs

if TYPE_CHECKING:  # the course's packages are imported only once grading starts
    from nbformat import NotebookNode

__all__ = ["CELL_TIMEOUT_S", "CellResult", "grade", "main", "resolve_lab"]

STUDENT = "me"  # the submission's student id in the scratch gradebook
# The course's per-cell limit while grading (nbgrader_config.py's CELL_TIMEOUT_S), and minidist's
# half of it, so that a deadlocked multi-rank cell fails first with RankTimeout's report.
CELL_TIMEOUT_S = 60
GRADING_LIMIT_S = 600  # an nbgrader command that runs longer is stopped: a grade never hangs
MESSAGE_LINES = 8  # a long message (a rank's traceback) is cut to its first lines
STATEMENT_CHARS = 100  # the failed statement is a reminder of which check failed, not a listing
ERROR_LOG_CHARS = 4000

# What only the full course has; the student release (`make release`) leaves all of it out.
INSTRUCTOR_ONLY = ("nbgrader_config.py", "tools/grading")


class CannotGrade(Exception):
    """Grading could not run; the message says why and what to do."""


@dataclass
class CellResult:
    """One graded test cell: its points (None without a gradebook) and why it failed."""

    grade_id: str
    passed: bool
    score: float | None
    max_score: float | None
    feedback: list[str]  # the failing statement (if visible) and the error; empty if passed


def resolve_lab(name: str) -> str:
    """The lab folder `name` means: "03" or "03_data_parallel" -> "03_data_parallel"."""
    course_labs = labs(COURSE)
    listing = "labs: " + ", ".join(course_labs)
    if not name:
        raise CannotGrade(f"say which lab to grade, e.g. make grade LAB=00\n{listing}")
    matches = [lab for lab in course_labs if name in (lab, lab[:2])]
    if len(matches) == 1:
        return matches[0]
    hint = f" (did you mean LAB={int(name):02d}?)" if name.isdigit() and len(name) < 2 else ""
    raise CannotGrade(f"LAB={name} names no lab{hint}; give a lab's number or folder name\n"
                      f"{listing}")


def has_hidden_tests(lab: str) -> bool:
    return all((ROOT / path).exists() for path in INSTRUCTOR_ONLY) and (
        ROOT / "solutions" / lab / f"{lab}.ipynb"
    ).exists()


def copy_lab(source: Path, destination: Path) -> None:
    """The learner's whole lab folder, hidden files included (they may hold what the notebook
    reads back, e.g. committed predictions); not Jupyter's checkpoints."""
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns(*IGNORED))


def run_tool(command: list[str], cwd: Path, log: Path) -> None:
    """Run an nbgrader command, its output to `log`; CannotGrade, with the log's end, if it
    fails."""
    with open(log, "a") as output:
        try:
            done = subprocess.run(command, cwd=cwd, stdout=output, stderr=subprocess.STDOUT,
                                  timeout=GRADING_LIMIT_S, check=False)
        except subprocess.TimeoutExpired:
            raise CannotGrade(f"`{' '.join(command[1:])}` ran past {GRADING_LIMIT_S} s") from None
    if done.returncode != 0:
        raise CannotGrade(f"`{' '.join(command[1:])}` failed ({done.returncode}):\n"
                          f"{log.read_text()[-ERROR_LOG_CHARS:]}")


def graded_test_cells(notebook: NotebookNode) -> list[NotebookNode]:
    """The autograder test cells (points, no answer), in notebook order."""
    return [cell for cell in notebook.cells
            if cell.metadata.get("nbgrader", {}).get("grade")
            and not cell.metadata["nbgrader"].get("solution")]


def failure(cell: NotebookNode) -> list[str] | None:
    """Why a test cell failed, without a line of its hidden tests; None if it raised nothing."""
    error = next((out for out in cell.get("outputs", []) if out.output_type == "error"), None)
    if error is None:
        return None
    try:  # the rules the course's feedback follows (tools/grading/, in the full course only)
        from grading.feedback import failed_statement, hidden_lines, quotes_hidden
    except ImportError:  # the student release, whose test cells hold no hidden tests
        return [f"{error.ename}: {line}" if n == 0 else line
                for n, line in enumerate(_cut(str(error.evalue).splitlines()))] or [error.ename]
    hidden = hidden_lines(cell.source)
    statement = failed_statement(error)
    lines = []
    if statement is not None and hidden and quotes_hidden(statement, hidden):
        lines.append("a hidden test failed")
    elif statement is not None:
        statement = statement.strip()
        if len(statement) > STATEMENT_CHARS:
            statement = statement[:STATEMENT_CHARS - 3] + "..."
        lines.append(f"failed: {statement}")
    # The message says what was wrong; any of its lines that quotes hidden code is left out.
    message = _cut([line for line in str(error.evalue).splitlines()
                    if not quotes_hidden(line, hidden)])
    lines.append(f"{error.ename}: {message[0]}" if message else error.ename)
    return lines + message[1:]


def _cut(message: list[str]) -> list[str]:
    message = [line for line in message if line.strip()]
    return message[:MESSAGE_LINES] + ["..."] if len(message) > MESSAGE_LINES else message


def autograde(lab: str, mine: Path, scratch: Path) -> list[CellResult]:
    """Grade `mine` with the hidden tests, in a scratch course: what the instructor's
    generate_assignment and autograde do (solutions/README.md)."""
    import nbformat
    from nbgrader.api import Gradebook

    course = scratch / "course"
    (course / "solutions").mkdir(parents=True)
    shutil.copy(ROOT / "nbgrader_config.py", course)
    shutil.copytree(ROOT / "tools", course / "tools", ignore=shutil.ignore_patterns(*IGNORED))
    shutil.copytree(ROOT / "solutions" / lab, course / "solutions" / lab,
                    ignore=shutil.ignore_patterns(*IGNORED))
    (course / ".venv").symlink_to(ROOT / ".venv")
    copy_lab(mine, course / "submitted" / STUDENT / lab)
    # The course's nbgrader_config.py (loaded from the scratch course's root) sets the cell
    # limits and preprocessors; its nbgrader runs from the interpreter running this.
    nbgrader = str(Path(sys.executable).parent / "nbgrader")
    log = scratch / "nbgrader.log"
    run_tool([nbgrader, "generate_assignment", lab, "--force"], course, log)
    run_tool([nbgrader, "autograde", lab, f"--student={STUDENT}", "--force"], course, log)
    graded = course / "autograded" / STUDENT / lab / f"{lab}.ipynb"
    if not graded.exists():
        raise CannotGrade(f"autograde wrote no notebook:\n{log.read_text()[-ERROR_LOG_CHARS:]}")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        notebook = gradebook.find_submission_notebook(lab, lab, STUDENT)
        points = {grade.name: (grade.score, grade.max_score) for grade in notebook.grades}
    results = []
    for cell in graded_test_cells(nbformat.read(graded, as_version=nbformat.NO_CONVERT)):
        grade_id = cell.metadata["nbgrader"]["grade_id"]
        score, max_score = points[grade_id]
        why = failure(cell)
        results.append(CellResult(grade_id, score == max_score, score, max_score, why or []))
    return results


def run_visible_tests(lab: str, mine: Path, scratch: Path) -> list[CellResult]:
    """Run a copy of `mine` top to bottom, errors and all, and read its test cells: what the
    student release can check without the hidden tests."""
    import nbformat
    from nbclient import NotebookClient

    folder = scratch / lab
    copy_lab(mine, folder)
    path = folder / f"{lab}.ipynb"
    notebook = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    os.environ.setdefault("MINIDIST_TIMEOUT", str(CELL_TIMEOUT_S // 2))
    client = NotebookClient(notebook, timeout=CELL_TIMEOUT_S, interrupt_on_timeout=True,
                            allow_errors=True, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}})
    # The kernel's own stderr (ipykernel's warning about TCP without encryption, which only
    # ever listens on 127.0.0.1) goes to a log, as it does under nbgrader; the cells' errors
    # are in the notebook's outputs.
    with open(scratch / "kernel.log", "w") as kernel_log:
        client.execute(stderr=kernel_log)
    results = []
    for cell in graded_test_cells(notebook):
        why = failure(cell)
        points = cell.metadata["nbgrader"].get("points")
        results.append(CellResult(cell.metadata["nbgrader"]["grade_id"], why is None, None,
                                  points, why or []))
    return results


def report(results: list[CellResult], with_points: bool) -> list[str]:
    width = max((len(result.grade_id) for result in results), default=0)
    lines = []
    for result in results:
        if with_points:
            status = f"{result.score:g} / {result.max_score:g}"
        else:
            status = "passed" if result.passed else "FAILED"
        lines.append(f"  {result.grade_id:<{width}}  {status}")
        lines += [f"      {line}" for line in result.feedback]
    if with_points:
        earned = sum(result.score or 0 for result in results)
        possible = sum(result.max_score or 0 for result in results)
        lines.append(f"Total: {earned:g} / {possible:g} points")
    else:
        passed = sum(result.passed for result in results)
        lines.append(f"Visible tests: {passed} of {len(results)} test cells pass")
    return lines


def grade(lab: str) -> None:
    """Grade my-labs/<lab>/ and print the result; CannotGrade if grading could not run."""
    mine = MINE / lab
    notebook = mine / f"{lab}.ipynb"
    if not notebook.exists():
        raise CannotGrade(
            f"there is no my-labs/{lab}/{lab}.ipynb to grade: your copies of the labs are made "
            "by `make lab` (it copies every lab into my-labs/ the first time, then opens "
            "JupyterLab), or by `.venv/bin/python tools/my_labs.py copy` alone")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"scaling-lab-grade-{lab}-") as scratch:
        if has_hidden_tests(lab):
            print(f"Grading my-labs/{lab}/{lab}.ipynb with the hidden tests, as a graded "
                  "class's autograde does, in a scratch copy (my-labs/ is only read)...",
                  flush=True)
            results = autograde(lab, mine, Path(scratch))
            with_points = True
        else:
            print("This copy of the course has no hidden tests (it is the student release: "
                  "in a graded class, the instructor grades them).\n"
                  f"Running the visible tests of my-labs/{lab}/{lab}.ipynb in a scratch copy "
                  "(my-labs/ is only read)...", flush=True)
            results = run_visible_tests(lab, mine, Path(scratch))
            with_points = False
    print("\n".join(report(results, with_points)))
    print(f"({lab} graded in {time.monotonic() - start:.0f} s)")


def main(argv: list[str]) -> int:
    check_only = argv[:1] == ["--check-lab"]
    if check_only:
        argv = argv[1:]
    if len(argv) > 1:
        print("usage: python tools/grade.py [--check-lab] LAB   (e.g. 03 or 03_data_parallel)",
              file=sys.stderr)
        return 2
    try:
        lab = resolve_lab(argv[0].strip() if argv else "")
        if not check_only:
            grade(lab)
    except CannotGrade as problem:
        print(f"make grade: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
