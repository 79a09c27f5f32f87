"""Ring attention and DeepSpeed-Ulysses against one process's attention at equal total work, and
how much of the ring's transfers hides behind its compute.

    python bench/context_parallel.py [--lengths 1024 4096] [--rounds 3]

For each sequence length s and cp in {2, 4} (gloo CPU ranks, one thread each), the attention of
b=1 sequence, h=4 heads of d=32, fp32, no causal mask, forward and backward:

    one process   all s queries against all s keys on one rank, with the library's blockwise
                  kernel (`context_parallel.ring_attention` alone: the same arithmetic the
                  ring and Ulysses run, so the ratio is about the communication), and with
                  F.scaled_dot_product_attention (PyTorch's fused CPU kernel) for reference
    ring          `ring_attention` over cp ranks (s/cp queries each)
    Ulysses       `ulysses_attention` over cp ranks

Every time is the slowest rank's, `timing.time_in_turns` alternating the calls (median of
--rounds). `ratio` is the cp ranks' time over one process's: 1/cp would be a perfect split.

Overlap: in the same launch, the ring's forward alone (T_ring), its cp blocks of attention
computed with no transfer (T_compute) and its cp - 1 key/value transfers with no compute
(T_transfer); the share of the transfers hidden is (T_compute + T_transfer - T_ring) /
T_transfer, clipped to [0, 1]. Ulysses' all-to-alls hide nothing by construction.

The course's laptop has 2 cores: with 4 ranks they take turns, and a rank's transfers (gloo's
copies through loopback) compete with its neighbours' compute; others' work on the machine
moves the numbers too, so the load average is printed with them. Measured on the course's
2-core machine while other users kept it busy (load average 8.8 rising to 13.9), 3 rounds:

    cp     s  one process (blockwise / SDPA)    ring (ratio)       Ulysses (ratio)  hidden
     2  1024       222.6 ms /   66.1 ms     156.7 ms (0.70)    146.4 ms (0.66)      0%
     2  4096      4738.9 ms /  966.8 ms    1764.8 ms (0.37)   2391.7 ms (0.50)    100%
     4  1024       279.7 ms /   65.4 ms     196.3 ms (0.70)    119.3 ms (0.43)      0%
     4  4096      4181.3 ms / 1067.0 ms    1776.3 ms (0.42)   2091.9 ms (0.50)      0%

Read them as what a shared laptop does, not as a cluster's answer: the cp ranks beat one
process (ratios 0.4-0.7: two cores at work instead of one), 4 ranks do no better than 2 on two
cores, and the "hidden" share swings between 0 and 100% with the load, because the ring's
compute and transfers, timed apart, each had the cores to themselves for some of the time.
PyTorch's fused kernel is 3.4-4.9x faster than the blockwise kernel on one process: the course's
ring and Ulysses share the blockwise kernel so that they differ only in what they send.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.communication import collectives, timing
from minidist.communication.mesh import Mesh
from minidist.core.launch import run
from minidist.parallel import context_parallel

BATCH, HEADS, HEAD_DIM = 1, 4, 32


def _fwd_bwd(attention, tensors: list[torch.Tensor], **kwargs) -> None:
    attention(*tensors, causal=False, **kwargs).sum().backward()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _one_length(rank: int, world_size: int, seq: int, rounds: int,
                by_itself: dist.ProcessGroup) -> dict[str, float]:
    generator = torch.Generator().manual_seed(rank)
    whole = [torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator, requires_grad=True)
             for _ in range(3)]
    mine = [torch.randn(BATCH, HEADS, seq // world_size, HEAD_DIM, generator=generator,
                        requires_grad=True) for _ in range(3)]
    q, k, v = (t.detach() for t in mine)
    block = torch.stack([k, v])

    def alone(attention, **kwargs):  # one process does it all; the other ranks wait
        return lambda: _fwd_bwd(attention, whole, **kwargs) if rank == 0 else None

    calls = {
        "one process, blockwise": alone(context_parallel.ring_attention, group=by_itself),
        "one process, PyTorch SDPA": alone(_sdpa),
        "ring": lambda: _fwd_bwd(context_parallel.ring_attention, mine),
        "Ulysses": lambda: _fwd_bwd(context_parallel.ulysses_attention, mine),
        "ring forward": lambda: context_parallel.ring_forward(q, k, v, causal=False),
        "its compute": lambda: [context_parallel.block_attention(q, k, v)
                                for _ in range(world_size)],
        "its transfers": lambda: [collectives.shift(block) for _ in range(world_size - 1)],
    }
    times = timing.time_in_turns(calls, rounds=rounds)
    return {name: statistics.median(values) for name, values in times.items()}


def _timings(rank: int, world_size: int, lengths: list[int], rounds: int) -> dict:
    by_itself = Mesh(ranks=world_size, cp=1).group("cp")  # a group of this rank alone
    return {seq: _one_length(rank, world_size, seq, rounds, by_itself) for seq in lengths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} CPUs)")
    print(f"b={BATCH}, h={HEADS}, d={HEAD_DIM}, fp32, no causal mask, forward + backward")
    print(f"{'cp':>3} {'s':>6} {'one proc (blockwise)':>21} {'one proc (SDPA)':>16} "
          f"{'ring':>9} {'ratio':>6} {'Ulysses':>9} {'ratio':>6} {'transfers hidden':>17}")
    for cp in (2, 4):
        results = run(_timings, cp, args.lengths, args.rounds, timeout=1800)[0]
        for seq, t in results.items():
            one = t["one process, blockwise"]
            transfer = t["its transfers"]
            hidden = (t["its compute"] + transfer - t["ring forward"]) / transfer
            sdpa = t["one process, PyTorch SDPA"]
            print(f"{cp:>3} {seq:>6} {one * 1e3:>18.1f} ms {sdpa * 1e3:>13.1f} ms "
                  f"{t['ring'] * 1e3:>6.1f} ms {t['ring'] / one:>6.2f} "
                  f"{t['Ulysses'] * 1e3:>6.1f} ms {t['Ulysses'] / one:>6.2f} "
                  f"{min(1.0, max(0.0, hidden)):>16.0%}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
