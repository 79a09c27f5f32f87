"""minidist.costs.cost: the alpha-beta model against the formulas of REFERENCES.md#collectives."""

from __future__ import annotations

import math

import pytest

from minidist.costs import algorithms
from minidist.costs.cost import (
    COLLECTIVES,
    AlgorithmLinks,
    AlphaBeta,
    all_reduce_bytes_sent,
    all_reduce_coefficients,
    all_reduce_time,
    best_all_reduce,
    busbw_factor,
    collective_time,
    crossover_size,
    fit_all_reduce,
    fit_alpha_beta,
    reduction_coefficient,
    ring_bytes_sent,
)

FLAT = algorithms.names("all_reduce", nodes=False)  # what one alpha-beta link prices

MB = 2**20


def test_the_algorithm_table_names_each_algorithm_once_and_prices_what_it_runs() -> None:
    names = [algorithm.name for algorithm in algorithms.TABLE]
    assert len(names) == len(set(names)), names
    assert FLAT == ("ring", "recursive_doubling", "tree", "rabenseifner")
    assert algorithms.names("all_reduce") == (*FLAT, "hierarchical")
    assert algorithms.named("tree").collectives == ("all_reduce", "broadcast")
    # Each collective's textbook formula is its first algorithm's.
    for collective in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        first = algorithms.running(collective)[0]
        a, b, _ = first.coefficients(collective, 6)
        assert collective_time(collective, 1e6, 6, 1.0, 1.0) == a + b * 1e6, collective
    # Without nodes (one rank per node) hierarchical is the ring.
    assert algorithms.HIERARCHICAL.coefficients("all_reduce", 8) == (
        algorithms.RING.coefficients("all_reduce", 8))
    with pytest.raises(ValueError, match="pairwise does not run all_reduce"):
        algorithms.PAIRWISE.coefficients("all_reduce", 4)
    with pytest.raises(ValueError, match="minidist's are ring, recursive_doubling"):
        algorithms.named("butterfly")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 64])
def test_busbw_factors_match_nccl_tests(n: int) -> None:
    assert busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert busbw_factor("all_gather", n) == pytest.approx((n - 1) / n)
    assert busbw_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert busbw_factor("broadcast", n) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_bytes(n: int) -> None:
    assert ring_bytes_sent("all_reduce", 12 * MB, n) == pytest.approx(2 * (n - 1) / n * 12 * MB)
    assert ring_bytes_sent("all_gather", 12 * MB, n) == pytest.approx((n - 1) / n * 12 * MB)
    assert ring_bytes_sent("reduce_scatter", 12 * MB, n) == pytest.approx((n - 1) / n * 12 * MB)


def test_ring_all_reduce_traffic_tends_to_twice_the_tensor() -> None:
    # Neither 2S for every N nor S/N: 2(N-1)/N * S, which approaches 2S as N grows.
    assert ring_bytes_sent("all_reduce", 100, 2) == 100
    assert ring_bytes_sent("all_reduce", 100, 1000) == pytest.approx(199.8)


def test_collective_times() -> None:
    alpha, beta, s = 1e-5, 1e-9, 8 * MB
    assert collective_time("all_reduce", s, 4, alpha, beta) == pytest.approx(
        6 * alpha + 1.5 * s * beta
    )
    assert collective_time("reduce_scatter", s, 4, alpha, beta) == pytest.approx(
        3 * alpha + 0.75 * s * beta
    )
    assert collective_time("all_gather", s, 4, alpha, beta) == pytest.approx(
        3 * alpha + 0.75 * s * beta
    )
    for n, rounds in ((1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4)):
        assert rounds == math.ceil(math.log2(n))
        assert collective_time("broadcast", s, n, alpha, beta) == pytest.approx(
            rounds * (alpha + s * beta)
        )
    assert collective_time("send", s, 2, alpha, beta) == pytest.approx(alpha + s * beta)
    assert collective_time("all_reduce", s, 1, alpha, beta) == 0


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_fit_recovers_alpha_and_beta(collective: str, n: int) -> None:
    true = AlphaBeta(alpha=25e-6, beta=1 / 3e9)
    sizes = [4**k for k in range(5, 14)]
    times = [true.predict(collective, s, n) for s in sizes]
    fitted = fit_alpha_beta(collective, n, sizes, times)
    assert fitted.alpha == pytest.approx(true.alpha, rel=1e-6)
    assert fitted.beta == pytest.approx(true.beta, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(3e9, rel=1e-6)
    assert fitted.predict("all_reduce", 64 * MB, 16) == pytest.approx(
        true.predict("all_reduce", 64 * MB, 16), rel=1e-6
    )


def test_fit_keeps_alpha_and_beta_non_negative() -> None:
    # Times that fall with size would need a negative alpha or beta; the fit clamps at zero.
    fitted = fit_alpha_beta("all_reduce", 2, [1e3, 1e6, 1e7], [1e-3, 2e-3, 1e-2])
    assert fitted.alpha >= 0 and fitted.beta >= 0
    bandwidth_only = fit_alpha_beta("send", 2, [1e6, 2e6], [2e-3, 1e-3])
    assert bandwidth_only.alpha >= 0 and bandwidth_only.beta >= 0
    assert AlphaBeta(1e-5, 0.0).bandwidth == math.inf


def test_predict_and_str() -> None:
    link = AlphaBeta(alpha=10e-6, beta=1e-9)
    assert link.predict("all_reduce", 1e9, 2) == pytest.approx(2 * 10e-6 + 1.0)
    assert str(link) == "alpha = 10.0 us, bandwidth = 1.00 GB/s"


def test_unknown_names_and_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="allreduce.*all_reduce, reduce_scatter"):
        busbw_factor("allreduce", 2)
    with pytest.raises(ValueError, match="valid ones are"):
        collective_time("all_to_all", 1, 2, 0.0, 0.0)
    with pytest.raises(ValueError, match="'broadcast'.*all_reduce, reduce_scatter, all_gather"):
        ring_bytes_sent("broadcast", 100, 4)
    with pytest.raises(ValueError, match="world_size"):
        busbw_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="at least 2 points"):
        fit_alpha_beta("all_reduce", 2, [1.0], [1.0])
    with pytest.raises(ValueError, match="world_size=1"):
        fit_alpha_beta("all_reduce", 1, [1.0, 2.0], [1.0, 2.0])


# --- All-reduce algorithms (Thakur, Rabenseifner & Gropp 2005) ----------------------------------


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        # n: {algorithm: (steps, bytes per byte of tensor)}; p = 2^floor(log2 n), and 2 more steps
        # of a whole tensor each when n is not a power of two.
        (1, {"ring": (0, 0), "recursive_doubling": (0, 0), "tree": (0, 0), "rabenseifner": (0, 0)}),
        (2, {"ring": (2, 1), "recursive_doubling": (1, 1), "tree": (2, 2), "rabenseifner": (2, 1)}),
        (3, {"ring": (4, 4 / 3), "recursive_doubling": (3, 3), "tree": (4, 4),
             "rabenseifner": (4, 3)}),
        (4, {"ring": (6, 1.5), "recursive_doubling": (2, 2), "tree": (4, 4),
             "rabenseifner": (4, 1.5)}),
        (5, {"ring": (8, 1.6), "recursive_doubling": (4, 4), "tree": (6, 6),
             "rabenseifner": (6, 3.5)}),
        (8, {"ring": (14, 1.75), "recursive_doubling": (3, 3), "tree": (6, 6),
             "rabenseifner": (6, 1.75)}),
    ],
)
def test_all_reduce_coefficients(n: int, expected: dict[str, tuple[float, float]]) -> None:
    for algorithm, (steps, per_byte) in expected.items():
        got = all_reduce_coefficients(algorithm, n)
        assert got == pytest.approx((steps, per_byte)), f"{algorithm}, N={n}: {got}"
        alpha, beta = 1e-5, 1e-9
        assert all_reduce_time(algorithm, MB, n, alpha, beta) == pytest.approx(
            steps * alpha + per_byte * MB * beta
        )
    assert all_reduce_coefficients("ring", n) == pytest.approx(
        (collective_time("all_reduce", 0, n, 1, 0), collective_time("all_reduce", 1, n, 0, 1))
    )


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_all_reduce_bytes_per_rank(n: int) -> None:
    s = 2520.0  # divisible by every n and p here
    p = 1 << (n.bit_length() - 1)
    log2_p, extra = p.bit_length() - 1, n - p
    for rank in range(n):
        folded_out = rank < 2 * extra and rank % 2 == 0
        returns_result = s if rank < 2 * extra else 0
        assert all_reduce_bytes_sent("ring", s, n, rank) == pytest.approx(2 * (n - 1) / n * s)
        assert all_reduce_bytes_sent("recursive_doubling", s, n, rank) == pytest.approx(
            s if folded_out else log2_p * s + returns_result
        )
        assert all_reduce_bytes_sent("rabenseifner", s, n, rank) == pytest.approx(
            s if folded_out else 2 * (p - 1) / p * s + returns_result
        )
    # The tree: every rank but the root sends its sum up once, the broadcast sends S per edge.
    tree = [all_reduce_bytes_sent("tree", s, n, rank) for rank in range(n)]
    assert sum(tree) == pytest.approx(2 * (n - 1) * s)
    assert tree[0] == pytest.approx((n - 1).bit_length() * s)


def test_best_algorithm_and_crossover() -> None:
    alpha, beta = 50e-6, 1e-9  # 50 us, 1 GB/s
    # Power of two: recursive doubling for small tensors, Rabenseifner (the ring's bytes in
    # fewer steps) for large ones; they cross where 2a + 2Sb = 4a + 1.5Sb, S = 4a/b.
    assert best_all_reduce(1024, 4, alpha, beta) == "recursive_doubling"
    assert best_all_reduce(64 * MB, 4, alpha, beta) == "rabenseifner"
    assert crossover_size("recursive_doubling", "rabenseifner", 4, alpha, beta) == pytest.approx(
        4 * alpha / beta
    )
    assert crossover_size("recursive_doubling", "ring", 4, alpha, beta) == pytest.approx(
        8 * alpha / beta
    )
    # N = 3: the fold costs Rabenseifner two whole-tensor steps, so the ring wins large sizes.
    assert best_all_reduce(64 * MB, 3, alpha, beta) == "ring"
    # N = 2: recursive doubling sends the ring's bytes in one step instead of two.
    assert {best_all_reduce(s, 2, alpha, beta) for s in (1, MB, 1024 * MB)} == {
        "recursive_doubling"
    }
    assert crossover_size("recursive_doubling", "ring", 2, alpha, beta) == math.inf
    assert AlphaBeta(alpha, beta).best_all_reduce(1024, 4) == "recursive_doubling"


def test_all_reduce_algorithm_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'butterfly'"):
        all_reduce_coefficients("butterfly", 4)
    with pytest.raises(ValueError, match="rank=4"):
        all_reduce_bytes_sent("ring", 100, 4, 4)
    with pytest.raises(ValueError, match="world_size=0"):
        all_reduce_time("ring", 100, 0, 1e-5, 1e-9)


def test_additions_make_the_ring_win_large_tensors_on_two_ranks() -> None:
    # Thakur's gamma term: recursive doubling adds S, the ring S/2, so with gamma > 0 the two
    # cross at S = (2 - 1) alpha / ((1 - 0.5) gamma) on 2 ranks.
    alpha, beta, gamma = 50e-6, 1e-9, 0.2e-9
    assert [reduction_coefficient(name, 4) for name in FLAT] == [
        0.75, 2, 2, 0.75
    ]
    assert reduction_coefficient("recursive_doubling", 3) == 2  # 1 step + the fold's addition
    assert crossover_size("recursive_doubling", "ring", 2, alpha, beta, gamma) == pytest.approx(
        2 * alpha / gamma
    )
    assert best_all_reduce(1024, 2, alpha, beta, gamma) == "recursive_doubling"
    assert best_all_reduce(64 * MB, 2, alpha, beta, gamma) == "ring"
    link = AlphaBeta(alpha, beta, gamma)
    assert link.best_all_reduce(64 * MB, 2) == "ring"
    assert all_reduce_time("ring", MB, 2, alpha, beta, gamma) == pytest.approx(
        2 * alpha + MB * beta + 0.5 * MB * gamma
    )
    assert str(link) == "alpha = 50.0 us, bandwidth = 1.00 GB/s, additions at 5.00 GB/s"


def test_each_algorithm_fits_its_own_links_and_the_cheapest_prediction_wins() -> None:
    # Where ranks share cores the tree's one-way sends cost less per byte than the others'
    # exchanges: with each algorithm's own links it wins large tensors, though one shared link
    # (the textbook model) says it never does.
    true = {"ring": AlphaBeta(60e-6, 1.0e-9), "recursive_doubling": AlphaBeta(30e-6, 1.2e-9),
            "tree": AlphaBeta(40e-6, 0.3e-9), "rabenseifner": AlphaBeta(50e-6, 1.1e-9)}
    sizes = [4**k for k in range(5, 12)]
    fitted = AlgorithmLinks.fit(4, sizes, {
        name: [all_reduce_time(name, s, 4, true[name].alpha, true[name].beta) for s in sizes]
        for name in FLAT})
    for name in FLAT:
        for nbytes in (1, 5000, 4**8, 10**9):  # below, inside, on, above the measured sizes
            assert fitted.link(name, nbytes).alpha == pytest.approx(true[name].alpha, rel=1e-6)
            assert fitted.link(name, nbytes).beta == pytest.approx(true[name].beta, rel=1e-6)
    assert fitted.predict("tree", MB) == pytest.approx(4 * 40e-6 + 4 * MB * 0.3e-9)
    assert fitted.best_all_reduce(1024, 4) == "recursive_doubling"
    assert fitted.best_all_reduce(64 * MB, 4) == "tree"
    assert best_all_reduce(64 * MB, 4, 60e-6, 1.0e-9) == "rabenseifner"
    table = str(fitted).splitlines()
    assert table[0].split() == ["size", *FLAT, "fastest"], table
    assert table[1].split()[:2] == ["1", "KiB"] and table[1].split()[-1] == "recursive_doubling"
    assert table[-1].split()[:2] == ["4", "MiB"] and table[-1].split()[-1] == "tree", table


def test_links_bend_with_size_one_range_at_a_time() -> None:
    # Above 1 MiB the ring pays 20% more per byte (a protocol change). Each range has its own
    # line, so the predictions on each side of the bend follow their own slope.
    sizes = [2**12, 2**20, 2**22]
    times = {name: [all_reduce_time(name, s, 2, 500e-6, 1e-9) for s in sizes]
             for name in FLAT}
    times["ring"][2] = times["ring"][1] + 1.2e-9 * (2**22 - 2**20)
    links = AlgorithmLinks.fit(2, sizes, times)
    assert links.link("ring", 2**16).beta == pytest.approx(1e-9, rel=1e-6)
    assert links.link("ring", 2**21).beta == pytest.approx(1.2e-9, rel=1e-6)
    for nbytes, seconds in zip(sizes, times["ring"], strict=True):
        assert links.predict("ring", nbytes) == pytest.approx(seconds, rel=1e-9)


def test_fits_weigh_every_size_alike_and_bad_links_are_clear() -> None:
    # A 10% error on the largest time must not swamp the smallest: alpha stays near the truth.
    sizes = [2**12, 2**16, 2**20, 2**22]
    times = [all_reduce_time("tree", s, 2, 50e-6, 1e-9) for s in sizes]
    times[-1] *= 1.1
    assert fit_all_reduce("tree", 2, sizes, times).alpha == pytest.approx(50e-6, rel=0.1)
    with pytest.raises(ValueError, match="times must be > 0"):
        fit_all_reduce("ring", 2, [1, 2], [0.0, 1.0])
    with pytest.raises(ValueError, match="'butterfly'"):
        fit_all_reduce("butterfly", 2, [1, 2], [1.0, 1.0])
    link = AlphaBeta(1e-5, 1e-9)
    with pytest.raises(ValueError, match="links must name each of"):
        AlgorithmLinks(2, (1, 2), (("ring", (link,)),))
    with pytest.raises(ValueError, match="sizes must be at least 2 increasing"):
        AlgorithmLinks(2, (2, 1), tuple((name, (link,)) for name in FLAT))
    with pytest.raises(ValueError, match="one link per range"):
        AlgorithmLinks(2, (1, 2, 3), tuple((name, (link,)) for name in FLAT))
    links = AlgorithmLinks(2, (1, 2), tuple((name, (link,)) for name in FLAT))
    with pytest.raises(ValueError, match="fitted on 2 ranks, not world_size=4"):
        links.best_all_reduce(1024, 4)


def test_exposed_time_is_what_outlasts_the_compute() -> None:
    from minidist.costs.cost import critical_intensity, exposed_time

    link = AlphaBeta(alpha=1e-5, beta=1 / 50e9)  # InfiniBand NDR, one direction
    transfer = 1e-5 + 1e9 / 50e9
    assert exposed_time(0, 1e9, 1e15, link) == pytest.approx(transfer)
    assert exposed_time(1e13, 1e9, 1e15, link) == pytest.approx(transfer - 0.01)
    assert exposed_time(1e15, 1e9, 1e15, link) == 0.0  # one second of compute hides 20 ms
    assert exposed_time(5, 0, 1e15, link) == 0.0  # nothing to send: no latency either
    # Exactly at the critical intensity the transfer just hides.
    intensity = critical_intensity(1e9, 1e15, link)
    assert exposed_time(intensity * 1e9, 1e9, 1e15, link) == pytest.approx(0.0, abs=1e-15)
    assert critical_intensity(math.inf, 989e12, AlphaBeta(0, 1 / 50e9)) == pytest.approx(19_780)
    assert critical_intensity(1e3, 1e12, link) == pytest.approx(1e12 * (1e-5 / 1e3 + 1 / 50e9))
    with pytest.raises(ValueError, match="peak_flops"):
        exposed_time(1, 1, 0, link)
    with pytest.raises(ValueError, match="nbytes"):
        critical_intensity(0, 1e12, link)
