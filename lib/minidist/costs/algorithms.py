"""The one table of minidist's algorithms: each one's name, the collectives it runs, its
alpha-beta cost, and where it applies.

This is the only place an algorithm is named. The cost model (`minidist.costs.cost`), the two
tiers' model (`minidist.communication.network`) and the collective layer, through
`minidist.communication.impls` (which joins each entry below to the code that runs it: comm's
plain version, streaming's fast one, the hierarchical one), all read their algorithms here.
It lives in costs/ so that the formulas stay importable without torch.distributed; the code
that runs an algorithm lives above it, in communication/, and points back to its entry.

An algorithm's cost on one link is a(N) * alpha + b(N) * S * beta + c(N) * S * gamma: a the
busiest rank's sequential steps, b the bytes it sends per byte of the tensor S, c the bytes it
adds up per byte of S (Thakur, Rabenseifner & Gropp 2005). Each row's `costs` holds them as
functions of N (and g, the ranks per node); the docstrings do not spell them out, because Lab 01
(the flat algorithms) and Lab 11 (hierarchical) ask for them before the library is used.

Where each applies:
- recursive doubling and Rabenseifner pair ranks by XOR, so they run on a power of two of
  ranks p: when N is not one, the first 2(N-p) ranks fold in pairs before (the even one hands
  its tensor to the odd one) and get the result back after (`folds`);
- hierarchical needs the job's nodes (`needs_nodes`): n nodes of g ranks each, g dividing N,
  given by the network a Mesh was built with (`mesh.network`), over the whole job. Its row
  prices every step on one link; `TwoTier.all_reduce_time` prices its phases on their own tier
  (inside the node, then across). Without nodes (g = 1) it is the ring;
- pairwise's row assumes even splits, S being the rows this rank holds: its N-1 messages of
  S/N leave through the rank's one port one after another.

The ring's rows are Patarasuk & Yuan's (2009); the tree's are its textbook schedule, each round
waiting for the whole tensor (`minidist.communication.streaming` pipelines it, as NCCL does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Algorithm", "RING", "RECURSIVE_DOUBLING", "TREE", "RABENSEIFNER", "HIERARCHICAL",
           "PAIRWISE", "TABLE", "named", "running", "names"]

Coefficients = tuple[float, float, float]  # (a, b, c) of the module's table


@dataclass(frozen=True)
class Algorithm:
    """One row of the table: `costs` maps each collective the algorithm runs to its
    coefficients (a, b, c) as a function of the world size N and the ranks per node g (which
    only hierarchical reads)."""

    name: str
    costs: Mapping[str, Callable[[int, int], Coefficients]]
    folds: bool = False  # runs on a power of two of ranks; the others fold in and out
    needs_nodes: bool = False  # runs on the job's two tiers: needs `mesh.network`

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collectives this algorithm runs."""
        return tuple(self.costs)

    def coefficients(self, collective: str, world_size: int,
                     ranks_per_node: int = 1) -> Coefficients:
        """(a, b, c): `collective` with this algorithm takes a * alpha + b * S * beta +
        c * S * gamma on `world_size` ranks, one link for every step."""
        if collective not in self.costs:
            raise ValueError(f"{self.name} does not run {collective}; it runs "
                             f"{', '.join(self.collectives)}")
        return self.costs[collective](world_size, ranks_per_node)


def _power_of_two_below(n: int) -> tuple[int, int]:
    """(p, log2 p) for the largest power of two p <= n."""
    log2_p = n.bit_length() - 1
    return 1 << log2_p, log2_p


def _ring_all_reduce(n: int, g: int) -> Coefficients:
    return 2 * (n - 1), 2 * (n - 1) / n, (n - 1) / n


def _ring_reduce_scatter(n: int, g: int) -> Coefficients:
    return n - 1, (n - 1) / n, (n - 1) / n


def _ring_all_gather(n: int, g: int) -> Coefficients:
    return n - 1, (n - 1) / n, 0


def _recursive_doubling(n: int, g: int) -> Coefficients:
    p, log2_p = _power_of_two_below(n)
    fold = 0 if p == n else 1  # hand the tensor in before, get the result back after
    return log2_p + 2 * fold, log2_p + 2 * fold, log2_p + fold


def _tree_all_reduce(n: int, g: int) -> Coefficients:
    rounds = (n - 1).bit_length()  # ceil(log2 n); rank 0 adds one tensor per child
    return 2 * rounds, 2 * rounds, rounds


def _tree_broadcast(n: int, g: int) -> Coefficients:
    rounds = (n - 1).bit_length()
    return rounds, rounds, 0


def _rabenseifner(n: int, g: int) -> Coefficients:
    p, log2_p = _power_of_two_below(n)
    fold = 0 if p == n else 1
    return 2 * log2_p + 2 * fold, 2 * (p - 1) / p + 2 * fold, (p - 1) / p + fold


def _hierarchical(n: int, g: int) -> Coefficients:
    nodes = n // g  # a ring over the node's g ranks, then over the n nodes on S/g
    return (2 * (g - 1) + 2 * (nodes - 1), 2 * (g - 1) / g + 2 * (nodes - 1) / (nodes * g),
            (g - 1) / g + (nodes - 1) / (nodes * g))


def _pairwise(n: int, g: int) -> Coefficients:
    return n - 1, (n - 1) / n, 0


RING = Algorithm("ring", {"all_reduce": _ring_all_reduce, "reduce_scatter": _ring_reduce_scatter,
                          "all_gather": _ring_all_gather})
RECURSIVE_DOUBLING = Algorithm("recursive_doubling", {"all_reduce": _recursive_doubling},
                               folds=True)
TREE = Algorithm("tree", {"all_reduce": _tree_all_reduce, "broadcast": _tree_broadcast})
RABENSEIFNER = Algorithm("rabenseifner", {"all_reduce": _rabenseifner}, folds=True)
HIERARCHICAL = Algorithm("hierarchical", {"all_reduce": _hierarchical}, needs_nodes=True)
PAIRWISE = Algorithm("pairwise", {"all_to_all": _pairwise})

TABLE = (RING, RECURSIVE_DOUBLING, TREE, RABENSEIFNER, HIERARCHICAL, PAIRWISE)
"""Every algorithm, in the order choices are listed and ties broken."""


def named(name: str) -> Algorithm:
    """The table's entry called `name`."""
    for algorithm in TABLE:
        if algorithm.name == name:
            return algorithm
    raise ValueError(f"unknown algorithm {name!r}; minidist's are "
                     f"{', '.join(a.name for a in TABLE)}")


def running(collective: str, *, nodes: bool = True) -> tuple[Algorithm, ...]:
    """The entries that run `collective`, in table order; nodes=False leaves out those that
    need the job's nodes (what a flat alpha-beta link can price)."""
    return tuple(algorithm for algorithm in TABLE if collective in algorithm.costs
                 and (nodes or not algorithm.needs_nodes))


def names(collective: str, *, nodes: bool = True) -> tuple[str, ...]:
    """The names of `running(collective, nodes=nodes)`."""
    return tuple(algorithm.name for algorithm in running(collective, nodes=nodes))
