"""Two tiers for real: minidist's flat ring, its hierarchical all-reduce and the backend's own.

    srun python hierarchy_check.py [--mib 8] [--rounds 3]      (one task per rank, block placement)

Lab 11 runs this comparison on an emulated network; here the links are the cluster's own (on
the local cluster, the links between nodes shaped with `cluster.sh shape`). Every rank finds
which ranks share its node (SLURMD_NODENAME), the ranks time every pair's link on its own
(`minidist.communication.link_sweep.pairwise_bandwidth`), and the median pair inside a node and
between nodes give the two-tier model (`TwoTier(..., emulated=False)`: it delays nothing, it only
says where the nodes are). Then all-reduce of --mib MiB runs in turns (`timing.time_in_turns`) with
minidist's ring, minidist's hierarchical all-reduce and the backend's `dist.all_reduce`
(gloo's or NCCL's). Rank 0 prints

    tiers: inside a node X MB/s, between nodes Y MB/s (median pair)
    all_reduce 8 MiB on 2 nodes x 2 ranks (gloo): ring ... ms (model ...), hierarchical ...
    ordering measured: hierarchical < torch < ring; model: hierarchical < ring

The model has no line for the backend's algorithm, which it does not know.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys

import torch

from minidist.communication import collectives, link_sweep
from minidist.communication.mesh import Mesh
from minidist.communication.network import TwoTier
from minidist.communication.timing import time_in_turns
from minidist.core.launch import device, run


def _placement() -> int:
    """Ranks per node, checking that each node holds a block of consecutive ranks."""
    nodes = collectives.all_gather_object(os.environ.get("SLURMD_NODENAME", socket.gethostname()))
    per_node = nodes.count(nodes[0])
    blocks = [nodes[i:i + per_node] for i in range(0, len(nodes), per_node)]
    if len(nodes) % per_node or any(len(set(block)) != 1 for block in blocks) \
            or len({block[0] for block in blocks}) != len(blocks):
        raise SystemExit(f"ranks are not placed in whole blocks per node ({nodes}): submit with "
                         f"--ntasks-per-node and the default block distribution")
    return per_node


def check(rank: int, world_size: int, nbytes: int, rounds: int) -> dict:
    per_node = _placement()
    pairs = link_sweep.pairwise_bandwidth(1 << 20)
    tier_of = TwoTier(ranks_per_node=per_node, emulated=False).tier
    medians = {tier: statistics.median([bw for pair, bw in pairs.items() if tier_of(*pair) == tier]
                                       or [float("inf")]) for tier in ("intra", "inter")}
    tiers = TwoTier(ranks_per_node=per_node, intra_bandwidth=medians["intra"],
                    inter_bandwidth=medians["inter"], emulated=False)
    net = Mesh(dp=world_size, network=tiers).network
    tensor = torch.zeros(nbytes // 4, device=device())
    times = time_in_turns({impl: (lambda impl=impl: collectives.all_reduce(tensor, impl=impl,
                                                                           network=net))
                           for impl in ("ring", "hierarchical", "torch")}, rounds,
                          device=device())
    return {"tiers": tiers, "nodes": world_size // per_node, "medians": medians,
            "seconds": {impl: statistics.median(seconds) for impl, seconds in times.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=8, help="all-reduce size (MiB)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS", "1"))
    if world_size < 2:
        sys.exit("hierarchy_check.py needs at least 2 ranks: run it with srun -n N (N >= 2)")
    nbytes = int(args.mib * 2**20) // 4 * 4
    result = run(check, world_size, nbytes, args.rounds, timeout=600)[0]
    if int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0"))) == 0:
        tiers, seconds = result["tiers"], result["seconds"]
        model = {impl: tiers.all_reduce_time(impl, nbytes, world_size)
                 for impl in ("ring", "hierarchical")}
        medians = result["medians"]
        print(f"tiers: inside a node {medians['intra'] / 1e6:.1f} MB/s, between nodes "
              f"{medians['inter'] / 1e6:.1f} MB/s (median pair)")
        print(f"all_reduce {args.mib:g} MiB on {result['nodes']} nodes x {tiers.ranks_per_node} "
              f"ranks ({os.environ.get('BACKEND', 'gloo')}): "
              + ", ".join(f"{impl} {seconds[impl] * 1e3:.1f} ms"
                          + (f" (model {model[impl] * 1e3:.1f} ms)" if impl in model else "")
                          for impl in seconds))
        print("ordering measured: " + " < ".join(sorted(seconds, key=seconds.get))
              + "; model: " + " < ".join(sorted(model, key=model.get)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
