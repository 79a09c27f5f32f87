"""Every `impl=` a collective accepts: the algorithm table joined to the code that runs it, and
how "auto" picks one.

`minidist.costs.algorithms.TABLE` names each algorithm and says what it costs and where it
applies; it lives in costs/, below this folder, so that the cost model needs no
torch.distributed. `TABLE` here joins each of its rows, in the same order, to its code:
`plain`, comm's version for reading (every message whole), and `streamed`, the version
`minidist.communication.collectives` runs (streaming's segments; the hierarchical one), each
per collective. Nothing here names an algorithm: the names are the costs table's.

A collective's choices are "torch" (torch.distributed's own), for all_reduce "auto", then the
names of the rows that run it; `check_impl` raises on any other, naming them. "auto" is a pure
function of the size, the group and its links (`choose`): the links each algorithm was
measured to have on the group (`fit_links`, on the first call, kept per group), or those given;
or, given the job's network and a group spanning it, the two-tier model's choice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minidist.communication import comm, streaming
from minidist.communication.comm import Ring
from minidist.communication.counting import uncounted
from minidist.communication.emulation import Network
from minidist.communication.timing import time_in_turns
from minidist.core._groups import per_group_cache
from minidist.costs import algorithms
from minidist.costs.algorithms import Algorithm
from minidist.costs.cost import AlgorithmLinks, AlphaBeta

__all__ = ["Implementation", "TABLE", "choices", "check_impl", "implementation", "FIT_SIZES",
           "fit_links",
           "best_algorithm", "choose"]


@dataclass(frozen=True)
class Implementation:
    """One row of the costs table (`algorithm`: its name, cost, where it applies) and its code,
    per collective: `plain` comm's, for reading; `streamed` what the collectives run."""

    algorithm: Algorithm
    streamed: Mapping[str, Callable[..., None]]
    plain: Mapping[str, Callable[..., None]]

    @property
    def name(self) -> str:
        return self.algorithm.name


TABLE = (
    Implementation(
        algorithms.RING,
        streamed={"all_reduce": streaming.ring_steps, "reduce_scatter": streaming.reduce_scatter,
                  "all_gather": streaming.all_gather},
        plain={"all_reduce": comm.ring_steps, "reduce_scatter": comm.reduce_scatter_steps,
               "all_gather": comm.all_gather_steps}),
    Implementation(
        algorithms.RECURSIVE_DOUBLING,
        streamed={"all_reduce": streaming.recursive_doubling_steps},
        plain={"all_reduce": comm.recursive_doubling_steps}),
    Implementation(
        algorithms.TREE,
        streamed={"all_reduce": streaming.tree_steps, "broadcast": streaming.broadcast_steps},
        plain={"all_reduce": comm.tree_steps, "broadcast": comm.binomial_broadcast}),
    Implementation(
        algorithms.RABENSEIFNER,
        streamed={"all_reduce": streaming.rabenseifner_steps},
        plain={"all_reduce": comm.rabenseifner_steps}),
    Implementation(  # f(flat, node, across, average): needs the job's nodes
        algorithms.HIERARCHICAL,
        streamed={"all_reduce": streaming.hierarchical_steps},
        plain={}),
    Implementation(  # f(sends, receives, ring): nothing to stream, both are comm's
        algorithms.PAIRWISE,
        streamed={"all_to_all": comm.pairwise_steps},
        plain={"all_to_all": comm.pairwise_steps}),
)
"""The costs table's rows, in its order, each with its code: f(flat, ring, average) for
all-reduce, f(flat, ring) for reduce-scatter and all-gather, f(flat, ring, root) for broadcast
(comm's take `messages` last)."""


def choices(collective: str) -> tuple[str, ...]:
    """The `impl` values `collective` accepts: "torch", "auto" (all_reduce only), then the
    names of the algorithms that run it, in the table's order."""
    automatic = ("auto",) if collective == "all_reduce" else ()
    return ("torch", *automatic, *algorithms.names(collective))


def check_impl(collective: str, impl: str) -> None:
    """Raise unless `impl` is one of `choices(collective)`."""
    if impl not in choices(collective):
        listed = ", ".join(map(repr, choices(collective)))
        raise ValueError(f"impl={impl!r}: {collective} runs with one of {listed} ('torch' is "
                         f"torch.distributed's own; the others are minidist's, from send/recv, "
                         f"whose bytes count_traffic counts)")


def implementation(name: str) -> Implementation:
    """The row of `TABLE` called `name` (the costs table's `named` says which names exist)."""
    algorithm = algorithms.named(name)
    return next(row for row in TABLE if row.algorithm is algorithm)


# --- Choosing one: "auto" ---------------------------------------------------------------------

# Sizes each algorithm is timed at by default; its links are fitted on each range between two.
FIT_SIZES = (2**12, 2**16, 2**18, 2**20, 2**22)
_links: dict[dist.ProcessGroup, dict[tuple[int, ...], AlgorithmLinks]] = per_group_cache()


def fit_links(group: dist.ProcessGroup | None = None, *, rounds: int = 9,
              sizes: Sequence[int] = FIT_SIZES) -> AlgorithmLinks:
    """Each flat all-reduce algorithm's own link on `group`, as "auto" sees it: measured on
    the first call and kept per group (and per `sizes`).

    Every algorithm is timed (its `streamed` code) at each of `sizes` (bytes; by default five
    from 4 KiB to 4 MiB), its additions included, in `rounds` rounds of
    `timing.time_in_turns`, and fitted to its own a * alpha + b * S * beta on each range
    between two sizes (`cost.AlgorithmLinks`); above the last size the last range's link
    holds, so a job that all-reduces much larger tensors fits up to its sizes. Each point is
    the median of its rounds, on the slowest rank, so every rank fits the same links and
    "auto" makes the same choice everywhere. About 1.5 s on 2 ranks of a 2-core laptop, 4 s
    on 4 with the default sizes; every member of the group must call it (as "auto" does), at
    the same time. Nothing it sends is counted.
    """
    sizes = tuple(sizes)
    if len(sizes) < 2 or list(sizes) != sorted(set(sizes)) or sizes[0] < 4:
        raise ValueError(f"sizes={sizes}: give at least two increasing sizes in bytes, "
                         f"from 4 up (for example {FIT_SIZES})")
    return _links_of(comm.ring_of(group, "fit_links"), rounds, sizes)


def _links_of(ring: Ring, rounds: int = 9, sizes: tuple[int, ...] = FIT_SIZES) -> AlgorithmLinks:
    fitted = _links.setdefault(ring.group or dist.group.WORLD, {})
    if sizes not in fitted:
        fitted[sizes] = _fit_links(ring, rounds, sizes)
    return fitted[sizes]


def _fit_links(ring: Ring, rounds: int, sizes: tuple[int, ...]) -> AlgorithmLinks:
    flat = [row for row in TABLE if row.algorithm in algorithms.running("all_reduce", nodes=False)]
    if ring.size == 1:  # nothing is ever sent
        free = (AlphaBeta(0.0, 0.0),) * (len(sizes) - 1)
        return AlgorithmLinks(1, sizes, tuple((row.name, free) for row in flat))
    tensors = [torch.zeros(nbytes // 4) for nbytes in sizes]  # zeros never overflow
    calls, repeat = {}, {}
    for row in flat:
        for tensor in tensors:
            point = f"{row.name} {tensor.numel()}"
            calls[point] = functools.partial(row.streamed["all_reduce"], tensor, ring, False)
            # a call of 4 KiB lasts about as long as the clock's and the barrier's jitter
            repeat[point] = max(1, 2**12 // tensor.numel())
    with uncounted():
        times = time_in_turns(calls, rounds, repeat, group=ring.group)
    medians = {row.name: [torch.tensor(times[f"{row.name} {t.numel()}"]).median().item()
                          for t in tensors] for row in flat}
    return AlgorithmLinks.fit(ring.size, sizes, medians)


@functools.lru_cache(maxsize=4096)
def best_algorithm(link: AlphaBeta | AlgorithmLinks, nbytes: int, world_size: int) -> str:
    """link.best_all_reduce, remembered: training all-reduces the same sizes every step, and a
    small all-reduce takes only tens of microseconds."""
    return link.best_all_reduce(nbytes, world_size)


def choose(impl: str, nbytes: int, ring: Ring, link: AlphaBeta | AlgorithmLinks | None = None,
           network: Network | None = None) -> Implementation:
    """The row all_reduce(impl=`impl`) runs on an `nbytes` tensor over `ring`'s group. "auto"
    decides with `link` (by default `fit_links` of the group), or, given the job's `network`
    and a group spanning the job, with its two-tier model; any other name is its own row."""
    if impl == "auto" and link is None and network is not None and network.spans(ring.group):
        impl = network.tiers.best_all_reduce(nbytes, ring.size)
    elif impl == "auto":
        impl = best_algorithm(link or _links_of(ring), nbytes, ring.size)
    return implementation(impl)
