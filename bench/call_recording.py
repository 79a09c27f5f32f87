"""What recording each rank's calls (minidist.core._calls, behind launch.run's mismatch and deadlock
reports) costs an all-reduce: torch's and minidist's ring, with and without the recording.

    .venv/bin/python bench/call_recording.py

Every rank that `launch.run` starts records each torch.distributed call as it starts. Lab 01
times all-reduces of a few KiB, which take tens of microseconds on gloo; the recording (about
a microsecond a call) must stay within their noise. The two variants take turns, in rounds, so
that background load hits both alike; the table gives the median time per all-reduce and the
median ratio of the rounds.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from minidist.communication import comm
from minidist.core.launch import run

SIZES = [1 << 10, 4 << 10, 64 << 10]  # bytes
ROUNDS, CALLS = 15, 200


def _unrecorded():
    """Swap torch's own functions back in; returns a function that restores the recording."""
    recorded = {"all_reduce": dist.all_reduce, "send": dist.ProcessGroup.send,
                "recv": dist.ProcessGroup.recv}
    dist.all_reduce = recorded["all_reduce"].__wrapped__
    dist.ProcessGroup.send = recorded["send"].__wrapped__
    dist.ProcessGroup.recv = recorded["recv"].__wrapped__

    def restore():
        dist.all_reduce = recorded["all_reduce"]
        dist.ProcessGroup.send, dist.ProcessGroup.recv = recorded["send"], recorded["recv"]

    return restore


def timings(rank: int, world_size: int) -> dict:
    results = {}
    for nbytes in SIZES:
        tensor = torch.ones(nbytes // 4)
        for name, call in (("torch", lambda t=tensor: dist.all_reduce(t)),
                           ("ring", lambda t=tensor: comm.ring_all_reduce(t))):
            times = {"recorded": [], "plain": []}
            for round_ in range(ROUNDS + 1):
                for variant in ("recorded", "plain") if round_ % 2 else ("plain", "recorded"):
                    restore = _unrecorded() if variant == "plain" else (lambda: None)
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(CALLS):
                        call()
                    elapsed = (time.perf_counter() - start) / CALLS
                    restore()
                    if round_:
                        times[variant].append(elapsed)
            results[nbytes, name] = times
    return results


def main() -> None:
    per_rank = run(timings, 2, timeout=600)
    print("all-reduce on 2 ranks (gloo), median per call: recorded vs torch's own functions")
    print(f"{'bytes':>7} {'impl':>5} {'recorded us':>12} {'plain us':>9} {'ratio':>6}")
    for (nbytes, name), times in per_rank[0].items():
        recorded, plain = (statistics.median(times[v]) * 1e6 for v in ("recorded", "plain"))
        ratio = statistics.median(a / b for a, b in zip(times["recorded"], times["plain"],
                                                        strict=True))
        print(f"{nbytes:>7} {name:>5} {recorded:12.1f} {plain:9.1f} {ratio:6.3f}")


if __name__ == "__main__":
    main()
