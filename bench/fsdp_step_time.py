"""Training-step time of minidist's FSDP against PyTorch's FSDP2 `fully_shard`, same run.

    python bench/fsdp_step_time.py [--world-size 2] [--rounds 9]

A TinyGPT of 10.5 M parameters on gloo CPU ranks (one thread each), each wrapped as its
library's user would: ours with its default units (each embedding, each transformer block,
the norm, the head), PyTorch's with `fully_shard` on each block and on the whole model.
Forward, backward, SGD step, timed by `minidist.communication.timing.time_in_turns`: the two take
turns, and the ratio is the median over rounds of (ours / torch). The last line says PASS or FAIL
against the target (<= 1.10).
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
from torch.distributed.fsdp import fully_shard

from minidist.communication.timing import median_ratio, time_in_turns
from minidist.core.launch import run
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.models import TinyGPT

TARGET_RATIO = 1.10
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 8192, 256, 4, 8, 64


def _build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ)
    if kind == "minidist":
        return FullyShardedDataParallel(model)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _rounds(rank: int, world_size: int, rounds: int) -> dict[str, list[float]]:
    models = {kind: _build(kind) for kind in ("torch", "minidist")}
    optimizers = {kind: torch.optim.SGD(m.parameters(), lr=1e-3) for kind, m in models.items()}
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(rank))

    def step(kind: str) -> None:
        models[kind].loss(ids[:, :-1], ids[:, 1:]).backward()
        optimizers[kind].step()
        optimizers[kind].zero_grad()

    return time_in_turns({kind: functools.partial(step, kind) for kind in models},
                                  rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    params = sum(p.numel() for p in TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ).parameters())
    times = run(_rounds, args.world_size, args.rounds, timeout=900)[0]
    ratio = median_ratio(times, "minidist", "torch")
    print(f"TinyGPT, {params / 1e6:.1f} M parameters, {args.world_size} ranks, gloo CPU")
    for kind, seconds in times.items():
        print(f"  {kind:9s} step {statistics.median(seconds) * 1e3:8.1f} ms (median)")
    print(f"  minidist / torch = {ratio:.3f} (median of {args.rounds} rounds)")
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    print(f"{verdict}: minidist / torch = {ratio:.3f}, target <= {TARGET_RATIO:.2f}")


if __name__ == "__main__":
    main()
