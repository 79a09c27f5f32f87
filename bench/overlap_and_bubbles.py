"""Measured shares of wall-clock time that the tests only check as mechanism.

    .venv/bin/python bench/overlap_and_bubbles.py

The tests assert which transfers run beside compute and in what order actions happen (a busy
machine changes the shares, never the order); this prints the shares themselves, on 2 ranks
(4 for the pipeline), so that a change that hides less communication shows up as a number:

- DDP: share of communication hidden behind compute, one flat buffer vs small buckets;
- FSDP: the same without and with prefetch;
- tensor parallel: share of matmul time with a transfer in flight, ColumnParallelLinear vs
  AsyncColumnParallelLinear;
- pipeline: the bubble measured on real ranks (emulated compute, 50 ms per forward) against
  the simulator's, for GPipe, 1F1B and interleaved schedules.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.core import launch
from minidist.jobs import profiling
from minidist.parallel import pipeline_exec
from minidist.parallel import tensor_parallel as tp
from minidist.parallel.pipeline import schedule
from minidist.parallel.pipeline_simulator import Timeline, simulate

PIPELINE_TIME_UNIT_S = 0.05


def matmul_share_in_flight(rank: int, world_size: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    shares = {}
    for cls in (tp.ColumnParallelLinear, tp.AsyncColumnParallelLinear):
        layer = cls(256, 1024, sequence_parallel=True)
        x = torch.randn(4, 64, 256, requires_grad=True)
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            layer(x).sum().backward()
        events = [(e.name, e.time_range.start, e.time_range.end) for e in trace.events()]
        transfers = profiling.merge((s, e) for n, s, e in events if n.startswith("gloo:"))
        matmuls = [(s, e) for n, s, e in events if n in ("aten::mm", "aten::addmm")]
        inside = profiling.total(profiling.intersect(profiling.merge(matmuls), transfers))
        shares[cls.__name__] = inside / sum(e - s for s, e in matmuls)
    return shares


def pipeline_events(rank: int, world_size: int, configs: list[tuple[str, int, int]]) -> list:
    torch.manual_seed(2)
    inputs, targets = torch.randn(16, 8), torch.randn(16, 8)
    traces = []
    for name, m, v in configs:
        s = schedule(name, world_size, m, chunks=v)
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(8)]
        stages = pipeline_exec.split_layers(layers, s.num_stages)
        mine = {k: stages[k] for k in s.stages_of(rank)}
        traces.append(pipeline_exec.execute(s, mine, inputs, targets, nn.functional.mse_loss,
                                            time_unit=PIPELINE_TIME_UNIT_S).events)
    return traces


def main() -> None:
    print("share of communication hidden behind compute, per rank (2 ranks, TinyGPT)")
    for pair in (("flat", "buckets"), ("no_prefetch", "prefetch")):
        for how in pair:
            timeline = profiling.profile_ranks(profiling.gradient_sync_step, 2, how, warmup=1,
                                               steps=3)
            shares = profiling.overlap_fraction(timeline)
            print(f"  {how:12s} " + "  ".join(f"rank {r}: {v:5.1%}" for r, v in shares.items()))

    print("share of matmul time with a transfer in flight, sequence-parallel column layer")
    for t in (2, 4):
        per_rank = launch.run(matmul_share_in_flight, t)
        for name in ("ColumnParallelLinear", "AsyncColumnParallelLinear"):
            values = "  ".join(f"{shares[name]:5.1%}" for shares in per_rank)
            print(f"  t={t} {name:26s} {values}")

    print(f"pipeline bubble on 4 ranks, measured ({PIPELINE_TIME_UNIT_S * 1e3:g} ms per forward) "
          "vs simulated")
    configs = [(name, m, v) for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
               for m in (4, 8, 16)]
    per_rank = launch.run(pipeline_events, 4, configs, timeout=300)
    for index, (name, m, v) in enumerate(configs):
        s = schedule(name, 4, m, chunks=v)
        measured = Timeline(s, [events[index] for events in per_rank], measured=True)
        simulated = simulate(s).bubble_fraction
        print(f"  {name:11s} m={m:2d}  measured {measured.bubble_fraction:6.1%}  simulated "
              f"{simulated:6.1%}  difference {measured.bubble_fraction - simulated:+6.1%}")


if __name__ == "__main__":
    main()
