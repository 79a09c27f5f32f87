"""The optimizer step on the host: AdamW on tensors that need not belong to an optimizer (a
shard just read from disk), and the host's AdamW throughput, measured.

    adamw_step_(master, grad, exp_avg, exp_avg_sq, step, lr=1e-3)   # in place, step from 1
    rate = measure_optimizer_throughput()   # parameters/s, for tiers.offload_step_time

ZeRO-Offload (Ren et al. 2021, §4) runs the optimizer on the CPU, where the fp32 master weights
and Adam's m and v live; the NVMe tier (`minidist.parallel.nvme`) steps each shard as it is read.
"""

from __future__ import annotations

import torch
from torch.optim import adamw

from minidist.core.timeline import clock

__all__ = ["adamw_step_", "measure_optimizer_throughput"]


@torch.no_grad()
def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, lr: float = 1e-3,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 1e-2) -> None:
    """One AdamW update of `param`, `exp_avg` and `exp_avg_sq` in place, `step` counting from 1:
    torch.optim.AdamW's own arithmetic (its functional form), on tensors that need not belong
    to an optimizer, such as a shard just read from disk."""
    taken = torch.tensor(float(step - 1))  # steps taken before: the functional adds this one
    adamw.adamw([param], [grad], [exp_avg], [exp_avg_sq], [], [taken], foreach=False,
                amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr,
                weight_decay=weight_decay, eps=eps, maximize=False)


def measure_optimizer_throughput(numel: int = 2**22, steps: int = 5, threads: int = 1) -> float:
    """Parameters per second AdamW updates on this host with `threads` torch threads (one by
    default, as the ranks run): the CPU optimizer's throughput, for `tiers.offload_step_time`.
    The median of `steps` steps over `numel` fp32 parameters, after one warm-up step. The
    caller's thread count is restored afterwards."""
    param = torch.zeros(numel)
    param.grad = torch.full((numel,), 1e-3)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        optimizer.step()
        times = []
        for _ in range(steps):
            start = clock()
            optimizer.step()
            times.append(clock() - start)
    finally:
        torch.set_num_threads(before)
    return numel / sorted(times)[steps // 2]
