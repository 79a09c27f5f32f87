"""An nccl-tests-style bandwidth benchmark: time collectives over a range of sizes.

    rows = measure(2, [2**k for k in range(10, 23)])      # 1 KiB .. 4 MiB, ours vs torch
    print(format_table(rows))
    plot(rows)

Like nccl-tests (doc/PERFORMANCE.md) each point reports
    time   the mean time of one call, taken on the slowest rank
    algbw  S / time, with S the full tensor's bytes
    busbw  algbw * busbw_factor(collective, N): the bytes each rank moved per second, which
           is comparable across N and to the link's bandwidth.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from minidist.communication import collectives, impls
from minidist.communication.timing import time_in_turns
from minidist.core.launch import device, run
from minidist.costs import algorithms
from minidist.costs.cost import AlgorithmLinks, busbw_factor

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["BENCH_COLLECTIVES", "OURS", "Row", "measure", "measure_links", "format_table",
           "plot"]

BENCH_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
OURS = {collective: algorithms.names(collective)[0] for collective in BENCH_COLLECTIVES}
"""minidist's own implementation of each collective, timed by default beside torch's: the first
of the algorithm table that runs it (the ring; for broadcast, the tree)."""
_MAX_ITERS = 10_000


@dataclass(frozen=True)
class Row:
    """One measured point: `seconds` per call, bandwidths in bytes/s."""

    implementation: str
    collective: str
    world_size: int
    nbytes: int
    seconds: float
    algbw: float
    busbw: float


def measure(
    world_size: int,
    sizes: Sequence[int],
    collective: str = "all_reduce",
    implementations: Sequence[str] | None = None,
    iters: int | None = None,
    dtype: torch.dtype = torch.float32,
    timeout: float | None = None,
    target_time: float = 0.01,
    repeats: int = 3,
    link: AlgorithmLinks | None = None,
) -> list[Row]:
    """Time `collective` at each size in `sizes` (bytes) on `world_size` ranks.

    implementations: names of `minidist.communication.impls.choices(collective)`, "torch" for
    torch.distributed's own on the same backend; by default torch and minidist's own
    (`OURS`). Every call goes through `minidist.communication.collectives`, so each pays the same
    small cost of recording it. "auto" decides with `link`, by default the links `measure_links`
    measures once, before the first size: what one process group fits once and keeps (sizes
    run in fresh ranks, which would otherwise each fit their own).

    Each point is timed `repeats` times with `timing.time_in_turns` (the implementations in
    turns, the slowest rank's time, after one untimed round), each timing `iters` calls, or
    when `iters` is None as many as last about `target_time` seconds; the median is kept.
    Sizes are rounded down to whole elements (and, for reduce_scatter and all_gather, to a
    multiple of world_size elements); `Row.nbytes` is the size actually used.
    """
    if collective not in BENCH_COLLECTIVES:
        raise ValueError(
            f"unknown collective {collective!r}; valid ones are {', '.join(BENCH_COLLECTIVES)}"
        )
    implementations = tuple(implementations or ("torch", OURS[collective]))
    valid = impls.choices(collective)
    unknown = [name for name in implementations if name not in valid]
    if unknown or not implementations:
        raise ValueError(
            f"implementations for {collective} must be a non-empty subset of {valid}, got "
            f"{implementations!r}"
        )
    if iters is not None and iters < 1:
        raise ValueError(f"iters must be >= 1 (or None to adapt to size), got {iters}")
    if repeats < 1:
        raise ValueError(f"need repeats >= 1, got {repeats}")
    if "auto" in implementations and link is None:
        link = measure_links(world_size, timeout=timeout)
    factor = busbw_factor(collective, world_size)
    element_size = torch.empty(0, dtype=dtype).element_size()
    rows = []
    numels = [_numel(nbytes, collective, world_size, dtype) for nbytes in sizes]
    # One `run` per size (about 0.1 s each to start) so that a progress bar can move. A text bar:
    # a widget bar leaves "Error displaying widget: model not found" in a reopened notebook.
    label = f"{collective} on {world_size} ranks"
    for numel in tqdm(numels, desc=label, unit="size", file=sys.stdout):
        times = run(_time_on_rank, world_size, collective, implementations, numel, dtype, iters,
                    target_time, repeats, link, timeout=timeout)[0]
        nbytes = numel * element_size
        for name in implementations:
            seconds = statistics.median(times[name])
            algbw = nbytes / seconds
            rows.append(Row(name, collective, world_size, nbytes, seconds, algbw, algbw * factor))
    return rows


def measure_links(world_size: int, timeout: float | None = None, *, rounds: int = 9,
                  sizes: Sequence[int] = impls.FIT_SIZES) -> AlgorithmLinks:
    """`minidist.communication.impls.fit_links` on `world_size` fresh ranks: each all-reduce
    algorithm's own links, the ones `collectives.all_reduce(impl="auto")` decides with (every rank
    fits the same ones), each point the median of `rounds` rounds (auto's own: 9), timed at
    `sizes` (auto's own by default)."""
    return run(_fit_links_on_rank, world_size, rounds, tuple(sizes), timeout=timeout)[0]


def _fit_links_on_rank(rank: int, world_size: int, rounds: int,
                       sizes: tuple[int, ...]) -> AlgorithmLinks:
    return impls.fit_links(rounds=rounds, sizes=sizes)


def _numel(nbytes: int, collective: str, world_size: int, dtype: torch.dtype) -> int:
    numel = max(1, nbytes // torch.empty(0, dtype=dtype).element_size())
    if collective in ("reduce_scatter", "all_gather"):  # torch needs equal shards
        numel = max(world_size, numel - numel % world_size)
    return numel


def _step(impl: str, collective: str, numel: int, dtype: torch.dtype, world_size: int,
          link: AlgorithmLinks | None) -> Callable[[], object]:
    """A no-argument function that runs one call of the collective on preallocated tensors."""
    # Zeros stay zeros however often they are summed: no overflow to inf along the way.
    full = torch.zeros(numel, dtype=dtype, device=device())
    shard = torch.zeros(numel // world_size, dtype=dtype, device=device())
    if collective == "all_reduce":
        return lambda: collectives.all_reduce(full, impl=impl, link=link)
    if collective == "reduce_scatter":
        return lambda: collectives.reduce_scatter(full, impl=impl)
    if collective == "all_gather":
        return lambda: collectives.all_gather(shard, numel, impl=impl)
    return lambda: collectives.broadcast(full, impl=impl)


def _time_on_rank(rank: int, world_size: int, collective: str, implementations: tuple[str, ...],
                  numel: int, dtype: torch.dtype, iters: int | None, target_time: float,
                  repeats: int, link: AlgorithmLinks | None) -> dict[str, list[float]]:
    """Seconds per call of each implementation in each repeat, the slowest rank's."""
    steps = {name: _step(name, collective, numel, dtype, world_size, link)
             for name in implementations}
    counts: dict[str, int] | int = iters or 1
    if iters is None:  # one call of each, to see how many last `target_time`
        once = time_in_turns(steps, 1, synchronize=_synchronize, device=device())
        counts = {name: max(1, min(_MAX_ITERS, math.ceil(target_time / max(t[0], 1e-9))))
                  for name, t in once.items()}
    return time_in_turns(steps, repeats, counts, synchronize=_synchronize, device=device())


def _synchronize() -> None:
    """Wait for queued GPU work: under nccl a call returns before its transfer is done."""
    if device().type == "cuda":
        torch.cuda.synchronize()


# --- Showing the results ------------------------------------------------------------------------


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a text table: one line per size, implementations side by side.

    Bandwidths are in GB/s (1e9 bytes/s, as nccl-tests prints them); "ratio" is the busbw of
    the first implementation other than torch over torch's, shown when both were measured.
    """
    blocks = []
    for collective, world_size in dict.fromkeys((r.collective, r.world_size) for r in rows):
        block = [r for r in rows if (r.collective, r.world_size) == (collective, world_size)]
        names = list(dict.fromkeys(r.implementation for r in block))
        ours = next((name for name in names if name != "torch"), None)
        with_ratio = ours is not None and "torch" in names
        header = f"{'size':>10}" + "".join(
            f" | {name + ' time':>14} {'algbw':>7} {'busbw':>7}" for name in names
        )
        header += " | ratio" if with_ratio else ""
        lines = [f"{collective}, N={world_size} (bandwidths in GB/s)", header, "-" * len(header)]
        for nbytes in dict.fromkeys(r.nbytes for r in block):
            by_name = {r.implementation: r for r in block if r.nbytes == nbytes}
            line = f"{_size(nbytes):>10}"
            for name in names:
                r = by_name.get(name)
                line += (
                    f" | {_time(r.seconds):>14} {r.algbw / 1e9:>7.3f} {r.busbw / 1e9:>7.3f}"
                    if r
                    else f" | {'':>14} {'':>7} {'':>7}"
                )
            if with_ratio and ours in by_name and "torch" in by_name:
                line += f" | {by_name['torch'].seconds / by_name[ours].seconds:5.2f}"
            lines.append(line)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def plot(rows: Sequence[Row], ax: Axes | None = None) -> Axes:
    """Bus bandwidth against message size (log scale), one line per implementation and N."""
    import matplotlib.pyplot as plt  # here, not at the top: every rank imports this module

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    setups = list(dict.fromkeys((r.collective, r.world_size) for r in rows))
    for series in dict.fromkeys((r.implementation, r.collective, r.world_size) for r in rows):
        points = sorted(
            (r.nbytes, r.busbw / 1e9)
            for r in rows
            if (r.implementation, r.collective, r.world_size) == series
        )
        name, collective, world_size = series
        label = name if len(setups) == 1 else f"{name}, {collective} N={world_size}"
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    if len(setups) == 1:
        ax.set_title(f"{setups[0][0]}, N={setups[0][1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return ax
