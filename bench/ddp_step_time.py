"""Training-step time of minidist's DistributedDataParallel against torch's, in the same run.

    python bench/ddp_step_time.py [--world-size 2] [--rounds 5] [--steps 4]

A TinyGPT of about 10.5 M parameters on gloo CPU ranks (one thread each): forward, backward
(with the gradient all-reduces) and an SGD step. The implementations take turns, `steps`
steps each per round, so background load hits them alike; each one's time is its median
step. The course's target: ours / torch <= 1.05 with the default (backend) all-reduce.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from minidist.ddp import DistributedDataParallel
from minidist.launch import run
from minidist.models import TinyGPT

TARGET_RATIO = 1.05
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 8192, 256, 4, 8, 64


def _step_times(rank: int, world_size: int, rounds: int, steps: int, batch: int) -> dict:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return TinyGPT(VOCAB, HIDDEN, HEADS, LAYERS, SEQ)

    models = {
        "torch DDP": nn.parallel.DistributedDataParallel(build()),
        "minidist DDP": DistributedDataParallel(build()),
        "minidist DDP, ring": DistributedDataParallel(build(), all_reduce="ring"),
    }
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator)

    def step(model: nn.Module) -> float:
        start = time.perf_counter()
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 1e-3 * param.grad
                param.grad = None
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in models}
    for name, model in models.items():  # warm up
        step(model)
    for _ in range(rounds):
        for name, model in models.items():
            times[name] += [step(model) for _ in range(steps)]
    params = sum(p.numel() for p in models["torch DDP"].parameters())
    return {"params": params, **{name: statistics.median(t) for name, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per implementation per round")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    args = parser.parse_args()

    results = run(_step_times, args.world_size, args.rounds, args.steps, args.batch, timeout=1800)
    slowest = {name: max(r[name] for r in results) for name in results[0] if name != "params"}
    torch_time = slowest["torch DDP"]
    print(f"TinyGPT, {results[0]['params'] / 1e6:.1f} M parameters, {args.world_size} gloo ranks, "
          f"batch {args.batch}x{SEQ} tokens per rank; median step time, slowest rank")
    print(f"{'implementation':<22}{'step (ms)':>10}{'/ torch':>9}")
    for name, seconds in slowest.items():
        print(f"{name:<22}{seconds * 1e3:>10.1f}{seconds / torch_time:>9.3f}")
    ratio = slowest["minidist DDP"] / torch_time
    verdict = "holds" if ratio <= TARGET_RATIO else "MISSED"
    print(f"minidist / torch = {ratio:.3f} -> target <= {TARGET_RATIO} {verdict}")


if __name__ == "__main__":
    main()
