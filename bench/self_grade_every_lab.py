"""`make grade LAB=NN` on every lab, as a self-learner runs it: untouched, solved, and faked.

    python bench/self_grade_every_lab.py [LAB ...]

In one temporary copy of the course (tests/test_self_grade.py's, never this checkout's
my-labs/), each lab's copy in my-labs/ is graded three times: as `make lab` left it, with the
solution filled in, and with the first fake of each exercise (tests/fakes/). It prints the
points of each, the cells each fake lost with the first line of their feedback, and the seconds
each `make grade` took (the budget is 90 s a lab on 2 cores). Exits non-zero unless untouched
scores 0, the solution full marks, and every fake 0 on the cells that check its exercise.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from fakes import fakes_of, rounds  # noqa: E402
from test_grading import LABS, answered, read_notebook  # noqa: E402
from test_self_grade import course_copy, make_grade  # noqa: E402

BUDGET_S = 90


def regions(source: str | tuple[str, ...]) -> list[str] | tuple[list[str], ...]:
    """A fake's source as `answered` takes it: lines, or lines per region of a cell with
    several."""
    return (tuple(part.splitlines() for part in source) if isinstance(source, tuple)
            else source.splitlines())


def grade_lab(course: Path, lab: str) -> list[str]:
    """Grade `lab` three ways; returns what went wrong (nothing when all three hold)."""
    solution = read_notebook(REPO / "solutions" / lab / f"{lab}.ipynb")
    released = read_notebook(REPO / "labs" / lab / f"{lab}.ipynb")
    fakes = rounds(fakes_of(lab))[0]
    faked = answered(released, solution,
                     {cell: regions(fake.source) for cell, fake in fakes.items()})
    wrong = []
    for name, notebook in (("untouched", None), ("solution", answered(released, solution)),
                           ("fakes", faked)):
        graded = make_grade(course, lab, notebook)
        if graded.returncode != 0:
            wrong.append(f"{name}: make grade exited {graded.returncode}")
            continue
        points = graded.points()
        got, possible = graded.total()
        checked = {cell for fake in fakes.values() for cell in fake.checked_by}
        lost = sorted(cell for cell, (score, top) in points.items() if score < top)
        print(f"{lab} {name:>9}: {got:g} / {possible:g} in {graded.seconds:.0f} s"
              + (f"; lost {', '.join(lost)}" if name == "fakes" else ""), flush=True)
        if name == "fakes":
            for cell in sorted(checked):
                first = graded.feedback(cell).strip().splitlines()[:1]
                print(f"    {cell}: {first[0] if first else '(no message)'}"[:150])
        if name == "untouched" and got != 0:
            wrong.append(f"untouched scored {got}")
        if name == "solution" and got != possible:
            wrong.append(f"solution lost {lost}")
        if name == "fakes" and any(points[cell][0] > 0 for cell in checked):
            wrong.append(f"a fake earned points on {[c for c in checked if points[c][0] > 0]}")
        if graded.seconds > BUDGET_S:
            wrong.append(f"{name} took {graded.seconds:.0f} s, over {BUDGET_S} s")
    return wrong


def main(names: list[str]) -> int:
    labs = [lab for lab in LABS if not names or any(lab.startswith(n) for n in names)]
    problems = []
    with tempfile.TemporaryDirectory(prefix="self-grade-") as folder:
        course = course_copy(Path(folder))
        for lab in labs:
            problems += [f"{lab}: {problem}" for problem in grade_lab(course, lab)]
    print("\n".join(problems) or f"make grade held on {len(labs)} labs")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
