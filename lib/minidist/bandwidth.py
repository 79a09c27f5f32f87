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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from minidist import comm
from minidist.cost import ALL_REDUCE_ALGORITHMS, AlgorithmLinks, busbw_factor
from minidist.launch import device, run

if TYPE_CHECKING:
    from matplotlib.axes import Axes

IMPLEMENTATIONS = ("minidist", "torch")
# all_reduce can also be timed with each of minidist.comm.all_reduce's algorithms by name.
ALL_REDUCE_IMPLEMENTATIONS = (*IMPLEMENTATIONS, "auto", *ALL_REDUCE_ALGORITHMS)
BENCH_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
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
    implementations: Sequence[str] = IMPLEMENTATIONS,
    iters: int | None = None,
    warmup: int = 2,
    dtype: torch.dtype = torch.float32,
    timeout: float | None = None,
    target_time: float = 0.01,
    repeats: int = 3,
    link: AlgorithmLinks | None = None,
) -> list[Row]:
    """Time `collective` at each size in `sizes` (bytes) on `world_size` ranks.

    implementations: "minidist" (this library's ring/tree, minidist.comm) and/or "torch"
    (torch.distributed's own collective on the same backend), timed in the same ranks; for
    all_reduce also "auto" or any of cost.ALL_REDUCE_ALGORITHMS ("recursive_doubling", ...),
    run by minidist.comm.all_reduce(tensor, algorithm=name). "auto" decides with `link`, by
    default the links `fit_links(world_size)` measures once, before the first size: what
    one process group fits once and keeps (sizes run in fresh ranks, which would otherwise
    each fit their own).

    Each point is `warmup` untimed calls, a barrier, then `iters` timed calls; when `iters` is
    None it is chosen per point so the timed block lasts about `target_time` seconds. A timing
    is the slowest rank's mean time per call. Every point is timed `repeats` times, the
    implementations taking turns, and the median timing is kept: a moment when other
    processes had the CPU spoils one timing, not the result, and, unlike the fastest timing,
    the median does not reward one implementation's lucky moment either (on shared cores
    the two are about as common).
    Sizes are rounded down to whole elements (and, for reduce_scatter and all_gather, to a
    multiple of world_size elements); `Row.nbytes` is the size actually used.
    """
    if collective not in BENCH_COLLECTIVES:
        raise ValueError(
            f"unknown collective {collective!r}; valid ones are {', '.join(BENCH_COLLECTIVES)}"
        )
    valid = ALL_REDUCE_IMPLEMENTATIONS if collective == "all_reduce" else IMPLEMENTATIONS
    unknown = [name for name in implementations if name not in valid]
    if unknown or not implementations:
        raise ValueError(
            f"implementations for {collective} must be a non-empty subset of {valid}, got "
            f"{tuple(implementations)!r}"
        )
    if iters is not None and iters < 1:
        raise ValueError(f"iters must be >= 1 (or None to adapt to size), got {iters}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    if "auto" in implementations and link is None:
        link = fit_links(world_size, timeout=timeout)
    factor = busbw_factor(collective, world_size)
    element_size = torch.empty(0, dtype=dtype).element_size()
    rows = []
    numels = [_numel(nbytes, collective, world_size, dtype) for nbytes in sizes]
    # One `run` per size (about 0.1 s each to start) so that a progress bar can move. A text bar:
    # a widget bar leaves "Error displaying widget: model not found" in a reopened notebook.
    label = f"{collective} on {world_size} ranks"
    for numel in tqdm(numels, desc=label, unit="size", file=sys.stdout):
        per_rank = run(
            _time_on_rank, world_size, collective, tuple(implementations), numel, dtype, iters,
            warmup, target_time, repeats, link, timeout=timeout,
        )
        nbytes = numel * element_size
        for i, name in enumerate(implementations):
            # A call ends when its last rank does: the slowest rank's time, for each repeat.
            seconds = statistics.median(max(timings[i][r] for timings in per_rank)
                                        for r in range(repeats))
            algbw = nbytes / seconds
            rows.append(Row(name, collective, world_size, nbytes, seconds, algbw, algbw * factor))
    return rows


def fit_links(world_size: int, timeout: float | None = None) -> AlgorithmLinks:
    """`minidist.comm.fit_links` on `world_size` fresh ranks: each all-reduce algorithm's own
    links, the ones `comm.all_reduce(algorithm="auto")` decides with (every rank fits the
    same ones)."""
    return run(_fit_links_on_rank, world_size, timeout=timeout)[0]


def _fit_links_on_rank(rank: int, world_size: int) -> AlgorithmLinks:
    return comm.fit_links()


def _numel(nbytes: int, collective: str, world_size: int, dtype: torch.dtype) -> int:
    numel = max(1, nbytes // torch.empty(0, dtype=dtype).element_size())
    if collective in ("reduce_scatter", "all_gather"):  # torch needs equal shards
        numel = max(world_size, numel - numel % world_size)
    return numel


def _step(
    implementation: str, collective: str, numel: int, dtype: torch.dtype, world_size: int,
    link: AlgorithmLinks | None,
) -> Callable[[], object]:
    """A no-argument function that runs one call of the collective on preallocated tensors."""
    # Zeros stay zeros however often they are summed: no overflow to inf along the way.
    full = torch.zeros(numel, dtype=dtype, device=device())
    shard = torch.zeros(numel // world_size, dtype=dtype, device=device())
    ours = implementation == "minidist"
    if collective == "all_reduce":
        if implementation == "torch":
            return lambda: dist.all_reduce(full)
        if ours:
            return lambda: comm.ring_all_reduce(full)
        return lambda: comm.all_reduce(full, algorithm=implementation, link=link)
    if collective == "reduce_scatter":
        if ours:
            return lambda: comm.ring_reduce_scatter(full)
        return lambda: dist.reduce_scatter_single(shard, full)
    if collective == "all_gather":
        if ours:
            return lambda: comm.ring_all_gather(full)
        return lambda: dist.all_gather_single(full, shard)
    return (lambda: comm.tree_broadcast(full, 0)) if ours else (lambda: dist.broadcast(full, 0))


def _time_on_rank(
    rank: int,
    world_size: int,
    collective: str,
    implementations: tuple[str, ...],
    numel: int,
    dtype: torch.dtype,
    iters: int | None,
    warmup: int,
    target_time: float,
    repeats: int,
    link: AlgorithmLinks | None,
) -> list[list[float]]:
    """This rank's mean seconds per call in each repeat, for each implementation."""
    steps = [_step(name, collective, numel, dtype, world_size, link) for name in implementations]
    counts = [iters or _iters_for(step, warmup, target_time) for step in steps]
    timings: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, (step, count) in enumerate(zip(steps, counts, strict=True)):
            for _ in range(warmup):
                step()
            dist.barrier()  # start together, or we would time the wait for late ranks
            start = time.perf_counter()
            for _ in range(count):
                step()
            _synchronize()
            timings[i].append((time.perf_counter() - start) / count)
    return timings


def _iters_for(step: Callable[[], object], warmup: int, target_time: float) -> int:
    """Calls needed for the timed block to last `target_time`; the same on every rank."""
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    step()
    _synchronize()
    # Every rank must run the same number of calls, so agree on the slowest rank's estimate.
    estimate = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device())
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    return max(1, min(_MAX_ITERS, math.ceil(target_time / max(estimate.item(), 1e-9))))


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

    Bandwidths are in GB/s (1e9 bytes/s, as nccl-tests prints them); "ratio" is
    busbw(minidist) / busbw(torch), shown when both were measured.
    """
    blocks = []
    for collective, world_size in dict.fromkeys((r.collective, r.world_size) for r in rows):
        block = [r for r in rows if (r.collective, r.world_size) == (collective, world_size)]
        names = list(dict.fromkeys(r.implementation for r in block))
        with_ratio = "minidist" in names and "torch" in names
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
            if with_ratio and "minidist" in by_name and "torch" in by_name:
                line += f" | {by_name['torch'].seconds / by_name['minidist'].seconds:5.2f}"
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
