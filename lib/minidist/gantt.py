"""Gantt charts of pipeline timelines, simulated (`pipeline.simulate`) or measured
(`pipeline_exec.run_pipeline`), for the lab and the slides.

    draw(pipeline.simulate(pipeline.schedule("1f1b", 4, 8)))
    draw_all([pipeline.simulate(pipeline.schedule(name, 4, 8)) for name in ("gpipe", "1f1b")])

One row per rank, rank 0 on top. Each compute action is a box coloured by its microbatch:
F plain, B hatched, W dotted; grey hatching marks idle time. Every row ends with the rank's
peak number of microbatches in flight, and the title gives the bubble (idle share of total
rank-time). Drawing is deterministic, so the slides rebuild byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from minidist.pipeline import Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

HATCHES = {"F": "", "B": "///", "W": "..."}
IDLE_COLOR = "#f2f2f2"


def _title(timeline: Timeline, name: str | None) -> str:
    s = timeline.schedule
    if name is None:
        chunks = f", v={s.chunks} (paler = later chunk)" if s.chunks > 1 else ""
        kind = "measured" if timeline.measured else "simulated"
        name = f"{s.name} ({kind}), p={s.ranks}, m={s.microbatches}{chunks}"
    return f"{name}: bubble {timeline.bubble_fraction:.1%}"


def draw_on(ax: Axes, timeline: Timeline, title: str | None = None) -> None:
    """Draw `timeline` on the matplotlib axes `ax`. The title is `title` (default: the
    schedule's name, p, m, and whether it was simulated or measured), then the bubble."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch, Rectangle

    schedule = timeline.schedule
    scale, unit = (1000.0, "ms") if timeline.measured else (1.0, "time units")
    start, makespan = timeline.start, timeline.makespan * scale
    colors = plt.get_cmap("tab10" if schedule.microbatches <= 10 else "tab20")
    # One collection per kind of box: drawing is then fast even with hundreds of actions.
    boxes: dict[str, tuple[list[Rectangle], list]] = {kind: ([], []) for kind in HATCHES}
    idle = []
    for rank, spans in enumerate(timeline.spans):
        y = schedule.ranks - 1 - rank
        idle.append(Rectangle((0, y + 0.1), makespan, 0.8))
        for span in spans:
            left, width = (span.start - start) * scale, (span.end - span.start) * scale
            action = span.action
            chunk = action.stage // schedule.ranks
            shade = 1.0 - 0.35 * chunk / max(schedule.chunks - 1, 1)  # paler: later chunk
            rectangles, faces = boxes[action.kind]
            rectangles.append(Rectangle((left, y + 0.1), width, 0.8))
            faces.append(to_rgba(colors(action.microbatch % colors.N), shade))
            label = action.label(show_stage=False)
            if width >= len(label) * makespan / 120:  # room for the label at fontsize 7
                ax.text(left + width / 2, y + 0.5, label, ha="center", va="center", fontsize=7)
        ax.text(makespan * 1.01, y + 0.5, f"peak {timeline.peak_inflight[rank]}",
                va="center", fontsize=8)
    ax.add_collection(PatchCollection(idle, facecolor=IDLE_COLOR, edgecolor="#bbbbbb",
                                      hatch="xx", linewidth=0.0))
    for kind, (rectangles, faces) in boxes.items():
        if rectangles:
            ax.add_collection(PatchCollection(rectangles, facecolors=faces, edgecolor="black",
                                              linewidth=0.6, hatch=HATCHES[kind] or None))
    ax.set_xlim(0, makespan * 1.12)
    ax.set_ylim(0, schedule.ranks)
    ax.set_yticks([schedule.ranks - 0.5 - r for r in range(schedule.ranks)])
    ax.set_yticklabels([f"rank {r}" for r in range(schedule.ranks)])
    ax.set_xlabel(unit)
    ax.set_title(_title(timeline, title), fontsize=10, loc="left")
    kinds = ["F", "B", "W"] if schedule.split_backward else ["F", "B"]
    names = {"F": "forward", "B": "input grad." if schedule.split_backward else "backward",
             "W": "weight grad."}
    handles = [Patch(facecolor="white", edgecolor="black", hatch=HATCHES[k], label=names[k])
               for k in kinds]
    handles.append(Patch(facecolor=IDLE_COLOR, edgecolor="#bbbbbb", hatch="xx", label="idle"))
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles),
              bbox_to_anchor=(1.0, 1.18), frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def draw(timeline: Timeline, title: str | None = None) -> Figure:
    """A figure with the Gantt chart of one timeline."""
    return draw_all([timeline], [title] if title else None)


def draw_all(timelines: Sequence[Timeline], titles: Sequence[str] | None = None,
             same_scale: bool = True) -> Figure:
    """One Gantt chart per timeline, stacked; with `same_scale` they share the time axis so
    that lengths compare (do not mix simulated and measured timelines then)."""
    import matplotlib.pyplot as plt

    if not timelines:
        raise ValueError("draw_all needs at least one timeline")
    heights = [0.9 + 0.42 * t.schedule.ranks for t in timelines]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, sum(heights)), squeeze=False,
                             height_ratios=heights)
    for index, (ax, timeline) in enumerate(zip(axes[:, 0], timelines, strict=True)):
        draw_on(ax, timeline, titles[index] if titles else None)
    if same_scale:
        right = max(ax.get_xlim()[1] for ax in axes[:, 0])
        for ax in axes[:, 0]:
            ax.set_xlim(0, right)
    fig.tight_layout()
    return fig
