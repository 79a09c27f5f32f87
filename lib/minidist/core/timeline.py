"""Events on one clock, and the one chart that draws them.

An `Event` is something one rank did from `start` to `end`, in seconds on `clock()` (an
instant when they are equal): a pipeline stage's forward (`kind` "F"), a gradient that became
ready or a bucket's all-reduce in DDP ("gradient", "all_reduce"), an operator a profiler saw
("compute", "communication"). DDP, the pipeline executor and the profiler all record Events,
and `plot_events` draws any of them: one horizontal lane per `lane(event)`, a box per event (a
tick for an instant), idle time hatched under each lane's `spans`, text after each lane.

    plot_events(events, lane=lambda e: f"rank {e.rank}", style=lambda e: {"facecolor": "tab:blue"})

Functions with no object to keep their events on (a key/value block's transfer, one block of
ring attention) `note` them; `collect()` gathers what is noted while it is open:

    with collect() as events:
        context_parallel.ring_attention(q, k, v, group=group)
    [e.kind for e in events]                # "attention", "transfer", ...
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minidist.core import interposer

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Event", "clock", "collect", "note", "plot_events", "IDLE_COLOR"]

IDLE_COLOR = "#f2f2f2"


def clock() -> float:
    """Seconds on the wall clock, the one clock of minidist's events: profiler events
    (Kineto's) use it too, and the ranks of a machine agree on it."""
    return time.time()


@dataclass
class Event:
    """What `rank` did from `start` to `end` (seconds; `end` is None while it runs, and equal
    to `start` for an instant). `detail` keeps what made it: a pipeline `Action`, a profiler
    thread id."""

    rank: int
    kind: str
    name: str
    start: float
    end: float | None = None
    detail: Any = None

    @property
    def duration(self) -> float:
        return 0.0 if self.end is None else self.end - self.start


@contextlib.contextmanager
def collect() -> Iterator[list[Event]]:
    """Collect every Event `note`d in this process while the block runs, in the order noted.
    Blocks nest: an outer one also gets what inner ones get. (A subscription to the
    interposer's "minidist.event" announcements, at its "recording" layer.)"""
    events: list[Event] = []

    def keep(_: Callable[..., None], event: Event) -> None:
        events.append(event)

    with interposer.subscribed("recording", {"minidist.event": keep}):
        yield events


def note(event: Event) -> None:
    """Add `event` to every open `collect()` (nothing happens when none is open)."""
    interposer.announce("minidist.event", event)


def plot_events(events: Sequence[Event],
                lane: Callable[[Event], str] = lambda e: f"rank {e.rank}",
                style: Callable[[Event], Mapping[str, Any]] = lambda e: {}, *,
                label: Callable[[Event], str] = lambda e: "",
                lanes: Sequence[str] | None = None,
                spans: Mapping[str, Sequence[tuple[float, float]]] | None = None,
                notes: Mapping[str, str] | None = None, origin: float | None = None,
                scale: float = 1e3, unit: str = "ms", right: float | None = None,
                ax: Axes | None = None, title: str = "",
                legend: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> Axes:
    """Draw `events`, one lane each by `lane(event)` (top to bottom in the order of `lanes`,
    by default first seen), times as (t - origin) * scale in `unit` (origin: the first start).

    `style(event)` gives matplotlib patch properties (facecolor, hatch, edgecolor, ...);
    `label(event)` text written in its box where it fits; `spans[lane]` the times the lane
    counts as busy or idle (hatched grey underneath, so idle shows); `notes[lane]` text after
    the lane's end; `legend` (label, style) pairs. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch, Rectangle

    order = list(lanes) if lanes is not None else list(dict.fromkeys(map(lane, events)))
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 + 0.42 * len(order)))
    if origin is None:
        origin = min((e.start for e in events), default=0.0)
    row = {name: len(order) - 1 - i for i, name in enumerate(order)}  # the first lane on top
    ends = [(e.end if e.end is not None else e.start) for e in events]
    right = right if right is not None else max([(end - origin) * scale for end in ends]
                                                + [0.0])
    idle = [Rectangle(((start - origin) * scale, row[name] + 0.1), (end - start) * scale, 0.8)
            for name, intervals in (spans or {}).items() for start, end in intervals]
    if idle:
        ax.add_collection(PatchCollection(idle, facecolor=IDLE_COLOR, edgecolor="#bbbbbb",
                                          hatch="xx", linewidth=0.0))
    # One collection per kind of outline: hundreds of boxes draw fast.
    boxes: dict[tuple, tuple[list[Rectangle], list]] = {}
    for event in events:
        y, left = row[lane(event)], (event.start - origin) * scale
        props = {"facecolor": "tab:blue", "edgecolor": "none", "linewidth": 0.0, "hatch": None,
                 **style(event)}
        if event.end is None or event.end == event.start:
            ax.vlines(left, y + 0.15, y + 0.85, color=props["facecolor"], linewidth=1)
            continue
        width = (event.end - event.start) * scale
        outline = (props["hatch"], props["edgecolor"], props["linewidth"])
        rectangles, faces = boxes.setdefault(outline, ([], []))
        rectangles.append(Rectangle((left, y + 0.1), width, 0.8))
        faces.append(props["facecolor"])
        text = label(event)
        if text and width >= len(text) * right / 120:  # room for it at fontsize 7
            ax.text(left + width / 2, y + 0.5, text, ha="center", va="center", fontsize=7)
    for (hatch, edgecolor, linewidth), (rectangles, faces) in boxes.items():
        ax.add_collection(PatchCollection(rectangles, facecolors=faces, edgecolor=edgecolor,
                                          linewidth=linewidth, hatch=hatch))
    for name, text in (notes or {}).items():
        ax.text(right * 1.01, row[name] + 0.5, text, va="center", fontsize=8)
    ax.set_xlim(0, right * (1.12 if notes else 1.02) or 1.0)
    ax.set_ylim(0, len(order))
    ax.set_yticks([row[name] + 0.5 for name in order], order)
    ax.set_xlabel(unit)
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    if legend:
        handles = [Patch(label=text, **{"facecolor": "white", "edgecolor": "black", **props})
                   for text, props in legend]
        ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles),
                  bbox_to_anchor=(1.0, 1.18 + 0.3 / max(len(order), 1)), frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax
