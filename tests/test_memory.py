"""minidist's arithmetic (memory, pipeline formulas, traffic, flops) against every row and
worked value of REFERENCES.md#by-lab's sources, and its bad inputs."""

import math
import re

import pytest

from minidist.costs import bubbles, flops, memory, traffic
from minidist.costs.bubbles import bubble_fraction, bubble_relative_to_ideal, inflight_microbatches
from minidist.costs.memory import GB, activation_bytes, model_state_bytes
from minidist.costs.traffic import data_parallel_traffic
from minidist.parallel import pipeline, pipeline_simulator

PSI, N = 7.5e9, 64  # ZeRO's worked example


# --- Memory table ---------------------------------------------------------------------------


def test_mixed_precision_adam_is_2_plus_2_plus_12_bytes_per_param():
    state = model_state_bytes(PSI)
    assert (state.params, state.grads, state.optimizer) == (2 * PSI, 2 * PSI, 12 * PSI)
    assert state.total == 16 * PSI


def test_zero_1_shards_optimizer_state():
    assert model_state_bytes(PSI, 1, N).total == pytest.approx(4 * PSI + 12 * PSI / N)


def test_zero_2_also_shards_gradients():
    assert model_state_bytes(PSI, 2, N).total == pytest.approx(2 * PSI + 14 * PSI / N)


def test_zero_3_shards_everything():
    assert model_state_bytes(PSI, 3, N).total == pytest.approx(16 * PSI / N)


def test_zero_check_row_7_5b_on_64():
    gb = [round(model_state_bytes(PSI, stage, N).total / GB, 1) for stage in range(4)]
    assert gb == [120.0, 31.4, 16.6, 1.9]


def test_precision_and_optimizer_recipes():
    assert model_state_bytes(10, precision="fp32").total == 160  # 4 + 4 + 8
    assert model_state_bytes(10, precision="fp32", optimizer="sgd-momentum").total == 120
    assert model_state_bytes(10, precision="fp32", optimizer="sgd").total == 80
    assert model_state_bytes(10, precision="fp16-mixed", optimizer="sgd").optimizer == 40
    custom = memory.Precision("bf16 everything", param=2, grad=2, master=0, state=2)
    assert model_state_bytes(10, precision=custom).total == 80


def test_fewest_80gb_gpus_for_70b_model_state():
    assert memory.min_gpus_for_model_state(70e9, 80 * GB, zero_stage=3) == 14
    assert 16 * 70e9 / 14 <= 80e9 < 16 * 70e9 / 13
    assert memory.min_gpus_for_model_state(70e9, 80 * GB, zero_stage=1) is None  # 4Ψ = 280 GB
    assert memory.min_gpus_for_model_state(70e9, 80 * GB, zero_stage=2) is None  # 2Ψ = 140 GB
    assert memory.min_gpus_for_model_state(1e9, 80 * GB, zero_stage=0) == 1
    assert memory.min_gpus_for_model_state(7.5e9, 80 * GB, zero_stage=1) == 2  # 30 + 90/N


S, B, H, A, T = 2048, 4, 12288, 96, 8  # GPT-3 175B's layer, as in Korthikanti


def test_activations_no_parallelism():
    assert activation_bytes(S, B, H, A) == pytest.approx(S * B * H * (34 + 5 * A * S / H))


def test_activations_tensor_parallel():
    expected = S * B * H * (10 + 24 / T + 5 * A * S / (H * T))
    assert activation_bytes(S, B, H, A, tp=T) == pytest.approx(expected)


def test_activations_tensor_and_sequence_parallel():
    expected = S * B * H * (34 + 5 * A * S / H) / T
    assert activation_bytes(S, B, H, A, tp=T, sequence_parallel=True) == pytest.approx(expected)


def test_activations_tensor_parallel_selective_recompute():
    expected = S * B * H * (10 + 24 / T)
    assert activation_bytes(S, B, H, A, tp=T, recompute="selective") == pytest.approx(expected)


def test_activations_tensor_sequence_parallel_selective_recompute():
    got = activation_bytes(S, B, H, A, tp=T, sequence_parallel=True, recompute="selective")
    assert got == pytest.approx(34 * S * B * H / T)


def test_activations_full_recompute_keeps_the_layer_input():
    assert activation_bytes(S, B, H, A, recompute="full") == 2 * S * B * H
    assert activation_bytes(S, B, H, A, tp=T, recompute="full") == 2 * S * B * H
    assert activation_bytes(S, B, H, A, T, True, "full") == 2 * S * B * H / T


def test_activation_terms_add_up_to_table_2():
    terms = memory.activation_terms(S, B, H, A)
    assert sum(t.bytes for t in terms) == pytest.approx(activation_bytes(S, B, H, A))
    sbh = S * B * H
    assert sum(t.bytes for t in terms if not t.tensor_parallel) == 10 * sbh
    assert sum(t.bytes for t in terms if t.tensor_parallel and not t.attention_core) == 24 * sbh
    assert sum(t.bytes for t in terms if t.attention_core) == 5 * A * S * S * B


def test_pipeline_memory_first_rank_holds_p_microbatches():
    per_layer, layers = activation_bytes(S, 1, H, A, T, True, "selective"), 96
    for p in (1, 2, 4, 8):
        first_rank = inflight_microbatches("1f1b", p, 64, 0) * layers / p * per_layer
        assert first_rank == pytest.approx(layers * per_layer)  # whatever p is


# --- Pipeline table -------------------------------------------------------------------------


def test_gpipe_bubble_both_forms():
    p, m = 4, 8
    assert bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_relative_to_ideal("gpipe", p, m) == pytest.approx((p - 1) / m)
    assert inflight_microbatches("gpipe", p, m, 0) == inflight_microbatches("gpipe", p, m, 3) == m


def test_1f1b_has_gpipe_bubble_and_less_memory():
    for p, m in ((4, 1), (4, 8), (8, 3), (2, 30)):
        assert bubble_fraction("1f1b", p, m) == bubble_fraction("gpipe", p, m)
        for rank in range(p):
            assert inflight_microbatches("1f1b", p, m, rank) == min(p - rank, m)


def test_interleaved_bubble_and_inflight():
    p, m, v = 4, 8, 2
    assert bubble_relative_to_ideal("interleaved", p, m, v) == pytest.approx((p - 1) / (v * m))
    assert bubble_fraction("interleaved", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
    assert inflight_microbatches("interleaved", p, m, 0, chunks=v) == v * p + p - 1
    sends = traffic.pipeline_traffic(1024, 1, 512, m, chunks=v).bytes_sent
    assert sends == v * traffic.pipeline_traffic(1024, 1, 512, m).bytes_sent  # v x p2p traffic
    with pytest.raises(ValueError, match="microbatches=6 is not a multiple of ranks=4"):
        bubble_fraction("interleaved", 4, 6, 2)


def test_zb_h1_bubble_is_a_third_of_1f1b():
    p, m = 4, 8
    bubble, ideal = bubbles.bubble_time("zb-h1", p, m)
    assert bubble == (p - 1) * (1 + 1 - 1) and ideal == 3 * m  # T_F = T_B = T_W = 1
    assert bubble == bubbles.bubble_time("1f1b", p, m)[0] / 3
    assert bubbles.bubble_time("zb-h1", p, m, costs=(1.0, 2.0, 1.5))[0] == (p - 1) * 1.5
    assert all(inflight_microbatches("zb-h1", p, m, i) == p for i in range(p))


def test_zb_h2_has_no_bubble_and_2p_minus_1_inflight():
    assert bubble_fraction("zb-h2", 4, 16) == 0
    assert inflight_microbatches("zb-h2", 4, 16, 0) == 7


@pytest.mark.parametrize(("m", "expected"), [(1, 0.75), (8, 3 / 11), (30, 3 / 33)])
def test_worked_bubble_values(m, expected):
    assert bubble_fraction("gpipe", 4, m) == pytest.approx(expected)
    assert bubble_fraction("1f1b", 4, m) == pytest.approx(expected)


def test_simulated_timelines_measure_the_formulas():
    """The bubble and peak in-flight counts of every schedule, measured on simulated
    timelines, equal the closed forms."""
    cases = [(s, p, m, 1) for s in ("gpipe", "1f1b") for p in (1, 2, 4, 5) for m in (1, 3, 8)]
    cases += [("zb-h1", p, m, 1) for p in (1, 2, 4) for m in (p, p + 3, 12)]
    cases += [("interleaved", p, m, v) for p in (2, 4) for m in (p, 3 * p) for v in (2, 3)]
    for schedule, p, m, v in cases:
        timeline = pipeline_simulator.simulate(pipeline.schedule(schedule, p, m, v))
        assert timeline.bubble_fraction == pytest.approx(bubble_fraction(schedule, p, m, v)), (
            schedule, p, m, v)
        expected = [inflight_microbatches(schedule, p, m, rank, v) for rank in range(p)]
        assert timeline.peak_inflight == expected, (schedule, p, m, v)


# --- Communication table ----------------------------------------------------------------------


def test_dp_and_zero_1_2_volume_is_2psi_and_zero_3_is_3psi():
    psi = 1e9
    for stage in (0, 1, 2):
        assert data_parallel_traffic(psi, N, stage, bytes_per_element=1).volume == 2 * psi
    assert data_parallel_traffic(psi, N, 3, bytes_per_element=1).volume == 3 * psi
    ring = data_parallel_traffic(psi, 4, 0, bytes_per_element=1).bytes_sent
    assert ring == pytest.approx(2 * 3 / 4 * psi)  # 2(N-1)/N · S per rank


def test_ring_collectives_bytes_per_rank():
    s, n = 1e9, 8
    assert traffic.Collective("all_reduce", s, n).bytes_sent == pytest.approx(2 * (n - 1) / n * s)
    assert traffic.Collective("all_gather", s, n).bytes_sent == pytest.approx((n - 1) / n * s)
    assert traffic.Collective("reduce_scatter", s, n).bytes_sent == pytest.approx((n - 1) / n * s)
    assert traffic.Collective("send", s, 2, count=3).bytes_sent == 3 * s


def test_zero_2_and_3_traffic_grows_with_gradient_accumulation():
    psi, m = 1e9, 8
    assert data_parallel_traffic(psi, N, 1, 1, m).volume == 2 * psi
    assert data_parallel_traffic(psi, N, 2, 1, m).volume == (m + 1) * psi
    assert data_parallel_traffic(psi, N, 3, 1, m).volume == 3 * m * psi


def test_tensor_parallel_is_two_forward_two_backward_all_reduces_per_layer():
    s, b, h, t = 2048, 1, 4096, 8
    layer = traffic.tensor_parallel_traffic(s, b, h, t)
    assert [(c.op, c.count) for c in layer.collectives] == [("all_reduce", 2)] * 2
    assert all(c.nbytes == 2 * b * s * h for c in layer.collectives)
    with_sp = traffic.tensor_parallel_traffic(s, b, h, t, sequence_parallel=True)
    assert {c.op for c in with_sp.collectives} == {"all_gather", "reduce_scatter"}
    assert with_sp.bytes_sent == pytest.approx(layer.bytes_sent)
    assert with_sp.volume == layer.volume == 8 * 2 * b * s * h


def test_pipeline_sends_bsh_per_microbatch_per_boundary():
    sent = traffic.pipeline_traffic(2048, 2, 4096, microbatches=8)
    assert sent.bytes_sent == 2 * 8 * 2 * 2048 * 4096 * 2  # forward + backward, bf16


# --- Compute ----------------------------------------------------------------------------------


def test_mfu_palm_formula_and_hfu():
    psi, layers, h, s, peak = 70e9, 80, 8192, 4096, 312e12
    tokens = 1000.0
    per_token = 6 * psi + 12 * layers * h * s
    assert flops.mfu(tokens, psi, layers, h, s, peak) == pytest.approx(tokens * per_token / peak)
    assert flops.mfu(tokens, psi, layers, h, s, peak, num_gpus=8) == pytest.approx(
        tokens * per_token / (8 * peak))
    assert flops.hfu(tokens, psi, layers, h, s, peak) == flops.mfu(tokens, psi, layers, h, s,
                                                                     peak)
    full = flops.hfu(tokens, psi, layers, h, s, peak, recompute="full")
    assert full == pytest.approx(tokens * (8 * psi + 16 * layers * h * s) / peak)
    assert flops.hfu(tokens, psi, layers, h, s, peak, recompute="selective") == pytest.approx(
        tokens * (6 * psi + 16 * layers * h * s) / peak)


def test_scaling_efficiency():
    assert flops.strong_scaling_efficiency(100.0, 25.0, 4) == 1.0
    assert flops.strong_scaling_efficiency(100.0, 50.0, 4) == 0.5
    assert flops.weak_scaling_efficiency(10.0, 12.5) == 0.8


# --- Bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: model_state_bytes(0), "num_params=0: must be a positive number"),
        (lambda: model_state_bytes(-5.0), "num_params=-5.0"),
        (lambda: model_state_bytes(1e9, 4), "zero_stage=4: choose one of 0, 1, 2, 3"),
        (lambda: model_state_bytes(1e9, 1, 0), "dp=0: must be a positive integer"),
        (lambda: model_state_bytes(1e9, precision="int8"), "precision='int8'"),
        (lambda: model_state_bytes(1e9, optimizer="lion"), "optimizer='lion'"),
        (lambda: activation_bytes(0, 1, 64, 4), "seq_len=0: must be a positive integer"),
        (lambda: activation_bytes(128, 1, 100, 8), "heads=8 does not divide hidden=100"),
        (lambda: activation_bytes(128, 1, 96, 6, tp=4), "tp=4 does not divide heads=6"),
        (lambda: activation_bytes(100, 1, 64, 8, tp=8, sequence_parallel=True),
         "tp=8 does not divide seq_len=100"),
        (lambda: activation_bytes(128, 1, 64, 4, recompute="some"), "recompute='some'"),
        (lambda: bubble_fraction("pipedream", 4, 8), "schedule='pipedream'"),
        (lambda: bubble_fraction("1f1b", 0, 8), "ranks=0: must be a positive integer"),
        (lambda: bubble_fraction("1f1b", 4, -1), "microbatches=-1"),
        (lambda: bubble_fraction("interleaved", 4, 6, 2), "not a multiple of ranks=4"),
        (lambda: bubble_fraction("1f1b", 4, 8, 2), "chunks=2: only the 'interleaved'"),
        (lambda: bubble_fraction("zb-h1", 4, 2), "microbatches=2 < ranks=4"),
        (lambda: inflight_microbatches("1f1b", 4, 8, 4), "rank=4: must be an integer in"),
        (lambda: data_parallel_traffic(1e9, 8, 5), "zero_stage=5"),
        (lambda: flops.mfu(0, 1e9, 1, 1, 1, 1e12), "tokens_per_second=0"),
        (lambda: flops.mfu(1, 1e9, 1, 1, 1, 1e12, num_gpus=0), "num_gpus=0"),
    ],
)
def test_bad_input_names_the_argument_and_the_rule(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_gb_and_gib_are_explicit():
    assert GB == 1e9 and memory.GiB == 2**30
    assert math.isclose(80 * GB / memory.GiB, 74.5, abs_tol=0.05)
