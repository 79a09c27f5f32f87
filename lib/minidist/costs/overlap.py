"""What prefetching hides: one FSDP step on one GPU, modelled as two lanes, the GPU's compute
and the link, each running one thing at a time in the order it is issued.

    events = modelled_step([1e9] * 4, tokens=20_000, world_size=8, flops_per_s=989e12,
                           link_bytes_per_s=50e9, prefetch=True)
    timeline.plot_events(events)     # the compute and link lanes of one step

Arithmetic only, no torch.distributed: Lab 04 writes this model and checks its own FSDP
(`minidist.parallel.fsdp`, which issues its collectives in the order modelled here) against it.
"""

from __future__ import annotations

from collections.abc import Sequence

from minidist.core.timeline import Event

__all__ = ["modelled_step"]


def modelled_step(unit_params: Sequence[float], tokens: float, world_size: int,
                  flops_per_s: float, link_bytes_per_s: float, bytes_per_element: int = 2,
                  prefetch: bool = True) -> list[Event]:
    """One FSDP step on one GPU, modelled: the Events (kind "forward", "backward",
    "all_gather" or "reduce_scatter", name the unit's index) of units of `unit_params`
    parameters, in forward order, processing `tokens` tokens.

    Two lanes each run one thing at a time, in the order it is issued: the GPU computes a
    unit's forward in 2Ψ_u·tokens FLOPs and its backward in twice that, at `flops_per_s`; the
    link moves each all-gather and reduce-scatter, (N-1)/N of the unit's `bytes_per_element`
    bytes, at `link_bytes_per_s`. As `minidist.parallel.fsdp` (and Lab 04's FSDP) issues them:
    a unit's parameters are all-gathered before its forward and, freed after it, again before its
    backward; its gradient is reduce-scattered when its backward ends (asynchronously, as on
    a GPU's own stream). With `prefetch`, the next unit's all-gather (forward order, then
    backward order) is issued when a unit starts computing; without, when it is needed."""
    events: list[Event] = []
    free = {"compute": 0.0, "link": 0.0}

    def run_on(lane: str, kind: str, unit: int, ready: float, seconds: float) -> float:
        start = max(ready, free[lane])
        free[lane] = start + seconds
        events.append(Event(0, kind, str(unit), start, free[lane]))
        return free[lane]

    n, last = world_size, len(unit_params) - 1
    moved = [(n - 1) / n * bytes_per_element * p / link_bytes_per_s for p in unit_params]
    forward = [2 * p * tokens / flops_per_s for p in unit_params]
    ready = run_on("link", "all_gather", 0, 0.0, moved[0])
    for unit in range(last + 1):
        start = max(free["compute"], ready)
        end = run_on("compute", "forward", unit, ready, forward[unit])
        if unit < last:
            ready = run_on("link", "all_gather", unit + 1, start if prefetch else end,
                           moved[unit + 1])
    ready = run_on("link", "all_gather", last, free["compute"], moved[last])
    for unit in reversed(range(last + 1)):
        start = max(free["compute"], ready)
        if prefetch and unit > 0:
            upcoming = run_on("link", "all_gather", unit - 1, start, moved[unit - 1])
        end = run_on("compute", "backward", unit, ready, 2 * forward[unit])
        run_on("link", "reduce_scatter", unit, end, moved[unit])
        if not prefetch and unit > 0:
            upcoming = run_on("link", "all_gather", unit - 1, end, moved[unit - 1])
        if unit > 0:
            ready = upcoming
    return events
