"""The timing loop of everything minidist measures across ranks.

    times = time_in_turns({"ours": step, "torch": torch_step}, rounds=15)
    times["ours"]                             # seconds per call in each round, slowest rank

Times are on `timeline.clock`, the one clock of minidist's events.

`time_in_turns` is how the course compares implementations on shared cores: in each round every
function runs in turn, so that a slow spell of the machine falls on all of them alike; a timing
is the slowest rank's, since a collective or a training step ends when its last rank does. It
synchronises ranks with minidist's own ring (a barrier is a one-element all-reduce; the slowest
rank's times come from an all-gather), outside any `count_traffic` log.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from minidist.communication import comm
from minidist.communication.counting import uncounted
from minidist.core.agreement import unchecked
from minidist.core.timeline import clock

__all__ = ["time_in_turns", "median_ratio", "barrier"]


def barrier(group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> None:
    """Wait until every rank of `group` arrives: a one-element ring all-reduce (uncounted)."""
    with uncounted():
        comm.ring_all_reduce(torch.zeros(1, device=device), group=group)


def time_in_turns(calls: Mapping[str, Callable[[], object]], rounds: int,
                  repeat: int | Mapping[str, int] = 1, warmup_rounds: int = 1,
                  group: dist.ProcessGroup | None = None,
                  synchronize: Callable[[], None] | None = None,
                  device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Time each function of `calls` once per round, in turns; call it on every rank of
    `group` at the same time.

    A turn is a barrier, one untimed call (ranks leave a barrier at different moments, and a
    call right after one pays for that), then `repeat` timed calls (a number, or one per name:
    a small collective lasts about as long as the clock's jitter). `warmup_rounds` rounds go
    untimed first (connections, buffers, first-call costs). `synchronize`, if given, runs
    before the clock stops (`torch.cuda.synchronize` under NCCL). Returns {name: seconds per
    call in each round}, the slowest rank's, the same on every rank.
    """
    names = list(calls)
    counts = {name: repeat if isinstance(repeat, int) else repeat[name] for name in names}
    timings = torch.zeros(rounds, len(names), dtype=torch.float64, device=device)
    with unchecked():  # a notebook compares each collective across ranks: not to be timed
        for round_ in range(-warmup_rounds, rounds):
            for i, name in enumerate(names):
                barrier(group, device)
                calls[name]()
                start = clock()
                for _ in range(counts[name]):
                    calls[name]()
                if synchronize is not None:
                    synchronize()
                if round_ >= 0:
                    timings[round_, i] = (clock() - start) / counts[name]
    slowest = _gather(timings.view(-1), group).amax(dim=0).view(rounds, len(names))
    return {name: slowest[:, i].tolist() for i, name in enumerate(names)}


def median_ratio(times: Mapping[str, list[float]], ours: str, theirs: str) -> float:
    """The median over rounds of (ours / theirs): a round's two timings met the same load."""
    return statistics.median(a / b for a, b in zip(times[ours], times[theirs], strict=True))


def _gather(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[ranks, n]: every rank's `values` (n of them), on every rank (an uncounted ring)."""
    ranks = comm.ring_of(group, "time_in_turns").size
    everyone = torch.zeros(ranks, values.numel(), dtype=values.dtype, device=values.device)
    everyone[comm.ring_of(group).rank] = values
    with uncounted():
        comm.ring_all_gather(everyone, group)
    return everyone
