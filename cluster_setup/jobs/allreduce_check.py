"""Each rank all-reduces rank + 1 and checks the sum: proof that a job's ranks reach each other.

    srun python allreduce_check.py        one task per rank (srun_ranks.sbatch)
    torchrun ... allreduce_check.py       torchrun's workers (torchrun.sbatch)

Either way minidist.core.launch.run joins the job's ranks, as a lab's code does on a cluster. The
backend is $BACKEND (gloo or nccl). Every rank prints one line
    allreduce rank=R/W node=NODE local_rank=L backend=B sum=S expected=E ok
and the job fails if any rank's sum is wrong.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

from minidist.core.launch import device, run


def expected_sum(world_size: int) -> float:
    return world_size * (world_size + 1) / 2


def check(rank: int, world_size: int) -> float:
    value = torch.tensor([rank + 1.0], device=device())
    dist.all_reduce(value)
    total = value.item()
    verdict = "ok" if total == expected_sum(world_size) else "WRONG"
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    line = (
        f"allreduce rank={rank}/{world_size} node={node} "
        f"local_rank={os.environ.get('LOCAL_RANK', os.environ.get('SLURM_LOCALID'))} "
        f"backend={dist.get_backend()} sum={total:g} expected={expected_sum(world_size):g} "
        f"{verdict}\n"
    )
    # One write per line: the ranks on a node share torchrun's output, and print() writes the
    # line and its newline separately when unbuffered, so lines of two ranks could interleave.
    sys.stdout.write(line)
    sys.stdout.flush()
    return total


def main() -> int:
    world_size = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS", "1"))
    sums = run(check, world_size, backend=os.environ.get("BACKEND", "gloo"), timeout=120)
    return 0 if all(total == expected_sum(world_size) for total in sums) else 1


if __name__ == "__main__":
    sys.exit(main())
