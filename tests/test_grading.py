"""The grading harness end to end, on every lab in solutions/ (solutions/README.md).

Each lab is graded in a temporary copy of the course, never the repo's own gradebook or
labs/, with the instructor commands of solutions/README.md. Submissions are what a student
would hand in: the released notebook with every answer cell filled in from the solution
("solution"), left untouched ("untouched"), or with one quiz answer wrong, one quiz cell
looping forever and another deadlocking two ranks ("mistaken"). The plausible fakes of the lab's
exercises (tests/fakes/): each exercise's first fake goes in the mistaken submission; its
others are tried in the solution's own notebook, each run through the cells from the exercise's
answer to the last check of those fakes (a trial: cells the harness adds after that check, then
the solution run through them again, so the notebook goes on as it was), or, for a fake whose
checks lie far below its answer, in rounds of submissions of their own. The correct alternatives
(tests/fakes/), which differ from the solution only where the spec allows it, are tried the
same way. The solution's autograde run, less its trials, is also the lab's timed run.

Quiz cells follow the labs' convention: an autograded-answer cell whose solution region only
assigns `answer_<name> = ...`, each answer checked by exactly one test cell.
"""

from __future__ import annotations

import ast
import atexit
import copy
import csv
import functools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat import NotebookNode
from nbgrader.api import Gradebook

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))  # tools/grading/, the instructors' tooling
sys.path.insert(0, str(REPO / "bench"))  # lab_run_times: each lab's budget
from fakes import Alternative, Fake, alternatives_of, fakes_of, rounds, tried_by_section  # noqa: E402
from grading.feedback import HideHiddenTests, markdown_with_mathml  # noqa: E402
from grading.timeouts import timeout_message  # noqa: E402
from lab_run_times import BUDGET_S, BUDGETS_S, cell_spans, seconds_and_slowest  # noqa: E402

LABS = sorted({notebook.parent.name for notebook in REPO.glob("solutions/*/*.ipynb")})

# The instructor commands exactly as solutions/README.md gives them (checked below); they run
# in the course root with $LAB set.
GENERATE = '.venv/bin/nbgrader generate_assignment "[0-9][0-9]_*" --force'
COLLECT = (
    'for f in incoming/$LAB/*.ipynb; do s=$(basename "$f" .ipynb); '
    'mkdir -p "submitted/$s/$LAB" && cp "$f" "submitted/$s/$LAB/$LAB.ipynb"; done'
)
AUTOGRADE = '.venv/bin/nbgrader autograde "$LAB"'
FEEDBACK = '.venv/bin/nbgrader generate_feedback "$LAB"'
EXPORT = ".venv/bin/nbgrader export"

COMMAND_LIMIT_S = 1200  # a grading command that runs longer is killed: the test must not hang
# The first test of a lab builds its fixtures: a generate, the solution's autograde and the
# autograde of every round of fakes, each bounded by COMMAND_LIMIT_S (a lab with seven rounds,
# on a busy machine, passed pytest's default of 600 s for the whole setup).
pytestmark = pytest.mark.timeout(3 * COMMAND_LIMIT_S)
EXIT_GRACE_S = 5  # processes that exit this soon after their command are not left behind
MARKER = "SCALING_LAB_GRADING_TEST"  # env var tagging every process a command starts

SOLUTION = ("BEGIN SOLUTION", "END SOLUTION")
HIDDEN_TESTS = ("BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
WRONG_ANSWER = "object()  # a value no check accepts"
# It waits rather than spins: a spinning loop would take a core from the rest of the suite
# for the whole cell timeout, and nbgrader interrupts both alike.
INFINITE_LOOP = ["import time", "", "while True:", "    time.sleep(1)"]
# The looping and the deadlocking cell's own time limit in the mistaken submission: a hang is
# bounded by whichever limit its cell has (nbclient's timeout_func), and a lab whose slowest cell
# is slow need not wait three times that, twice.
HANG_S = 6
DEADLOCK = [
    "import torch",
    "import torch.distributed as dist",
    "from minidist.core.launch import run",
    "",
    "",
    "def wait_for_rank1(rank, world_size):",
    "    if rank == 0:",
    "        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends",
    "",
    "",
    "run(wait_for_rank1, 2)",
]


# --- Notebooks -----------------------------------------------------------------------------


def nbgrader_meta(cell: NotebookNode) -> dict:
    return cell.metadata.get("nbgrader", {})


def read_notebook(path: Path) -> NotebookNode:
    return nbformat.read(path, as_version=nbformat.NO_CONVERT)


def split_region(source: str, delimiters: tuple[str, str]) -> tuple[list[str], list[str]]:
    """(lines outside, lines inside) the delimited regions; delimiter lines are in neither."""
    begin, end = delimiters
    outside: list[str] = []
    inside: list[str] = []
    in_region = False
    for line in source.splitlines():
        if begin in line or end in line:
            in_region = begin in line
        else:
            (inside if in_region else outside).append(line)
    return outside, inside


def without_magics(source: str) -> str:
    """A cell's Python: IPython's magic lines (`%%writefile my_job.py`) left out."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("%"))


def is_delimiter(line: str) -> bool:
    return any(delimiter in line for delimiter in SOLUTION + HIDDEN_TESTS)


def replace_solution(source: str, lines: list[str] | tuple[list[str], ...]) -> str:
    """`source` with its solution region replaced by `lines`, the rest kept in place; a cell
    with several regions gets `lines` in each, or the k-th of a tuple of them in the k-th."""
    result: list[str] = []
    in_region, region = False, 0
    for line in source.splitlines():
        if SOLUTION[0] in line:
            in_region = True
            result += lines[region] if isinstance(lines, tuple) else lines
            region += 1
        elif SOLUTION[1] in line:
            in_region = False
        elif not in_region:
            result.append(line)
    return "\n".join(result)


def quiz_cells(solution: NotebookNode) -> dict[str, list[str]]:
    """Quiz cells, in notebook order: grade id -> the `answer_*` names they assign."""
    quizzes = {}
    for cell in solution.cells:
        meta = nbgrader_meta(cell)
        if cell.cell_type != "code" or not meta.get("solution") or meta.get("grade"):
            continue
        try:
            body = ast.parse("\n".join(split_region(cell.source, SOLUTION)[1])).body
        except SyntaxError:
            continue
        names = [
            statement.targets[0].id
            for statement in body
            if isinstance(statement, ast.Assign)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
            and statement.targets[0].id.startswith("answer_")
        ]
        if body and len(names) == len(body):
            quizzes[meta["grade_id"]] = names
    return quizzes


def checking_cell(solution: NotebookNode, answer: str) -> str:
    """The grade id of the one test cell that checks `answer`."""
    checks = [
        nbgrader_meta(cell)["grade_id"]
        for cell in solution.cells
        if nbgrader_meta(cell).get("grade") and re.search(rf"\b{answer}\b", cell.source)
    ]
    assert len(checks) == 1, f"{answer} should be checked by exactly one test cell: {checks}"
    return checks[0]


def answered(
    released: NotebookNode, solution: NotebookNode,
    replaced: dict[str, list[str] | tuple[list[str], ...]] | None = None,
) -> NotebookNode:
    """`released` with each answer cell as the solution has it, delimiter lines dropped, or
    with its solution region replaced by `replaced[grade_id]`."""
    replaced = replaced or {}
    solutions = {
        nbgrader_meta(cell)["grade_id"]: cell.source
        for cell in solution.cells
        if nbgrader_meta(cell).get("solution")
    }
    submission = copy.deepcopy(released)
    for cell in submission.cells:
        grade_id = nbgrader_meta(cell).get("grade_id")
        if nbgrader_meta(cell).get("solution"):
            source = solutions[grade_id]
            if grade_id in replaced:
                cell.source = replace_solution(source, replaced[grade_id])
            else:
                lines = source.splitlines()
                cell.source = "\n".join(line for line in lines if not is_delimiter(line))
    return submission


def secret_lines(solution: NotebookNode) -> set[str]:
    """Lines of solutions and hidden tests that would give something away: long enough to
    mean something, and not also in what students see anyway: the notebook's released part
    and minidist, whose code the labs rebuild (a traceback may show it)."""
    secret, public = [], []
    for cell in solution.cells:
        meta = nbgrader_meta(cell)
        outside, solution_region = split_region(cell.source, SOLUTION)
        if meta.get("solution") and SOLUTION[0] not in cell.source:
            # An answer cell without delimiters is all solution (nbgrader replaces all of it).
            outside, solution_region = [], outside
        outside, hidden = split_region("\n".join(outside), HIDDEN_TESTS)
        secret += solution_region + hidden
        public += outside
    library = (REPO / "lib" / "minidist").rglob("*.py")
    public_text = "\n".join(public + [path.read_text() for path in library])
    return {
        line.strip()
        for line in secret
        if len(line.strip()) >= 6 and not is_delimiter(line) and line.strip() not in public_text
    }


def notebook_text(notebook: NotebookNode) -> str:
    """Everything a notebook shows: cell sources and outputs."""
    parts = []
    for cell in notebook.cells:
        parts.append(cell.source)
        for output in cell.get("outputs", []):
            parts += [output.get("text", ""), output.get("evalue", "")]
            parts += output.get("traceback", []) + [str(v) for v in output.get("data", {}).values()]
    return "\n".join(parts)


class _VisibleText(HTMLParser):
    """The text of an HTML page as a browser shows it: no tags, styles or scripts."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._invisible = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self._invisible += tag in ("style", "script")

    def handle_endtag(self, tag: str) -> None:
        self._invisible -= tag in ("style", "script")

    def handle_data(self, data: str) -> None:
        if not self._invisible:
            self.parts.append(data)


def html_text(path: Path) -> str:
    parser = _VisibleText()
    parser.feed(path.read_text())
    return "".join(parser.parts)


def leaks(text: str, secrets: set[str]) -> list[str]:
    markers = [marker for marker in SOLUTION + HIDDEN_TESTS if marker in text]
    return markers + sorted(line for line in secrets if line in text)


# --- Running commands ----------------------------------------------------------------------


@dataclass
class Ran:
    output: str
    seconds: float
    left_behind: list[str]  # processes still running after the command ended (now killed)


def failure_part(output: str, limit: int = 8000) -> str:
    """What of a failed command's `output` a failure message shows: from its first traceback or
    logged error (nbgrader logs a notebook's traceback long before its closing summary), and its
    end."""
    first = min((at for at in (output.find("Traceback"), output.find("| ERROR]")) if at >= 0),
                default=len(output))
    if len(output) - first <= limit:
        return output[max(0, min(first, len(output) - limit)):]
    return f"{output[first:first + limit // 2]}\n[...]\n{output[-limit // 2:]}"


def run_in_course(course: Path, command: str, lab: str, **env: str) -> Ran:
    """Run a shell command in the course root, with $LAB set, and check what it left running.

    Every process it starts inherits a unique MARKER, so a kernel, fork server or rank that
    outlives it is found even after it was re-parented away from this test."""
    tag = uuid.uuid4().hex
    # Not pytest's marker: under it ipykernel leaves output written to the kernel's file
    # descriptors (C++ warnings, Kineto's log) out of the cells, where nbgrader scores a cell
    # that wrote to stderr 0, as it does for students.
    outside = {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}
    before = {process.pid for process in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    # Output goes to a file, not a pipe: a process left behind would keep a pipe open.
    with tempfile.TemporaryFile("w+") as log:
        shell = subprocess.Popen(
            ["bash", "-c", command],
            cwd=course,
            env={**outside, "TMPDIR": str(scratch_folder(course)), **env, "LAB": lab, MARKER: tag},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            shell.wait(timeout=COMMAND_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
            log.write(f"\n(killed after {COMMAND_LIMIT_S} s)")
        log.seek(0)
        output = log.read()
    seconds = time.monotonic() - start
    left_behind = _kill_left_behind(tag, before)
    assert shell.returncode == 0, (
        f"`{command}` failed ({shell.returncode}):\n{failure_part(output)}")
    return Ran(output, seconds, left_behind)


@functools.cache
def scratch_folder(course: Path) -> Path:
    """The course's temporary folder (a lab's work folders, a fake's side channel), removed
    when the worker exits. Not inside the course: a fork server's socket lives in it, and a
    socket's path must be short (108 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="grading-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _kill_left_behind(tag: str, before: set[int]) -> list[str]:
    candidates = {p for p in psutil.Process().children(recursive=True) if p.pid not in before}
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == tag:
                candidates.add(process)
        except psutil.Error:  # gone, or not ours to read
            pass
    _, alive = psutil.wait_procs(candidates, timeout=EXIT_GRACE_S)
    described = []
    for process in alive:
        try:
            described.append(f"{process.pid}: {' '.join(process.cmdline())}")
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return described


@functools.cache  # once per worker: a new gradebook asks `alembic heads` (a process, 1.4 s)
def empty_gradebook() -> bytes:
    """An empty gradebook.db as nbgrader's first command in a course makes it, as bytes."""
    path = Path(tempfile.mkdtemp(prefix="gradebook-")) / "gradebook.db"
    search = os.environ["PATH"]
    os.environ["PATH"] = f"{REPO / '.venv' / 'bin'}{os.pathsep}{search}"  # where alembic is
    try:
        with Gradebook(f"sqlite:///{path}", course_id="scaling-lab"):
            pass
    finally:
        os.environ["PATH"] = search
    made = path.read_bytes()
    shutil.rmtree(path.parent)
    return made


def scores(course: Path, lab: str, student: str) -> dict[str, tuple[float, float]]:
    """grade cell -> (score, max score) of a student's autograded submission."""
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        notebook = gradebook.find_submission_notebook(lab, lab, student)
        return {grade.name: (grade.score, grade.max_score) for grade in notebook.grades}


# --- Trials: further fakes of an exercise, run in the solution's own notebook ---------------


TRIAL_MARK = "# grading test, trial:"  # the first line of every cell the harness adds
TRIAL_SPAN = 20  # an exercise is tried when its answer and checks lie within this many code cells
# A trial runs as one harness cell per cell it reruns, so that each keeps the per-cell time
# limit its own cell has (a trial in one cell would have to fit a whole span in one limit).
TRIAL_STEP = """{mark} {name} ({step} of {steps})
def _trial_step(name, source, check, last):
    # The source run as a cell of its own, as autograde would run it; which checks raised.
    import json
    from IPython import get_ipython
    from IPython.utils.capture import capture_output
    shell = get_ipython()
    raised = shell.user_ns.setdefault("_trials_raised", {{}}).setdefault(name, {{}})
    shown, shell._showtraceback = shell._showtraceback, lambda *args, **kwargs: None
    try:
        with capture_output():
            result = shell.run_cell(source, store_history=False)
    finally:
        shell._showtraceback = shown
    error = result.error_before_exec or result.error_in_exec
    if check:
        raised[check] = error and f"{{type(error).__name__}}: {{error}}"[:400]
    if last:
        # dollar signs escaped (chr(36), written so that this cell has none): an error's text
        # (gloo's addresses) would read as LaTeX in the feedback, where this output shows
        line = json.dumps({{"name": name, "raised": raised}}).replace(chr(36), "\\\\u0024")
        print("TRIAL " + line)


_trial_step({name!r}, {source!r}, {check!r}, {last!r})
"""


@dataclass(frozen=True)
class Trial:
    """One answer run through the cells that check its exercise, in the solution's notebook:
    a fake (its checks must all raise), a correct alternative, or the solution again after them
    (theirs must all pass)."""

    name: str
    exercise: str  # the grade id of the answer cell
    checked_by: tuple[str, ...]
    kind: str  # "fake", "alternative" or "solution"

    @property
    def key(self) -> str:
        return f"{self.exercise}: {self.name}"


def check_span(solution: NotebookNode, exercise: str, checks: Iterable[str]) -> range:
    """The indices of the cells from `exercise`'s answer cell to the last of `checks`."""
    ids = [nbgrader_meta(cell).get("grade_id") for cell in solution.cells]
    return range(ids.index(exercise), max(ids.index(check) for check in checks) + 1)


def tried_here(solution: NotebookNode, exercise: str, checks: Iterable[str]) -> bool:
    """Whether a further fake (or alternative) of `exercise` checked by `checks` is tried in the
    solution's notebook: those checks lie close below its answer (a trial reruns the cells in
    between, and the solution's trial after it reruns them again)."""
    span = check_span(solution, exercise, checks)
    return sum(solution.cells[i].cell_type == "code" for i in span) <= TRIAL_SPAN


def section_cells(solution: NotebookNode, exercise: str,
                  checks: Iterable[str]) -> tuple[list[int], list[int]]:
    """What a trial of an exercise in its fakes module's TRIED_BY_SECTION reruns below the
    answer, as cell indices: the set-up (the cells that follow the answer up to the first test
    cell or heading: an import of the file it wrote), and each of `checks`' own section, from
    the heading above it down to it, less the other test cells. What the sections before
    compute (a race, say) stays the solution's; their cells start afresh when run again (the
    lab's `fresh`)."""
    ids = [nbgrader_meta(cell).get("grade_id") for cell in solution.cells]

    def graded(index: int) -> bool:
        return bool(nbgrader_meta(solution.cells[index]).get("grade"))

    def heading(index: int) -> bool:
        cell = solution.cells[index]
        return cell.cell_type == "markdown" and cell.source.lstrip().startswith("#")

    answer = ids.index(exercise)
    setup, index = set(), answer + 1
    while index < len(solution.cells) and not graded(index) and not heading(index):
        setup.add(index)
        index += 1
    chosen = set()
    for check in checks:
        end = ids.index(check)
        start = max(k for k in range(answer, end) if k == answer or heading(k))
        chosen |= {k for k in range(start + 1, end + 1) if k == end or not graded(k)}
    return sorted(setup), sorted(chosen - setup)


def section_steps(solution: NotebookNode,
                  indices: Iterable[int]) -> list[tuple[str, str | None]]:
    """The code cells at `indices`, as trial steps (source, check or None)."""
    return [(without_delimiters(solution.cells[k].source),
             nbgrader_meta(solution.cells[k]).get("grade_id")
             if nbgrader_meta(solution.cells[k]).get("grade") else None)
            for k in sorted(indices) if solution.cells[k].cell_type == "code"]


def with_trials(submission: NotebookNode, solution: NotebookNode,
                tried: dict[str, list[Fake] | list[Alternative]], *,
                by_section: Iterable[str] = ()) -> list[Trial]:
    """Add to `submission` (the solution, answered) a trial of each of `tried`'s answers, then
    one of the solution's answer, which puts the notebook back as it was; returns the trials,
    in order.

    The trials come before the notebook's own run of the cells they rerun and check, so that
    this run, after them, is the check that no trial left the notebook changed (test b). An
    exercise's trials come right after its answer cell: the first runs every cell below down
    to its last check (other exercises' checks among them, unrecorded); the next ones those
    from the first that depends on the answer on (`depending_on`), and any not run yet. The
    exercises `by_section`, whose sections use what the sections before them computed (a
    race, then a resume from its checkpoints), rerun only the set-up below the answer and
    their checks' sections (`section_cells`), each right before the notebook's own run of its
    last check's section."""
    assert [nbgrader_meta(c).get("grade_id") for c in submission.cells] == [
        nbgrader_meta(c).get("grade_id") for c in solution.cells], "cells out of step"
    trials, added = [], {}

    def add(at: int, trial: Trial, steps: list[tuple[str, str | None]]) -> None:
        added.setdefault(at, []).extend(nbformat.v4.new_code_cell(TRIAL_STEP.format(
            mark=TRIAL_MARK, name=trial.key, step=k + 1, steps=len(steps), source=step,
            check=check, last=k == len(steps) - 1)) for k, (step, check) in enumerate(steps))
        trials.append(trial)

    for exercise, answers in tried.items():
        checked = {check for answer in answers for check in answer.checked_by}
        span = check_span(solution, exercise, checked)
        answer_cell = solution.cells[span[0]]
        solution_source = without_delimiters(answer_cell.source)
        if exercise in by_section:
            ids = [nbgrader_meta(cell).get("grade_id") for cell in solution.cells]
            groups: dict[str, list] = {}  # each answer under the last of its checks
            for answer in answers:
                groups.setdefault(max(answer.checked_by, key=ids.index), []).append(answer)
            for last, group in sorted(groups.items(), key=lambda item: ids.index(item[0])):
                setup, own = section_cells(solution, exercise, [last])
                for answer in group:
                    rerun = sum(section_cells(solution, exercise, answer.checked_by), [])
                    add(own[0] - 1, trial_of(exercise, answer),
                        [(replace_solution(answer_cell.source, answer_lines(answer)), None),
                         *section_steps(solution, rerun)])
                add(own[0] - 1, Trial(f"the solution of {exercise}, put back before {last}",
                                      exercise, (), "solution"),
                    [(solution_source, None), *section_steps(solution, setup)])
            continue
        below = [(without_delimiters(solution.cells[i].source),
                  nbgrader_meta(solution.cells[i]).get("grade_id")
                  if nbgrader_meta(solution.cells[i]).get("grade") else None)
                 for i in span[1:] if solution.cells[i].cell_type == "code"]
        ran = 0  # how many cells of `below` a trial has run so far
        magics = any(line.lstrip().startswith(("%", "!"))
                     for line in answer_cell.source.splitlines())
        for answer in answers:
            source = replace_solution(answer_cell.source, answer_lines(answer))
            trial = trial_of(exercise, answer)
            last = max(k for k, (_, check) in enumerate(below) if check in trial.checked_by)
            # Cells not run yet: all of them (another exercise's check unrecorded: what it
            # defines, the checks below may use). Those run already: this trial's own checks
            # and the cells from the first that depends on the answer on; all of them if it
            # has magics (a file it writes is read by cells no name of it leads to).
            seen = [(step, check) for step, check in below[:min(ran, last + 1)]
                    if check is None or check in trial.checked_by]
            if not magics:
                seen = depending_on(source, seen)
            new = [(step, check if check in trial.checked_by else None)
                   for step, check in below[ran:last + 1]]
            ran = max(ran, last + 1)
            add(span[0], trial, [(source, None), *seen, *new])
        add(span[0], Trial(f"the solution of {exercise}, put back", exercise, (), "solution"),
            [(solution_source, None)])
    for index in sorted(added, reverse=True):
        submission.cells[index + 1:index + 1] = added[index]
    return trials


def trial_of(exercise: str, answer: Fake | Alternative) -> Trial:
    return Trial(answer.name, exercise, answer.checked_by,
                 "fake" if isinstance(answer, Fake) else "alternative")


def depending_on(answer: str, steps: list[tuple[str, str | None]]) -> list[tuple[str, str | None]]:
    """`steps` (source, check or None) from the first that reads a name the answer cell binds
    (or is a check) on. The cells before it depend on nothing a trial changes, so what they
    computed when first run stands (torch's own groups, say); every cell after it runs again,
    since it may read what an earlier one wrote (a file, which no name leads to)."""
    bound = _names(answer, ast.Store) or set()
    for k, (step, check) in enumerate(steps):
        read = _names(step, ast.Load)
        if check is not None or read is None or read & bound:
            return steps[k:]
    return []


def _names(source: str, context: type) -> set[str] | None:
    """The names `source` reads (ast.Load) or binds (ast.Store, and the functions, classes and
    imports it defines); None if it does not parse."""
    try:
        tree = ast.parse(without_magics(source))
    except SyntaxError:
        return None
    found = {node.id for node in ast.walk(tree)
             if isinstance(node, ast.Name) and isinstance(node.ctx, context)}
    if context is ast.Store:
        found |= {node.name for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        found |= {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    return found


def trial_outcomes(notebook: NotebookNode) -> dict[str, dict[str, str | None]]:
    """{trial name: {check: None if it passed, else what it raised}} from an executed notebook."""
    found = {}
    for cell in notebook.cells:
        if cell.cell_type == "code" and cell.source.startswith(TRIAL_MARK):
            for output in cell.get("outputs", []):
                for line in output.get("text", "").splitlines():
                    if line.startswith("TRIAL "):
                        record = json.loads(line[len("TRIAL "):])
                        found[record["name"]] = record["raised"]
    return found


def without_trials(notebook: NotebookNode) -> NotebookNode:
    """`notebook` less the cells the harness added (the lab's own run, for its timing)."""
    kept = copy.copy(notebook)
    kept.cells = [cell for cell in notebook.cells
                  if not (cell.cell_type == "code" and cell.source.startswith(TRIAL_MARK))]
    return kept


def answer_lines(answer: Fake | Alternative) -> list[str] | tuple[list[str], ...]:
    return (tuple(part.splitlines() for part in answer.source)
            if isinstance(answer.source, tuple) else answer.source.splitlines())


def without_delimiters(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not is_delimiter(line))


def split_fakes(lab: str, solution: NotebookNode) -> tuple[dict[str, Fake], list[dict],
                                                           dict[str, list[Fake]]]:
    """A lab's fakes: the first of each exercise (in the mistaken submission), the rounds of
    submissions of their own, and those tried in the solution's notebook."""
    first, far, tried = {}, {}, {}
    by_section = tried_by_section(lab)
    for exercise, fakes in fakes_of(lab).items():
        first[exercise] = fakes[0]
        for fake in fakes[1:]:
            near = exercise in by_section or tried_here(solution, exercise, fake.checked_by)
            (tried if near else far).setdefault(exercise, []).append(fake)
    return first, rounds(far), tried


def split_alternatives(lab: str, solution: NotebookNode) -> tuple[list[dict],
                                                                  dict[str, list[Alternative]]]:
    """A lab's correct alternatives: rounds of submissions of their own, and those tried."""
    far, tried = {}, {}
    for exercise, correct in alternatives_of(lab).items():
        for alternative in correct:
            near = tried_here(solution, exercise, alternative.checked_by)
            (tried if near else far).setdefault(exercise, []).append(alternative)
    return rounds(far), tried


# --- Fixtures: the expensive work, once per lab ----------------------------------------------


_built: dict[tuple[str, str], object] = {}


def once_per_lab(build):
    """Build a fixture's value once per lab and worker. Under pytest-xdist a worker may tear
    module fixtures down between two tests of the same lab; grading a lab again would double
    the suite's time."""

    @functools.wraps(build)
    def fixture(lab: str, **dependencies):
        key = (build.__name__, lab)
        if key not in _built:
            _built[key] = build(lab, **dependencies)
        return _built[key]

    return fixture


@pytest.fixture(scope="module", params=LABS)
def lab(request: pytest.FixtureRequest) -> str:
    return request.param


@dataclass
class Course:
    root: Path
    solution: NotebookNode
    released: NotebookNode
    quizzes: dict[str, list[str]]
    runs: list[Ran] = field(default_factory=list)

    def run(self, command: str, lab: str, **env: str) -> Ran:
        self.runs.append(run_in_course(self.root, command, lab, **env))
        return self.runs[-1]

    def submit(self, lab: str, student: str, notebook: NotebookNode) -> None:
        incoming = self.root / "incoming" / lab
        incoming.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, incoming / f"{student}.ipynb")


@pytest.fixture(scope="module")
@once_per_lab
def course(lab: str, tmp_path_factory: pytest.TempPathFactory) -> Course:
    """A course of just this lab, with the student version generated."""
    notebooks = [path.name for path in (REPO / "solutions" / lab).glob("*.ipynb")]
    assert notebooks == [f"{lab}.ipynb"], f"solutions/{lab} should hold one notebook, {lab}.ipynb"
    root = tmp_path_factory.mktemp(f"{lab}-course")
    shutil.copy(REPO / "nbgrader_config.py", root)
    shutil.copytree(REPO / "tools", root / "tools")
    shutil.copytree(REPO / "solutions" / lab, root / "solutions" / lab)
    (root / ".venv").symlink_to(REPO / ".venv")
    (root / "gradebook.db").write_bytes(empty_gradebook())
    ran = run_in_course(root, GENERATE, lab)
    solution = read_notebook(root / "solutions" / lab / f"{lab}.ipynb")
    released = read_notebook(root / "labs" / lab / f"{lab}.ipynb")
    quizzes = quiz_cells(solution)
    assert len(quizzes) >= 3, f"{lab} needs at least 3 quiz cells, found {list(quizzes)}"
    return Course(root, solution, released, quizzes, [ran])


@dataclass
class Execution:
    seconds: float  # from the first cell's start to the last cell's end
    slowest_cell_s: float


def execution_times(notebook: NotebookNode) -> Execution:
    """How long an executed notebook ran, from the timestamps nbclient records in each cell."""
    assert cell_spans(notebook), "the autograded notebook records no cell timings"
    return Execution(*seconds_and_slowest(notebook))


@dataclass
class Graded:
    autograde_log: str
    executed: Execution  # the solution's own run, as autograde executed it, less its trials
    trials: list[Trial]  # tried in the solution's notebook, in order
    outcomes: dict[str, dict[str, str | None]]  # trial key -> check -> what it raised (None)


@pytest.fixture(scope="module")
@once_per_lab
def graded(lab: str, course: Course) -> Graded:
    """Collect and autograde, as the instructor does.

    The solution and the untouched submission are graded by one autograde with the real
    limits; nbgrader runs one notebook at a time, so the solution's run is also the lab's
    timed run (test g), less the trials of further fakes and alternatives it holds. The
    mistaken submission is graded by `mistaken`."""
    solution = answered(course.released, course.solution)
    _, _, fakes = split_fakes(lab, course.solution)
    _, alternatives = split_alternatives(lab, course.solution)
    tried = {exercise: [*fakes.get(exercise, []), *alternatives.get(exercise, [])]
             for exercise in {**fakes, **alternatives}}
    trials = with_trials(solution, course.solution, tried, by_section=tried_by_section(lab))
    course.submit(lab, "solution", solution)
    course.submit(lab, "untouched", course.released)
    course.run(COLLECT, lab)
    autograde = course.run(AUTOGRADE, lab)
    autograded = read_notebook(course.root / "autograded" / "solution" / lab / f"{lab}.ipynb")
    return Graded(autograde.output, execution_times(without_trials(autograded)), trials,
                  trial_outcomes(autograded))


@dataclass
class Mistaken:
    ran: Ran
    executed: Execution  # the mistaken submission's own run, hangs included
    hang_s: dict[str, float]  # how long the looping and the deadlocking cell ran
    wrong_cells: set[str]  # the test cells that check the wrong answer
    stuck_cells: set[str]  # the test cells that check the answers that hang
    faked: dict[str, list[Fake]]  # the submission (student id) each round of fakes is in
    faked_cells: set[str]  # the test cells that check the first round's fakes
    rounds_s: float  # how long the other rounds' notebooks ran, in the same autograde
    # the submission (student id) each round of correct alternatives is in
    alternatives: dict[str, list[Alternative]] = field(default_factory=dict)


def faked_submission(course: Course, lab: str, fakes: dict[str, Fake] | dict[str, Alternative],
                     replaced: dict[str, list[str]] | None = None, *,
                     cut: bool = False) -> NotebookNode:
    """The solution with each faked exercise's solution region replaced by its fake (or by
    its correct alternative). With `cut`, every cell a student may edit below the last cell
    that checks one of them is emptied: what those cells would compute grades nothing this
    submission is for, and the test cells there (which autograde restores) then fail at once."""
    replaced = dict(replaced or {})
    sources = {nbgrader_meta(c).get("grade_id"): c.source for c in course.solution.cells}
    for cell, fake in fakes.items():
        assert cell in sources, (
            f"tests/fakes/{lab}.py fakes {cell!r}, which is no cell of solutions/{lab}")
        lines = (tuple(part.splitlines() for part in fake.source)
                 if isinstance(fake.source, tuple) else fake.source.splitlines())
        try:  # a fake that does not even compile would score 0 without being caught
            ast.parse(without_magics(replace_solution(sources[cell], lines)))
        except SyntaxError as error:
            raise AssertionError(f"tests/fakes/{lab}.py: the fake {fake.name!r} of {cell} does "
                                 f"not compile in its cell (indent it as the cell's solution "
                                 f"region is): {error}") from None
        replaced[cell] = lines
    submission = answered(course.released, course.solution, replaced)
    if cut:
        cut_below(submission, {cell for fake in fakes.values() for cell in fake.checked_by})
    return submission


def cut_below(submission: NotebookNode, checks: set[str]) -> None:
    """Empty every cell a student may edit below the last of the test cells `checks`: what
    they would compute grades nothing the caller looks at, and the test cells there (which
    autograde restores) then fail at once instead of running the rest of the lab."""
    ids = [nbgrader_meta(cell).get("grade_id") for cell in submission.cells]
    last = max(index for index, grade_id in enumerate(ids) if grade_id in checks)
    for cell in submission.cells[last + 1:]:
        if cell.cell_type == "code" and not nbgrader_meta(cell).get("locked"):
            cell.source = "pass  # cut: nothing below the last check this submission is for"


@pytest.fixture(scope="module")
@once_per_lab
def mistaken(lab: str, course: Course, graded: Graded) -> Mistaken:
    """Autograde a submission with one wrong quiz answer, one quiz looping forever and one
    deadlocking two ranks; then give feedback and export, as the instructor does.

    The limits are lowered to keep the suite fast, but in proportion to the lab's slowest
    cell, and minidist's still below the cell's, as nbgrader_config.py sets them."""
    (wrong_quiz, wrong_names), (loop_quiz, _), (deadlock_quiz, _) = list(course.quizzes.items())[:3]
    replaced = {
        wrong_quiz: [f"{name} = {WRONG_ANSWER}" for name in wrong_names],
        loop_quiz: INFINITE_LOOP,
        deadlock_quiz: DEADLOCK,
    }
    first, fake_rounds, _ = split_fakes(lab, course.solution)
    course.submit(lab, "mistaken", faked_submission(course, lab, first, replaced))
    faked = {"mistaken": list(first.values())}
    for k, fakes in enumerate(fake_rounds, start=1):
        course.submit(lab, f"fakes-{k}", faked_submission(course, lab, fakes, cut=True))
        faked[f"fakes-{k}"] = list(fakes.values())
    alternatives = {}
    for k, correct in enumerate(split_alternatives(lab, course.solution)[0]):
        course.submit(lab, f"alternatives-{k}", faked_submission(course, lab, correct, cut=True))
        alternatives[f"alternatives-{k}"] = list(correct.values())
    course.run(COLLECT, lab)
    # Three times the slowest cell of the solution's run, which ran under the same load, and
    # minidist's half of that, still 1.5 times it. Never above the real per-cell limit. The two
    # hanging cells stop at HANG_S, their own limit.
    cell_timeout = min(BUDGET_S, max(15, math.ceil(3 * graded.executed.slowest_cell_s)))
    minidist_timeout = cell_timeout // 2
    hangs = {"loop": INFINITE_LOOP[-1], "deadlock": DEADLOCK[-1]}
    with open(course.root / "nbgrader_config.py", "a") as config:
        config.write(f"\n# grading test: the hanging cells stop at their own limit\n"
                     f"c.Execute.timeout_func = lambda cell: {HANG_S} if "
                     f"{set(hangs.values())!r} & set(cell.source.splitlines()) else "
                     f"{cell_timeout}\n")
    # Autograde skips the submissions already graded: this grades "mistaken" (and the rounds
    # of fakes) only.
    ran = course.run(
        f"{AUTOGRADE} --Execute.timeout={cell_timeout}", lab, MINIDIST_TIMEOUT=str(minidist_timeout)
    )
    course.run(FEEDBACK, lab)
    course.run(EXPORT, lab)
    stuck = {
        checking_cell(course.solution, name)
        for quiz in (loop_quiz, deadlock_quiz) for name in course.quizzes[quiz]
    }
    executed = read_notebook(course.root / "autograded" / "mistaken" / lab / f"{lab}.ipynb")
    hang_s = {
        hang: (end - start).total_seconds()
        for hang, line in hangs.items()
        for cell, start, end in cell_spans(executed) if line in cell.source.splitlines()
    }
    wrong = {checking_cell(course.solution, name) for name in wrong_names}
    faked_cells = {cell for fake in first.values() for cell in fake.checked_by}
    rounds_s = sum(execution_times(read_notebook(
        course.root / "autograded" / student / lab / f"{lab}.ipynb")).seconds
        for student in [*faked, *alternatives] if student != "mistaken")
    return Mistaken(ran, execution_times(executed), hang_s, wrong, stuck, faked,
                    faked_cells, rounds_s, alternatives)


# --- Tests ---------------------------------------------------------------------------------


def test_readme_gives_the_tested_commands() -> None:
    readme = (REPO / "solutions" / "README.md").read_text()
    for command in (GENERATE, COLLECT, AUTOGRADE, FEEDBACK, EXPORT):
        assert command in readme, f"solutions/README.md should give: {command}"


def test_feedback_hides_hidden_tests_and_tracebacks_that_quote_them() -> None:
    """A failed visible test keeps its traceback, minus the hidden lines IPython shows around
    it; a failed hidden test shows the error's name and its message, unless the message quotes
    a hidden line."""
    source = "assert f(1) == 1\n### BEGIN HIDDEN TESTS\nassert f(2) == 4\n### END HIDDEN TESTS"

    def failed_at(line: int, message: str = "") -> NotebookNode:  # IPython's, colours included
        listing = "\n".join(
            f"\x1b[32m{'---->' if number == line else '     '} {number}\x1b[39m {text}"
            for number, text in enumerate(source.splitlines(), 1)
        )
        return nbformat.v4.new_output(
            "error",
            ename="AssertionError",
            evalue=message,
            traceback=[f"\x1b[36mCell In[3], line {line}\x1b[39m\n{listing}",
                       f"AssertionError: {message}"],
        )

    meta = {"grade": True, "grade_id": "test-f", "points": 1, "solution": False, "locked": True}
    cells = [
        nbformat.v4.new_code_cell(source, metadata={"nbgrader": meta}, outputs=[failed_at(line)])
        for line in (1, 3)
    ]
    visible, hidden = (HideHiddenTests().preprocess_cell(cell, {}, 0)[0] for cell in cells)
    assert visible.source == hidden.source == "assert f(1) == 1"
    assert visible.outputs[0].traceback == [
        "Cell In[3], line 1",
        "----> 1 assert f(1) == 1",
        "AssertionError: ",
    ]
    assert hidden.outputs[0].traceback == ["A hidden test failed: AssertionError"]
    said, quoted = (
        HideHiddenTests().preprocess_cell(nbformat.v4.new_code_cell(
            source, metadata={"nbgrader": meta}, outputs=[failed_at(3, message)]), {}, 0)[0]
        for message in ("f(2) should be 4, got 5", "assert f(2) == 4 failed"))
    assert said.outputs[0].traceback == [
        "A hidden test failed: AssertionError: f(2) should be 4, got 5"]
    assert quoted.outputs[0].traceback == ["A hidden test failed: AssertionError"]
    # A helper from one cell's hidden tests, failing in a later cell: hidden there too.
    later = nbformat.v4.new_code_cell("check_again()", metadata={"nbgrader": {
        **meta, "grade_id": "test-g"}}, outputs=[nbformat.v4.new_output(
            "error", ename="AssertionError", evalue="", traceback=[
                "Cell In[4], line 1\n----> 1 check_again()",
                "Cell In[3], line 3, in check_again\n----> 3 assert f(2) == 4",
                "AssertionError: "])])
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source, metadata={"nbgrader": meta}), later]
    shown = HideHiddenTests().preprocess(notebook, {})[0].cells[1]
    assert not any("f(2) == 4" in line for line in shown.outputs[0].traceback), shown.outputs


def test_trials_fail_a_fake_pass_an_alternative_and_put_the_notebook_back() -> None:
    """The harness's trials on a notebook of its own: a fake's check raises, a correct
    alternative's passes, the solution's answer run again puts the state back for the cells
    below, whose own run (the last cell here) then passes."""
    from nbclient import NotebookClient

    def cell(source: str, **meta: object) -> NotebookNode:
        made = nbformat.v4.new_code_cell(source)
        made.metadata["nbgrader"] = meta
        return made

    solution = nbformat.v4.new_notebook()
    solution.cells = [
        cell("def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION",
             grade_id="impl-double", solution=True),
        cell("unrelated = sum(range(4))"),  # reads nothing the answer binds: not run again
        cell("doubled = double(21)"),
        cell("assert doubled == 42 and double(3) == 6, doubled", grade_id="test-double",
             grade=True, points=1),
        cell("assert double(5) == 10 and doubled == 42, 'the state below the trials'"),
    ]
    fake = Fake("the visible answer only", "doubling", ("test-double",), "    return 42")
    correct = Alternative("an addition", "doubling by adding", ("test-double",), "    return x + x")
    submission = answered(solution, solution)
    trials = with_trials(submission, solution, {"impl-double": [fake, correct]})
    assert [trial.kind for trial in trials] == ["fake", "alternative", "solution"]
    added = [c.source for c in submission.cells if c.source.startswith(TRIAL_MARK)]
    # right after the answer, before the notebook's own cells below it have run
    assert submission.cells[1].source.startswith(TRIAL_MARK), submission.cells[1].source
    # the first trial runs every cell below; the next from the first that reads the answer's
    # names on
    assert sum("doubled = double(21)" in c for c in added) == 2, added
    assert sum("unrelated = " in c for c in added) == 1, added
    NotebookClient(submission, timeout=60, kernel_name="python3").execute()
    outcomes = trial_outcomes(submission)
    assert outcomes[trials[0].key]["test-double"].startswith("AssertionError"), outcomes
    assert outcomes[trials[1].key] == {"test-double": None}, outcomes
    assert outcomes[trials[2].key] == {}, outcomes  # the answer put back; the notebook's own
    assert len(without_trials(submission).cells) == len(solution.cells)  # cells check it


def test_feedback_math_is_mathml_and_code_is_left_alone() -> None:
    converted = markdown_with_mathml(
        "Each rank sends $2(N-1)/N \\cdot S$ bytes; `cost = $5` and\n```\n$x$\n```\n$$\\Psi$$"
    )
    assert converted.startswith('Each rank sends <math display="inline">')
    assert "`cost = $5`" in converted and "```\n$x$\n```" in converted
    assert converted.endswith('<math display="block"><mrow><mi>&#x003A8;</mi></mrow></math>')
    for notebook in REPO.glob("solutions/*/*.ipynb"):  # every lab's math converts
        for cell in read_notebook(notebook).cells:
            if cell.cell_type == "markdown":
                markdown_with_mathml(cell.source)


def _lab_files(folder: Path) -> dict[str, Path]:
    ignored = {".ipynb_checkpoints", "__pycache__"}
    return {
        str(path.relative_to(folder)): path
        for path in folder.rglob("*")
        if path.is_file() and not ignored & set(path.relative_to(folder).parts)
    }


def test_a_labs_are_generated_from_solutions(lab: str, course: Course) -> None:
    committed = _lab_files(REPO / "labs" / lab)
    generated = _lab_files(course.root / "labs" / lab)
    hint = f"labs/{lab} is out of date; regenerate it with: {GENERATE}"
    assert sorted(committed) == sorted(generated), hint
    assert f"{lab}.ipynb" in generated
    for name, path in generated.items():
        if name.endswith(".ipynb"):
            # nbgrader's output is deterministic; JSON-equal ignores only formatting.
            assert json.loads(committed[name].read_text()) == json.loads(path.read_text()), hint
        else:
            assert committed[name].read_bytes() == path.read_bytes(), hint


def test_b_solution_gets_full_marks(lab: str, course: Course, mistaken: Mistaken) -> None:
    solution = scores(course.root, lab, "solution")
    max_score = sum(points for _, points in solution.values())
    assert max_score > 0
    assert {cell: score for cell, (score, _) in solution.items()} == {
        cell: points for cell, (_, points) in solution.items()
    }
    with open(course.root / "grades.csv") as exported:
        row = next(r for r in csv.DictReader(exported) if r["student_id"] == "solution")
    assert float(row["score"]) == float(row["max_score"]) == max_score


def test_c_untouched_lab_gets_zero(lab: str, course: Course, graded: Graded) -> None:
    untouched = scores(course.root, lab, "untouched")
    assert untouched and all(score == 0 for score, _ in untouched.values())
    assert "| ERROR]" not in graded.autograde_log, graded.autograde_log[-5000:]
    assert (course.root / "autograded" / "untouched" / lab / f"{lab}.ipynb").exists()


def test_d_wrong_answer_loses_only_its_points(lab: str, course: Course, mistaken: Mistaken) -> None:
    solution = scores(course.root, lab, "solution")
    submitted = scores(course.root, lab, "mistaken")
    assert {cell: submitted[cell][0] for cell in mistaken.wrong_cells} == dict.fromkeys(
        mistaken.wrong_cells, 0
    )
    for cell in mistaken.wrong_cells | mistaken.stuck_cells | mistaken.faked_cells:
        del solution[cell], submitted[cell]
    assert submitted == solution


def test_e_hangs_are_bounded_and_cleaned_up(lab: str, course: Course, mistaken: Mistaken) -> None:
    submitted = scores(course.root, lab, "mistaken")
    print(f"{lab}: graded the hanging submission in {mistaken.ran.seconds:.0f} s")
    # Each hang ends by its cell's limit, and autograde soon after the last cell: not a bound
    # on the whole run, whose other cells may run slower than the solution's did, at another
    # moment of the suite's load.
    limits = dict.fromkeys(("loop", "deadlock"), HANG_S + 5)
    assert mistaken.hang_s.keys() == limits.keys(), f"hang cells not found: {mistaken.hang_s}"
    for hang, limit in limits.items():
        assert mistaken.hang_s[hang] <= limit, (
            f"the {hang} should end within {limit} s; it ran {mistaken.hang_s[hang]:.1f} s")
    # Each further round of fakes or alternatives is one more notebook: its own kernel start
    # and end.
    notebooks = len(mistaken.faked) + len(mistaken.alternatives)
    overhead = mistaken.ran.seconds - mistaken.executed.seconds - mistaken.rounds_s
    assert overhead <= 30 * notebooks, (
        f"autograde should end within 30 s of each notebook's last cell; it took "
        f"{overhead:.0f} s more for {notebooks} notebook(s)")
    assert "Interrupting kernel" in mistaken.ran.output  # the loop was stopped, the kernel kept
    executed = read_notebook(course.root / "autograded" / "mistaken" / lab / f"{lab}.ipynb")
    looped = next(cell for cell in executed.cells if INFINITE_LOOP[-1] in cell.source.splitlines())
    said = "".join(output.get("text", "") for output in looped.outputs)
    assert timeout_message(HANG_S) in said, (
        f"the looping cell's output should say grading stopped it (tools/grading/timeouts.py); "
        f"it shows {said[:300]!r}")
    assert {cell: submitted[cell][0] for cell in mistaken.stuck_cells} == dict.fromkeys(
        mistaken.stuck_cells, 0
    )
    left_behind = [process for ran in course.runs for process in ran.left_behind]
    assert not left_behind, f"grading left processes running: {left_behind}"


def test_f_students_never_see_solutions_or_hidden_tests(
    lab: str, course: Course, mistaken: Mistaken
) -> None:
    secrets = secret_lines(course.solution)
    assert secrets, "no solution or hidden-test lines to look for"
    released = read_notebook(REPO / "labs" / lab / f"{lab}.ipynb")
    assert not (found := leaks(notebook_text(released), secrets)), f"labs/{lab} shows {found}"
    for student in ("untouched", "mistaken"):
        # What the student wrote is theirs to see; nothing else of the solution is.
        submitted = read_notebook(course.root / "submitted" / student / lab / f"{lab}.ipynb")
        submitted_text = notebook_text(submitted)
        unseen = {line for line in secrets if line not in submitted_text}
        feedback = html_text(course.root / "feedback" / student / lab / f"{lab}.html")
        assert not (found := leaks(feedback, unseen)), f"{student}'s feedback shows {found}"


def test_h_feedback_reads_offline(lab: str, course: Course, mistaken: Mistaken) -> None:
    """Feedback loads nothing from the network, and its math is MathML, not LaTeX."""
    latex = [
        cell.source for cell in course.released.cells
        if cell.cell_type == "markdown" and re.search(r"\$[^$\s]", cell.source)
    ]
    for student in ("solution", "untouched"):
        path = course.root / "feedback" / student / lab / f"{lab}.html"
        page = path.read_text()
        assert not (found := network_references(page)), f"{path.name} loads {found}"
        if latex:
            assert "<math" in page, f"{path.name} has no MathML, though {lab} has math"
            assert "$" not in html_text(path).replace("$$", ""), "LaTeX left in the feedback"


def network_references(html: str) -> list[str]:
    """Every http(s) resource an HTML page loads (scripts, styles, images, frames, CSS urls);
    plain links to other pages are not loaded, and are fine."""
    loads = re.findall(
        r"<(?:script|img|iframe|source|embed)\b[^>]*\bsrc=[\"']?(https?://[^\"' >]+)", html, re.I
    )
    loads += re.findall(r"<link\b[^>]*\bhref=[\"']?(https?://[^\"' >]+)", html, re.I)
    loads += re.findall(r"(?:url\(|@import\s+)[\"']?(https?://[^\"' )]+)", html, re.I)
    return loads


def test_g_solution_runs_headless_and_states_its_budget(lab: str, graded: Graded) -> None:
    """The solution ran headless under autograde (test b scores it). Its time is printed, not
    asserted: a busy machine is slower, and a test that flakes with the load blocks landing.
    `bench/lab_run_times.py` holds every lab to its budget on a quiet machine."""
    executed = graded.executed
    budget = BUDGETS_S.get(lab, BUDGET_S)
    print(f"{lab}: ran in {executed.seconds:.1f} s (slowest cell {executed.slowest_cell_s:.1f} s;"
          f" budget {budget} s on a quiet 2-core machine)")
    if budget > BUDGET_S:  # a lab allowed more says so, with its budget
        released = notebook_text(read_notebook(REPO / "labs" / lab / f"{lab}.ipynb"))
        assert f"{budget} s" in released, f"{lab} should state its budget of {budget} s"


def test_i_every_fake_scores_zero_on_the_checks_of_its_exercise(
    lab: str, course: Course, graded: Graded, mistaken: Mistaken
) -> None:
    """A fake gets the final numbers right while skipping the mechanism its exercise teaches
    (tests/fakes/); it must earn nothing on the cells that check that exercise, while the
    solution, graded in the same course, earns full marks (test b). A fake tried in the
    solution's notebook must make each of those checks raise, and the solution must pass them
    all after it (else the trial's verdicts mean nothing): the notebook's own run of them,
    after the trials (test b), or, for an exercise tried by section, the solution run through
    them again."""
    if not fakes_of(lab):
        pytest.skip(f"{lab} has no fakes yet (tests/fakes/{lab}.py)")
    earned = []
    for student, fakes in mistaken.faked.items():
        got = scores(course.root, lab, student)
        for fake in fakes:
            earned += [f"{fake.name!r} ({fake.skips}) earned {got[cell][0]} of {got[cell][1]} "
                       f"on {cell}" for cell in fake.checked_by if got[cell][0] > 0]
    for trial in graded.trials:
        raised = graded.outcomes.get(trial.key)
        if raised is None:
            earned.append(f"{trial.key!r} never reported: its trial cell did not finish")
        elif trial.kind == "fake":
            earned += [f"{trial.key!r} passed {cell} (tried in the solution's notebook)"
                       for cell in trial.checked_by if cell in raised and raised[cell] is None]
        elif trial.kind == "solution":
            earned += [f"{trial.key!r} failed {cell}: {error} (a fake tried before it left the "
                       f"notebook changed; its verdicts cannot be trusted)"
                       for cell, error in raised.items() if error is not None]
    assert not earned, f"{lab}: fakes earned points:\n" + "\n".join(earned)


@pytest.mark.parametrize("lab", [lab for lab in LABS if alternatives_of(lab)], indirect=True)
def test_j_correct_alternatives_score_full(lab: str, course: Course, graded: Graded,
                                          mistaken: Mistaken) -> None:
    """The mirror of test i: an answer the spec allows, though the solution does it otherwise
    (tests/fakes/, ALTERNATIVES), earns full marks on the cells that check its exercise. The
    lowered cell timeout of this autograde is three times the solution's slowest cell. Only
    the labs that have alternatives are parametrized: the others have nothing to check."""
    tried = [trial for trial in graded.trials if trial.kind == "alternative"]
    assert mistaken.alternatives or tried, f"{lab}: its alternatives were not submitted"
    lost = []
    for trial in tried:
        raised = graded.outcomes.get(trial.key) or {}
        lost += [f"{trial.key!r} raised on {cell}: {raised.get(cell, 'never ran')}"
                 for cell in trial.checked_by if raised.get(cell, "never ran") is not None]
    for student, alternatives in mistaken.alternatives.items():
        got = scores(course.root, lab, student)
        for alternative in alternatives:
            lost += [f"{alternative.name!r} ({alternative.why}) earned {got[cell][0]} of "
                     f"{got[cell][1]} on {cell}"
                     for cell in alternative.checked_by if got[cell][0] < got[cell][1]]
    assert not lost, f"{lab}: correct alternatives lost points:\n" + "\n".join(lost)


@pytest.mark.parametrize("lab", LABS)
def test_every_stub_names_its_exercise_and_how_to_go_on(lab: str) -> None:
    """Run All stops at the first check of an unwritten exercise: the student's stub says which
    exercise it is and how to run the cells below it (tools/grading/stubs.py), never a bare
    NotImplementedError."""
    released = read_notebook(REPO / "labs" / lab / f"{lab}.ipynb")
    for cell in released.cells:
        grade_id = nbgrader_meta(cell).get("grade_id")
        if cell.cell_type != "code" or "NotImplementedError" not in cell.source:
            continue
        raised = [node.exc for node in ast.walk(ast.parse(without_magics(cell.source)))
                  if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                  and getattr(node.exc.func, "id", "") == "NotImplementedError"]
        assert raised, f"{lab}: {grade_id}'s stub raises a bare NotImplementedError"
        for call in raised:
            message = ast.literal_eval(call.args[0]) if call.args else ""
            assert (f"(cell {grade_id})" in message
                    and "Run Selected Cell and All Below" in message), (
                f"{lab}: {grade_id}'s stub should name its cell and say how to run the cells "
                f"below it; it says {message!r}")


@pytest.mark.parametrize("lab", LABS)
def test_every_exercise_has_three_fakes_and_every_graded_cell_hidden_tests(lab: str) -> None:
    """Read from the sources alone (test i grades the fakes): an implementation exercise (a
    solution cell that defines a function) needs at least three fakes, and a graded test cell
    that students can read in full would grade only what they can see."""
    cells = read_notebook(REPO / "solutions" / lab / f"{lab}.ipynb").cells
    exercises = [nbgrader_meta(cell)["grade_id"] for cell in cells
                 if nbgrader_meta(cell).get("solution") and cell.cell_type == "code"
                 and "def " in cell.source]
    faked = fakes_of(lab)
    short = {grade_id: len(faked.get(grade_id, [])) for grade_id in exercises
             if len(faked.get(grade_id, [])) < 3}
    assert not short, (
        f"{lab}: exercises with fewer than three fakes in tests/fakes/{lab}.py: {short}")
    assert set(faked) <= set(exercises), (
        f"{lab}: fakes of cells that are not implementation exercises: "
        f"{sorted(set(faked) - set(exercises))}")
    alternatives = alternatives_of(lab)
    assert set(alternatives) <= set(exercises), (
        f"{lab}: correct alternatives of cells that are not implementation exercises: "
        f"{sorted(set(alternatives) - set(exercises))}")
    open_tests = [nbgrader_meta(cell)["grade_id"] for cell in cells
                  if nbgrader_meta(cell).get("grade") and not nbgrader_meta(cell).get("solution")
                  and HIDDEN_TESTS[0] not in cell.source]
    assert not open_tests, f"{lab}: graded test cells without hidden tests: {open_tests}"
