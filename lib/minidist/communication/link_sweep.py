"""Finding a slow link: every pair of ranks timed, in rounds of disjoint pairs, and the node whose
inter-node links are slower than the rest (the seeds' incident of an InfiniBand link running at
half speed). cluster_setup/jobs/busbw_check.py --pairwise runs the same sweep on a cluster.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from minidist.communication import comm
from minidist.communication.counting import uncounted
from minidist.communication.network import TwoTier
from minidist.communication.timing import barrier
from minidist.core._checks import positive_int

__all__ = ["pairwise_bandwidth", "slow_nodes"]


def _rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of n ranks once, in rounds where each rank is in at most one pair (the
    circle method): n-1 rounds for even n, n for odd n."""
    ranks = list(range(n)) + ([None] if n % 2 else [])
    rounds = []
    for _ in range(len(ranks) - 1):
        half = len(ranks) // 2
        pairs = [(a, b) for a, b in zip(ranks[:half], reversed(ranks[half:]), strict=True)
                 if a is not None and b is not None]
        rounds.append([tuple(sorted(pair)) for pair in pairs])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return rounds


def pairwise_bandwidth(nbytes: int = 1 << 20, repeat: int = 3) -> dict[tuple[int, int], float]:
    """Bytes per second between every pair of ranks (a < b) of the job, each way: a sends
    `nbytes` to b and b sends them back, `repeat` times, one-way time = half a round trip.
    Pairs go in rounds of disjoint pairs, all pairs of a round at once, as a cluster's
    link check does (cluster_setup/jobs/busbw_check.py --pairwise). Call it on every rank;
    every rank gets the whole table. Nothing it sends is counted."""
    positive_int(nbytes=nbytes, repeat=repeat)
    rank, n = dist.get_rank(), dist.get_world_size()
    payload = torch.zeros(max(1, nbytes // 4))
    mine: dict[tuple[int, int], float] = {}
    with uncounted():
        for pairs in _rounds(n):
            barrier()
            for a, b in pairs:
                if rank not in (a, b):
                    continue
                peer = b if rank == a else a
                for timed in (False, True):  # the first round trip opens the connection
                    start = time.perf_counter()
                    for _ in range(repeat if timed else 1):
                        if rank == a:
                            dist.send(payload, peer)
                            dist.recv(payload, peer)
                        else:
                            dist.recv(payload, peer)
                            dist.send(payload, peer)
                mine[(a, b)] = payload.numel() * 4 / ((time.perf_counter() - start) / (2 * repeat))
        table = torch.zeros(n, n, dtype=torch.float64)
        for (a, b), bandwidth in mine.items():
            if rank == a:
                table[a, b] = bandwidth
        everyone = torch.zeros(n, n * n, dtype=torch.float64)
        everyone[rank] = table.view(-1)
        comm.ring_all_gather(everyone)
    summed = everyone.sum(dim=0).view(n, n)
    return {(a, b): summed[a, b].item() for a in range(n) for b in range(a + 1, n)}


def slow_nodes(bandwidths: Mapping[tuple[int, int], float], tiers: TwoTier,
               expected: float | None = None, below: float = 0.75) -> list[int]:
    """The nodes all of whose inter-node pairs run below `below` times `expected` (bytes/s;
    default: the upper quartile of the sweep's inter-node pairs, the healthy speed when most
    links are healthy): where a degraded link is. With two nodes every pair has both ends, so
    give the healthy speed as `expected`; a slow pair then names both nodes."""
    inter = {pair: bw for pair, bw in bandwidths.items() if tiers.tier(*pair) == "inter"}
    if not inter:
        return []
    if expected is None:
        expected = float(torch.tensor(list(inter.values()), dtype=torch.float64).quantile(0.75))
    nodes = sorted({tiers.node_of(rank) for pair in inter for rank in pair})
    return [node for node in nodes
            if all(bw < below * expected for pair, bw in inter.items()
                   if node in (tiers.node_of(pair[0]), tiers.node_of(pair[1])))]
