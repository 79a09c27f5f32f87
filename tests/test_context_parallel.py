"""minidist.parallel.context_parallel: ring attention and DeepSpeed-Ulysses equal one process's
attention (outputs and q, k, v gradients, causal and not, odd head dims, cp 2 and 4), send what
minidist.costs.traffic's formulas say, keep s/cp-sized activations, overlap transfers with compute;
the zigzag layout balances causal work; dp2·cp2·tp2 TinyGPT trains like one process; bad input
is a ValueError on every rank, never a hang. One launch per world size checks every case."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from minidist.communication import counting
from minidist.communication.mesh import Mesh
from minidist.core import timeline
from minidist.core.launch import run
from minidist.costs import traffic
from minidist.costs.footprint import saved_activations
from minidist.parallel import context_parallel as cp
from minidist.parallel.models import TinyGPT
from minidist.parallel.parallelize import parallelize

pytestmark = pytest.mark.xdist_group("context_parallel")

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 24, 5  # an odd head dim; 24 splits into 2·4 chunks
METHODS = {"ring": cp.ring_attention, "ulysses": cp.ulysses_attention}
CASES = [(method, layout, causal) for method in METHODS for layout in cp.LAYOUTS
         for causal in (True, False)]
TOLERANCE = 1e-5  # fp32


def _reference(causal: bool, seq: int = SEQ,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Attention over the whole sequence in one process, and its gradients."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator, dtype=dtype,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator, dtype=dtype)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(grad)
    return {"q": q.detach(), "k": k.detach(), "v": v.detach(), "grad": grad,
            "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _bad_inputs(rank: int, world_size: int) -> dict[str, str]:
    """Each mistake on every rank at once (or on one rank only): the error each rank got."""
    def q_k_v(tokens: int = 4, heads: int = HEADS, k_tokens: int | None = None):
        q = torch.randn(1, heads, tokens, HEAD_DIM)
        return q, torch.randn(1, heads, k_tokens or tokens, HEAD_DIM), q.clone()

    cases = {
        "zigzag odd tokens": lambda: cp.ring_attention(*q_k_v(3), layout="zigzag"),
        "heads": lambda: cp.ulysses_attention(*q_k_v(heads=3)),
        "shapes across ranks": lambda: cp.ring_attention(*q_k_v(4 + rank)),
        "ulysses shapes across ranks": lambda: cp.ulysses_attention(*q_k_v(4 + 2 * rank)),
        "q k v differ": lambda: cp.ring_attention(*q_k_v(k_tokens=2)),
        "layout on one rank": lambda: cp.ring_attention(
            *q_k_v(), layout="zigzag" if rank == 0 else "stripes"),
        "positions": lambda: cp.ring_attention(*q_k_v(), layout=torch.arange(4)),
    }
    errors = {}
    for name, call in cases.items():
        try:
            call()
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    return errors


def _every_case(rank: int, world_size: int) -> dict:
    results = {}
    for method, layout, causal in CASES:
        ref = _reference(causal)
        mine = {name: cp.split_sequence(ref[name], world_size, layout=layout)[rank]
                for name in ref}
        q, k, v = (mine[name].clone().requires_grad_() for name in "qkv")
        with counting.count_traffic() as log, timeline.collect() as events:
            out = METHODS[method](q, k, v, causal=causal, layout=layout)
            out.backward(mine["grad"])
        errors = {"out": (out - mine["out"]).abs().max().item()}
        for name, tensor in zip("qkv", (q, k, v), strict=True):
            errors["d" + name] = (tensor.grad - mine["d" + name]).abs().max().item()
        transfers = [e for e in events if e.kind == "transfer"]
        blocks = [e for e in events if e.kind == "attention" and e.name == "forward"]
        forward_transfers = [e for e in transfers if e.name.startswith("forward")]
        results[method, layout, causal] = {
            "errors": errors,
            "bytes": log.bytes_sent, "bytes_to": log.bytes_to(),
            "calls": {op: log.calls(op) for op in ("shift", "all_to_all", "all_gather")},
            "work": sum(e.detail for e in blocks),
            "overlapped": [any(t.start <= b.start and b.end <= t.end for b in blocks)
                           for t in forward_transfers],
        }
    for method, fn in METHODS.items():
        saved = {}
        for seq in (SEQ, 2 * SEQ):
            q, k, v = (torch.randn(BATCH, HEADS, seq // world_size, HEAD_DIM, requires_grad=True)
                       for _ in range(3))
            saved[seq] = sum(t.nbytes for t in saved_activations(
                lambda a, b, c, fn=fn: fn(a, b, c, causal=True), q, k, v))
        results["saved", method] = saved
    for method, fn in METHODS.items():
        for causal in (True, False):
            ref = _reference(causal, dtype=torch.float64)
            mine = {name: cp.split_sequence(ref[name], world_size)[rank] for name in ref}
            q, k, v = (mine[name].clone().requires_grad_() for name in "qkv")
            out = fn(q, k, v, causal=causal)
            out.backward(mine["grad"])
            results["fp64", method, causal] = {
                "dtypes": {str(t.dtype) for t in (out, q.grad, k.grad, v.grad)},
                "error": max((got - mine[name]).abs().max().item() for name, got in
                             (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)))}
    results["bad"] = _bad_inputs(rank, world_size)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def per_rank(request) -> tuple[int, list[dict]]:
    return request.param, run(_every_case, request.param, timeout=300)


def test_equal_to_one_process_attention_outputs_and_gradients(per_rank):
    world, results = per_rank
    for rank, result in enumerate(results):
        for case in CASES:
            for name, error in result[case]["errors"].items():
                assert error <= TOLERANCE, (
                    f"cp={world}, rank {rank}, {case}: {name} off by {error:.1e} from "
                    f"F.scaled_dot_product_attention on the whole sequence")


def test_fp64_inputs_are_computed_in_fp64(per_rank):
    """Nothing below the input's precision: fp64 in, fp64 out, equal to one process's fp64
    attention to rounding (an fp32 accumulation would leave errors near 1e-6)."""
    world, results = per_rank
    for rank, result in enumerate(results):
        for method in METHODS:
            for causal in (True, False):
                found = result["fp64", method, causal]
                assert found["dtypes"] == {"torch.float64"}, (
                    f"cp={world}, rank {rank}, {method}, causal={causal}: outputs and "
                    f"gradients should stay fp64, got {found['dtypes']}")
                assert found["error"] <= 1e-12, (
                    f"cp={world}, rank {rank}, {method}, causal={causal}: off by "
                    f"{found['error']:.1e} from one process's fp64 attention")


def test_bytes_per_rank_equal_the_formulas(per_rank):
    world, results = per_rank
    formulas = {"ring": traffic.ring_attention_traffic, "ulysses": traffic.ulysses_traffic}
    for rank, result in enumerate(results):
        for method, layout, causal in CASES:
            got = result[method, layout, causal]
            expected = formulas[method](SEQ, BATCH, HEADS * HEAD_DIM, world, 4)
            assert got["bytes"] == expected.bytes_sent, (
                f"cp={world}, rank {rank}, {method}: sent {got['bytes']} B, formula "
                f"{expected.bytes_sent:.0f}")
            if method == "ring":  # every byte to the right neighbour, in 3cp - 2 messages
                assert list(got["bytes_to"]) == [(rank + 1) % world]
                assert got["calls"]["shift"] == 3 * world - 2
            else:  # an equal share to every other rank, by 8 all-to-alls
                assert sorted(got["bytes_to"]) == sorted(set(range(world)) - {rank})
                assert len(set(got["bytes_to"].values())) == 1
                assert got["calls"]["all_to_all"] == 8


def test_zigzag_balances_causal_work_and_the_plain_split_does_not(per_rank):
    world, results = per_rank
    work = {layout: [r["ring", layout, True]["work"] for r in results] for layout in cp.LAYOUTS}
    zigzag, plain = work["zigzag"], work["contiguous"]
    assert max(zigzag) <= 1.1 * min(zigzag), f"cp={world}: zigzag work per rank {zigzag}"
    # contiguous: rank r scores r full blocks and one half (the diagonal)
    n = SEQ // world
    per_block = BATCH * HEADS * n * n
    assert plain == [r * per_block + BATCH * HEADS * n * (n + 1) // 2 for r in range(world)]
    assert max(plain) / min(plain) > 2 * world - 2, f"cp={world}: plain split's work {plain}"
    assert sum(zigzag) == sum(plain), "both layouts score the same pairs in all"


def test_each_forward_transfer_overlaps_a_block_of_compute(per_rank):
    world, results = per_rank
    for rank, result in enumerate(results):
        for layout in cp.LAYOUTS:
            overlapped = result["ring", layout, False]["overlapped"]
            assert overlapped == [True] * (world - 1), (
                f"cp={world}, rank {rank}: which of the {world - 1} key/value transfers had a "
                f"block of attention computed while in flight: {overlapped}")


def test_saved_activations_grow_with_s_over_cp(per_rank):
    world, results = per_rank
    for method in METHODS:
        saved = results[0]["saved", method]
        # q, k, v, output (b·h·(s/cp)·d each) and the log-sum-exp (b·h·s/cp), fp32
        expected = {s: BATCH * HEADS * (s // world) * (4 * HEAD_DIM + 1) * 4 for s in saved}
        assert saved == expected, f"cp={world}, {method}: saved {saved}, expected {expected}"


def test_bad_input_is_a_value_error_on_every_rank_naming_the_fix(per_rank):
    world, results = per_rank
    expected = {
        "zigzag odd tokens": ["2·cp", "multiple of"],
        "heads": ["heads=3", f"cp={world}"],
        "shapes across ranks": ["rank 1", "rank 0"],
        "ulysses shapes across ranks": ["rank 1", "rank 0"],
        "q k v differ": ["one shape", "k (1, 4, 2, 5)"],
        "layout on one rank": ["layout"],
        "positions": [f"0..{4 * world - 1}"],
    }
    for rank, result in enumerate(results):
        for case, words in expected.items():
            message = result["bad"][case]
            assert all(word in message for word in words), (
                f"rank {rank}, {case}: expected a ValueError naming {words}, got {message!r}")
    with pytest.raises(ValueError, match="not divisible by 2·cp = 8"):
        cp.split_sequence(torch.zeros(1, 1, 12, 1), 4, layout="zigzag")
    with pytest.raises(ValueError, match="not divisible by cp = 4"):
        cp.split_sequence(torch.zeros(1, 1, 10, 1), 4)


# --- One process, no process group ---------------------------------------------------------------


def test_split_and_gather_are_inverses_and_zigzag_pairs_chunks():
    x = torch.arange(16).view(1, 1, 16, 1)
    parts = cp.split_sequence(x, 4, layout="zigzag")
    assert parts[0].flatten().tolist() == [0, 1, 14, 15]
    assert parts[3].flatten().tolist() == [6, 7, 8, 9]
    assert torch.equal(cp.gather_sequence(parts, layout="zigzag"), x)
    for rank in range(4):
        assert torch.equal(cp.positions(16, rank, 4, layout="zigzag"), parts[rank].flatten())
    assert cp.chunks_of(1, 4, layout="zigzag") == (1, 6)


def test_alone_it_is_plain_attention_and_the_merge_is_exact():
    for causal in (True, False):
        ref = _reference(causal)
        q, k, v = (ref[n].clone().requires_grad_() for n in "qkv")
        out = cp.ring_attention(q, k, v, causal=causal)
        out.backward(ref["grad"])
        assert (out - ref["out"]).abs().max() <= TOLERANCE
        assert (q.grad - ref["dq"]).abs().max() <= TOLERANCE
    ref = _reference(False)
    halves = [cp.block_attention(ref["q"], ref[n][:, :, part], ref["v"][:, :, part])
              for n, part in (("k", slice(0, 10)), ("k", slice(10, None)))]
    merged, _ = cp.merge_partials(*halves[0], *halves[1])
    assert (merged - ref["out"]).abs().max() <= TOLERANCE


def test_traffic_formulas():
    ring = traffic.ring_attention_traffic(seq_len=1024, micro_batch=1, hidden=64, cp=4,
                                          bytes_per_element=2)
    pair = 2 * 1 * 256 * 64 * 2
    assert ring.bytes_sent == pair * (3 + 3 + 4)
    ulysses = traffic.ulysses_traffic(seq_len=1024, micro_batch=1, hidden=64, cp=4,
                                      bytes_per_element=2)
    assert ulysses.bytes_sent == 8 * (256 * 64 * 2) * 3 / 4
    assert traffic.ring_attention_traffic(8, 1, 4, 1).bytes_sent == 0
    with pytest.raises(ValueError, match="hidden=6 is not divisible by cp=4"):
        traffic.ulysses_traffic(8, 1, 6, 4)


# --- The fourth dimension: dp2·cp2·tp2 TinyGPT on 8 ranks -----------------------------------------

VOCAB, HIDDEN, GPT_HEADS, LAYERS, GPT_SEQ, GPT_BATCH, STEPS = 32, 16, 4, 2, 8, 4, 3
DIMS = ("dp", "cp", "tp")


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=VOCAB, hidden=HIDDEN, heads=GPT_HEADS, layers=LAYERS, max_seq=GPT_SEQ)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(VOCAB, (GPT_BATCH, GPT_SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _adamw(params):
    # eps=1e-5, as test_parallel3d: k_proj's bias has a zero true gradient, float noise.
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def _train_4d(rank: int, world_size: int) -> dict:
    mesh = Mesh(pp=1, dp=2, cp=2, tp=2)
    theirs = init_device_mesh("cpu", (1, 2, 2, 2), mesh_dim_names=("pp", *DIMS))
    groups = {"ours": {d: mesh.ranks(d) for d in DIMS},
              "torch": {d: dist.get_process_group_ranks(theirs.get_group(d)) for d in DIMS}}
    parallel = parallelize(_model(), mesh, _adamw, microbatches=1)
    ids, targets = _batch()
    losses = [parallel.step(ids, targets) for _ in range(STEPS)]
    expected = parallel.expected_traffic()
    sent = {d: (parallel.traffic[d].bytes_sent, expected[d].bytes_sent) for d in expected}
    return {"losses": losses, "state": parallel.full_state_dict(), "groups": groups,
            "traffic": sent}


def test_dp2_cp2_tp2_tinygpt_trains_like_one_process():
    model, (ids, targets) = _model(), _batch()
    optimizer = _adamw(model.parameters())
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model.loss(ids, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    results = run(_train_4d, 8, timeout=300)
    for rank, result in enumerate(results):
        assert result["groups"]["ours"] == result["groups"]["torch"], (
            f"rank {rank}: Mesh(pp=1, dp=2, cp=2, tp=2) groups {result['groups']['ours']}, "
            f"init_device_mesh's {result['groups']['torch']}")
        for step, (got, want) in enumerate(zip(result["losses"], losses, strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), (
                f"rank {rank}, step {step}: loss {got}, one process {want}")
        for name, value in model.state_dict().items():
            error = (result["state"][name] - value).abs().max().item()
            assert error <= 1e-5, f"rank {rank}: {name} off by {error:.1e} after {STEPS} steps"
        for dim, (counted, formula) in result["traffic"].items():
            assert counted == formula, (
                f"rank {rank}: {dim} sent {counted} B, "
                f"minidist.costs.traffic.mesh_traffic {formula}")
        assert result["traffic"]["cp"][0] > 0 and result["traffic"]["pp"][0] == 0


# --- The planner and Lab 02's calculator know cp -------------------------------------------------


def test_planner_cp_divides_activations_and_sends_the_ring():
    from dataclasses import replace

    from minidist.costs import planner

    model = replace(planner.MODELS["7B"], seq_len=131072)
    cluster = planner.Cluster.dgx_h100(64)
    one = planner.Layout(tp=8, pp=1, dp=8, zero_stage=1, micro_batch=1, microbatches=8,
                         recompute="selective")
    four = replace(one, dp=2, cp=4)
    memory = {lay.cp: planner.estimate_memory(lay, model) for lay in (one, four)}
    assert memory[4].activations == pytest.approx(memory[1].activations / 4)
    assert "CP4" in str(four)
    # at 131k tokens each ring step's attention hides its transfer; at 1k it cannot
    assert planner.estimate_time(four, model, cluster, 16).cp_comm == 0
    short = planner.estimate_time(replace(four, micro_batch=1), replace(model, seq_len=1024),
                                  cluster, 16)
    assert short.cp_comm > 0
    rules = planner.check_rules(replace(four, cp=3), replace(model, seq_len=1000), cluster, 16)
    assert "cp-seq" in {reason.rule for reason in rules}
    without = planner.plan(model, cluster, global_batch=64)
    assert not without.feasible, "131k tokens of a 7B model need context parallelism here"
    with_cp = planner.plan(model, cluster, global_batch=64, context_parallel=(1, 2, 4, 8))
    assert with_cp.best.layout.cp > 1 and "CP com" in with_cp.table(3)


def test_memory_calculator_has_a_cp_control():
    from minidist.pictures.widgets import MemoryCalculator

    calculator = MemoryCalculator(seq_len=131072, tp=8, recompute="selective")
    before = calculator.data[1].activations
    calculator.controls["cp"].value = 8
    assert calculator.data[1].activations == pytest.approx(before / 8)
    assert "CP=8" in calculator.message
