"""Plausible fakes of every implementation exercise: what a student who wants the points
without the work might hand in. Each lab's module, `NN_topic.py`, maps the grade id of an
exercise's solution cell to its fakes (`FAKES`); tests/test_grading.py (test i) grades them with
nbgrader and requires each to score 0 on the test cells that check that exercise.

The mirror: a module's `ALTERNATIVES` (optional) maps a grade id to correct answers that differ
from the solution in what the spec leaves open (an order it does not define, a warm-up it
allows); test j grades them and requires each to score full marks on its checks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fake:
    """`source` replaces the solution region of the exercise's cell, indented as that region
    is (a tuple: one source per region, for a cell with several); `skips` names the mechanism
    the fake skips while getting the final numbers right; `checked_by` lists the test cells
    (grade ids) that must then score 0."""

    name: str
    skips: str
    checked_by: tuple[str, ...]
    source: str | tuple[str, ...]


@dataclass(frozen=True)
class Alternative:
    """A correct answer the spec allows that the solution does not give: `source` replaces the
    solution region of the exercise's cell as a Fake's does; `why` says what it does otherwise
    and why the spec allows it; `checked_by` lists the test cells that must then give it full
    marks."""

    name: str
    why: str
    checked_by: tuple[str, ...]
    source: str | tuple[str, ...]


def _module(lab: str):
    """`lab`'s module `NN_topic.py` beside this file, None if it has none."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).with_name(f"{lab}.py")
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"fakes_{lab}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fakes_of(lab: str) -> dict[str, list[Fake]]:
    """The fakes of `lab`, {} if it has none: {grade id of an exercise's solution cell: its
    fakes}."""
    module = _module(lab)
    return module.FAKES if module else {}


def alternatives_of(lab: str) -> dict[str, list[Alternative]]:
    """The correct alternatives of `lab`, {} if it has none: {grade id of an exercise's
    solution cell: its alternatives}."""
    module = _module(lab)
    return getattr(module, "ALTERNATIVES", {}) if module else {}


def rounds(fakes: dict[str, list[Fake]] | dict[str, list[Alternative]]) -> list[dict]:
    """The fakes (or alternatives) in rounds, one submission each: round k holds fake k of
    every exercise that has one. An exercise whose checks call another exercise's function can
    then score 0 because of that one's fake too; every fake still scores 0, and each round
    costs one run of the notebook instead of one per fake."""
    count = max((len(found) for found in fakes.values()), default=0)
    return [{cell: found[k] for cell, found in fakes.items() if k < len(found)}
            for k in range(count)]
