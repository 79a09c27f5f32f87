"""Plausible fakes of every implementation exercise: what a student who wants the points
without the work might hand in. Each lab's module, `NN_topic.py`, maps the grade id of an
exercise's solution cell to its fakes; tests/test_fakes.py grades them with nbgrader and
requires each to score 0 on the test cells that check that exercise."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fake:
    """`source` replaces the solution region of the exercise's cell; `skips` names the
    mechanism the fake skips while getting the final numbers right; `checked_by` lists the
    test cells (grade ids) that must then score 0."""

    name: str
    skips: str
    checked_by: tuple[str, ...]
    source: str
