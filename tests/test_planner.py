"""minidist.costs.planner: a 70B model on 64 x 80 GB GPUs, and why layouts are rejected."""

import pytest

from minidist.costs import planner
from minidist.costs.memory import GB, activation_bytes, model_state_bytes
from minidist.costs.planner import MODELS, Cluster, Layout, Model


@pytest.fixture(scope="module")
def plan_70b() -> planner.Plan:
    return planner.plan(MODELS["70B"], Cluster.dgx_a100(64), global_batch=512)


def test_finds_a_layout_for_70b_on_64_gpus(plan_70b):
    best = plan_70b.best
    lay = best.layout
    assert lay.tp * lay.pp * lay.dp == 64
    assert lay.tp <= 8 and best.memory.total <= 0.9 * 80 * GB
    assert best.fits and 0 < best.mfu < 0.6  # compute_efficiency bounds it
    times = [e.time.total for e in plan_70b.feasible]
    assert times == sorted(times)
    assert "Best: " + str(lay) in plan_70b.explain()
    table = plan_70b.table(5)
    assert len(table.splitlines()) == 6 and "MFU" in table.splitlines()[0]


def test_tp_16_is_rejected_because_it_crosses_nodes(plan_70b):
    with_tp16 = [e for e in plan_70b.evaluations if e.layout.tp == 16]
    assert with_tp16 and not any(e.fits for e in with_tp16)
    assert all("tp-crosses-nodes" in {r.rule for r in e.reasons} for e in with_tp16)
    why = plan_70b.why(tp=16)
    assert why.startswith(f"all {len(with_tp16)} layouts with tp=16 are rejected")
    assert "TP=16 crosses nodes: a TP group is larger than a node (8 GPUs)" in why
    forced = plan_70b.evaluate(tp=16, dp=64 // (16 * plan_70b.best.layout.pp),
                               enforce_rules=False)
    inside = plan_70b.evaluate(tp=8, dp=64 // (8 * plan_70b.best.layout.pp))
    assert forced.time.tp_comm > 5 * inside.time.tp_comm


def test_rejection_reasons_name_the_rule():
    model = Model(1e9, layers=6, hidden=960, heads=12, seq_len=1024, vocab=1000)
    cluster = Cluster(8, 40 * GB, 8, 300e9, 25e9, 312e12)

    def reasons(**fields):
        layout = Layout(**{"tp": 1, "pp": 1, "dp": 8, "zero_stage": 0, "micro_batch": 1,
                           "microbatches": 1, "recompute": None, **fields})
        return [str(r) for r in planner.evaluate(layout, model, cluster, 24).reasons]

    assert reasons(tp=8, dp=1) == ["TP=8 does not divide heads=12: each TP rank needs whole heads"]
    assert reasons(pp=4, dp=2, microbatches=12) == [
        "PP=4 does not divide layers=6: stages need equal numbers of layers"]
    assert reasons(micro_batch=2) == [
        "global batch 24 is not a multiple of DP x b = 8 x 2"]
    assert reasons(pp=2, dp=4, micro_batch=2, microbatches=3, chunks=3) == [
        "m=3 is not a multiple of p=2: the interleaved schedule runs microbatches in groups of p"]
    assert reasons(microbatches=3) == []  # 16 GB of model state + activations: fits in 36 GB
    small = Cluster(8, 8 * GB, 8, 300e9, 25e9, 312e12)
    layout = Layout(1, 1, 8, 0, 1, 3, None)
    over = planner.evaluate(layout, model, small, 24).reasons
    assert len(over) == 1 and over[0].rule == "memory"
    assert str(over[0]).startswith("over memory by ") and "of the 7.2 GB usable per GPU" in str(
        over[0])


def test_memory_estimate_adds_up_model_state_and_activations():
    model = MODELS["70B"]
    layout = Layout(tp=8, pp=4, dp=2, zero_stage=1, micro_batch=1, microbatches=16,
                    recompute="selective")
    first = planner.pipeline_rank_memory(layout, model, 0)
    state = model_state_bytes(70e9 / 32, 1, 2)
    assert (first.params, first.grads, first.optimizer) == (state.params, state.grads,
                                                             state.optimizer)
    shape = (4096, 1, 8192, 64, 8, True)
    per_layer = activation_bytes(*shape, recompute="selective")
    workspace = activation_bytes(*shape) - per_layer
    assert first.activations == pytest.approx(4 * 80 / 4 * per_layer + workspace)
    last = planner.pipeline_rank_memory(layout, model, 3)
    logits = 4 * 4096 * 32000 / 8
    assert last.activations == pytest.approx(1 * 80 / 4 * per_layer + workspace + logits)


def test_step_time_parts():
    model, cluster = MODELS["70B"], Cluster.dgx_a100(64)
    layout = Layout(tp=8, pp=4, dp=2, zero_stage=1, micro_batch=1, microbatches=256,
                    recompute=None)
    time = planner.estimate_time(layout, model, cluster, 512, compute_efficiency=0.5)
    flops = 512 * 4096 * (6 * 70e9 + 12 * 80 * 8192 * 4096)
    assert time.compute == pytest.approx(flops / (64 * 312e12 * 0.5))
    assert time.bubble == pytest.approx(time.compute * 3 / 256)
    assert time.tp_comm > 0 and time.pp_comm > 0 and time.dp_comm > 0
    assert time.total == pytest.approx(time.compute + time.bubble + time.tp_comm
                                       + time.pp_comm + time.dp_comm)


def test_rules_of_thumb_report(plan_70b):
    checks = {c.rule: c for c in planner.rules_of_thumb(plan_70b)}
    assert checks["Keep tensor parallelism inside a node."].holds
    assert not checks["ZeRO-3 / FSDP costs 1.5x the communication of DDP."].holds
    assert not checks["Pipeline parallelism over p stages cuts activation memory by p."].holds
    assert any(c.holds for c in checks.values()) and any(not c.holds for c in checks.values())
    assert all(c.evidence for c in checks.values())


def test_bad_planner_input():
    with pytest.raises(ValueError, match="heads=7 does not divide hidden=64"):
        Model(1e6, 2, 64, 7, 128, 100)
    with pytest.raises(ValueError, match="gpus=12 is not a whole number of nodes of 8"):
        Cluster(12, 80 * GB, 8, 1e11, 1e10, 1e14)
    with pytest.raises(ValueError, match="global_batch=0"):
        planner.plan(MODELS["1.3B"], Cluster.dgx_a100(8), 0)
    empty = planner.plan(MODELS["175B"], Cluster(2, 16 * GB, 2, 1e11, 1e10, 1e14), 8)
    with pytest.raises(ValueError, match="no layout fits"):
        _ = empty.best
    assert "0 of" in empty.explain()
