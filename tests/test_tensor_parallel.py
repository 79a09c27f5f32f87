"""minidist.parallel.tensor_parallel against the unsharded modules, PyTorch's DTensor tensor
parallel, and the communication and memory the Megatron papers state
(REFERENCES.md#tensor-and-sequence-parallel)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minidist.communication.counting import count_traffic
from minidist.core.launch import run
from minidist.costs.footprint import saved_activations
from minidist.parallel import tensor_parallel as tp
from minidist.parallel.models import TransformerBlock

B, S, H, HEADS, FFN, VOCAB = 2, 8, 16, 4, 32, 12
TOL = 1e-5


def _shard_of(full: torch.Tensor, local: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    """This rank's piece of `full`, along the dim where the shapes differ."""
    for dim, (a, b) in enumerate(zip(full.shape, local.shape, strict=True)):
        if a != b:
            return full.chunk(t, dim=dim)[rank]
    return full


def _max_grad_error(sharded: nn.Module, unsharded: nn.Module, rank: int, t: int) -> float:
    reference = dict(unsharded.named_parameters())
    return max(
        (p.grad - _shard_of(reference[name].grad, p.grad, rank, t)).abs().max().item()
        for name, p in sharded.named_parameters()
    )


def _linear_errors(rank: int, t: int) -> dict[str, float]:
    torch.manual_seed(0)
    linear = nn.Linear(H, FFN)
    x = torch.randn(B, S, H, requires_grad=True)
    linear(x).square().sum().backward()
    errors = {}
    for gather in (False, True):
        column = tp.ColumnParallelLinear(H, FFN, gather_output=gather).load_from(linear)
        xc = x.detach().clone().requires_grad_()
        y = column(xc)
        expected = linear(x) if gather else _shard_of(linear(x), y, rank, t)
        y.square().sum().backward()  # a shard's loss terms are the full loss's, restricted
        errors[f"column gather={gather} out"] = (y - expected).abs().max().item()
        errors[f"column gather={gather} grads"] = _max_grad_error(column, linear, rank, t)
        if gather:  # with the full output on every rank, the input gradient is complete
            errors["column input grad"] = (xc.grad - x.grad).abs().max().item()
    row_linear = nn.Linear(FFN, H)
    z = torch.randn(B, S, FFN, requires_grad=True)
    row_linear(z).square().sum().backward()
    for parallel_input in (True, False):
        row = tp.RowParallelLinear(FFN, H, input_is_parallel=parallel_input).load_from(row_linear)
        zr = z.detach().clone()
        zr = (zr.chunk(t, dim=-1)[rank] if parallel_input else zr).requires_grad_()
        y = row(zr)
        y.square().sum().backward()
        errors[f"row parallel_input={parallel_input} out"] = (y - row_linear(z)).abs().max().item()
        errors[f"row parallel_input={parallel_input} grads"] = _max_grad_error(
            row, row_linear, rank, t)
        expected_input_grad = _shard_of(z.grad, zr.grad, rank, t)
        errors[f"row parallel_input={parallel_input} input grad"] = (
            (zr.grad - expected_input_grad).abs().max().item())
    return errors


def _block_check(rank: int, t: int, sequence_parallel: bool) -> dict:
    torch.manual_seed(0)
    block = TransformerBlock(H, HEADS, FFN)
    x = torch.randn(B, S, H, requires_grad=True)
    reference = block(x)
    reference.square().sum().backward()
    sharded = tp.ParallelTransformerBlock(H, HEADS, FFN, sequence_parallel=sequence_parallel)
    sharded.load_from(block)
    mine = x.detach().chunk(t, dim=1)[rank] if sequence_parallel else x.detach()
    mine = mine.clone().requires_grad_()
    with count_traffic() as log:
        out = sharded(mine)
        out.square().sum().backward()
    expected_out = reference.chunk(t, dim=1)[rank] if sequence_parallel else reference
    expected_grad = x.grad.chunk(t, dim=1)[rank] if sequence_parallel else x.grad
    state = sharded.full_state_dict()
    return {
        "out": (out - expected_out).abs().max().item(),
        "input grad": (mine.grad - expected_grad).abs().max().item(),
        "param grads": _max_grad_error(sharded, block, rank, t),
        "gathered state": max((state[k] - v).abs().max().item()
                              for k, v in block.state_dict().items()),
        "same keys": sorted(state) == sorted(block.state_dict()),
        # (op, phase, elements of the full fp32 tensor), from minidist's one traffic counter
        "calls": [(c.op, c.when, c.nbytes // 4) for c in log.collectives],
        "groups": {c.group for c in log.collectives},
    }


def _vocab_check(rank: int, t: int) -> dict[str, float]:
    torch.manual_seed(0)
    embedding, head = nn.Embedding(VOCAB, H), nn.Linear(H, VOCAB, bias=False)
    ids = torch.randint(0, VOCAB, (B, S))
    targets = torch.randint(0, VOCAB, (B, S))
    logits = head(embedding(ids))
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    sharded_embedding = tp.VocabParallelEmbedding(VOCAB, H).load_from(embedding)
    sharded_head = tp.ColumnParallelLinear(H, VOCAB, bias=False).load_from(head)
    local_logits = sharded_head(sharded_embedding(ids))
    losses = tp.vocab_parallel_cross_entropy(local_logits, targets)
    losses.sum().backward()
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return {
        "loss": (losses.flatten() - expected).abs().max().item(),
        "embedding grad": (sharded_embedding.weight.grad
                           - embedding.weight.grad.chunk(t)[rank]).abs().max().item(),
        "head grad": _max_grad_error(sharded_head, head, rank, t),
    }


def _saved_bytes(rank: int, t: int) -> dict[bool, int]:
    torch.manual_seed(0)
    saved = {}
    for sequence_parallel in (False, True):
        block = tp.ParallelTransformerBlock(64, 8, 256, sequence_parallel=sequence_parallel)
        seq = 64 // t if sequence_parallel else 64
        x = torch.randn(2, seq, 64, requires_grad=True)
        saved[sequence_parallel] = sum(s.nbytes for s in saved_activations(block, x, exclude=[x]))
    return saved


def _async_column_check(rank: int, t: int) -> dict[str, object]:
    """AsyncColumnParallelLinear against ColumnParallelLinear(sequence_parallel=True): outputs,
    gradients (in float64, so that only the decomposition shows, not the order of fp32
    additions) and recorded collectives; with t > 1, how much matmul time ran while a gloo send
    or receive was in flight, in a torch.profiler trace of forward and backward."""
    torch.manual_seed(0)
    linear = nn.Linear(H, FFN).double()
    mine = torch.randn(B, S, H, dtype=torch.float64).chunk(t, dim=1)[rank]
    found: dict[str, object] = {}
    for cls in (tp.ColumnParallelLinear, tp.AsyncColumnParallelLinear):
        layer = cls(H, FFN, sequence_parallel=True).double().load_from(linear)
        x = mine.clone().requires_grad_()
        with count_traffic() as log:
            y = layer(x)
            (y * y.detach().sin()).sum().backward()
        found[cls.__name__] = [y, x.grad, layer.weight.grad, layer.bias.grad]
        found[f"{cls.__name__} calls"] = [(c.op, c.when, c.nbytes) for c in log.collectives]
    found["error"] = max((a - b).abs().max().item() for a, b in zip(
        found.pop("ColumnParallelLinear"), found.pop("AsyncColumnParallelLinear"), strict=True))
    if t > 1:
        for cls in (tp.ColumnParallelLinear, tp.AsyncColumnParallelLinear):
            found[f"{cls.__name__} overlap"] = _matmuls_in_flight(cls, t)
    return found


def _matmuls_in_flight(cls, t: int) -> tuple[int, int]:
    """(how many matmuls (aten::mm, addmm) ran while a gloo transfer was in flight, how many
    ran) in a profiler trace of forward and backward: the mechanism of the overlap, not its
    share of wall-clock time (bench/overlap_and_bubbles.py prints that)."""
    from torch.profiler import ProfilerActivity, profile

    layer = cls(256, 1024, sequence_parallel=True)
    x = torch.randn(4, 64, 256, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        layer(x).sum().backward()
    events = [(e.name, e.time_range.start, e.time_range.end) for e in trace.events()]
    transfers = [(start, end) for name, start, end in events if name.startswith("gloo:")]
    matmuls = [(start, end) for name, start, end in events if name in ("aten::mm", "aten::addmm")]
    inside = sum(any(t_start < end and start < t_end for t_start, t_end in transfers)
                 for start, end in matmuls)
    return inside, len(matmuls)


def _everything(rank: int, t: int) -> dict:
    return {
        "async column": _async_column_check(rank, t),
        "linear": _linear_errors(rank, t),
        "block": _block_check(rank, t, sequence_parallel=False),
        "block sp": _block_check(rank, t, sequence_parallel=True),
        "vocab": _vocab_check(rank, t),
        "saved": _saved_bytes(rank, t),
    }


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    return {t: run(_everything, t) for t in (1, 2, 4)}


@pytest.mark.parametrize("t", [1, 2, 4])
def test_layers_equal_the_unsharded_modules(results, t):
    for rank_result in results[t]:
        errors = {**rank_result["linear"], **rank_result["vocab"]}
        for name in ("block", "block sp"):
            errors |= {f"{name} {k}": v for k, v in rank_result[name].items()
                       if isinstance(v, float)}
        assert max(errors.values()) <= TOL, errors
        assert rank_result["block"]["same keys"]


@pytest.mark.parametrize("t", [1, 2, 4])
def test_a_block_sends_two_all_reduces_each_way(results, t):
    """Megatron §3: 2 all-reduces forward + 2 backward per block, b·s·h elements each."""
    calls = results[t][0]["block"]["calls"]
    assert calls == [("all_reduce", "forward", B * S * H)] * 2 + [
        ("all_reduce", "backward", B * S * H)] * 2
    assert results[t][0]["block"]["groups"] == {t}


@pytest.mark.parametrize("t", [1, 2, 4])
def test_sequence_parallel_trades_each_all_reduce_for_gather_and_scatter(results, t):
    """Korthikanti §4.2.2: each all-reduce becomes reduce-scatter + all-gather, same volume.
    Backward gathers the attention and MLP inputs once more instead of storing them, and
    sums the partial gradients of the parameters that see only a slice of the sequence."""
    calls = results[t][0]["block sp"]["calls"]
    full = B * S * H
    forward = [c for c in calls if c[1] == "forward"]
    assert forward == [("all_gather", "forward", full), ("reduce_scatter", "forward", full)] * 2
    backward = [c for c in calls if c[1] == "backward"]
    big = [c[0] for c in backward if c[2] == full]
    assert sorted(big) == sorted(["all_gather"] * 4 + ["reduce_scatter"] * 2)
    small = [c for c in backward if c[2] != full]
    # LayerNorm weight and bias (2 norms) and the 2 row-parallel biases: h elements each.
    assert small == [("all_reduce", "backward", H)] * 6


@pytest.mark.parametrize("t", [1, 2, 4])
def test_async_column_parallel_equals_column_parallel_with_sequence_parallel(results, t):
    for rank, found in enumerate(results[t]):
        checks = found["async column"]
        assert checks["error"] <= 1e-6, (f"t={t}, rank {rank}: expected outputs and gradients "
                                         f"within 1e-6 of ColumnParallelLinear, got "
                                         f"{checks['error']:.2e}")
        expected = checks["ColumnParallelLinear calls"]
        got = checks["AsyncColumnParallelLinear calls"]
        assert got == expected, f"t={t}, rank {rank}: expected collectives {expected}, got {got}"


@pytest.mark.parametrize("t", [2, 4])
def test_async_column_parallel_overlaps_transfers_with_matmuls(results, t):
    """In the profiler trace, the async layer's matmuls run while gloo sends and receives are
    in flight; the plain layer's all-gather ends before its matmul starts."""
    for rank, found in enumerate(results[t]):
        checks = found["async column"]
        overlapped, total = checks["AsyncColumnParallelLinear overlap"]
        plain, plain_total = checks["ColumnParallelLinear overlap"]
        assert overlapped >= 1, (f"t={t}, rank {rank}: expected some of the async layer's "
                                 f"{total} matmuls to run while a transfer was in flight, got none")
        assert plain == 0, (f"t={t}, rank {rank}: expected none of the plain layer's "
                            f"{plain_total} matmuls to run during a transfer, got {plain}")


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_saves_one_t_th_of_the_activations(results, t):
    """With sequence parallel every saved activation is split t ways: exactly 1/t of the
    unsharded block's, where tensor parallel alone keeps the LayerNorm regions whole."""
    unsharded = results[1][0]["saved"][False]
    for rank_result in results[t]:
        with_sp, without = rank_result["saved"][True], rank_result["saved"][False]
        assert with_sp == pytest.approx(unsharded / t, rel=0.01)
        assert without > 1.2 * with_sp


def _against_dtensor(rank: int, t: int, sequence_parallel: bool) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    block = TransformerBlock(H, HEADS, FFN)
    ours = tp.ParallelTransformerBlock(H, HEADS, FFN, sequence_parallel=sequence_parallel)
    ours.load_from(block)
    plan = {f"attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")}
    plan["mlp.fc1"] = ColwiseParallel()
    if sequence_parallel:
        to_replicated = PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),))
        plan |= {"norm1": SequenceParallel(), "norm2": SequenceParallel(),
                 "attn": to_replicated, "mlp": to_replicated,
                 "attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
                 "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan |= {"attn.out_proj": RowwiseParallel(), "mlp.fc2": RowwiseParallel()}
    parallelize_module(block, init_device_mesh("cpu", (t,)), plan)
    block.attn.heads = HEADS // t  # DTensor hands q, k, v over as local shards of heads/t heads
    x = torch.randn(B, S, H)
    if sequence_parallel:
        x = x.chunk(t, dim=1)[rank]
    errors = []
    outputs = []
    for module in (ours, block):
        y = module(x.clone().requires_grad_())
        y.square().sum().backward()
        outputs.append(y)
    errors.append((outputs[0] - outputs[1]).abs().max().item())
    theirs = dict(block.named_parameters())
    for name, param in ours.named_parameters():
        grad = theirs[name].grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        errors.append((param.grad - _shard_of(grad, param.grad, rank, t)).abs().max().item())
    return max(errors)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_equals_pytorch_dtensor_tensor_parallel(sequence_parallel):
    assert max(run(_against_dtensor, 2, sequence_parallel)) <= TOL


def _bad_inputs(rank: int, world_size: int) -> list[str]:
    messages = []
    attempts = [
        lambda: tp.ColumnParallelLinear(16, 6),
        lambda: tp.RowParallelLinear(6, 16),
        lambda: tp.ParallelAttention(16, 6),
        lambda: tp.VocabParallelEmbedding(10, 4),
        lambda: tp.RowParallelLinear(16, 8)(torch.randn(2, 16)),
        lambda: tp.ColumnParallelLinear(16, 8).load_from(nn.Linear(8, 16)),
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_sizes_are_explained():
    messages = run(_bad_inputs, 4)[0]
    assert "out_features=6 is not divisible by t=4" in messages[0]
    assert "in_features=6 is not divisible by t=4" in messages[1]
    assert "heads=6 must divide hidden=16" in messages[2]
    assert "vocab=10 is not divisible by t=4" in messages[3]
    assert "expects this rank's 4 of 16 input features, got 16" in messages[4]
    assert "cannot load an nn.Linear of weight shape (16, 8)" in messages[5]


def test_without_a_process_group_the_error_says_what_to_do():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="no process group"):
        tp.ColumnParallelLinear(4, 4)
