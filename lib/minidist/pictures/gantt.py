"""Gantt charts of pipeline timelines, simulated (`pipeline_simulator.simulate`) or measured
(`pipeline_exec.run_pipeline`), for the lab and the slides.

    draw(pipeline_simulator.simulate(pipeline.schedule("1f1b", 4, 8)))
    draw_all([pipeline_simulator.simulate(pipeline.schedule(name, 4, 8))
              for name in ("gpipe", "1f1b")])

One row per rank, rank 0 on top. Each compute action is a box coloured by its microbatch:
F plain, B hatched, W dotted; grey hatching marks idle time. Every row ends with the rank's
peak number of microbatches in flight, and the title gives the bubble (idle share of total
rank-time). Drawing is deterministic, so the slides rebuild byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from minidist.core.timeline import IDLE_COLOR, Event, plot_events
from minidist.parallel.pipeline_simulator import Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["draw", "draw_all"]

_HATCHES = {"F": "", "B": "///", "W": "..."}


def _title(timeline: Timeline, name: str | None) -> str:
    s = timeline.schedule
    if name is None:
        chunks = f", v={s.chunks} (paler = later chunk)" if s.chunks > 1 else ""
        kind = "measured" if timeline.measured else "simulated"
        name = f"{s.name} ({kind}), p={s.ranks}, m={s.microbatches}{chunks}"
    return f"{name}: bubble {timeline.bubble_fraction:.1%}"


def _draw_on(ax: Axes, timeline: Timeline, title: str | None = None) -> None:
    """Draw `timeline` on the matplotlib axes `ax` with `minidist.core.timeline.draw`. The title is
    `title` (default: the schedule's name, p, m, and whether it was simulated or measured),
    then the bubble."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    schedule = timeline.schedule
    scale, unit = (1000.0, "ms") if timeline.measured else (1.0, "time units")
    colors = plt.get_cmap("tab10" if schedule.microbatches <= 10 else "tab20")

    def style(event: Event) -> dict:
        action = event.detail
        chunk = action.stage // schedule.ranks
        shade = 1.0 - 0.35 * chunk / max(schedule.chunks - 1, 1)  # paler: later chunk
        return {"facecolor": to_rgba(colors(action.microbatch % colors.N), shade),
                "edgecolor": "black", "linewidth": 0.6, "hatch": _HATCHES[action.kind] or None}

    lanes = [f"rank {r}" for r in range(schedule.ranks)]
    end = timeline.start + timeline.makespan
    kinds = ["F", "B", "W"] if schedule.split_backward else ["F", "B"]
    names = {"F": "forward", "B": "input grad." if schedule.split_backward else "backward",
             "W": "weight grad."}
    legend = [(names[k], {"hatch": _HATCHES[k]}) for k in kinds]
    legend.append(("idle", {"facecolor": IDLE_COLOR, "edgecolor": "#bbbbbb", "hatch": "xx"}))
    plot_events([e for events in timeline.events for e in events], style=style,
         label=lambda e: e.detail.label(show_stage=False), lanes=lanes,
         spans={lane: [(timeline.start, end)] for lane in lanes},
         notes={lane: f"peak {peak}" for lane, peak in zip(lanes, timeline.peak_inflight,
                                                           strict=True)},
         origin=timeline.start, scale=scale, unit=unit, right=timeline.makespan * scale,
         ax=ax, title=_title(timeline, title), legend=legend)


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
        _draw_on(ax, timeline, titles[index] if titles else None)
    if same_scale:
        right = max(ax.get_xlim()[1] for ax in axes[:, 0])
        for ax in axes[:, 0]:
            ax.set_xlim(0, right)
    fig.tight_layout()
    return fig
