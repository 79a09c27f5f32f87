"""Proof that no grade depends on the machine: each lab's solution, autograded three ways.

    python bench/grading_on_any_machine.py [LAB ...] [--timeout 600]

For each lab (all of solutions/ by default, or those named: `08_profiling` or just `08`),
this builds a temporary course as tests/test_grading.py does (copies of nbgrader_config.py,
tools/, solutions/<lab> and a .venv symlink; the student version generated with the
instructor's command), submits the released notebook with every solution region filled in,
and autogrades that submission under three conditions:

* `1 core`: the autograde under `taskset -c 0`, its kernel and every rank on one core;
* `busy`: on the machine's cores, beside 4 busy processes (`while True: pass`), killed after;
* `plain`: on the machine's cores, nothing else started.

It prints a table lab x condition -> score / max and seconds, and exits non-zero unless
every autograde gave full marks. Each autograde runs under a time limit (--timeout), every
process it left behind is killed (test_grading's markers), and the busy processes run in a
process group of their own that is killed however this script ends.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import test_grading as grading  # noqa: E402  (the grading tests' course and submissions)

BUSY_PROCESSES = 4
CONDITIONS = ("1 core", "busy", "plain")


@dataclass
class Outcome:
    score: float | None  # None when the autograde itself failed or timed out
    max_score: float | None
    seconds: float
    note: str = ""

    @property
    def full(self) -> bool:
        return self.score is not None and self.max_score and self.score >= self.max_score


def build_course(lab: str, root: Path) -> None:
    """A course of just this lab, the solution submitted once per condition."""
    shutil.copy(REPO / "nbgrader_config.py", root)
    shutil.copytree(REPO / "tools", root / "tools")
    shutil.copytree(REPO / "solutions" / lab, root / "solutions" / lab)
    (root / ".venv").symlink_to(REPO / ".venv")
    grading.run_in_course(root, grading.GENERATE, lab)
    solution = grading.read_notebook(root / "solutions" / lab / f"{lab}.ipynb")
    released = grading.read_notebook(root / "labs" / lab / f"{lab}.ipynb")
    submission = grading.answered(released, solution)
    incoming = root / "incoming" / lab
    incoming.mkdir(parents=True)
    for condition in CONDITIONS:
        grading.nbformat.write(submission, incoming / f"{student(condition)}.ipynb")
    grading.run_in_course(root, grading.COLLECT, lab)


def student(condition: str) -> str:
    return "solution_" + condition.replace(" ", "_")


def start_busy() -> subprocess.Popen:
    """BUSY_PROCESSES spinning processes in one new process group (a shell's children)."""
    spin = f"{sys.executable} -c 'while True: pass'"
    script = " & ".join([spin] * BUSY_PROCESSES) + " & wait"
    busy = subprocess.Popen(["bash", "-c", script], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Wait until all of them spin: one started after the autograde would look like a
    # process the autograde left behind.
    deadline = time.monotonic() + 10
    while len(psutil.Process(busy.pid).children()) < BUSY_PROCESSES and time.monotonic() < deadline:
        time.sleep(0.05)
    return busy


def stop_busy(busy: subprocess.Popen | None) -> None:
    if busy is None:
        return
    try:
        os.killpg(busy.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    busy.wait()


def autograde(root: Path, lab: str, condition: str) -> Outcome:
    name = student(condition)
    command = f"{grading.AUTOGRADE} --student={name}"
    if condition == "1 core":
        command = "taskset -c 0 " + command
    busy = start_busy() if condition == "busy" else None
    try:
        ran = grading.run_in_course(root, command, lab)
    except AssertionError as error:  # the command failed or was killed at the time limit
        return Outcome(None, None, float("nan"), str(error).splitlines()[0][:120])
    finally:
        stop_busy(busy)
    graded = grading.scores(root, lab, name)
    score = sum(score for score, _ in graded.values())
    max_score = sum(max_score for _, max_score in graded.values())
    lost = [grade_id for grade_id, (s, m) in graded.items() if s < m]
    note = ("lost: " + ", ".join(lost)) if lost else ""
    if ran.left_behind:
        note += f" ({len(ran.left_behind)} processes left behind, killed)"
    return Outcome(score, max_score, ran.seconds, note.strip())


def shown(outcome: Outcome) -> str:
    if outcome.score is None:
        return "failed"
    return f"{outcome.score:g}/{outcome.max_score:g}"


def labs_named(names: list[str]) -> list[str]:
    if not names:
        return grading.LABS
    chosen = []
    for name in names:
        matches = [lab for lab in grading.LABS if lab == name or lab.startswith(f"{name}_")]
        if len(matches) != 1:
            raise SystemExit(f"{name!r} names no single lab of {grading.LABS}")
        chosen += matches
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("labs", nargs="*", help="labs to grade (default: every lab)")
    parser.add_argument("--timeout", type=int, default=grading.COMMAND_LIMIT_S,
                        help="seconds one autograde may run before it is killed")
    args = parser.parse_args()
    grading.COMMAND_LIMIT_S = args.timeout
    # The worktree's library, whatever the shared virtual environment installed.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "lib"), *filter(None, [os.environ.get("PYTHONPATH")])])
    # SIGTERM ends the script through its finally blocks, like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cores} cores for this process; conditions: {', '.join(CONDITIONS)} "
          f"(busy = {BUSY_PROCESSES} spinning processes beside the autograde)", flush=True)

    table: dict[str, dict[str, Outcome]] = {}
    for lab in labs_named(args.labs):
        table[lab] = {}
        with tempfile.TemporaryDirectory(prefix=f"{lab}-any-machine-") as folder:
            build_course(lab, Path(folder))
            for condition in CONDITIONS:
                outcome = autograde(Path(folder), lab, condition)
                table[lab][condition] = outcome
                print(f"{lab} [{condition}]: {shown(outcome)} in {outcome.seconds:.0f} s "
                      f"{outcome.note}", flush=True)

    print()
    header = f"{'lab':28s}" + "".join(f"{condition:>18s}" for condition in CONDITIONS)
    print(header)
    print("-" * len(header))
    for lab, row in table.items():
        cells = []
        for condition in CONDITIONS:
            o = row[condition]
            cells.append(f"{shown(o) + ('' if o.full else ' !'):>10s} {o.seconds:5.0f} s")
        print(f"{lab:28s}" + "".join(f"{c:>18s}" for c in cells))
    notes = [(lab, c, o.note) for lab, row in table.items() for c, o in row.items() if o.note]
    for lab, condition, note in notes:
        print(f"  {lab} [{condition}]: {note}")
    failed = [(lab, c) for lab, row in table.items() for c, o in row.items() if not o.full]
    print("every autograde gave full marks" if not failed
          else f"not full marks: {', '.join(f'{lab} [{c}]' for lab, c in failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
