"""The pipeline bubble and the microbatches in flight, as formulas of the schedule's name, the
pipeline ranks p, the microbatches m and the model chunks per rank v: what the planner prices
and what `minidist.parallel.pipeline_simulator.simulate` reproduces on generated schedules
(tests/test_pipeline.py checks them against each other for every p <= 8, m <= 32).

Sources: GPipe (Huang et al. 2019); Narayanan et al. 2021 §2.2 (1F1B, interleaved); Qi et al.
2023, "Zero Bubble Pipeline Parallelism" (ZB-H1, ZB-H2).
"""

from __future__ import annotations

from minidist.core._checks import one_of, positive, positive_int

__all__ = [
    "SCHEDULES", "ZB_COSTS", "bubble_time", "bubble_fraction", "bubble_relative_to_ideal",
    "inflight_microbatches",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
"""Every schedule minidist knows. `minidist.parallel.pipeline.schedule` generates all but "zb-h2",
whose
bubble and memory the formulas below give."""

ZB_COSTS = (1.0, 1.0, 1.0)  # (T_F, T_B, T_W): ZB §2's assumption of equal F, B and W times


def _check_schedule(schedule: str, ranks: int, microbatches: int, chunks: int) -> None:
    one_of("schedule", schedule, SCHEDULES)
    positive_int(ranks=ranks, microbatches=microbatches, chunks=chunks)
    if chunks > 1 and schedule != "interleaved":
        raise ValueError(f"chunks={chunks}: only the 'interleaved' schedule has more than one "
                         "model chunk per rank")
    if schedule == "interleaved" and microbatches % ranks:
        raise ValueError(f"microbatches={microbatches} is not a multiple of ranks={ranks}: "
                         "the interleaved schedule runs microbatches in groups of p")
    if schedule == "zb-h1" and microbatches < ranks:
        raise ValueError(f"microbatches={microbatches} < ranks={ranks}: ZB-H1 needs at least "
                         "p microbatches to fill its bubbles with W passes")


def bubble_time(schedule: str, ranks: int, microbatches: int, chunks: int = 1,
                costs: tuple[float, float, float] = ZB_COSTS) -> tuple[float, float]:
    """(bubble, ideal) time of one pipeline rank per step, in the units of `costs`.

    `costs` = (T_F, T_B, T_W): forward, backward for the input, backward for the weights, per
    microbatch per stage. Schedules that do not split the backward run B and W as one pass of
    T_B + T_W. Ideal = m(T_F + T_B + T_W), the rank's own work. The bubble of each schedule is
    what Lab 06 derives (its Exercises 1 and 6 and its predictions), from GPipe, Narayanan
    §2.2.1–2.2.2 (interleaved: m a multiple of p) and Zero Bubble §2.1–2.2 (ZB-H1: m >= p;
    ZB-H2 is the ideal handcrafted schedule).
    """
    _check_schedule(schedule, ranks, microbatches, chunks)
    positive(T_F=costs[0], T_B=costs[1], T_W=costs[2])
    t_f, t_b, t_w = costs
    ideal = microbatches * (t_f + t_b + t_w)
    bubble = {
        "gpipe": (ranks - 1) * (t_f + t_b + t_w),
        "1f1b": (ranks - 1) * (t_f + t_b + t_w),
        "interleaved": (ranks - 1) * (t_f + t_b + t_w) / chunks,
        "zb-h1": (ranks - 1) * max(0.0, t_f + t_b - t_w),
        "zb-h2": 0.0,
    }[schedule]
    return bubble, ideal


def bubble_fraction(schedule: str, ranks: int, microbatches: int, chunks: int = 1,
                    costs: tuple[float, float, float] = ZB_COSTS) -> float:
    """The bubble as a share of total time, bubble / (ideal + bubble), from `bubble_time`
    (Lab 06 derives its closed form, Exercise 1). For bubble / ideal, see
    `bubble_relative_to_ideal`.
    """
    bubble, ideal = bubble_time(schedule, ranks, microbatches, chunks, costs)
    return bubble / (ideal + bubble)


def bubble_relative_to_ideal(schedule: str, ranks: int, microbatches: int, chunks: int = 1,
                             costs: tuple[float, float, float] = ZB_COSTS) -> float:
    """The bubble relative to the ideal (bubble-free) time, bubble / ideal: the step takes
    (1 + this) times as long as the pure compute.

    Narayanan §2.2 writes the bubble this way (Lab 06 derives its closed form, Exercise 1).
    This is not the share of total time (`bubble_fraction`).
    """
    bubble, ideal = bubble_time(schedule, ranks, microbatches, chunks, costs)
    return bubble / ideal


def inflight_microbatches(schedule: str, ranks: int, microbatches: int, rank: int,
                          chunks: int = 1) -> int:
    """Peak number of microbatches whose activations pipeline rank `rank` (0-based) holds at
    once, for each schedule (interleaved: chunk-microbatches, each 1/`chunks` of a stage's
    layers). Lab 06 predicts these before reading them off its schedules; the sources are
    Narayanan et al. 2021 §2.2 (GPipe, 1F1B, interleaved) and Qi et al. 2024 §2 (zero bubble).

    (What that means for the first rank's activation memory is Lab 06's Q2; Korthikanti §4.2.3.)
    """
    _check_schedule(schedule, ranks, microbatches, chunks)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
        raise ValueError(f"rank={rank!r}: must be an integer in [0, ranks={ranks})")
    p, m, v, i = ranks, microbatches, chunks, rank
    return {
        "gpipe": m,
        "1f1b": min(p - i, m),
        "interleaved": min((v - 1) * p + 2 * (p - i - 1) + 1, v * m),
        "zb-h1": min(p, m),
        "zb-h2": min(2 * p - 1, m),
    }[schedule]
