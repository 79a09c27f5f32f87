"""Training-step time of minidist's DistributedDataParallel against torch's, in the same run.

    python bench/ddp_step_time.py [--world-size 2] [--rounds 15] [--batch 2]

A TinyGPT of about 10.5 M parameters on gloo CPU ranks (one thread each): forward, backward
(with the gradient all-reduces) and an SGD step, timed by
`minidist.communication.timing.time_in_turns`: the implementations take turns; the ratio to torch
is the median of the rounds' ratios, the step time each one's median. The course's target:
ours / torch <= 1.00 with the default (backend) all-reduce.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from minidist.communication.timing import median_ratio, time_in_turns
from minidist.core.launch import run
from minidist.parallel.ddp import DistributedDataParallel
from minidist.parallel.models import TinyGPT

TARGET_RATIO = 1.00
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 8192, 256, 4, 8, 64


def _step_times(rank: int, world_size: int, rounds: int, batch: int) -> dict[str, list[float]]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ)

    models = {
        "torch DDP": nn.parallel.DistributedDataParallel(build()),
        "minidist DDP": DistributedDataParallel(build()),
        "minidist DDP, ring": DistributedDataParallel(build(), impl="ring"),
    }
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator)

    def step(model: nn.Module) -> None:
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 1e-3 * param.grad
                param.grad = None  # each step starts from fresh gradients

    return time_in_turns(
        {name: functools.partial(step, model) for name, model in models.items()}, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    args = parser.parse_args()

    times = run(_step_times, args.world_size, args.rounds, args.batch, timeout=1800)[0]
    params = sum(p.numel() for p in TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ).parameters())
    print(f"TinyGPT, {params / 1e6:.1f} M parameters, {args.world_size} gloo ranks, batch "
          f"{args.batch}x{SEQ} tokens per rank, {args.rounds} rounds")
    print(f"{'implementation':<22}{'median step (ms)':>18}{'/ torch (median of rounds)':>28}")
    ratios = {}
    for name, seconds in times.items():
        ratios[name] = median_ratio(times, name, "torch DDP")
        print(f"{name:<22}{statistics.median(seconds) * 1e3:>18.1f}{ratios[name]:>28.3f}")
    ratio = ratios["minidist DDP"]
    verdict = "holds" if ratio <= TARGET_RATIO else "MISSED"
    print(f"minidist / torch = {ratio:.3f} -> target <= {TARGET_RATIO} {verdict}")


if __name__ == "__main__":
    main()
