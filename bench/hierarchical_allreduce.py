"""Hierarchical all-reduce against the flat ring on 1 and on g channels, 2 nodes x 2 ranks of
the EMULATED network.

    python bench/hierarchical_allreduce.py [--sizes-mib 1 4 16] [--rounds 5]
                                           [--intra-bandwidth 250e6] [--inter-bandwidth 25e6]

Four ranks on one machine, grouped as 2 nodes of g = 2 by `minidist.communication.network.TwoTier`
(defaults: intra-node links 250 MB/s and 100 us, inter-node 25 MB/s and 1 ms: 10x slower), every
point-to-point message delayed by its link, each rank with one port per tier. At each size it
times, in the same ranks, taking turns (`timing.time_in_turns`, median of --rounds):

    flat ring, 1 channel    `hierarchical.channels_all_reduce(t, network=..., channels=1)`: the
                            plain ring; it leaves each node through one rank's port, the
                            other g-1 sit idle
    flat ring, g channels   `channels=2`: the tensor in g parts, each around its own ring that
                            leaves the node through a different rank's port, as NCCL runs a
                            channel per NIC
    hierarchical            `collectives.all_reduce(t, impl="hierarchical", network=...)`

and prints hierarchical / flat for both flat rings beside the ratio the two-tier alpha-beta model
predicts (`TwoTier.all_reduce_time`, the intra-node phases of hierarchical included). It then
checks the course's target at 16 MiB: both measured ratios within 20% of the predicted ones.
Last, it degrades one node's link to half bandwidth on 4 nodes of 1 rank, runs the pairwise
sweep (`link_sweep.pairwise_bandwidth`) and names the node `link_sweep.slow_nodes` finds.

What it shows: against the single-channel ring hierarchical all-reduce wins big (0.40 predicted
at 16 MiB: it sends S/2 across per rank where the ring's edge ranks send 3S/2, and the ring uses
one port of two); against the g-channel ring, which already spreads the inter-node bytes over
every port, it wins far less (0.79 predicted): the per-port inter-node bytes differ only by
(ng-1)/(ng) * n/(n-1), below 2 for any n >= 2, and hierarchical adds its intra-node phases.

This is an emulation: the times are the emulated links' (plus the real cost of moving the bytes
between processes, which the links are scaled down to dwarf), not a cluster's; torch's own
all-reduce bypasses the emulation and is not timed here. The real loopback transfer and the
additions run after each emulated delay, so measured times sit a little above the model's, most
at small sizes. On the course's 2-core VM, beside other users' work (load average 7 to 10), in 56 s
(the printed table, abridged):

    size | flat, 1 ch | flat, 2 ch | hierarchical | hierarchical / flat: 1 ch, 2 ch (predicted)
   1 MiB |    74.6 ms |    45.3 ms |      34.8 ms | 0.47 (0.40), 0.77 (0.73)
   4 MiB |   267.5 ms |   146.9 ms |     119.9 ms | 0.45 (0.40), 0.82 (0.78)
  16 MiB |  1035.0 ms |   528.2 ms |     431.7 ms | 0.42 (0.40), 0.82 (0.79)
    pairwise sweep, 4 nodes x 1 rank, node 2 at half bandwidth: slow node(s) [2]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from minidist.communication import collectives, emulation, hierarchical, link_sweep
from minidist.communication.mesh import Mesh
from minidist.communication.network import TwoTier
from minidist.communication.timing import time_in_turns
from minidist.core.launch import run

TARGET_SIZE = 16 * 2**20
TOLERANCE = 0.2  # each measured ratio within 20% of the predicted one
RANKS_PER_NODE = 2
WORLD_SIZE = 4


def _calls(tensor: torch.Tensor, net: emulation.Network) -> dict:
    g = net.tiers.ranks_per_node
    return {"flat, 1 channel": lambda: hierarchical.channels_all_reduce(tensor, network=net,
                                                                   channels=1),
            f"flat, {g} channels": lambda: hierarchical.channels_all_reduce(tensor, network=net,
                                                                       channels=g),
            "hierarchical": lambda: collectives.all_reduce(tensor, impl="hierarchical",
                                                           network=net)}


def _time(rank: int, world_size: int, tiers: TwoTier, sizes: list[int],
          rounds: int) -> dict[int, dict[str, float]]:
    net = Mesh(dp=world_size, network=tiers).network
    medians = {}
    for nbytes in sizes:
        times = time_in_turns(_calls(torch.zeros(nbytes // 4), net), rounds)
        medians[nbytes] = {name: statistics.median(seconds) for name, seconds in times.items()}
    return medians


def _sweep(rank: int, world_size: int, tiers: TwoTier) -> list[int]:
    Mesh(dp=world_size, network=tiers)
    return link_sweep.slow_nodes(link_sweep.pairwise_bandwidth(1 << 20), tiers)


def _predicted(tiers: TwoTier, nbytes: int) -> dict[str, float]:
    g = tiers.ranks_per_node
    return {"flat, 1 channel": tiers.all_reduce_time("ring", nbytes, WORLD_SIZE),
            f"flat, {g} channels": tiers.all_reduce_time("ring", nbytes, WORLD_SIZE, channels=g),
            "hierarchical": tiers.all_reduce_time("hierarchical", nbytes, WORLD_SIZE)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--intra-bandwidth", type=float, default=TwoTier.intra_bandwidth)
    parser.add_argument("--inter-bandwidth", type=float, default=TwoTier.inter_bandwidth)
    args = parser.parse_args()
    tiers = TwoTier(ranks_per_node=RANKS_PER_NODE, intra_bandwidth=args.intra_bandwidth,
                    inter_bandwidth=args.inter_bandwidth)
    g = tiers.ranks_per_node
    sizes = sorted({int(mib * 2**20) for mib in args.sizes_mib} | {TARGET_SIZE})
    timeout = 60 + 4 * (args.rounds + 2) * sum(sum(_predicted(tiers, nbytes).values())
                                                for nbytes in sizes)
    medians = run(_time, WORLD_SIZE, tiers, sizes, args.rounds, timeout=timeout)[0]
    print(f"EMULATED network, 2 nodes x {g} ranks: {tiers}; median of {args.rounds} rounds")
    print(f"{'size':>8} | {'flat, 1 channel':>15} | {f'flat, {g} channels':>16} | "
          f"{'hierarchical':>12} | hierarchical / flat, measured (predicted)")
    verdict = True
    for nbytes in sizes:
        measured, predicted = medians[nbytes], _predicted(tiers, nbytes)
        flats = [name for name in measured if name.startswith("flat")]
        ratios = {name: (measured["hierarchical"] / measured[name],
                         predicted["hierarchical"] / predicted[name]) for name in flats}
        print(f"{nbytes / 2**20:>4g} MiB | "
              + " | ".join(f"{measured[name] * 1e3:>{width - 3}.1f} ms"
                           for name, width in zip(measured, (15, 16, 12), strict=True))
              + " | " + ", ".join(f"{name.removeprefix('flat, ')}: {got:.2f} ({want:.2f})"
                                  for name, (got, want) in ratios.items()))
        if nbytes == TARGET_SIZE:
            within = {name: abs(got - want) <= TOLERANCE * want
                      for name, (got, want) in ratios.items()}
            verdict = all(within.values())
            target = "; ".join(f"hierarchical / {name}: {got:.2f} against {want:.2f} predicted, "
                               f"within {TOLERANCE:.0%}: {within[name]}"
                               for name, (got, want) in ratios.items())
    degraded = TwoTier(ranks_per_node=1, intra_bandwidth=args.intra_bandwidth,
                       inter_bandwidth=args.inter_bandwidth, degraded={2: 0.5})
    found = run(_sweep, 4, degraded, timeout=120)[0]
    print(f"pairwise sweep, 4 nodes x 1 rank, node 2 at half bandwidth: slow node(s) {found}")
    verdict = verdict and found == [2]
    print(f"at 16 MiB: {target}; degraded node found: {found == [2]}: "
          f"{'PASS' if verdict else 'FAIL'}")
    return 0 if verdict else 1


if __name__ == "__main__":
    raise SystemExit(main())
