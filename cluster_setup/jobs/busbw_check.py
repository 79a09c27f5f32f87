"""Cluster validation: all-reduce bus bandwidth between the job's ranks, against a threshold.

    srun python busbw_check.py [--max-mib 256] [--min-busbw GBPS]      (one task per rank)

It measures with the course's benchmark (minidist.bandwidth, as bench/allreduce_busbw.py does)
on $BACKEND: sizes from 1 KiB to --max-mib, busbw as nccl-tests defines it. Rank 0 prints the
table and a verdict on the largest size's busbw; every rank exits 1 below --min-busbw.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TQDM_DISABLE", "1")  # one progress bar per rank is noise in a job log

import torch.distributed as dist  # noqa: E402

from minidist.bandwidth import format_table, measure  # noqa: E402
from minidist.launch import run  # noqa: E402


def _joined(rank: int, world_size: int) -> None:
    return None


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
    args = parser.parse_args()

    world_size = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS", "1"))
    if world_size < 2:
        sys.exit("busbw_check.py needs at least 2 ranks: run it with srun -n N (N >= 2)")
    backend = os.environ.get("BACKEND", "nccl")
    # Join the job's process group on $BACKEND; measure's own run calls then reuse it.
    run(_joined, world_size, backend=backend, timeout=120)

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
