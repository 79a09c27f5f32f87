"""minidist.parallel.moe: expert parallelism over all-to-all equals a single-process loop over the
experts (outputs, gradients, dropped tokens)."""

import pytest
import torch
import torch.nn.functional as F

from minidist.communication.counting import count_traffic
from minidist.communication.mesh import Mesh
from minidist.core.launch import run
from minidist.parallel.moe import MoELayer

HIDDEN, FFN, EXPERTS, TOP_K, BATCH, SEQ = 8, 16, 4, 2, 2, 5
WORLD = 4
TOL = 1e-5
CONFIGS = [(ep, factor) for ep in (2, 4) for factor in (None, 1.0)]


def _data(group=None):
    """The whole layer (every expert here: a single process, or a group of one rank)."""
    torch.manual_seed(0)
    full = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, group=group)
    inputs = torch.randn(WORLD, BATCH, SEQ, HIDDEN)
    output_weights = torch.randn(WORLD, BATCH, SEQ, HIDDEN)  # loss = sum(out * w), per rank
    return full, inputs, output_weights


def reference(full: MoELayer, x: torch.Tensor, capacity_factor: float | None):
    """One rank's tokens through the experts, one expert at a time: (output, dropped)."""
    tokens = x.reshape(-1, HIDDEN)
    weights, chosen = F.softmax(full.router(tokens), dim=-1).topk(TOP_K, dim=-1)
    out, dropped = torch.zeros_like(tokens), 0
    for expert in range(EXPERTS):
        token_ids, slots = (chosen == expert).nonzero(as_tuple=True)  # in token order
        if capacity_factor is not None:
            capacity = -(-capacity_factor * len(tokens) * TOP_K // EXPERTS)
            dropped += max(0, len(token_ids) - int(capacity))
            token_ids, slots = token_ids[:int(capacity)], slots[:int(capacity)]
        expert_out = full.experts[expert](tokens[token_ids])
        out = out.index_add(0, token_ids, expert_out * weights[token_ids, slots].unsqueeze(1))
    return out.view_as(x), dropped


def _expert_parallel(rank: int, world_size: int) -> list[dict]:
    meshes = {ep: Mesh(dp=world_size // ep, ep=ep) for ep in (1, 2, 4)}
    full, inputs, output_weights = _data(meshes[1].group("ep"))
    results = []
    for ep, factor in CONFIGS:
        group = meshes[ep].group("ep")
        layer = MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, group=group,
                         capacity_factor=factor).load_from(full)
        x = inputs[rank].clone().requires_grad_()
        with count_traffic() as log:
            out = layer(x)
            (out * output_weights[rank]).sum().backward()
        results.append({
            "out": out.detach(), "x_grad": x.grad, "router_grad": layer.router.weight.grad,
            "experts": {layer.first_expert + i: {n: p.grad for n, p in e.named_parameters()}
                        for i, e in enumerate(layer.experts)},
            "dropped": layer.dropped, "load": layer.load,
            "all_to_all": {when: (log.calls("all_to_all", when), log.nbytes("all_to_all", when))
                           for when in ("forward", "backward", "counts")},
        })
    with pytest.raises(ValueError) as error:
        MoELayer(HIDDEN, FFN, 6, TOP_K, group=meshes[4].group("ep"))
    results.append(str(error.value))
    return results


def test_expert_parallel_equals_the_loop_over_experts_on_ep_2_and_4():
    per_rank = run(_expert_parallel, WORLD, timeout=120)
    full, inputs, output_weights = _data()
    for index, (ep, factor) in enumerate(CONFIGS):
        for start in range(0, WORLD, ep):
            members = range(start, start + ep)
            full.zero_grad()
            expected_router = torch.zeros(EXPERTS, HIDDEN)
            for rank in members:
                x = inputs[rank].clone().requires_grad_()
                out, dropped = reference(full, x, factor)
                (out * output_weights[rank]).sum().backward()
                got = per_rank[rank][index]
                label = f"EP {ep}, capacity_factor={factor}, rank {rank}"
                error = (got["out"] - out).abs().max().item()
                assert error < TOL, f"{label}: expected the loop's output, max error {error:.2e}"
                error = (got["x_grad"] - x.grad).abs().max().item()
                assert error < TOL, (
                    f"{label}: expected the loop's input gradient, max error {error:.2e}")
                assert got["dropped"] == dropped, (
                    f"{label}: expected {dropped} dropped assignments, got {got['dropped']}")
                if factor is not None:
                    assert dropped > 0, f"{label}: the test needs a capacity that drops tokens"
                expected_load = torch.bincount(
                    F.softmax(full.router(x.reshape(-1, HIDDEN)), -1).topk(TOP_K).indices
                    .flatten(), minlength=EXPERTS)
                assert torch.equal(got["load"], expected_load), (
                    f"{label}: expected load {expected_load.tolist()}, got {got['load'].tolist()}")
                expected_router += got["router_grad"]  # the router is replicated: sum it
                calls = {when: c for when, (c, _) in got["all_to_all"].items()}
                assert calls == {"forward": 2, "backward": 2, "counts": 1}, (
                    f"{label}: expected all-to-alls dispatch + combine forward, their two "
                    f"backward, one of the counts; got {calls}")
                sent = {when: b for when, (_, b) in got["all_to_all"].items()}
                assert sent["forward"] == sent["backward"], (
                    f"{label}: backward sends back what forward received: expected "
                    f"{sent['forward']} bytes, got {sent['backward']}")
            error = (expected_router - full.router.weight.grad).abs().max().item()
            assert error < TOL, f"EP {ep}: router gradient summed over ranks, max error {error:.2e}"
            for rank in members:
                for expert, grads in per_rank[rank][index]["experts"].items():
                    for name, grad in grads.items():
                        want = dict(full.experts[expert].named_parameters())[name].grad
                        want = torch.zeros_like(grad) if want is None else want
                        error = (grad - want).abs().max().item()
                        assert error < TOL, (f"EP {ep}, capacity_factor={factor}: expert "
                                             f"{expert} {name} gradient, max error {error:.2e}")
    message = per_rank[0][-1]
    assert "experts=6" in message and "4 ranks" in message, (
        f"expected an error naming experts=6 and the group's 4 ranks, got {message!r}")


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="top_k=5 is more than experts=4"):
        MoELayer(HIDDEN, FFN, EXPERTS, 5)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        MoELayer(HIDDEN, FFN, EXPERTS, TOP_K, capacity_factor=0)
