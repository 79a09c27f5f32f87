"""Predictions committed before their measurement, and graded as first committed.

A lab asks for a prediction, then measures it. The prediction cell ends with
`commit("name", prediction_name)`, and the measurement cell starts with `reveal("name")`, which
refuses to go on until that prediction is committed. Each call appends an event to the lab's
ledger, a JSON file beside the notebook (`.predictions.json`), and shows the prediction's whole
history in the cell's output, so the history travels inside the submitted notebook as well.

At grading, the course's nbgrader configuration rebuilds the ledger from the submitted outputs
(tools/grading/predictions.py) before the notebook runs again, and the prediction's hidden test
calls `assert_committed_unchanged(name, value)`: a prediction changed after its measurement
was shown scores 0, and so does a variable set again after its commit. Changing it before the
measurement is free, as is putting back the value that was committed when it was shown.

What this cannot stop: a student who deletes the ledger and clears every output, then runs the
notebook again, leaves no trace (solutions/README.md, "Predictions").
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "LEDGER_NAME",
    "MIME_TYPE",
    "LedgerEvent",
    "History",
    "PredictionNotCommitted",
    "assert_committed_unchanged",
    "canonical",
    "chain",
    "commit",
    "history",
    "read_ledger",
    "reveal",
    "write_ledger",
]

LEDGER_NAME = ".predictions.json"
# Outputs carry each record under this type; Jupyter shows the text/plain beside it.
MIME_TYPE = "application/vnd.scaling-lab.prediction+json"


class PredictionNotCommitted(RuntimeError):
    """A measurement was asked for before the prediction it checks was committed."""


@dataclass(frozen=True)
class LedgerEvent:
    """One line of the ledger: `kind` is "commit" (the value a prediction was set to) or
    "reveal" (its measurement was shown; `value` is the prediction committed then). `digest`
    chains each event to the one before it, so that an edited ledger no longer verifies."""

    name: str
    kind: str
    value: Any
    time: float
    digest: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "value": self.value, "time": self.time,
                "digest": self.digest}


def canonical(value: Any) -> Any:
    """`value` as JSON that compares as the value does: every number a float (2 and 2.0 are
    one prediction), tuples as lists, keys as strings, a tensor or numpy scalar as its number,
    anything else as its repr."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        number = float(value)
        return number if math.isfinite(number) else repr(number)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return canonical(value.item())
    if isinstance(value, (list, tuple)):
        return [canonical(item) for item in value]
    if isinstance(value, dict):
        return {str(key): canonical(item) for key, item in sorted(value.items(), key=str)}
    return {"repr": repr(value)}


def _digest(previous: str, name: str, kind: str, value: Any, when: float) -> str:
    text = json.dumps([previous, name, kind, value, when], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def chain(events: list[dict[str, Any]]) -> list[LedgerEvent]:
    """`events` without repeats, ordered by time (a commit before a reveal of the same moment),
    each digest computed on the one before it."""
    unique = {(e["name"], e["kind"], json.dumps(e["value"], sort_keys=True), e["time"]): e
              for e in events}
    chained: list[LedgerEvent] = []
    previous = ""
    for event in sorted(unique.values(), key=lambda e: (e["time"], e["kind"] == "reveal")):
        previous = _digest(previous, event["name"], event["kind"], event["value"], event["time"])
        chained.append(LedgerEvent(event["name"], event["kind"], event["value"], event["time"],
                             previous))
    return chained


def _ledger_path(ledger: Path | None) -> Path:
    return Path(ledger) if ledger is not None else Path.cwd() / LEDGER_NAME


def read_ledger(ledger: Path | None = None) -> tuple[list[LedgerEvent], bool]:
    """(the events in `ledger`, default `.predictions.json` in the current folder, and whether
    their digests verify). A missing file is an empty ledger that verifies; a file that is not
    a ledger reads as empty and does not verify."""
    path = _ledger_path(ledger)
    if not path.exists():
        return [], True
    try:
        stored = json.loads(path.read_text())["events"]
        events = chain(stored)
    except (ValueError, KeyError, TypeError):  # not a ledger: the outputs still hold the history
        return [], False
    return events, [e.digest for e in events] == [e.get("digest") for e in stored]


def write_ledger(events: list[dict[str, Any]], ledger: Path | None = None) -> list[LedgerEvent]:
    """Write `events`, chained, to `ledger`; returns what was written."""
    chained = chain(events)
    path = _ledger_path(ledger)
    path.write_text(json.dumps({"events": [e.as_dict() for e in chained]}, indent=1) + "\n")
    return chained


@dataclass(frozen=True)
class History:
    """What the ledger says of one prediction: the value committed when its measurement was
    first shown (None if it was never shown), and the values committed after that."""

    name: str
    commits: list[LedgerEvent]
    first_reveal: LedgerEvent | None

    @property
    def current(self) -> Any:
        return self.commits[-1].value if self.commits else None

    @property
    def changed_after_measurement(self) -> bool:
        return self.first_reveal is not None and self.current != self.first_reveal.value

    def describe(self) -> str:
        if not self.commits:
            return f"{self.name}: not committed"
        first = self.commits[0]
        text = f"{self.name} = {_show(self.current)} (first committed {_clock(first.time)})"
        if self.first_reveal is None:
            return text + ", measurement not shown yet"
        shown = self.first_reveal
        if self.changed_after_measurement:
            return (f"{self.name} = {_show(self.current)}: CHANGED after its measurement was "
                    f"shown at {_clock(shown.time)}, when it was {_show(shown.value)}")
        return text + f", measurement shown {_clock(shown.time)}"


def history(name: str, events: list[LedgerEvent]) -> History:
    mine = [e for e in events if e.name == name]
    reveals = [e for e in mine if e.kind == "reveal"]
    return History(name, [e for e in mine if e.kind == "commit"], reveals[0] if reveals else None)


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _clock(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def _record(name: str, events: list[LedgerEvent]) -> dict[str, Any]:
    """The output record of one prediction: its events, for the grader to rebuild the ledger."""
    return {"name": name, "events": [e.as_dict() for e in events if e.name == name]}


def _display(lines: list[str], records: list[dict[str, Any]]) -> None:
    bundle = {"text/plain": "\n".join(lines), MIME_TYPE: {"predictions": records}}
    try:
        from IPython.display import display
    except ImportError:  # a plain script: no cell output to carry the record
        print(bundle["text/plain"])
        return
    display(bundle, raw=True)


def commit(name: str, value: Any, *, ledger: Path | None = None) -> None:
    """Commit the prediction `name` = `value` to `ledger` (default: `.predictions.json` in the
    current folder, the notebook's). A value that differs from the last committed one is a new
    commit; one that changes after the measurement was shown is marked so (and graded 0)."""
    events, _ = read_ledger(ledger)
    value = canonical(value)
    before = history(name, events)
    new = [e.as_dict() for e in events]
    if not before.commits or before.current != value:
        new.append({"name": name, "kind": "commit", "value": value, "time": time.time()})
    events = write_ledger(new, ledger)
    found = history(name, events)
    lines = ["Committed: " + found.describe()]
    if found.changed_after_measurement:
        lines.append(f"  A prediction changed after its measurement scores 0; the value "
                     f"committed when it was shown was {_show(found.first_reveal.value)}.")
    _display(lines, [_record(name, events)])


def reveal(*names: str, ledger: Path | None = None) -> None:
    """Let a measurement show its numbers: every prediction in `names` must be committed
    first. The first reveal of each is recorded with the value committed then."""
    events, _ = read_ledger(ledger)
    missing = [name for name in names if not history(name, events).commits]
    if missing:
        raise PredictionNotCommitted(
            f"commit your prediction first: {', '.join(missing)} is not committed. Run the "
            f"prediction cell above (it ends with commit(...)), then this cell.")
    now = time.time()
    new = [e.as_dict() for e in events]
    for name in names:
        found = history(name, events)
        if found.first_reveal is None:
            new.append({"name": name, "kind": "reveal", "value": found.current, "time": now})
    events = write_ledger(new, ledger)
    _display([f"Measuring against your prediction {history(name, events).describe()}"
              for name in names], [_record(name, events) for name in names])


def assert_committed_unchanged(name: str, value: Any, *, ledger: Path | None = None) -> None:
    """The grader's check of the prediction `name`, whose variable holds `value` now: it was
    committed, it is what was committed (not set again after its `commit`), and it is what it
    was when its measurement was first shown."""
    events, _ = read_ledger(ledger)
    found = history(name, events)
    assert found.commits, f"prediction {name} was never committed: run its cell's commit(...)"
    assert canonical(value) == found.current, (
        f"prediction {name} is {_show(canonical(value))} but {_show(found.current)} was "
        f"committed: a prediction is graded as committed, so set it in its own cell, before "
        f"its commit(...)")
    assert not found.changed_after_measurement, (
        f"prediction {name} was changed after its measurement was shown: it was "
        f"{_show(found.first_reveal.value)} then and is {_show(found.current)} now. A "
        f"prediction is graded as committed before the measurement; a changed one scores 0.")
