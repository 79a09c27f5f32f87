"""Training-step time of minidist's 3D parallelism against the same layout from PyTorch's pieces.

    python bench/parallel3d_step_time.py [--rounds 5]

8 gloo CPU ranks (one thread each), a TinyGPT on a dp2·pp2·tp2 mesh, 1F1B over 2 microbatches,
AdamW. Ours: `minidist.parallel.parallelize` (the course's tensor-parallel blocks, pipeline executor
and ZeRO-1). PyTorch's: on `mesh.to_torch()`, DTensor `parallelize_module` on the "tp"
dimension (q, k, v and fc1 column-wise, out_proj and fc2 row-wise), `fully_shard` on "dp"
(FSDP2, which also shards the parameters: ZeRO-3 to our ZeRO-1) and
`torch.distributed.pipelining.Schedule1F1B` on "pp". Timed by `step_timing`: the two take
turns, and the ratio is the median over rounds of (ours / torch). Target: <= 1.2.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
from torch.distributed import pipelining
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from minidist.communication.comm import chunk_bounds
from minidist.communication.mesh import Mesh
from minidist.communication.timing import median_ratio, time_in_turns
from minidist.core.launch import run
from minidist.parallel.models import TinyGPT, lm_loss  # what every layout trains
from minidist.parallel.parallelize import TinyGPTStage, parallelize

TARGET_RATIO = 1.2
DP, PP, TP, MICROBATCHES = 2, 2, 2, 2
VOCAB, HIDDEN, HEADS, LAYERS, SEQ, BATCH = 1024, 128, 4, 4, 64, 8
TP_PLAN = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
           "attn.v_proj": ColwiseParallel(), "attn.out_proj": RowwiseParallel(),
           "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


class _TorchStep:
    """This rank's stage of the same layout, from PyTorch's own pieces."""

    def __init__(self, mesh: Mesh):
        torch_mesh = mesh.to_torch()
        stage_index = mesh.coord("pp")
        self.first, self.last = stage_index == 0, stage_index == PP - 1
        start, end = chunk_bounds(LAYERS, PP)[stage_index]
        stage = TinyGPTStage(_model(), start, end, self.first, self.last, tp_group=None,
                             sequence_parallel=False)
        for block in stage.blocks:
            parallelize_module(block, torch_mesh["tp"], TP_PLAN)
            block.attn.heads //= TP  # each TP rank attends with its own heads
            fully_shard(block, mesh=torch_mesh["dp"])
        fully_shard(stage, mesh=torch_mesh["dp"])
        self.optimizer = _adamw(stage.parameters())
        self.dp_coord = mesh.coord("dp")
        pipeline_stage = pipelining.PipelineStage(stage, stage_index, PP, torch.device("cpu"),
                                                  group=torch_mesh["pp"].get_group())
        self.schedule = pipelining.Schedule1F1B(pipeline_stage, MICROBATCHES, loss_fn=lm_loss)

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> None:
        mine = slice(self.dp_coord * BATCH // DP, (self.dp_coord + 1) * BATCH // DP)
        inputs = [ids[mine]] if self.first else []
        extra = {"target": targets[mine], "losses": []} if self.last else {}
        self.schedule.step(*inputs, **extra)
        self.optimizer.step()  # the same SGD step as the 3D run
        self.optimizer.zero_grad()  # before the next step


def _rounds(rank: int, world_size: int, rounds: int) -> dict[str, list[float]]:
    mesh = Mesh(pp=PP, dp=DP, tp=TP)
    steps = {"torch": _TorchStep(mesh).step,
             "minidist": parallelize(_model(), mesh, _adamw, MICROBATCHES).step}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return time_in_turns(
        {kind: functools.partial(step, ids[:, :-1], ids[:, 1:]) for kind, step in steps.items()},
        rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    params = sum(p.numel() for p in _model().parameters())
    times = run(_rounds, DP * PP * TP, args.rounds, timeout=900)[0]
    ratio = median_ratio(times, "minidist", "torch")
    print(f"TinyGPT, {params / 1e6:.2f} M parameters, dp{DP}·pp{PP}·tp{TP} = 8 ranks, "
          f"{MICROBATCHES} microbatches, gloo CPU")
    for kind, seconds in times.items():
        print(f"  {kind:9s} step {statistics.median(seconds) * 1e3:8.1f} ms (median)")
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    print(f"{verdict}: minidist / torch = {ratio:.3f} (target <= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
