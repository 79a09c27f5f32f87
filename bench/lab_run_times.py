"""How long each lab's solution takes to run top to bottom, headless, against its budget.

    python bench/lab_run_times.py [LAB ...]

The course promises every lab runs in 60 s on a 2-core laptop CPU (the capstone, which trains
a model to its target three times, in the 120 s it states). Each solution notebook runs in a
scratch copy of its folder with the labs' kernel, one after another; the table gives the time
from the first cell's start to the last cell's end and the slowest cell. Run it on a quiet
machine: a busy one is slower, which is why the test suite reports these times but does not
assert them. Exits non-zero if a lab is over its budget or raises.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 60
BUDGETS_S = {"14_capstone": 120}


Span = tuple[nbformat.NotebookNode, datetime, datetime]


def cell_spans(notebook: nbformat.NotebookNode) -> list[Span]:
    """Each executed cell with the start and end times nbclient recorded in it."""
    return [
        (cell, datetime.fromisoformat(timing["iopub.execute_input"]),
         datetime.fromisoformat(timing["shell.execute_reply"]))
        for cell in notebook.cells
        if "iopub.execute_input" in (timing := cell.metadata.get("execution", {}))
    ]


def seconds_and_slowest(notebook: nbformat.NotebookNode) -> tuple[float, float]:
    """An executed notebook's seconds from its first cell's start to its last cell's end, and
    its slowest cell's seconds, from the times nbclient recorded."""
    spans = cell_spans(notebook)
    if not spans:
        raise ValueError("the notebook records no cell timings: was it executed?")
    return ((spans[-1][2] - spans[0][1]).total_seconds(),
            max((end - start).total_seconds() for _, start, end in spans))


def run_time(lab: str) -> tuple[float, float, list[str]]:
    """(seconds top to bottom, slowest cell's seconds, the cells that raised) of `lab`'s
    solution, run in a scratch copy of its folder."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / lab
        shutil.copytree(REPO / "solutions" / lab, folder)
        notebook = nbformat.read(folder / f"{lab}.ipynb", as_version=4)
        client = NotebookClient(notebook, timeout=600, kernel_name="python3", allow_errors=True,
                                record_timing=True, resources={"metadata": {"path": str(folder)}})
        client.execute()
    raised = [cell.metadata.get("nbgrader", {}).get("grade_id", f"cell {index}")
              for index, cell in enumerate(notebook.cells)
              for output in cell.get("outputs", []) if output.output_type == "error"]
    return (*seconds_and_slowest(notebook), raised)


def main(labs: list[str]) -> int:
    labs = labs or sorted(path.name for path in (REPO / "solutions").iterdir()
                          if path.is_dir() and path.name[:2].isdigit())
    failed = False
    print(f"{'lab':28} {'seconds':>8} {'budget':>7} {'slowest cell':>13}")
    for lab in labs:
        seconds, slowest, raised = run_time(lab)
        budget = BUDGETS_S.get(lab, BUDGET_S)
        verdict = "over budget" if seconds > budget else ""
        if raised:
            verdict = f"raised in {', '.join(raised)}"
        failed |= bool(verdict)
        print(f"{lab:28} {seconds:8.1f} {budget:7d} {slowest:13.1f}  {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
