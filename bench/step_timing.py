"""The timing loop of the step-time benchmarks (ddp, fsdp, parallel3d).

The implementations take turns, one step each per round, so that background load hits them
alike; each step is timed on the slowest rank, since a step ends when its last rank does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def alternating_step_times(
    steps: dict[str, Callable[[], object]], rounds: int
) -> dict[str, list[float]]:
    """Call on every rank: one untimed warm-up round, then `rounds` rounds in which each of
    `steps` runs once. Returns {name: seconds per round}, the slowest rank's, on every rank."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(rounds + 1):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_:
                times[name].append(elapsed.item())
    return times


def median_ratio(times: dict[str, list[float]], ours: str, theirs: str) -> float:
    """The median over rounds of (ours / theirs): a round's two steps met the same load."""
    return statistics.median(a / b for a, b in zip(times[ours], times[theirs], strict=True))
