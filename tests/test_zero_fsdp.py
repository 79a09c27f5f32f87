"""ZeRO-1/2 and FSDP: the numbers (single-process training, PyTorch's FSDP2) and the mechanism
(what each rank stores, how many units are gathered at once, bytes sent per step), on TinyGPT
and on a GPT-2-style model with tied, root-level and frozen parameters and a buffer."""

from collections.abc import Callable

import pytest
import torch
from torch import nn

from minidist.communication.counting import count_traffic
from minidist.core.launch import run
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.models import TinyGPT, TransformerBlock, lm_loss
from minidist.parallel.zero import ZeroOptimizer

STEPS, LR = 3, 0.1


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab=32, hidden=16, heads=2, layers=2, max_seq=8)


def _data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (2 * world_size, 8), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _reference(world_size: int, build: Callable[[], nn.Module] = _model
               ) -> dict[str, torch.Tensor]:
    """Single-process training on the whole batch."""
    model, (ids, targets) = build(), _data(world_size)
    optimizer = _sgd(model.parameters())
    for _ in range(STEPS):
        optimizer.zero_grad()
        model.loss(ids, targets).backward()
        optimizer.step()
    return model.state_dict()


def _train(rank: int, world_size: int, kind: str, build: Callable[[], nn.Module] = _model
           ) -> dict:
    model, (ids, targets) = build(), _data(world_size)
    ids, targets = ids.chunk(world_size)[rank], targets.chunk(world_size)[rank]
    psi = sum(p.numel() for p in model.parameters())  # a tied parameter counts once
    ring = kind.endswith("ring")
    if kind.startswith("fsdp"):
        wrapped = FullyShardedDataParallel(model, impl="ring" if ring else "torch")
        optimizer = _sgd(wrapped.parameters())
    else:
        wrapped = model
        optimizer = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=int(kind[4]),
                                  impl="ring" if ring else "torch", lr=LR, momentum=0.9)
    result = {"psi": psi}
    for _ in range(STEPS):
        optimizer.zero_grad()
        with count_traffic() as counter:
            wrapped.loss(ids, targets).backward()
            if kind.startswith("zero2"):
                result["grad elements kept"] = sum(
                    0 if p.grad is None else p.grad.numel() for p in model.parameters()
                ) + sum(s.grad.numel() for s in optimizer.shards)
            if kind.startswith("fsdp"):
                wrapped.reshard()
            optimizer.step()
        result["bytes sent"] = counter.bytes_sent
    if kind.startswith("fsdp"):
        result["state"] = wrapped.full_state_dict()
        result["stored bytes"] = wrapped.sharded_bytes()
        result["peak units gathered"] = wrapped.peak_gathered
    else:
        result["state"] = model.state_dict()
        result["momentum elements"] = sum(
            s["momentum_buffer"].numel() for s in optimizer.state.values())
        result["params"] = len(optimizer.shards)
    return result


def _fsdp2(rank: int, world_size: int, build: Callable[[], nn.Module] = _model
           ) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    model, (ids, targets) = build(), _data(world_size)
    ids, targets = ids.chunk(world_size)[rank], targets.chunk(world_size)[rank]
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = _sgd(model.parameters())
    for _ in range(STEPS):
        optimizer.zero_grad()
        model.loss(ids, targets).backward()
        optimizer.step()
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in model.state_dict().items()}


def _max_error(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


KINDS = ["zero1", "zero2", "fsdp", "zero1 ring", "zero2 ring", "fsdp ring"]


def _one_worker_each(name: str, world_sizes: list[int]) -> list:
    """Fixture params that keep each world size's tests on one xdist worker, so that its
    ranks start and train once."""
    return [pytest.param(n, marks=pytest.mark.xdist_group(f"{name}-{n}")) for n in world_sizes]


@pytest.fixture(scope="module", params=_one_worker_each("tinygpt", [2, 4]))
def trained(request) -> tuple[int, dict]:
    world_size = request.param

    def everything(rank, world_size):
        results = {kind: _train(rank, world_size, kind) for kind in KINDS}
        if world_size == 2:  # the same ranks, to save starting them again
            results["fully_shard"] = {"state": _fsdp2(rank, world_size)}
        return results

    return world_size, run(everything, world_size)


def test_parameters_equal_single_process_training(trained):
    world_size, results = trained
    reference = _reference(world_size)
    for rank_results in results:
        for kind in KINDS:
            assert _max_error(rank_results[kind]["state"], reference) <= 1e-6, kind


def test_zero1_keeps_one_nth_of_the_optimizer_state(trained):
    world_size, results = trained
    for rank_results in results:
        result = rank_results["zero1"]
        # element-level shards: 1/N of every parameter, up to one element each
        assert abs(result["momentum elements"] - result["psi"] / world_size) <= result["params"]


def test_zero2_keeps_only_its_gradient_shard(trained):
    world_size, results = trained
    for rank_results in results:
        result = rank_results["zero2"]
        assert abs(result["grad elements kept"] - result["psi"] / world_size) <= result["params"]


def test_fsdp_stores_one_nth_and_gathers_at_most_two_units(trained):
    world_size, results = trained
    for rank_results in results:
        result = rank_results["fsdp"]
        units = 2 + 2 + 2  # tok_emb, pos_emb, 2 blocks, norm, head
        assert abs(result["stored bytes"] / 4 - result["psi"] / world_size) <= units
        # the running unit and the prefetched one, with the backend's gathers or the ring's
        # (run on minidist's communication thread, so they prefetch too)
        assert result["peak units gathered"] == 2
        assert rank_results["fsdp ring"]["peak units gathered"] == 2


@pytest.mark.parametrize("kind, passes", [("zero1 ring", 2), ("zero2 ring", 2), ("fsdp ring", 3)])
def test_bytes_sent_per_step_are_2_or_3_psi(trained, kind, passes):
    """ZeRO §7: 2Ψ for ZeRO-1/2, 3Ψ for ZeRO-3; a ring sends (N-1)/N of each pass per rank."""
    world_size, results = trained
    for rank_results in results:
        result = rank_results[kind]
        expected = passes * result["psi"] * 4 * (world_size - 1) / world_size
        assert result["bytes sent"] == pytest.approx(expected, rel=0.01)


def test_fsdp_equals_pytorch_fsdp2(trained):
    world_size, results = trained
    if world_size != 2:
        pytest.skip("compared at N = 2")
    for rank_results in results:
        error = _max_error(rank_results["fsdp"]["state"], rank_results["fully_shard"]["state"])
        assert error <= 1e-6, f"differs from fully_shard by {error:.2e}"


def _mixed_precision(rank: int, world_size: int) -> float:
    model, (ids, targets) = _model(), _data(world_size)
    wrapped = FullyShardedDataParallel(model, compute_dtype=torch.bfloat16)
    loss = wrapped.loss(ids, targets)
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in wrapped.parameters())
    return loss.item()


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_shards():
    full_precision = _model().loss(*_data(2)).item()
    for loss in run(_mixed_precision, 2):
        assert loss == pytest.approx(full_precision, rel=0.02)


# --- GPT-2's layout: tied embedding and head, parameters of the model itself, frozen ones ---


class _GPT2Style(nn.Module):
    """The token embedding doubles as the output head (tied), the model itself owns a position
    embedding and a final scale (in no unit), and a buffer scales the input. `frozen` freezes
    a layer norm inside a block, the whole final norm (a unit) and the final scale (root)."""

    def __init__(self, frozen: bool):
        super().__init__()
        self.tok_emb = nn.Embedding(32, 16)
        self.pos_emb = nn.Parameter(torch.randn(8, 16) * 0.1)
        self.blocks = nn.ModuleList(TransformerBlock(16, 2, 64) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.final_scale = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.tok_emb.weight
        self.register_buffer("input_scale", torch.full((16,), 0.5))
        if frozen:
            for module in (self.blocks[0].norm1, self.norm):
                module.requires_grad_(False)
            self.final_scale.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids) * self.input_scale + self.pos_emb[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x) * self.final_scale)

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self(ids), targets)


def _gpt2_style(frozen: bool = False) -> _GPT2Style:
    torch.manual_seed(0)
    return _GPT2Style(frozen)


def _gpt2_frozen() -> _GPT2Style:
    return _gpt2_style(frozen=True)


GPT2_BUILDS = {"tied": _gpt2_style, "tied+frozen": _gpt2_frozen}
GPT2_KINDS = ["fsdp", "fsdp ring", "zero1", "zero2"]


def _gathered_in_first_blocks_backward(rank: int, world_size: int) -> list[str]:
    """The units in memory when the first block's backward starts, in the frozen model."""
    model, (ids, targets) = _gpt2_frozen(), _data(world_size)
    wrapped = FullyShardedDataParallel(model)
    seen = []

    def snapshot(module, args, output):  # its gradient hook runs after FSDP's, which gathers
        output.register_hook(lambda grad: seen.append(sorted(wrapped.gathered)))

    model.blocks[0].register_forward_hook(snapshot)
    wrapped.loss(ids, targets).backward()
    return seen[0]


@pytest.fixture(scope="module", params=_one_worker_each("gpt2-style", [1, 2, 4]))
def gpt2_trained(request) -> tuple[int, list[dict]]:
    world_size = request.param

    def everything(rank, world_size):
        results = {(model, kind): _train(rank, world_size, kind, build)
                   for model, build in GPT2_BUILDS.items() for kind in GPT2_KINDS}
        state = results[("tied", "fsdp")]["state"]  # identity does not survive the return
        results["tied weight is one tensor"] = state["head.weight"] is state["tok_emb.weight"]
        results["gathered in first block's backward"] = _gathered_in_first_blocks_backward(
            rank, world_size)
        if world_size == 2:  # the same ranks, to save starting them again
            for model, build in GPT2_BUILDS.items():
                results[(model, "fully_shard")] = {"state": _fsdp2(rank, world_size, build)}
        return results

    return world_size, run(everything, world_size)


def test_gpt2_style_trains_like_one_process(gpt2_trained):
    world_size, results = gpt2_trained
    for model, build in GPT2_BUILDS.items():
        reference = _reference(world_size, build)
        for rank_results in results:
            for kind in GPT2_KINDS:
                error = _max_error(rank_results[(model, kind)]["state"], reference)
                assert error <= 1e-6, f"{model}, {kind}, N={world_size}: max error {error:.2e}"


def test_gpt2_style_equals_pytorch_fsdp2(gpt2_trained):
    world_size, results = gpt2_trained
    if world_size != 2:
        pytest.skip("compared at N = 2")
    for model in GPT2_BUILDS:
        for rank_results in results:
            ours = rank_results[(model, "fsdp")]["state"]
            error = _max_error(ours, rank_results[(model, "fully_shard")]["state"])
            assert error <= 1e-6, f"{model}: differs from fully_shard by {error:.2e}"


def test_gathered_tied_parameter_has_every_name(gpt2_trained):
    _, results = gpt2_trained
    for rank_results in results:
        state = rank_results[("tied", "fsdp")]["state"]
        expected = list(_gpt2_style().state_dict())
        assert list(state) == expected, f"keys {list(state)}, expected {expected}"
        assert rank_results["tied weight is one tensor"], "the tied weight came back as two"


def test_frozen_parameters_are_freed_after_their_units_backward(gpt2_trained):
    """The final norm (all frozen) and block 1 are done when block 0's backward starts: only
    the root and block 0 are in memory."""
    _, results = gpt2_trained
    for rank_results in results:
        gathered = rank_results["gathered in first block's backward"]
        assert gathered == ["", "blocks.0"], f"in memory: {gathered}"


def test_fsdp_sends_3_psi_less_the_root_counting_the_tied_parameter_once(gpt2_trained):
    """3Ψ (two all-gathers, one reduce-scatter) except for the root unit, gathered once for
    both forward and backward; Ψ counts the tied embedding/head once."""
    world_size, results = gpt2_trained
    model = _gpt2_style()
    tied = model.tok_emb.weight.numel()
    root = tied + model.pos_emb.numel() + model.final_scale.numel()
    for rank_results in results:
        result = rank_results[("tied", "fsdp ring")]
        expected = (3 * result["psi"] - root) * 4 * (world_size - 1) / world_size
        assert result["bytes sent"] == pytest.approx(expected, rel=0.01), (
            f"sent {result['bytes sent']} B, expected (3Ψ - Ψ_root) = {expected:.0f} B with "
            f"Ψ = {result['psi']} (the tied {tied} elements counted twice would add "
            f"{3 * tied * 4 * (world_size - 1) / world_size:.0f} B)")


def test_root_unit_stays_gathered_beside_the_running_units(gpt2_trained):
    """Root (embedding + head, position embedding, final scale), blocks, final norm: the root
    stays gathered through forward and backward, beside the running and prefetched unit."""
    world_size, results = gpt2_trained
    for rank_results in results:
        for model in GPT2_BUILDS:
            fsdp, ring = rank_results[(model, "fsdp")], rank_results[(model, "fsdp ring")]
            assert fsdp["peak units gathered"] == 3, f"{model}: {fsdp['peak units gathered']}"
            assert ring["peak units gathered"] == 3, f"{model}: {ring['peak units gathered']}"
            units = 4  # root, two blocks, final norm: each shard is 1/N up to one element
            stored = fsdp["stored bytes"] / 4
            assert abs(stored - fsdp["psi"] / world_size) <= 2 * units, (
                f"{model}: {stored} elements stored, expected {fsdp['psi'] / world_size}")


class _Branchy(nn.Module):
    """`extra` is used only when asked and `never` not at all: unused parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.extra, self.never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.body(x)
        return self.extra(y) if use_extra else y


def _unused(rank: int, world_size: int) -> dict[str, float]:
    """ZeRO against torch's DDP with find_unused_parameters: a gradient missing on some ranks
    counts as zero there, and a parameter no rank used is left untouched (stage 1); stage 2
    needs every rank to use the same parameters, and skips those none used."""
    x = torch.randn(4 * world_size, 4, generator=torch.Generator().manual_seed(1))
    x = x.chunk(world_size)[rank]
    errors = {}
    for stage, use_extra in ((1, rank % 2 == 1), (2, True)):
        ours = _Branchy()
        theirs = nn.parallel.DistributedDataParallel(_Branchy(), find_unused_parameters=True)
        for model, optimizer in (
            (ours, ZeroOptimizer(ours.parameters(), torch.optim.SGD, stage=stage, lr=LR,
                                 momentum=0.9)),
            (theirs, _sgd(theirs.parameters())),
        ):
            for _ in range(STEPS):
                optimizer.zero_grad()
                model(x, use_extra).square().mean().backward()
                optimizer.step()
        errors[f"stage {stage}"] = _max_error(ours.state_dict(), theirs.module.state_dict())
    return errors


def test_zero_with_unused_parameters_equals_ddp():
    for rank, errors in enumerate(run(_unused, 2)):
        for stage, error in errors.items():
            assert error <= 1e-6, f"rank {rank}, {stage}: differs from torch DDP by {error:.2e}"


def _bad(rank: int, world_size: int) -> list[str]:
    messages = []
    for attempt in (
        lambda: ZeroOptimizer(nn.Linear(2, 2).parameters(), torch.optim.SGD, stage=3, lr=1),
        lambda: FullyShardedDataParallel(nn.Linear(2 + rank, 2)),
        lambda: FullyShardedDataParallel(_model(), units=lambda model: [nn.Linear(2, 2)]),
        lambda: FullyShardedDataParallel(_model(), units=lambda model: [model.blocks]),
    ):
        try:
            attempt()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_input_is_explained():
    messages = run(_bad, 2)[0]
    assert "stage=3" in messages[0] and "minidist.parallel.fsdp" in messages[0]
    assert "the ranks' models differ" in messages[1] and "same model" in messages[1]
    assert "units() returned a Linear" in messages[2] and "not inside the wrapped TinyGPT" in (
        messages[2]), messages[2]
    assert "'blocks', a ModuleList" in messages[3] and "return its children" in messages[3], (
        messages[3])
    with pytest.raises(RuntimeError, match="no process group"):
        FullyShardedDataParallel(nn.Linear(2, 2))


def test_modelled_step_hides_the_collectives_from_the_ddp_threshold_with_prefetch_only():
    """FSDP's modelled schedule: two all-gathers and a reduce-scatter per unit, each lane busy
    with one thing at a time, and with prefetch everything but the first gather hidden once a
    unit's forward outlasts its gather (but the first gather, the last unit's gather for
    backward and the last reduce-scatter): from (N-1)/N · FLOP/s ÷ link bytes/s tokens (bf16),
    the threshold of DDP's all-reduce under backward."""
    from minidist.costs.overlap import modelled_step

    flops, link, n, units = 1e15, 1e11, 8, [1e9] * 4
    threshold = (n - 1) / n * flops / link
    gather = (n - 1) / n * 2 * 1e9 / link
    for prefetch in (True, False):
        events = modelled_step(units, 2 * threshold, n, flops, link, prefetch=prefetch)
        kinds = sorted((e.kind, e.name) for e in events)
        assert kinds == sorted([(k, str(u)) for u in range(4) for k in
                                ("forward", "backward", "all_gather", "all_gather",
                                 "reduce_scatter")])
        for lane in (("forward", "backward"), ("all_gather", "reduce_scatter")):
            spans = sorted((e.start, e.end) for e in events if e.kind in lane)
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))
        compute = sum(e.end - e.start for e in events if e.kind in ("forward", "backward"))
        end = max(e.end for e in events)
        if prefetch:  # nothing computes beside the first and last gathers and the last scatter
            assert end == pytest.approx(compute + 3 * gather)
        else:
            assert end > compute + 6 * gather
    below = modelled_step(units, threshold / 2, n, flops, link)
    compute = sum(e.end - e.start for e in below if e.kind in ("forward", "backward"))
    assert max(e.end for e in below) > compute + 4 * gather  # the link is the bottleneck
