"""Cluster validation: all-reduce bus bandwidth between the job's ranks, against a threshold;
with --pairwise, every pair of ranks' link on its own, to find a degraded one.

    srun python busbw_check.py [--max-mib 256] [--min-busbw GBPS]      (one task per rank)
    srun python busbw_check.py --pairwise [--min-pair-gbps GBPS]

It measures with the course's benchmark (minidist.communication.bandwidth, as
bench/allreduce_busbw.py does) on $BACKEND: sizes from 1 KiB to --max-mib, busbw as nccl-tests
defines it. Rank 0 prints the table and a verdict on the largest size's busbw; every rank exits 1
below --min-busbw.

An all-reduce goes at the speed of its slowest link, so one degraded link shows only as a lower
busbw. --pairwise times each pair of ranks alone (a 1 MiB ping-pong, pairs in rounds of
disjoint pairs: minidist.communication.link_sweep.pairwise_bandwidth), prints every pair with its
nodes and GB/s, and fails when a pair is below --min-pair-gbps; it names the slow pairs and the
nodes that are in every one of them: with three nodes or more, the node whose link is bad.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

os.environ.setdefault("TQDM_DISABLE", "1")  # one progress bar per rank is noise in a job log

import torch.distributed as dist  # noqa: E402

from minidist.communication import collectives, link_sweep  # noqa: E402
from minidist.communication.bandwidth import format_table, measure  # noqa: E402
from minidist.core.launch import run  # noqa: E402


def _joined(rank: int, world_size: int) -> None:
    return None


def _pairs(rank: int, world_size: int) -> tuple[list[str], dict[tuple[int, int], float]]:
    nodes = collectives.all_gather_object(os.environ.get("SLURMD_NODENAME", socket.gethostname()))
    return nodes, link_sweep.pairwise_bandwidth(1 << 20)


def check_pairs(world_size: int, min_gbps: float) -> bool:
    """Every pair's bandwidth; False when one is below `min_gbps`."""
    nodes, pairs = run(_pairs, world_size, timeout=600)[0]
    slow = {pair: bw for pair, bw in pairs.items() if bw / 1e9 < min_gbps}
    if dist.get_rank() == 0:
        for (a, b), bw in pairs.items():
            where = "same node" if nodes[a] == nodes[b] else "between nodes"
            print(f"pair rank {a} ({nodes[a]}) - rank {b} ({nodes[b]}): {bw / 1e9:.3f} GB/s "
                  f"({where}){'  SLOW' if (a, b) in slow else ''}", flush=True)
        if slow:
            suspects = set.intersection(*({nodes[a], nodes[b]} for a, b in slow))
            print(f"slow pairs: {len(slow)} of {len(pairs)} below {min_gbps:g} GB/s; node(s) in "
                  f"every slow pair: {', '.join(sorted(suspects)) or 'none'}", flush=True)
        print(f"link check: slowest pair {min(pairs.values()) / 1e9:.3f} GB/s vs minimum "
              f"{min_gbps:g} GB/s: {'FAIL' if slow else 'PASS'}", flush=True)
    return not slow


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=float, default=256, help="largest message (MiB)")
    parser.add_argument(
        "--min-busbw", type=float, default=float(os.environ.get("MIN_BUSBW_GBPS", "0")),
        help="fail below this busbw in GB/s at the largest size (default $MIN_BUSBW_GBPS or 0)",
    )
    parser.add_argument(
        "--implementations", nargs="+", default=["torch"], choices=["torch", "minidist"],
        help="torch: the backend's own all-reduce (NCCL's); minidist: the course's ring",
    )
    parser.add_argument("--pairwise", action="store_true",
                        help="time every pair of ranks on its own instead (a link check)")
    parser.add_argument(
        "--min-pair-gbps", type=float, default=float(os.environ.get("MIN_PAIR_GBPS", "0")),
        help="with --pairwise: fail when a pair is below this GB/s (default $MIN_PAIR_GBPS or 0)",
    )
    args = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS", "1"))
    if world_size < 2:
        sys.exit("busbw_check.py needs at least 2 ranks: run it with srun -n N (N >= 2)")
    backend = os.environ.get("BACKEND", "nccl")
    # Join the job's process group on $BACKEND; measure's own run calls then reuse it.
    run(_joined, world_size, backend=backend, timeout=120)
    if args.pairwise:
        return 0 if check_pairs(world_size, args.min_pair_gbps) else 1

    max_bytes = int(args.max_mib * 2**20)
    sizes = [4**k for k in range(5, 20) if 4**k <= max_bytes] or [max_bytes]
    rows = measure(world_size, sizes, implementations=args.implementations, timeout=600)
    largest = max(r.nbytes for r in rows)
    busbw = {r.implementation: r.busbw / 1e9 for r in rows if r.nbytes == largest}
    passed = busbw[args.implementations[0]] >= args.min_busbw
    if dist.get_rank() == 0:
        print(format_table(rows), flush=True)
        for name, value in busbw.items():
            print(f"busbw {name} all_reduce {largest / 2**20:g} MiB on {world_size} ranks "
                  f"({backend}): {value:.3f} GB/s", flush=True)
        print(f"busbw check: {busbw[args.implementations[0]]:.3f} GB/s vs minimum "
              f"{args.min_busbw:g} GB/s: {'PASS' if passed else 'FAIL'}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
