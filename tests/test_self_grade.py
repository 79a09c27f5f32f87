"""`make grade LAB=NN`, the self-learner's grader (tools/grade.py), as a learner runs it.

In a temporary copy of the course (never this checkout's my-labs/), one cheap lab is graded as
the learner left it: untouched, the solution filled in, and with the first fake of each
exercise (tests/fakes/). The same command then runs in a student-release tree, which has no
hidden tests. Each run's duration is printed, not asserted: the machine may be busy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from fakes import Fake, fakes_of, rounds
from nbformat import NotebookNode
from test_grading import HIDDEN_TESTS, answered, nbgrader_meta, read_notebook, split_region

# One worker runs them all: the course copies are made once.
pytestmark = pytest.mark.xdist_group("self_grade")

REPO = Path(__file__).resolve().parents[1]
LAB = "00_first_ranks"  # the cheapest lab to grade: about 20 s for `make grade` on 2 cores
GRADE_LIMIT_S = 300  # a run past this is killed: the test must not hang
# What a course copy needs to grade (lib/ is the installed minidist's, through the env).
COURSE_FILES = ("labs", "tools", "solutions", "nbgrader_config.py", "Makefile",
                "requirements.txt", "pyproject.toml")
# What the student release leaves out (Makefile's RELEASED).
INSTRUCTOR_ONLY = ("solutions", "tests", "tools/grading", "nbgrader_config.py")
GRADED_CELL = re.compile(r"^  (\S+)\s+([\d.]+) / ([\d.]+)$", re.M)
RELEASE_CELL = re.compile(r"^  (\S+)\s+(passed|FAILED)$", re.M)
TOTAL = re.compile(r"^Total: ([\d.]+) / ([\d.]+) points$", re.M)


@dataclass
class Graded:
    returncode: int
    output: str
    seconds: float

    def points(self) -> dict[str, tuple[float, float]]:
        return {cell: (float(score), float(possible))
                for cell, score, possible in GRADED_CELL.findall(self.output)}

    def total(self) -> tuple[float, float]:
        found = TOTAL.search(self.output)
        assert found, f"no total printed:\n{self.output}"
        return float(found[1]), float(found[2])

    def feedback(self, cell: str) -> str:
        """The lines printed under a graded cell's score."""
        found = re.search(rf"^  {re.escape(cell)}\s.*\n((?:      .*\n)*)", self.output, re.M)
        assert found, f"{cell} not printed:\n{self.output}"
        return found[1]


def course_copy(root: Path, release: bool = False) -> Path:
    """This checkout's course (working tree) in `root`, with its own my-labs/ made as
    `make lab` does; `release` leaves out what the student release does."""
    for name in COURSE_FILES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, root / name,
                            ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
        else:
            shutil.copy2(source, root / name)
    if release:
        for name in INSTRUCTOR_ONLY:
            if (root / name).is_dir():
                shutil.rmtree(root / name)
            elif (root / name).exists():
                (root / name).unlink()
    (root / ".venv").symlink_to(REPO / ".venv")
    # Older than make's install stamp in the shared .venv: `make grade` installs nothing.
    for name in ("requirements.txt", "pyproject.toml"):
        os.utime(root / name, (0, 0))
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), "tools/my_labs.py", "copy"],
                   cwd=root, check=True, capture_output=True, timeout=60)
    return root


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def make_grade(course: Path, lab: str, notebook: NotebookNode | None = None) -> Graded:
    """Save `notebook` as the learner's copy of `lab` (if given), run `make grade LAB=<lab>`,
    and check that my-labs/ is byte for byte as it was."""
    if notebook is not None:
        nbformat.write(notebook, course / "my-labs" / lab / f"{lab}.ipynb")
    before = snapshot(course / "my-labs")
    start = time.monotonic()
    done = subprocess.run(["make", "--no-print-directory", "grade", f"LAB={lab}"], cwd=course,
                          capture_output=True, text=True, timeout=GRADE_LIMIT_S)
    graded = Graded(done.returncode, done.stdout + done.stderr, time.monotonic() - start)
    print(f"make grade LAB={lab} in {course.name}: {graded.seconds:.0f} s\n{graded.output}")
    assert snapshot(course / "my-labs") == before, "make grade changed my-labs/"
    return graded


def solution() -> NotebookNode:
    return read_notebook(REPO / "solutions" / LAB / f"{LAB}.ipynb")


def released() -> NotebookNode:
    return read_notebook(REPO / "labs" / LAB / f"{LAB}.ipynb")


def first_fakes() -> dict[str, Fake]:
    found = rounds(fakes_of(LAB))
    assert found, f"{LAB} has no fakes in tests/fakes/"
    return found[0]


def faked() -> NotebookNode:
    """The solution with the first fake of each exercise in its solution region."""
    return answered(released(), solution(),
                    {cell: fake.source.splitlines() for cell, fake in first_fakes().items()})


def hidden_test_lines() -> set[str]:
    return {line.strip() for cell in solution().cells if nbgrader_meta(cell).get("grade")
            for line in split_region(cell.source, HIDDEN_TESTS)[1] if len(line.strip()) >= 6}


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = course_copy(tmp_path_factory.mktemp("course"))
    # A hidden file beside the notebook travels with it (committed predictions will).
    (root / "my-labs" / LAB / ".predictions.json").write_text("{}\n")
    return root


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return course_copy(tmp_path_factory.mktemp("release"), release=True)


def test_a_untouched_lab_scores_zero(course: Path) -> None:
    graded = make_grade(course, LAB)
    assert graded.returncode == 0, graded.output
    points = graded.points()
    assert points and all(score == 0 for score, _ in points.values()), points
    possible = sum(possible for _, possible in points.values())
    assert possible > 0 and graded.total() == (0, possible)


def test_b_solution_gets_full_marks(course: Path) -> None:
    graded = make_grade(course, LAB, answered(released(), solution()))
    assert graded.returncode == 0, graded.output
    points = graded.points()
    assert points and all(score == possible for score, possible in points.values()), points
    assert graded.total()[0] == graded.total()[1] > 0


def test_c_a_fake_loses_its_exercise_with_the_message_and_no_hidden_test(course: Path) -> None:
    graded = make_grade(course, LAB, faked())
    assert graded.returncode == 0, graded.output
    points = graded.points()
    checked = {cell for fake in first_fakes().values() for cell in fake.checked_by}
    assert {cell: points[cell][0] for cell in checked} == dict.fromkeys(checked, 0)
    assert all(score == possible for cell, (score, possible) in points.items()
               if cell not in checked), points
    for cell in checked:  # the failing assert's type and message
        assert re.search(r"AssertionError: \S", graded.feedback(cell)), graded.feedback(cell)
    hidden = hidden_test_lines()
    assert hidden, f"no hidden tests found in solutions/{LAB}"
    shown = [line for line in hidden if line in graded.output]
    assert not shown, f"make grade printed hidden tests: {shown}"
    assert HIDDEN_TESTS[0] not in graded.output


def test_d_mistakes_are_named_before_anything_runs(course: Path) -> None:
    for lab, says in (("", "say which lab"), ("99", "LAB=99"), ("3", "LAB=03")):
        graded = make_grade(course, lab)
        assert graded.returncode != 0 and says in graded.output, graded.output
        assert LAB in graded.output, "the labs should be listed"
    shutil.rmtree(course / "my-labs" / "01_collectives")
    graded = make_grade(course, "01")
    assert graded.returncode != 0, graded.output
    assert "my-labs/01_collectives" in graded.output and "make lab" in graded.output


def test_e_release_runs_the_visible_tests_and_says_there_are_no_hidden_ones(
    release: Path,
) -> None:
    assert not (release / "solutions").exists() and not (release / "tools" / "grading").exists()
    graded = make_grade(release, LAB, faked())
    assert graded.returncode == 0, graded.output
    assert "no hidden tests" in graded.output
    results = dict(RELEASE_CELL.findall(graded.output))
    tests = [nbgrader_meta(cell)["grade_id"] for cell in released().cells
             if nbgrader_meta(cell).get("grade") and not nbgrader_meta(cell).get("solution")]
    assert sorted(results) == sorted(tests), results
    checked = {cell for fake in first_fakes().values() for cell in fake.checked_by}
    # The fakes fail the visible tests too (they check the mechanism), the rest pass.
    assert {cell for cell, result in results.items() if result == "FAILED"} == checked, results
    for cell in checked:
        assert re.search(r"AssertionError: \S", graded.feedback(cell)), graded.feedback(cell)
