"""Predictions graded as first committed (minidist.core.predictions, tools/grading/predictions.py).

The ledger on its own, then a student's notebook edited as a student would: a prediction
committed, its measurement shown, the prediction changed and its cell run again. Autograde
scores that prediction 0 and the instructor's report lists it; an honest notebook keeps full
marks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from minidist.core.predictions import (
    LEDGER_NAME,
    PredictionNotCommitted,
    assert_committed_unchanged,
    canonical,
    commit,
    read_ledger,
    reveal,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_grading import (  # noqa: E402
    AUTOGRADE,
    COLLECT,
    GENERATE,
    REPO,
    Course,
    answered,
    cut_below,
    empty_gradebook,
    nbgrader_meta,
    read_notebook,
    run_in_course,
    scores,
)
from test_self_grade import course_copy, make_grade  # noqa: E402

LAB = "02_memory_math"  # the cheapest lab whose first prediction is measured within a few cells
PREDICTION = "fp32_adam_bytes"


def test_a_prediction_changed_after_its_measurement_fails_and_one_put_back_passes(tmp_path):
    ledger = tmp_path / LEDGER_NAME
    with pytest.raises(PredictionNotCommitted, match="x is not committed"):
        reveal("x", ledger=ledger)
    commit("x", 3, ledger=ledger)
    commit("x", 4, ledger=ledger)  # changed before the measurement: free
    reveal("x", ledger=ledger)
    commit("x", 4.0, ledger=ledger)  # the same number written another way
    assert_committed_unchanged("x", 4, ledger=ledger)
    with pytest.raises(AssertionError, match="is 5.0 but 4.0 was committed"):
        assert_committed_unchanged("x", 5, ledger=ledger)  # set again after its commit
    commit("x", 5, ledger=ledger)
    with pytest.raises(AssertionError, match="it was 4.0 then and is 5.0 now"):
        assert_committed_unchanged("x", 5, ledger=ledger)
    commit("x", 4, ledger=ledger)
    assert_committed_unchanged("x", 4, ledger=ledger)
    events, verified = read_ledger(ledger)
    assert verified and [e.kind for e in events] == ["commit"] * 2 + ["reveal"] + ["commit"] * 2


def test_an_edited_ledger_no_longer_verifies(tmp_path):
    ledger = tmp_path / LEDGER_NAME
    commit("x", 1, ledger=ledger)
    reveal("x", ledger=ledger)
    stored = json.loads(ledger.read_text())
    stored["events"][0]["value"] = 2.0
    ledger.write_text(json.dumps(stored))
    assert read_ledger(ledger)[1] is False


def test_a_file_that_is_not_a_ledger_reads_as_empty_and_unverified(tmp_path):
    ledger = tmp_path / LEDGER_NAME
    for text in ("{}", "not json", '{"events": [{"name": "x"}]}'):
        ledger.write_text(text)
        assert read_ledger(ledger) == ([], False), text
    commit("x", 1, ledger=ledger)  # a fresh ledger replaces it
    assert read_ledger(ledger)[1] and len(read_ledger(ledger)[0]) == 1


def test_values_compare_as_numbers_not_as_spellings():
    assert canonical({2: 3, 3: 4.0}) == canonical({"2": 3.0, "3": 4})
    assert canonical((1, 2)) == canonical([1.0, 2.0])
    assert canonical(float("nan")) == canonical(float("nan"))
    assert canonical(object()) != canonical(1)


def first_prediction_cells(notebook: nbformat.NotebookNode) -> tuple[int, int, int]:
    """(prediction cell, its measurement cell, its test cell) of PREDICTION."""
    ids = [nbgrader_meta(cell).get("grade_id", "") for cell in notebook.cells]
    prediction = ids.index(f"prediction-{PREDICTION}")
    test = ids.index(f"test-prediction-{PREDICTION}")
    measurement = next(i for i, cell in enumerate(notebook.cells)
                       if i > prediction and f'reveal("{PREDICTION}")' in cell.source)
    return prediction, measurement, test


def student_session(notebook: nbformat.NotebookNode, folder: Path, changed_to: str | None):
    """Run the notebook as a student would, up to the prediction's test cell; with
    `changed_to`, then edit the prediction cell to it and run that cell and the test again."""
    prediction, measurement, test = first_prediction_cells(notebook)
    client = NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}})
    with client.setup_kernel():
        for index in range(test + 1):
            if notebook.cells[index].cell_type == "code":
                client.execute_cell(notebook.cells[index], index)
        if changed_to is not None:
            notebook.cells[prediction].source = changed_to
            client.execute_cell(notebook.cells[prediction], prediction)
            client.execute_cell(notebook.cells[test], test)
    assert any(f'"{PREDICTION}"' in json.dumps(output.get("data", {}))
               for output in notebook.cells[measurement].outputs), "the measurement's record"


def test_autograde_and_the_report_catch_a_prediction_changed_after_its_measurement(tmp_path):
    root = tmp_path / "course"
    (root / "solutions").mkdir(parents=True)
    for name in ("nbgrader_config.py",):
        (root / name).write_bytes((REPO / name).read_bytes())
    subprocess.run(["cp", "-r", str(REPO / "tools"), str(root / "tools")], check=True)
    subprocess.run(["cp", "-r", str(REPO / "solutions" / LAB), str(root / "solutions")],
                   check=True)
    (root / ".venv").symlink_to(REPO / ".venv")
    (root / "gradebook.db").write_bytes(empty_gradebook())
    course = Course(root, read_notebook(REPO / "solutions" / LAB / f"{LAB}.ipynb"), None, {})
    course.run(GENERATE, LAB)
    released = read_notebook(root / "labs" / LAB / f"{LAB}.ipynb")
    solved = answered(released, course.solution)
    prediction, _, _ = first_prediction_cells(solved)
    correct = solved.cells[prediction].source
    # well formed, so that only the hidden test can fail it: half of each right number
    wrong, count = re.subn(rf"^prediction_{PREDICTION} = .*$",
                           f"prediction_{PREDICTION} = (2, 2, 4)", correct, flags=re.M)
    assert count == 1, correct

    # "changer" commits a wrong one, sees the measurement, then writes the right one;
    # "rethinker" commits a first guess, then changes it to the right one before measuring
    # (an honest student who commits once is every lab's solution: test_grading's test_b);
    # "overwriter" keeps the wrong commit but sets the variable right in the measurement cell.
    sessions = {"changer": (wrong, correct), "rethinker": (correct, None),
                "overwriter": (wrong, None)}
    notebooks = {}
    for student, (first, then) in sessions.items():
        notebook = nbformat.from_dict(json.loads(json.dumps(solved)))
        folder = tmp_path / student
        folder.mkdir()
        notebook.cells[prediction].source = first
        if student == "overwriter":
            _, measurement, _ = first_prediction_cells(notebook)
            notebook.cells[measurement].source += f"\nprediction_{PREDICTION} = (4, 4, 8)"
        if student == "rethinker":
            commit(PREDICTION, "a first guess", ledger=folder / LEDGER_NAME)
        student_session(notebook, folder, then)
        cut_below(notebook, {f"test-prediction-{PREDICTION}"})
        course.submit(LAB, student, notebook)
        notebooks[student] = notebook
    course.run(COLLECT, LAB)
    course.run(AUTOGRADE, LAB)

    cell = f"test-prediction-{PREDICTION}"
    got = {student: scores(root, LAB, student)[cell] for student in sessions}
    assert got["rethinker"][0] == got["rethinker"][1] > 0, f"changed before measuring: {got}"
    assert got["changer"][0] == 0, f"changed after the measurement: {got['changer']}"
    assert got["overwriter"][0] == 0, f"set again after its commit: {got['overwriter']}"
    feedback = nbformat.read(root / "autograded" / "changer" / LAB / f"{LAB}.ipynb", 4)
    test_cell = next(c for c in feedback.cells if nbgrader_meta(c).get("grade_id") == cell)
    assert "changed after its measurement was shown" in json.dumps(test_cell.outputs)

    report = run_in_course(root, ".venv/bin/python tools/grading/predictions.py", LAB).output
    assert f"changer  {LAB}  {PREDICTION} = " in report and "CHANGED" in report, report
    assert not {"rethinker", "overwriter"} & set(report.split()), report
    assert "1 prediction(s) changed after their measurement was shown" in report, report

    # A self-learner's `make grade` reads the same history, from the notebook and the ledger.
    own = course_copy(tmp_path / "self-study")
    (own / "my-labs" / LAB / LEDGER_NAME).write_bytes((tmp_path / "changer" / LEDGER_NAME)
                                                      .read_bytes())
    graded = make_grade(own, LAB, notebooks["changer"])
    assert graded.returncode == 0, graded.output
    assert graded.points()[cell][0] == 0, graded.output
    assert "changed after its measurement was shown" in graded.feedback(cell), graded.output
