"""Fakes of Lab 08's exercises: the right numbers on the lab's own profiles and runs, without
the arithmetic each exercise teaches.

A cell with two functions has two solution regions, and a fake's source replaces both: the
fakes of those cells tell the functions apart by their arguments (`locals()`)."""

from fakes import Fake

FAKES = {
    "impl-overlap": [
        Fake("the library's overlap", "writes no interval arithmetic: profiling.merge and "
             "profiling.overlap_fraction", ("test-overlap",), """\
    if "timeline" not in locals():
        return profiling.merge(intervals)
    return profiling.overlap_fraction(timeline)[rank]"""),
        Fake("every pair of raw events", "no union per kind: events of one kind that overlap "
             "each other are counted twice", ("test-overlap",), """\
    if "timeline" not in locals():
        merged = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        return merged
    mine = [e for e in timeline.events if e.rank == rank]
    communication = [(e.start, e.end) for e in mine if e.kind == "communication"]
    compute = [(e.start, e.end) for e in mine if e.kind == "compute"]
    total = sum(end - start for start, end in communication)
    hidden = sum(max(0.0, min(c_end, p_end) - max(c_start, p_start))
                 for c_start, c_end in communication for p_start, p_end in compute)
    return hidden / total if total > 0 else 0.0"""),
    ],
    "impl-mfu": [
        Fake("6Ψ per token", "drops attention's 12·L·h·s (and recompute's 4·L·h·s)",
             ("test-mfu",), """\
    per_token = 6 * num_params
    if "recompute" in locals() and recompute == "full":
        per_token += 2 * num_params
    return tokens_per_second * per_token / peak"""),
        Fake("the library's MFU", "delegates to minidist.flops.mfu and flops.hfu",
             ("test-mfu",), """\
    if "recompute" in locals():
        return flops.hfu(tokens_per_second, num_params, layers, hidden, seq_len, peak,
                         recompute=recompute)
    return flops.mfu(tokens_per_second, num_params, layers, hidden, seq_len, peak)"""),
    ],
    "impl-scaling": [
        Fake("speedup for strong scaling", "strong efficiency without N: T1/TN, the speedup",
             ("test-scaling",), """\
    return time_1 / time_n"""),
        Fake("the library's efficiencies", "delegates to minidist.flops",
             ("test-scaling",), """\
    if "n" in locals():
        return flops.strong_scaling_efficiency(time_1, time_n, n)
    return flops.weak_scaling_efficiency(time_1, time_n)"""),
    ],
    "impl-straggler": [
        Fake("mean compute", "means instead of medians: one hiccup decides",
             ("test-straggler",), """\
    def mean(values):
        return sum(values) / len(values)

    return max(per_rank, key=lambda rank: mean(per_rank[rank]["compute"]))"""),
        Fake("least time in the all-reduce", "reads the all-reduce's waiting instead of compute: "
             "right while links are equal", ("test-straggler",), """\
    def median(values):
        return sorted(values)[len(values) // 2]

    return min(per_rank, key=lambda rank: median(per_rank[rank]["all_reduce"]))"""),
    ],
    "impl-mismatch": [
        Fake("the lab's answer", "parses nothing: returns the calls of the lab's own report",
             ("test-mismatch",), """\
    return {0: ("ALLREDUCE", "[4]"), 1: ("ALLREDUCE", "[8]")}"""),
        Fake("a pattern fitted to one report", "one-digit ranks and one-number shapes only",
             ("test-mismatch",), """\
    pattern = (r"Rank (\\d) is running collective: CollectiveFingerPrint\\(SequenceNumber=\\d+, "
               r"OpType=(\\w+), TensorShape=(\\[\\d+\\])")
    return {int(rank): (op, shape) for rank, op, shape in re.findall(pattern, report)}"""),
    ],
}
