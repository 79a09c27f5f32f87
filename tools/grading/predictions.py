"""Predictions graded as first committed (minidist.core.predictions), on the instructor's side.

A submitted notebook carries each prediction's history in its outputs (the records that
`commit` and `reveal` display), and the ledger file beside it when the submission kept it.
nbgrader's autograde clears outputs before it runs the notebook again, so two preprocessors
carry the history across, and the report lists what was changed after its measurement:

    KeepPredictionRecords    sanitize step, before ClearOutput: the history, from the outputs
                             and the submitted ledger, into the notebook's metadata
    RestorePredictionLedger  autograde step, before Execute: that history written as the
                             ledger beside the notebook, which the hidden tests then read

    python tools/grading/predictions.py [COURSE_ROOT]
        every prediction in submitted/ changed after its measurement was shown
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode
from nbgrader.preprocessors import NbGraderPreprocessor

from minidist.core.predictions import (
    LEDGER_NAME,
    MIME_TYPE,
    History,
    chain,
    history,
    read_ledger,
    write_ledger,
)

__all__ = ["KeepPredictionRecords", "RestorePredictionLedger", "histories", "recorded_events"]

METADATA_KEY = "scaling_lab_predictions"


def recorded_events(notebook: NotebookNode, folder: Path | None = None) -> list[dict[str, Any]]:
    """Every ledger event the notebook's outputs show, and those of the ledger in `folder`."""
    events: list[dict[str, Any]] = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            for record in output.get("data", {}).get(MIME_TYPE, {}).get("predictions", []):
                events += record["events"]
    if folder is not None and (folder / LEDGER_NAME).exists():
        stored, _ = read_ledger(folder / LEDGER_NAME)
        events += [event.as_dict() for event in stored]
    return events


def histories(notebook: NotebookNode, folder: Path | None = None) -> list[History]:
    """Each committed prediction's history, as the notebook and its folder tell it."""
    events = recorded_events(notebook, folder)
    if not events:
        return []
    chained = chain(events)
    return [history(name, chained) for name in dict.fromkeys(e.name for e in chained)]


class KeepPredictionRecords(NbGraderPreprocessor):
    """Sanitize step: keep the history that clearing the outputs would lose."""

    def preprocess(self, nb: NotebookNode, resources: dict) -> tuple[NotebookNode, dict]:
        folder = Path(resources.get("metadata", {}).get("path") or ".")
        nb.metadata[METADATA_KEY] = recorded_events(nb, folder)
        return nb, resources


class RestorePredictionLedger(NbGraderPreprocessor):
    """Autograde step: the kept history becomes the ledger the notebook's run reads."""

    def preprocess(self, nb: NotebookNode, resources: dict) -> tuple[NotebookNode, dict]:
        folder = Path(resources.get("metadata", {}).get("path") or ".")
        events = nb.metadata.pop(METADATA_KEY, [])
        if events:
            write_ledger(events, ledger=folder / LEDGER_NAME)
        return nb, resources


def changed_after_measurement(root: Path) -> list[tuple[str, str, History]]:
    """(student, lab, history) of every prediction in root/submitted changed after its
    measurement was shown."""
    found = []
    for path in sorted((root / "submitted").glob("*/*/*.ipynb")):
        notebook = nbformat.read(path, as_version=nbformat.NO_CONVERT)
        for each in histories(notebook, path.parent):
            if each.changed_after_measurement:
                found.append((path.parts[-3], path.parts[-2], each))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=".", type=Path,
                        help="the course root, whose submitted/ folder is read (default: .)")
    root = parser.parse_args(argv).root
    if not (root / "submitted").is_dir():
        print(f"no submitted/ folder in {root.resolve()}: run this in the course root after "
              "collecting submissions (solutions/README.md)", file=sys.stderr)
        return 2
    changed = changed_after_measurement(root)
    for student, lab, each in changed:
        print(f"{student}  {lab}  {each.describe()}")
    print(f"{len(changed)} prediction(s) changed after their measurement was shown "
          f"(each scores 0 at autograde)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
