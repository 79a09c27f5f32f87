"""The alpha-beta model of communication time, and nccl-tests' bus-bandwidth factors.

Sending S bytes from one rank to another takes t = alpha + S * beta: alpha is the latency paid
per message (software, network hops), beta the seconds per byte of the link (1/beta is its
bandwidth). A collective is a schedule of such messages, so its time is a(N) * alpha +
b(N) * S * beta, with S the size of the full tensor and coefficients set by the algorithm.
Each collective's algorithm here is the first row of `minidist.costs.algorithms.TABLE` that
runs it (ring for all-reduce, reduce-scatter and all-gather, a binomial tree for broadcast, one
message for send), with that row's a(N) and b(N). All-reduce has several algorithms: the
table's rows for all_reduce, each with a third coefficient c(N); the ones a single link can
price (all but hierarchical, which needs the nodes) are those `best_all_reduce` chooses among.
Lab 01 counts their steps and bytes before this module's formulas are used (Thakur,
Rabenseifner and Gropp 2005).

c(N) is Thakur's third term: the bytes the busiest rank adds up per byte of tensor, at gamma
seconds per byte, so all-reduce takes a * alpha + b * S * beta + c * S * gamma. On a fast
network gamma is negligible beside beta; between processes on one CPU it is not, and it is
what makes recursive doubling, which adds up the whole tensor at every step, lose to the ring
for large tensors even on 2 ranks, where both send S.

The tree's row is its textbook schedule, each round waiting for the whole tensor; on a
network of full-duplex links it never wins. `minidist.communication.comm` pipelines it in segments,
as NCCL pipelines its trees: the rounds and the reduce and broadcast overlap, so for large S it
takes about ceil(log2 N) * S * beta (rank 0 receiving from and sending to its children at once),
half the row's bandwidth term, for a few more latencies.

The table assumes each rank has a link of its own that sends and receives at once. Ranks
that share a CPU break both assumptions: a rank waits for a core before each step, and the
copies of a send and a receive compete for the same cores, so an exchange (ring, recursive
doubling, Rabenseifner) costs more per byte than the tree's one-way sends. One alpha and beta
then no longer fit every algorithm, so `AlgorithmLinks` gives each its own, fitted on its own
timings over each range of sizes, as NCCL's tuner keeps a latency and a bandwidth per
algorithm and protocol; on a 2-core laptop the tree often wins.

Recursive doubling: in step k every rank swaps its whole tensor with rank XOR 2^k and adds.
Tree: a binomial-tree reduce to rank 0, then a binomial-tree broadcast. Rabenseifner:
a reduce-scatter by recursive halving (swap half the remaining part with rank XOR 2^k, keep
the other half), then an all-gather by recursive doubling; it moves the ring's bytes in
2 log2 N steps instead of 2(N-1). When N is not a power of two, the first 2(N-p) ranks pair up
and the even one of each pair hands its whole tensor to the odd one (one step of S) and sits
out, getting the result back at the end (one more): the 2f terms. `best_all_reduce` picks
the algorithm with the smallest predicted time. Only all-reduce models the reduction's cost
(gamma); the other collectives' formulas above leave it out.

Compute against communication. A transfer of S bytes that runs while a device computes F
FLOPs at its peak P, both started together (a GPU's copy engines or NCCL's kernels move data
while its SMs compute), adds max(0, alpha + S * beta - F / P) seconds to the step:
`exposed_time`. It hides entirely when the arithmetic intensity F / S (FLOPs per byte moved)
is at least P * (alpha / S + beta), `critical_intensity`; for large transfers that tends to
P * beta = P / bandwidth, the ridge point of a roofline drawn against the link (Williams,
Waterman & Patterson 2009; the same reasoning per parallel strategy is the core of Austin et
al., "How to Scale Your Model", 2025).

Sources: Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
in MPICH", IJHPCA 19(1), 2005 (the model and the tree/ring costs); Patarasuk & Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 69(2), 2009 (ring
all-reduce and its optimality); NVIDIA nccl-tests, doc/PERFORMANCE.md (bus bandwidth).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minidist.core._checks import positive_int
from minidist.costs import algorithms

__all__ = [
    "COLLECTIVES", "RING_COLLECTIVES", "busbw_factor", "ring_bytes_sent",
    "collective_time", "all_reduce_coefficients", "reduction_coefficient", "all_reduce_time",
    "best_all_reduce", "crossover_size", "all_reduce_bytes_sent", "AlphaBeta", "fit_alpha_beta",
    "fit_all_reduce", "AlgorithmLinks", "parameter_server_time", "exposed_time",
    "critical_intensity",
]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send")
RING_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


_FLAT = algorithms.names("all_reduce", nodes=False)  # what one link prices: all but hierarchical


def _check(collective: str, world_size: int, valid: tuple[str, ...] = COLLECTIVES) -> None:
    if collective not in valid:
        raise ValueError(f"unknown collective {collective!r}; valid ones are {', '.join(valid)}")
    positive_int(world_size=world_size)


def _coefficients(collective: str, world_size: int) -> tuple[float, float]:
    """(a, b) such that the collective takes a * alpha + b * S * beta (table above): those of
    the first algorithm in the table that runs it."""
    _check(collective, world_size)
    if collective == "send":
        return 1, 1
    a, b, _ = algorithms.running(collective)[0].coefficients(collective, world_size)
    return a, b


def busbw_factor(collective: str, world_size: int) -> float:
    """busbw / algbw, as nccl-tests defines it (doc/PERFORMANCE.md).

    algbw = S / t depends on N even for a perfect implementation; multiplying by the bytes each
    rank must move per byte of S gives the "bus bandwidth", comparable to the link's peak
    whatever N is (Lab 01 derives each collective's factor before using this).
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


def _check_algorithm(algorithm: str, world_size: int) -> None:
    if algorithm not in _FLAT:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r}; valid ones are {', '.join(_FLAT)}"
        )
    positive_int(world_size=world_size)


def all_reduce_coefficients(algorithm: str, world_size: int) -> tuple[float, float]:
    """(a, b) such that all-reduce with `algorithm` takes a * alpha + b * S * beta.

    The busiest rank's sequential steps (a) and bytes per byte of tensor (b), as in
    `minidist.costs.algorithms`' table (Thakur, Rabenseifner & Gropp 2005).
    """
    _check_algorithm(algorithm, world_size)
    a, b, _ = algorithms.named(algorithm).coefficients("all_reduce", world_size)
    return a, b


def reduction_coefficient(algorithm: str, world_size: int) -> float:
    """c such that the busiest rank adds up c * S bytes in all-reduce (the table's c(N))."""
    _check_algorithm(algorithm, world_size)
    return algorithms.named(algorithm).coefficients("all_reduce", world_size)[2]


def all_reduce_time(
    algorithm: str, nbytes: float, world_size: int, alpha: float, beta: float,
    gamma: float = 0.0,
) -> float:
    """Seconds the model predicts for all-reduce of `nbytes` with `algorithm`:
    a * alpha + b * S * beta + c * S * gamma (gamma, seconds per byte added, defaults to 0)."""
    a, b = all_reduce_coefficients(algorithm, world_size)
    c = reduction_coefficient(algorithm, world_size)
    return a * alpha + b * nbytes * beta + c * nbytes * gamma


def best_all_reduce(
    nbytes: float, world_size: int, alpha: float, beta: float, gamma: float = 0.0
) -> str:
    """The flat algorithm with the smallest predicted time; on a tie, the first in the
    table."""
    return min(
        _FLAT,
        key=lambda name: all_reduce_time(name, nbytes, world_size, alpha, beta, gamma),
    )


def crossover_size(
    first: str, second: str, world_size: int, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """The tensor size in bytes at which `first` and `second` take equal predicted time.

    Solves a1 alpha + (b1 beta + c1 gamma) S = a2 alpha + (b2 beta + c2 gamma) S for S
    (with gamma = 0: S = (a2 - a1) alpha / ((b1 - b2) beta)). Below it the algorithm with
    fewer steps wins, above it the one moving fewer bytes. inf when the lines never cross at
    a positive size (one algorithm wins at every size).
    """
    a1, b1 = all_reduce_coefficients(first, world_size)
    a2, b2 = all_reduce_coefficients(second, world_size)
    per_byte_1 = b1 * beta + reduction_coefficient(first, world_size) * gamma
    per_byte_2 = b2 * beta + reduction_coefficient(second, world_size) * gamma
    if per_byte_1 == per_byte_2:
        return float("inf")
    size = (a2 - a1) * alpha / (per_byte_1 - per_byte_2)
    return size if size > 0 else float("inf")


def all_reduce_bytes_sent(algorithm: str, nbytes: float, world_size: int, rank: int) -> float:
    """Bytes group rank `rank` sends in all-reduce of an `nbytes` tensor with `algorithm`.

    Exact when the chunks divide evenly (N divides the tensor for the ring, p for
    rabenseifner); otherwise off by at most one element per step. Unlike the ring, the other
    algorithms do not load every rank equally:
      recursive_doubling  log2 p * S; with N != p, a folded-out (even, < 2(N-p)) rank sends
                          S once, and its odd partner S more to return the result
      rabenseifner        2(p-1)/p * S, with the same fold as recursive doubling
      tree                S up to its parent (all but rank 0), then S to each child in the
                          broadcast: rank 0 sends ceil(log2 N) * S, leaves S
    """
    _check_algorithm(algorithm, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: must be in 0..{world_size - 1}")
    n = world_size
    if algorithm == "ring":
        return 2 * (n - 1) / n * nbytes
    if algorithm == "tree":
        children = sum(1 for k in range(n.bit_length()) if rank < 2**k and rank + 2**k < n)
        return (int(rank != 0) + children) * nbytes
    log2_p = n.bit_length() - 1
    p = 1 << log2_p  # the largest power of two <= n
    folded = rank < 2 * (n - p)
    if folded and rank % 2 == 0:
        return nbytes
    core = log2_p * nbytes if algorithm == "recursive_doubling" else 2 * (p - 1) / p * nbytes
    return core + (nbytes if folded else 0)


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted link: latency `alpha` (seconds) and inverse bandwidth `beta` (seconds/byte);
    `gamma` (seconds per byte added up) only enters all-reduce's algorithm choice."""

    alpha: float
    beta: float
    gamma: float = 0.0

    @property
    def bandwidth(self) -> float:
        """Bytes per second, 1 / beta."""
        return 1 / self.beta if self.beta > 0 else float("inf")

    def predict(self, collective: str, nbytes: float, world_size: int) -> float:
        """Seconds `collective` on an `nbytes` tensor should take on this link."""
        return collective_time(collective, nbytes, world_size, self.alpha, self.beta)

    def best_all_reduce(self, nbytes: float, world_size: int) -> str:
        """The all-reduce algorithm this link makes fastest for an `nbytes` tensor."""
        return best_all_reduce(nbytes, world_size, self.alpha, self.beta, self.gamma)

    def __str__(self) -> str:
        text = f"alpha = {self.alpha * 1e6:.1f} us, bandwidth = {self.bandwidth / 1e9:.2f} GB/s"
        return text + (f", additions at {1 / self.gamma / 1e9:.2f} GB/s" if self.gamma else "")


def fit_alpha_beta(
    collective: str, world_size: int, sizes: Sequence[float], times: Sequence[float]
) -> AlphaBeta:
    """Least-squares alpha, beta >= 0 from measured `times` (s) of `collective` at `sizes` (B).

    Fits t = a(N) * alpha + b(N) * S * beta, each point to the same relative error, so that
    microsecond timings of small messages count as much as the milliseconds of large ones.
    Small messages pin down alpha and large ones beta, so give sizes spanning both (e.g. 1 KB
    to 16 MB).
    """
    return _fit(*_coefficients(collective, world_size), sizes, times, collective)


def fit_all_reduce(
    algorithm: str, world_size: int, sizes: Sequence[float], times: Sequence[float]
) -> AlphaBeta:
    """`fit_alpha_beta` for one all-reduce algorithm: alpha and beta such that
    a * alpha + b * S * beta (its coefficients from `all_reduce_coefficients`) matches its
    measured `times`. Its additions are folded into beta."""
    return _fit(*all_reduce_coefficients(algorithm, world_size), sizes, times, algorithm)


def _fit(a: float, b: float, sizes: Sequence[float], times: Sequence[float],
         what: str) -> AlphaBeta:
    sizes_, times_ = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    if sizes_.shape != times_.shape or sizes_.ndim != 1 or len(sizes_) < 2:
        raise ValueError(
            f"need two equally long lists with at least 2 points, got {len(sizes_)} sizes "
            f"and {len(times_)} times"
        )
    if a == 0:
        raise ValueError(f"{what} on world_size=1 sends nothing; fit with world_size >= 2")
    if (times_ <= 0).any():
        raise ValueError(f"times must be > 0 seconds, got {times_.tolist()}")
    # Each row divided by its time: the residuals are relative errors.
    columns = np.column_stack([np.full_like(sizes_, a), b * sizes_]) / times_[:, None]
    target = np.ones_like(times_)
    # Scale the columns to unit norm: alpha ~ 1e-5 and beta ~ 1e-9 differ by orders of magnitude.
    scale = np.linalg.norm(columns, axis=0)
    scale[scale == 0] = 1
    solution = np.linalg.lstsq(columns / scale, target, rcond=None)[0] / scale
    if (solution < 0).any():
        # The best non-negative fit then has alpha = 0 or beta = 0: fit each alone, keep the best.
        candidates = []
        for j in range(2):
            column = columns[:, j]
            coefficient = max(0.0, column @ target / max(column @ column, 1e-300))
            candidate = np.zeros(2)
            candidate[j] = coefficient
            candidates.append(candidate)
        solution = min(candidates, key=lambda x: np.sum((columns @ x - target) ** 2))
    return AlphaBeta(alpha=float(solution[0]), beta=float(solution[1]))


@dataclass(frozen=True)
class AlgorithmLinks:
    """Each all-reduce algorithm's own fitted links on a group of `world_size` ranks.

    `sizes` are the tensor sizes (bytes, ascending) the algorithms were timed at; `links` pairs
    each flat all-reduce algorithm of the table with its links, one per range between
    neighbouring sizes: the alpha and beta through its two timings there (`fit_all_reduce`; the
    additions are in beta). A size below the first range uses the first, above the last the
    last. Where ranks share cores, an algorithm's steps and bytes cost what its own traffic
    pattern costs there, not what the ring's do, and the cost per byte changes with size
    (messages of 512 KiB or more travel in segments; large messages outgrow the caches): one
    line fitted on the ring alone misleads the choice.
    """

    world_size: int
    sizes: tuple[int, ...]
    links: tuple[tuple[str, tuple[AlphaBeta, ...]], ...]

    def __post_init__(self) -> None:
        names = tuple(name for name, _ in self.links)
        if sorted(names) != sorted(_FLAT):
            raise ValueError(f"links must name each of {', '.join(_FLAT)} once, got {names}")
        if len(self.sizes) < 2 or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"sizes must be at least 2 increasing sizes, got {self.sizes}")
        ranges = len(self.sizes) - 1
        if any(len(links) != ranges for _, links in self.links):
            raise ValueError(f"{len(self.sizes)} sizes make {ranges} ranges: give each "
                             f"algorithm one link per range, got {self.links}")

    @classmethod
    def fit(cls, world_size: int, sizes: Sequence[int],
            times: dict[str, Sequence[float]]) -> AlgorithmLinks:
        """The links through each algorithm's measured `times` (s) at `sizes` (B)."""
        return cls(world_size, tuple(sizes), tuple(
            (name, tuple(fit_all_reduce(name, world_size, sizes[i:i + 2], times[name][i:i + 2])
                         for i in range(len(sizes) - 1)))
            for name in _FLAT
        ))

    def link(self, algorithm: str, nbytes: float) -> AlphaBeta:
        """`algorithm`'s link for an `nbytes` tensor: the one fitted on the range holding it."""
        _check_algorithm(algorithm, self.world_size)
        index = max(0, min(bisect.bisect_right(self.sizes, nbytes) - 1, len(self.sizes) - 2))
        return dict(self.links)[algorithm][index]

    def predict(self, algorithm: str, nbytes: float) -> float:
        """Seconds all-reduce of `nbytes` with `algorithm` should take, on its own link."""
        link = self.link(algorithm, nbytes)
        return all_reduce_time(algorithm, nbytes, self.world_size, link.alpha, link.beta)

    def best_all_reduce(self, nbytes: float, world_size: int) -> str:
        """The algorithm predicted fastest for an `nbytes` tensor; on a tie, the first in
        the table. `world_size` must be the one the links were fitted on."""
        if world_size != self.world_size:
            raise ValueError(
                f"these links were fitted on {self.world_size} ranks, not world_size="
                f"{world_size}; fit them on the group that all-reduces"
            )
        return min(_FLAT, key=lambda name: self.predict(name, nbytes))

    def __str__(self) -> str:
        """A table: at each measured size, each algorithm's predicted time and the fastest."""
        widths = {name: max(len(name), 10) for name in _FLAT}
        lines = [f"{'size':>8}" + "".join(f"  {name:>{width}}" for name, width in widths.items())
                 + "  fastest"]
        for nbytes in self.sizes:
            times = "".join(f"  {f'{self.predict(name, nbytes) * 1e6:.0f} us':>{width}}"
                            for name, width in widths.items())
            lines.append(f"{_size_label(nbytes):>8}{times}  "
                         f"{self.best_all_reduce(nbytes, self.world_size)}")
        return "\n".join(lines)


def _size_label(nbytes: float) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def parameter_server_time(nbytes: float, workers: int, servers: int, alpha: float,
                          beta: float) -> float:
    """Seconds one synchronous parameter-server step spends on its busiest link, a server's.

    Each of the k = `servers` shards is S/k bytes: a server receives N = `workers` gradient
    shards, then (the update needs all of them) sends N parameter shards back, one message at
    a time: 2N * (alpha + S/k * beta) (Li et al., OSDI 2014). Ring all-reduce takes
    2(N-1) * alpha + 2(N-1)/N * S * beta, so with one server the parameter server is about N
    times slower for large S, and k servers bring that down to N/k.
    """
    positive_int(workers=workers, servers=servers)
    return 2 * workers * (alpha + nbytes / servers * beta)


def exposed_time(flops: float, nbytes: float, peak_flops: float, link: AlphaBeta) -> float:
    """Seconds a transfer of `nbytes` over `link` adds to `flops` of compute at `peak_flops`
    that runs at the same time, both started together: the part of alpha + nbytes * beta that
    outlasts flops / peak_flops, 0 when the transfer hides."""
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops={flops} and nbytes={nbytes} must be >= 0")
    if not peak_flops > 0:
        raise ValueError(f"peak_flops={peak_flops} must be > 0 FLOP/s")
    transfer = link.alpha + nbytes * link.beta if nbytes > 0 else 0.0
    return max(0.0, transfer - flops / peak_flops)


def critical_intensity(nbytes: float, peak_flops: float, link: AlphaBeta) -> float:
    """The fewest FLOPs per byte moved for which compute at `peak_flops` hides a transfer of
    `nbytes` over `link`: peak * (alpha / nbytes + beta). `nbytes=math.inf` gives the ridge
    point peak * beta = peak / bandwidth, the large-transfer limit."""
    if not nbytes > 0:
        raise ValueError(f"nbytes={nbytes} must be > 0: an empty transfer hides under anything")
    if not peak_flops > 0:
        raise ValueError(f"peak_flops={peak_flops} must be > 0 FLOP/s")
    return peak_flops * (link.alpha / nbytes + link.beta)
