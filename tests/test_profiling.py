"""minidist.jobs.profiling: events classified, ranks merged, overlap measured on real DDP and FSDP
steps, a valid Chrome trace, and the machine's peak."""

import json

import pytest
import torch

from minidist.costs import flops
from minidist.jobs import profiling


def test_interval_arithmetic():
    assert profiling.merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert profiling.total([(0, 2), (1, 3), (5, 6)]) == 4
    assert profiling.intersect([(0, 4), (6, 8)], [(1, 2), (3, 7)]) == [(1, 2), (3, 4), (6, 7)]
    assert profiling.subtract([(0, 10)], [(2, 3), (8, 12)]) == [(0, 2), (3, 8)]


def test_classify_keeps_outermost_operators_and_all_communication():
    ms = 1_000_000  # ns
    records = [
        ("autograd::engine::evaluate_function: MmBackward0", 0, 10 * ms, 1),  # a range: no
        ("aten::mm", 1 * ms, 4 * ms, 1),                   # outermost operator: compute
        ("aten::empty", 2 * ms, 3 * ms, 1),                # inside aten::mm: counted there
        ("c10d::allreduce_", 5 * ms, 6 * ms, 1),           # the launch: communication
        ("aten::copy_", 5 * ms + 1, 6 * ms - 1, 1),        # gloo's copy inside it: not compute
        ("gloo:all_reduce", 5 * ms, 9 * ms, 7),            # the transfer, on gloo's thread
        ("aten::add", 7 * ms, 8 * ms, 1),
    ]
    events = profiling.classify(records, origin_ns=0, rank=3)
    got = [(e.name, e.kind) for e in events]
    assert got == [("aten::mm", "compute"), ("c10d::allreduce_", "communication"),
                   ("gloo:all_reduce", "communication"), ("aten::add", "compute")], got
    assert all(e.rank == 3 for e in events)
    assert events[0].start == pytest.approx(0.001) and events[0].end == pytest.approx(0.004)


@pytest.fixture(scope="module")
def timelines():
    return {how: profiling.profile_ranks(profiling.gradient_sync_step, 2, how, warmup=1, steps=2)
            for how in profiling.GRADIENT_SYNCS}


def transfers(timeline, rank: int, name: str) -> list[tuple[float, float]]:
    """The backend's transfers `name` ("gloo:all_reduce") on `rank`, in order of start."""
    return sorted((e.start, e.end) for e in timeline.events if e.rank == rank and e.name == name)


def launches(timeline, rank: int, name: str) -> list[float]:
    return sorted(e.start for e in timeline.events if e.rank == rank and e.name == name)


def in_flight_during_compute(timeline, rank: int, launch: str, transfer: str,
                             window: tuple[float, float]) -> list[tuple[float, float]]:
    """(launch, transfer end) of each collective launched in `window` while compute went on:
    some compute event of `rank` started after the launch and before the transfer ended.

    That is the mechanism, whether or not gloo's thread got a core at the time: a request
    waited on at once (a synchronous call, a hook that waits) lets no compute start until its
    transfer ends. Requests pair with transfers in order."""
    first, last = window
    computes = [s for s, _ in timeline.intervals(rank, "compute")]
    ends = [end for _, end in transfers(timeline, rank, transfer)]
    pairs = zip(launches(timeline, rank, launch), ends, strict=True)
    return [(sent, done) for sent, done in pairs if first <= sent < last
            and any(sent < start < min(done, last) for start in computes)]


# Overlap is asserted as mechanism (which requests stay in flight while compute runs, which
# launches come before backward's last gradient), never as a share of wall-clock time, which a
# busy machine changes; bench/overlap_and_bubbles.py prints the measured shares.
def test_ddp_buckets_hide_communication_and_one_flat_buffer_does_not(timelines):
    flat, buckets = timelines["flat"], timelines["buckets"]
    for rank in (0, 1):
        assert len(transfers(flat, rank, "gloo:all_reduce")) == 2, (
            f"rank {rank}: one flat all-reduce per step")
        for window in flat.steps[rank]:
            hidden = in_flight_during_compute(flat, rank, "c10d::allreduce_", "gloo:all_reduce",
                                              window)
            assert not hidden, (f"rank {rank}: expected no compute while the flat buffer is "
                                f"all-reduced (backward has ended), got compute during {hidden}")
        for start, end in buckets.steps[rank]:
            started = [t for t in launches(buckets, rank, "c10d::allreduce_") if start <= t <= end]
            assert len(started) >= 3, f"rank {rank}: {len(started)} bucket all-reduces per step"
            # The last launch follows backward's last gradient; every earlier one came while
            # backward was still producing gradients, and stays in flight beside that work.
            hidden = in_flight_during_compute(buckets, rank, "c10d::allreduce_",
                                              "gloo:all_reduce", (start, started[-1]))
            assert hidden, (
                f"rank {rank}: expected bucket all-reduces in flight while backward still "
                f"computes gradients; {len(started)} launches, none was")
    for timeline in timelines.values():
        for rank in (0, 1):
            assert len(timeline.steps[rank]) == 2, timeline.steps
            assert timeline.busy_time(rank) <= sum(timeline.step_times(rank)) + 1e-6
            assert timeline.intervals(rank, "communication"), f"rank {rank} sent nothing"


def test_fsdp_prefetch_gathers_the_next_unit_while_this_one_computes(timelines):
    """Without prefetch no all-gather is ever in flight while compute starts; with it, some
    are. Not every step of every rank: a gather of these few kilobytes can end before the
    rank's next operator starts when gloo's thread gets a core first, which is no fault of
    prefetching (a quiet run of the suite once saw a step like that)."""
    gather = ("c10d::_allgather_base_", "gloo:all_gather")
    without, prefetched = timelines["no_prefetch"], timelines["prefetch"]
    overlapped = []
    for rank in (0, 1):
        assert len(transfers(prefetched, rank, gather[1])) == len(
            transfers(without, rank, gather[1])), "prefetch gathers the same units"
        for window in without.steps[rank]:
            hidden = in_flight_during_compute(without, rank, *gather, window)
            assert not hidden, (f"rank {rank}: without prefetch each unit waits for its own "
                                f"all-gather; expected none in flight during compute, got "
                                f"{len(hidden)}")
        overlapped += [hidden for window in prefetched.steps[rank]
                       for hidden in in_flight_during_compute(prefetched, rank, *gather, window)]
    assert overlapped, ("with prefetch, expected the next unit's all-gather in flight while "
                        "this unit computes, in some step of some rank; none was")


def test_chrome_trace_is_valid_and_holds_every_rank(timelines, tmp_path):
    timeline = timelines["buckets"]
    path = timeline.to_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["ph"] for e in trace["traceEvents"]} <= {"X", "M"}, "only complete and metadata"
    for event in complete:
        for key in ("name", "ts", "dur", "pid", "tid"):
            assert key in event, f"complete event without {key!r}: {event}"
        assert event["dur"] >= 0, event
    assert {e["pid"] for e in complete} == {0, 1}, "expected events of ranks 0 and 1"
    assert len(complete) == len(timeline.events) + 4  # and the 2 steps of each rank
    kinds = {e["cat"] for e in complete}
    assert kinds == {"step", "compute", "communication"}, kinds
    figure = timeline.plot("DDP buckets")
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == [
        "rank 0 compute", "rank 0 communication", "rank 1 compute", "rank 1 communication"]


def test_profiled_ranks_print_nothing_of_their_own(capfd):
    """Kineto logs each profile's start and stop; in a notebook that was a line per rank and
    profile under every profiled cell."""
    profiling.profile_ranks(profiling.gradient_sync_step, 2, "flat", warmup=0, steps=1)
    printed = "".join(capfd.readouterr())
    assert "profiler_st" not in printed, f"expected no profiler log lines, got {printed[-2000:]}"


def test_peak_flops_and_mfu_from_it():
    torch.set_num_threads(1)
    peak = profiling.measure_peak_flops(torch.float32, "cpu", size=256, repeats=3)
    assert 1e8 < peak < 1e13, f"expected a CPU core's FLOP/s, got {peak:.3g}"
    # MFU of a step is Lab 02's formula with this peak: tokens/s x (6Ψ + 12·L·h·s) / peak.
    assert flops.mfu(1000, 1e6, 2, 64, 32, peak) == pytest.approx(
        1000 * (6e6 + 12 * 2 * 64 * 32) / peak)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no GPU"):
            profiling.measure_peak_flops(torch.bfloat16, "cuda")


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="warmup"):
        profiling.profile_ranks(profiling.gradient_sync_step, 2, "flat", warmup=-1)
    with pytest.raises(ValueError, match="kind"):
        profiling.ProfileTimeline(1, [], {0: [(0.0, 1.0)]}).intervals(0, "idle")
