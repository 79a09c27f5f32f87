"""Bus bandwidth of minidist's ring all-reduce against torch.distributed.all_reduce.

    python bench/allreduce_busbw.py [--world-sizes 2 4] [--repeats 5] [--target-time 0.25]

Sweeps 1 KiB to 64 MiB (powers of 4) on each world size and checks the course's target:
ring_all_reduce reaches at least 0.8x the bus bandwidth of the backend's own all-reduce
(gloo on CPU) for messages of 16 MiB and more.
"""

from __future__ import annotations

import argparse

from minidist.bandwidth import format_table, measure

SIZES = [4**k for k in range(5, 14)]  # 1 KiB .. 64 MiB
TARGET_RATIO = 0.8
LARGE = 16 * 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5, help="timings per point; best is kept")
    parser.add_argument("--target-time", type=float, default=0.25, help="seconds per timing")
    args = parser.parse_args()

    verdicts = []
    for world_size in args.world_sizes:
        rows = measure(
            world_size, SIZES, repeats=args.repeats, target_time=args.target_time, timeout=600
        )
        print(format_table(rows), end="\n\n", flush=True)
        seconds = {(r.implementation, r.nbytes): r.seconds for r in rows}
        ratios = [
            seconds["torch", nbytes] / seconds["minidist", nbytes]
            for nbytes in SIZES
            if nbytes >= LARGE
        ]
        holds = min(ratios) >= TARGET_RATIO
        verdicts.append(
            f"N={world_size}: busbw ratio at >= 16 MiB is {', '.join(f'{r:.2f}' for r in ratios)}"
            f" -> target >= {TARGET_RATIO} {'holds' if holds else 'MISSED'}"
        )
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
