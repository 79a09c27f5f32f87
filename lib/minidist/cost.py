"""The alpha-beta model of communication time, and nccl-tests' bus-bandwidth factors.

Sending S bytes from one rank to another takes t = alpha + S * beta: alpha is the latency paid
per message (software, network hops), beta the seconds per byte of the link (1/beta is its
bandwidth). A collective is a schedule of such messages, so its time is a(N) * alpha +
b(N) * S * beta, with S the size of the full tensor and coefficients set by the algorithm:

    collective      algorithm        a(N)             b(N)
    all_reduce      ring             2(N-1)           2(N-1)/N
    reduce_scatter  ring             N-1              (N-1)/N
    all_gather      ring             N-1              (N-1)/N
    broadcast       binomial tree    ceil(log2 N)     ceil(log2 N)
    send            point-to-point   1                1

Sources: Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
in MPICH", IJHPCA 19(1), 2005 (the model and the tree/ring costs); Patarasuk & Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 69(2), 2009 (ring
all-reduce and its optimality); NVIDIA nccl-tests, doc/PERFORMANCE.md (bus bandwidth).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minidist._checks import positive_int

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send")
RING_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def _check(collective: str, world_size: int, valid: tuple[str, ...] = COLLECTIVES) -> None:
    if collective not in valid:
        raise ValueError(f"unknown collective {collective!r}; valid ones are {', '.join(valid)}")
    positive_int(world_size=world_size)


def _coefficients(collective: str, world_size: int) -> tuple[float, float]:
    """(a, b) such that the collective takes a * alpha + b * S * beta (table above)."""
    _check(collective, world_size)
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather"):
        return n - 1, (n - 1) / n
    if collective == "broadcast":
        rounds = (n - 1).bit_length()  # ceil(log2 n)
        return rounds, rounds
    return 1, 1  # send


def busbw_factor(collective: str, world_size: int) -> float:
    """busbw / algbw, as nccl-tests defines it (doc/PERFORMANCE.md).

    algbw = S / t depends on N even for a perfect implementation; multiplying by the bytes each
    rank must move per byte of S gives the "bus bandwidth", comparable to the link's peak
    whatever N is: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast and
    send 1.
    """
    _check(collective, world_size)
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def ring_bytes_sent(collective: str, nbytes: float, world_size: int) -> float:
    """Bytes each rank sends when the ring algorithm runs `collective` on an `nbytes` tensor.

    all_reduce 2(N-1)/N * S, reduce_scatter and all_gather (N-1)/N * S, S being the full
    tensor (Thakur et al. 2005; Patarasuk & Yuan 2009). When N does not divide the tensor the
    chunks differ by one element, and a rank's count is off by at most one element per step.
    """
    _check(collective, world_size, RING_COLLECTIVES)
    return _coefficients(collective, world_size)[1] * nbytes


def collective_time(
    collective: str, nbytes: float, world_size: int, alpha: float, beta: float
) -> float:
    """Seconds the alpha-beta model predicts: a(N) * alpha + b(N) * nbytes * beta.

    alpha in seconds, beta in seconds per byte; nbytes is the full tensor (S in the table
    above; for "send", the message).
    """
    a, b = _coefficients(collective, world_size)
    return a * alpha + b * nbytes * beta


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted link: latency `alpha` (seconds) and inverse bandwidth `beta` (seconds/byte)."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second, 1 / beta."""
        return 1 / self.beta if self.beta > 0 else float("inf")

    def predict(self, collective: str, nbytes: float, world_size: int) -> float:
        """Seconds `collective` on an `nbytes` tensor should take on this link."""
        return collective_time(collective, nbytes, world_size, self.alpha, self.beta)

    def __str__(self) -> str:
        return f"alpha = {self.alpha * 1e6:.1f} us, bandwidth = {self.bandwidth / 1e9:.2f} GB/s"


def fit_alpha_beta(
    collective: str, world_size: int, sizes: Sequence[float], times: Sequence[float]
) -> AlphaBeta:
    """Least-squares alpha, beta >= 0 from measured `times` (s) of `collective` at `sizes` (B).

    Fits t = a(N) * alpha + b(N) * S * beta. Small messages pin down alpha and large ones
    beta, so give sizes spanning both (e.g. 1 KB to 16 MB).
    """
    a, b = _coefficients(collective, world_size)
    sizes_, times_ = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    if sizes_.shape != times_.shape or sizes_.ndim != 1 or len(sizes_) < 2:
        raise ValueError(
            f"need two equally long lists with at least 2 points, got {len(sizes_)} sizes "
            f"and {len(times_)} times"
        )
    if a == 0:
        raise ValueError(f"{collective} on world_size=1 sends nothing; fit with world_size >= 2")
    columns = np.column_stack([np.full_like(sizes_, a), b * sizes_])
    # Scale the columns to unit norm: alpha ~ 1e-5 and beta ~ 1e-9 differ by orders of magnitude.
    scale = np.linalg.norm(columns, axis=0)
    scale[scale == 0] = 1
    solution = np.linalg.lstsq(columns / scale, times_, rcond=None)[0] / scale
    if (solution < 0).any():
        # The best non-negative fit then has alpha = 0 or beta = 0: fit each alone, keep the best.
        candidates = []
        for j in range(2):
            column = columns[:, j]
            coefficient = max(0.0, column @ times_ / max(column @ column, 1e-300))
            candidate = np.zeros(2)
            candidate[j] = coefficient
            candidates.append(candidate)
        solution = min(candidates, key=lambda x: np.sum((columns @ x - times_) ** 2))
    return AlphaBeta(alpha=float(solution[0]), beta=float(solution[1]))
