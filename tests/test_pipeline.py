"""minidist.parallel.pipeline (schedules), pipeline_validator, pipeline_simulator, pipeline_exec
(real ranks), pipeline_harness (from a notebook, against PyTorch) and gantt.

The simulator is checked against the formulas of REFERENCES.md#pipelines, written out here
(not imported from the library), on every p <= 8, m <= 32.
"""

from __future__ import annotations

import matplotlib
import pytest
import torch
from torch import nn

from minidist.core import launch
from minidist.parallel import pipeline_exec, pipeline_harness
from minidist.parallel.models import TinyGPT, lm_loss
from minidist.parallel.pipeline import Action, Schedule, ScheduleError, schedule
from minidist.parallel.pipeline_simulator import Costs, Timeline, action_event, simulate
from minidist.parallel.pipeline_validator import validate
from minidist.pictures import gantt

matplotlib.use("Agg")

GRID = [(p, m) for p in range(1, 9) for m in range(1, 33)]
# Uniform costs (F, B, W). A schedule that does not split the backward runs B + W as one action.
COSTS = [(1, 1, 1), (1, 1.5, 0.5), (2, 1, 1), (1, 2, 1), (1, 1, 0.5)]


# --- Simulator against the formulas --------------------------------------------------------------


@pytest.mark.parametrize("costs", COSTS)
def test_gpipe_and_1f1b_bubble_and_memory(costs: tuple[float, float, float]) -> None:
    for p, m in GRID:
        for name in ("gpipe", "1f1b"):
            s = schedule(name, p, m)
            if costs == COSTS[0]:
                validate(s)
            t = simulate(s, Costs(*costs))
            bubble = (p - 1) / (m + p - 1)
            assert t.bubble_fraction == pytest.approx(bubble, abs=1e-12), (name, p, m)
            # Relative to the ideal time m(F+B+W) it is (p-1)/m: the other formula.
            ideal = m * sum(costs)
            assert (t.makespan - ideal) / ideal == pytest.approx((p - 1) / m, abs=1e-12)
            expected = [m] * p if name == "gpipe" else [min(p - i, m) for i in range(p)]
            assert t.peak_inflight == expected, (name, p, m)


@pytest.mark.parametrize("costs", COSTS)
def test_interleaved_bubble_and_first_rank_memory(costs: tuple[float, float, float]) -> None:
    for p, m in GRID:
        if m % p:
            continue
        for v in (1, 2, 3, 4):
            s = schedule("interleaved", p, m, chunks=v)
            if costs == COSTS[0]:
                validate(s)
            t = simulate(s, Costs(*costs))
            # (p-1)/(v*m) relative to ideal time, i.e. (p-1)/(v*m + p - 1) of total time.
            assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
            assert t.peak_inflight[0] == min(v * p + p - 1, v * m), (p, m, v)


@pytest.mark.parametrize("costs", [c for c in COSTS if c[2] <= c[0]])
def test_zb_h1_bubble_and_memory(costs: tuple[float, float, float]) -> None:
    f, b, w = costs
    for p, m in GRID:
        s = schedule("zb-h1", p, m)
        if costs == COSTS[0]:
            validate(s)
        t = simulate(s, Costs(f, b, w))
        formula = m * (f + b + w) + (p - 1) * (f + b - w)
        if m >= p:  # the paper's setting: enough microbatches to fill the cool-down with W's
            assert t.makespan == pytest.approx(formula, abs=1e-9), (p, m)
            assert t.peak_inflight == [p] * p
        else:
            assert t.makespan >= formula - 1e-9
            assert t.peak_inflight == [m] * p
    one_f_one_b = simulate(schedule("1f1b", 8, 32)).makespan - 32 * 3
    assert simulate(schedule("zb-h1", 8, 32)).makespan - 32 * 3 == one_f_one_b / 3


def test_worked_values_and_latency() -> None:
    assert simulate(schedule("gpipe", 4, 1)).bubble_fraction == pytest.approx(0.75)
    assert simulate(schedule("1f1b", 4, 8)).bubble_fraction == pytest.approx(3 / 11)
    assert simulate(schedule("gpipe", 4, 30)).bubble_fraction == pytest.approx(3 / 33)
    # Latency on every hop of the fill and drain: 2(p-1) hops for GPipe.
    slow = simulate(schedule("gpipe", 4, 8), Costs(latency=0.5))
    assert slow.makespan == pytest.approx(3 * (8 + 3) + 2 * 3 * 0.5)
    # Per-stage costs: the slowest stage sets the pace.
    uneven = simulate(schedule("gpipe", 2, 4), Costs(F=[1, 2], B=[1, 2], W=[0, 0]))
    assert uneven.makespan == pytest.approx(1 + 4 * 2 + 4 * 2 + 1)


def test_text_table_and_round_trip() -> None:
    s = schedule("1f1b", 3, 4)
    assert str(s).splitlines()[1:] == [
        "rank 0: F0 F1 F2 B0 F3 B1 B2 B3",
        "rank 1: F0 F1 B0 F2 B1 F3 B2 B3",
        "rank 2: F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert s.text(comm=True).splitlines()[3].startswith("rank 2: F0<1 F0 B0 B0>1 F1<1")
    table = simulate(s).table().splitlines()
    assert table[1].split()[2:7] == ["F0", "F1", "F2", ".", "."]
    assert "bubble 33.3%" in table[-1]
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        original = schedule(name, 4, 8, v)
        again = Schedule.from_text(original.text(comm=True), chunks=v, name=name)
        assert again == original


# --- Validator -------------------------------------------------------------------------------


def two_ranks(rank0: str, rank1: str, microbatches: int | None = None) -> Schedule:
    return Schedule.from_text(f"rank 0: {rank0}\nrank 1: {rank1}", microbatches)


GOOD = ("F0 F0>1 B0<1 B0", "F0<0 F0 B0 B0>0")


def fault(s: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as caught:
        validate(s)
    return caught.value


def test_validator_accepts_a_legal_schedule() -> None:
    validate(two_ranks(*GOOD))


def test_backward_before_forward() -> None:
    error = fault(two_ranks("F0 F0>1 B0<1 B0", "F0<0 B0 F0 B0>0"))
    assert (error.rank, error.index, error.action) == (1, 1, Action("B", 1, 0))
    assert "runs before its forward" in str(error) and "rank 1, compute action 0 (B0)" in str(error)


def test_missing_microbatch() -> None:
    error = fault(two_ranks(*GOOD, microbatches=2))
    assert error.rank == 0 and error.action == Action("F", 0, 1) and error.index is None
    assert "never runs F1" in str(error)


def test_send_without_receive_and_receive_without_send() -> None:
    error = fault(two_ranks("F0 F0>1 B0<1 B0", "F0 B0 B0>0"))
    assert (error.rank, error.action.kind) == (0, "SEND_F")
    assert "rank 1 never receives it" in str(error)
    error = fault(two_ranks("F0 F0>1 B0<1 B0", "F0<0 F0 B0"))
    assert (error.rank, error.action.kind) == (0, "RECV_B")
    assert "rank 1 never sends it" in str(error)


def test_deadlock_names_every_stuck_rank_and_the_cycle() -> None:
    s = Schedule.from_text("rank 0: F0 F0>1 B0<1 B0\n"
                           "rank 1: F0<0 F0 B0<2 F0>2 B0 B0>0\n"
                           "rank 2: F0<1 F0 B0 B0>1")
    error = fault(s)
    assert set(error.blocked) == {0, 1, 2}
    assert error.blocked[2] == (0, Action("RECV_F", 2, 0))
    message = str(error)
    assert "rank 1 -> rank 2 -> rank 1" in message
    assert ("rank 2 is stuck at F0<1, before compute action 0: waiting to receive the "
            "activation of microbatch 0 from rank 1") in message


@pytest.mark.parametrize("text, complaint", [
    (("F0 F0 F0>1 B0<1 B0", GOOD[1]), "appears twice"),
    (("F0 F0>1 B0<1 B0 F1@1", GOOD[1]), "stage 1 lives on rank 1"),
    (("F0 F0>1 B0<1 B0", "F0<0 F0 B0 B0>0 F0>0"), "has no next stage"),
    (("F0 F0>1 B0<1 B0", "F0<0 F0 F0>1 B0 B0>0"), "peer"),
])
def test_malformed_actions(text: tuple[str, str], complaint: str) -> None:
    try:
        error = fault(two_ranks(*text))
    except ScheduleError as parse_error:  # from_text already refuses some
        error = parse_error
    if complaint == "peer":
        assert "that message goes to or comes from rank 0" in str(error)
    else:
        assert complaint in str(error), str(error)
    assert error.rank is not None


# --- Bad input -------------------------------------------------------------------------------


def test_weight_gradient_in_an_unsplit_schedule() -> None:
    s = two_ranks(*GOOD)
    unsplit = Schedule(s.name, 2, 1, (s.actions[0] + (Action("W", 0, 0),), s.actions[1]))
    error = fault(unsplit)
    assert (error.rank, error.index) == (0, 4) and "backward is not split" in str(error)


def test_bad_arguments_give_clear_errors() -> None:
    with pytest.raises(ValueError, match="microbatches=0: must be a positive integer"):
        schedule("1f1b", 4, 0)
    with pytest.raises(ValueError, match="schedule='pipedream': choose one of"):
        schedule("pipedream", 4, 8)
    with pytest.raises(ValueError, match="interleaved needs microbatches to be a multiple of "
                                         "ranks: m=6, p=4; use m=4 or m=8"):
        schedule("interleaved", 4, 6, chunks=2)
    with pytest.raises(ValueError, match="chunks=2 applies to 'interleaved' only"):
        schedule("gpipe", 4, 8, chunks=2)
    with pytest.raises(ValueError, match="5 stages but the model has only 4 layers"):
        pipeline_exec.split_layers([nn.Linear(2, 2) for _ in range(4)], 5)
    with pytest.raises(ValueError, match="Costs.F has 3 entries for 4 stages"):
        simulate(schedule("gpipe", 4, 4), Costs(F=[1, 1, 1]))
    stages = [nn.Linear(8, 16), nn.Linear(32, 8)]
    with pytest.raises(ValueError, match=r"stage 1 cannot take the output of stage 0, of shape "
                                         r"\(2, 16\)"):
        pipeline_exec.check_stages(stages, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="does not split into microbatches=3"):
        pipeline_exec.split_microbatches(torch.zeros(8, 2), 3)


# --- Real ranks ------------------------------------------------------------------------------

VOCAB, HIDDEN, SEQ = 32, 16, 8


def gpt_stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, HIDDEN, heads=2, layers=6, max_seq=SEQ)
    return pipeline_exec.split_layers(model.layers(), num_stages)


def gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def grads_from_both_executors(rank: int, world_size: int) -> list:
    inputs, targets = gpt_batch()
    results = []
    for name, v in SCHEDULES:
        s = schedule(name, world_size, 4, chunks=v)
        runs = []
        for step in (pipeline_exec.execute, pipeline_harness.torch_step):
            stages = gpt_stages(s.num_stages)
            mine = {k: stages[k] for k in s.stages_of(rank)}
            output = step(s, mine, inputs, targets, lm_loss)
            grads = {f"{k}.{n}": p.grad for k, m in mine.items() for n, p in m.named_parameters()}
            runs.append((grads, output))
        results.append(runs)
    return results


def test_executor_gradients_equal_single_process_and_pytorch() -> None:
    inputs, targets = gpt_batch()
    per_rank = launch.run(grads_from_both_executors, 4, timeout=120)
    for index, (name, v) in enumerate(SCHEDULES):
        s = schedule(name, 4, 4, chunks=v)
        expected, _ = pipeline_harness.reference_grads(lambda s=s: gpt_stages(s.num_stages),
                                                       inputs, targets, lm_loss)
        ours = {k: g for runs in per_rank for k, g in runs[index][0][0].items()}
        theirs = {k: g for runs in per_rank for k, g in runs[index][1][0].items()}
        assert ours.keys() == theirs.keys() == expected.keys()
        for key, grad in expected.items():
            assert (ours[key] - grad).abs().max() <= 1e-5, (name, key)
            assert (theirs[key] - grad).abs().max() <= 1e-5, (name, key)
        traces = [runs[index][0][1] for runs in per_rank]
        timeline = Timeline(s, [trace.events for trace in traces], measured=True)
        assert timeline.peak_inflight == simulate(s).peak_inflight
        assert [[e.detail for e in events] for events in timeline.events] == [
            s.compute(rank) for rank in range(4)]
        torch_orders = [runs[index][1][1] for runs in per_rank]
        if torch_orders[0] is not None:  # PyTorch runs these from an action list: same order
            assert torch_orders == [[a.label(show_stage=True) for a in s.compute(rank)]
                                    for rank in range(4)], name


def mlp_stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(8)]
    return pipeline_exec.split_layers(layers, num_stages)


# Emulated cost of one forward (a full backward lasts 2 units). The test checks order, not
# time shares: bench/overlap_and_bubbles.py prints the measured bubbles against the simulator.
TIME_UNIT_S = 0.01


def timed_runs(rank: int, world_size: int, configs: list[tuple[str, int, int]]) -> list:
    torch.manual_seed(2)
    inputs, targets = torch.randn(16, 8), torch.randn(16, 8)
    traces = []
    for name, m, v in configs:
        s = schedule(name, world_size, m, chunks=v)
        stages = mlp_stages(s.num_stages)
        mine = {k: stages[k] for k in s.stages_of(rank)}
        traces.append(pipeline_exec.execute(s, mine, inputs, targets, nn.functional.mse_loss,
                                            time_unit=TIME_UNIT_S).events)
    return traces


def test_measured_timeline_follows_the_schedule_and_its_dependencies() -> None:
    """p = 4, m in {4, 8, 16}, on real ranks: each rank runs its compute actions in the
    schedule's order, each lasting at least its emulated cost, and no action starts before the
    actions it depends on (on other ranks: the activation or gradient it receives) have ended.
    Events are stamped on timeline.clock(), one clock for every process of the machine."""
    todo = [(name, m, v) for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
            for m in (4, 8, 16)]
    per_rank = launch.run(timed_runs, 4, todo, timeout=120)
    for index, (name, m, v) in enumerate(todo):
        s = schedule(name, 4, m, chunks=v)
        events = [rank_events[index] for rank_events in per_rank]
        ended = {}
        for rank in range(4):
            got = [event.detail for event in events[rank]]
            assert got == s.compute(rank), f"{name} m={m}: rank {rank} ran {got[:6]}..."
            for event in events[rank]:
                cost = Costs().of(event.detail, s.split_backward) * TIME_UNIT_S
                assert event.end - event.start >= cost * 0.999, (name, m, event)
                ended[event.detail] = event.end
        last = s.num_stages - 1
        for rank in range(4):
            for event in events[rank]:
                kind, k, j = event.detail
                needs = []
                if kind == "F" and k > 0:
                    needs = [Action("F", k - 1, j)]
                elif kind == "B":
                    needs = [Action("F", k, j)] + ([Action("B", k + 1, j)] if k < last else [])
                for need in needs:
                    assert event.start >= ended[need], (
                        f"{name} m={m}: {event.detail} on rank {rank} started "
                        f"{ended[need] - event.start:.4f} s before {need} ended")


def test_deadlock_on_real_ranks_names_what_each_rank_waits_for() -> None:
    s = Schedule.from_text("rank 0: F0 F0>1 B0<1 B0\n"
                           "rank 1: F0<0 F0 B0<2 F0>2 B0 B0>0\n"
                           "rank 2: F0<1 F0 B0 B0>1")
    with pytest.raises(ScheduleError):
        pipeline_harness.run_pipeline(s, lambda: mlp_stages(3), torch.randn(4, 8),
                                      torch.randn(4, 8), nn.functional.mse_loss)
    with pytest.raises(pipeline_exec.PipelineDeadlock) as caught:
        pipeline_harness.run_pipeline(s, lambda: mlp_stages(3), torch.randn(4, 8),
                                      torch.randn(4, 8), nn.functional.mse_loss, timeout=1.0,
                                      check=False)
    message = str(caught.value)
    assert message.startswith("pipeline deadlock: rank(s) 0, 1, 2 stuck (time limit 1 s")
    assert ("rank 2 is stuck at F0<1, before compute action 0: waiting to receive the "
            "activation of microbatch 0 from rank 1") in message
    assert ("rank 1 is stuck at B0<2, before compute action 1: waiting to receive the "
            "gradient of microbatch 0 from rank 2") in message


# --- Gantt -----------------------------------------------------------------------------------


def test_gantt_draws_simulated_and_measured_timelines() -> None:
    simulated = simulate(schedule("zb-h1", 4, 8))
    s = schedule("1f1b", 2, 2)
    events = [[action_event(r, a, 0.1 * i, 0.1 * i + 0.05) for i, a in enumerate(s.compute(r))]
              for r in range(2)]
    measured = Timeline(s, events, measured=True)
    figure = gantt.draw_all([simulated, measured], same_scale=False)
    titles = [ax.get_title(loc="left") for ax in figure.axes]
    assert titles[0] == "zb-h1 (simulated), p=4, m=8: bubble 11.1%"
    assert titles[1].startswith("1f1b (measured), p=2, m=2: bubble")
    assert figure.axes[1].get_xlabel() == "ms"
    hatched = {c.get_hatch(): len(c.get_paths()) for c in figure.axes[0].collections}
    assert hatched == {"xx": 4, None: 32, "///": 32, "...": 32}  # idle rows, F, B, W
    assert "peak 4" in [text.get_text() for text in figure.axes[0].texts]
