"""minidist.cost: the alpha-beta model against REFERENCE.md's communication table."""

from __future__ import annotations

import math

import pytest

from minidist.cost import (
    COLLECTIVES,
    AlphaBeta,
    busbw_factor,
    collective_time,
    fit_alpha_beta,
    ring_bytes_sent,
)

MB = 2**20


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
