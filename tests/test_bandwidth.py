"""minidist.communication.bandwidth: a tiny sweep returns sane rows, and the table and plot show
them."""

from __future__ import annotations

import functools

import matplotlib
import pytest

from minidist.communication.bandwidth import (
    BENCH_COLLECTIVES,
    OURS,
    Row,
    format_table,
    measure,
    measure_links,
    plot,
)
from minidist.core.launch import RankError
from minidist.costs import algorithms
from minidist.costs.cost import AlgorithmLinks, AlphaBeta, busbw_factor

FLAT = algorithms.names("all_reduce", nodes=False)

matplotlib.use("Agg")

SIZES = [1024, 64 * 1024]


@functools.cache
def _rows(collective: str) -> list[Row]:
    return measure(2, SIZES, collective=collective, iters=2, repeats=1)


@pytest.mark.parametrize("collective", BENCH_COLLECTIVES)
def test_measure_returns_sane_rows(collective: str) -> None:
    rows = _rows(collective)
    assert [(r.implementation, r.nbytes) for r in rows] == [
        (name, size) for size in SIZES for name in ("torch", OURS[collective])
    ]
    for r in rows:
        assert (r.collective, r.world_size) == (collective, 2)
        assert r.seconds > 0  # no bound on speed: a busy machine is slow
        assert r.algbw == pytest.approx(r.nbytes / r.seconds)
        assert r.busbw == pytest.approx(r.algbw * busbw_factor(collective, 2))


def test_adaptive_iterations_and_rounding() -> None:
    # iters=None picks the count per point; 1001 bytes round down to 250 float32 elements,
    # and all_gather needs a multiple of N elements.
    rows = measure(3, [1001], collective="all_gather", implementations=("ring",),
                   target_time=0.005, repeats=2)
    assert [(r.implementation, r.nbytes) for r in rows] == [("ring", 249 * 4)]


def test_auto_is_timed_with_the_links_given_or_its_own_fit() -> None:
    links = measure_links(2)
    assert isinstance(links, AlgorithmLinks) and links.world_size == 2
    for given in (links, None):  # None: measure fits before the first size
        rows = measure(2, SIZES, implementations=("auto",), iters=2, repeats=1, link=given)
        assert [(r.implementation, r.nbytes) for r in rows] == [("auto", size) for size in SIZES]
    # The ranks decide with the very links passed in: ones fitted on 3 ranks are refused there.
    three_ranks = AlgorithmLinks(3, (2**12, 2**22), tuple(
        (name, (AlphaBeta(1e-5, 1e-9),)) for name in FLAT))
    with pytest.raises(RankError, match="fitted on 3 ranks"):
        measure(2, SIZES, implementations=("auto",), iters=1, repeats=1, link=three_ranks)


def test_format_table_and_plot() -> None:
    rows = _rows("all_reduce")
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0] == "all_reduce, N=2 (bandwidths in GB/s)"
    assert "ring time" in lines[1] and "torch time" in lines[1] and "ratio" in lines[1]
    assert lines[3].split()[:2] == ["1", "KiB"] and lines[4].split()[:2] == ["64", "KiB"]
    ratio = rows[0].seconds / rows[1].seconds  # torch's time over the ring's
    assert lines[3].endswith(f"{ratio:5.2f}")

    ax = plot(rows)
    assert [line.get_label() for line in ax.get_lines()] == ["torch", "ring"]
    assert list(ax.get_lines()[0].get_xdata()) == SIZES
    assert ax.get_xscale() == "log"
    assert ax.get_title() == "all_reduce, N=2"


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="valid ones are all_reduce"):
        measure(2, SIZES, collective="allreduce")
    with pytest.raises(ValueError, match="implementations"):
        measure(2, SIZES, implementations=("nccl",))
    with pytest.raises(ValueError, match="iters"):
        measure(2, SIZES, iters=0)
