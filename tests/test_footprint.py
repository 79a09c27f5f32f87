"""Measured bytes (minidist.costs.footprint) against the formulas of minidist.costs.memory."""

import torch

from minidist.costs import memory
from minidist.costs.footprint import model_state_footprint, saved_activations, storage_bytes
from minidist.parallel.models import TinyGPT, TransformerBlock


def one_step(model, optimizer):
    ids = torch.randint(0, 50, (2, 16))
    model.loss(ids, ids).backward()
    optimizer.step()


def test_fp32_adam_holds_16_bytes_per_param_plus_a_step_counter_per_tensor():
    torch.manual_seed(0)
    model = TinyGPT(vocab=50, hidden=32, heads=4, layers=2, max_seq=16)
    optimizer = torch.optim.Adam(model.parameters())
    one_step(model, optimizer)
    psi = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    measured = model_state_footprint(model, optimizer)
    predicted = memory.model_state_bytes(psi, precision="fp32")
    assert (measured.params, measured.grads) == (predicted.params, predicted.grads)
    assert measured.optimizer == predicted.optimizer + 4 * tensors  # fp32 scalar `step`s


def test_sgd_momentum_and_plain_sgd():
    torch.manual_seed(0)
    model = TinyGPT(vocab=50, hidden=32, heads=4, layers=1, max_seq=16)
    psi = sum(p.numel() for p in model.parameters())
    for name, optimizer in (("sgd-momentum", torch.optim.SGD(model.parameters(), 0.1, 0.9)),
                            ("sgd", torch.optim.SGD(model.parameters(), 0.1))):
        one_step(model, optimizer)
        measured = model_state_footprint(model, optimizer)
        assert measured == memory.model_state_bytes(psi, precision="fp32", optimizer=name)


def test_mixed_precision_adam_is_16_bytes_per_param():
    torch.manual_seed(0)
    model = TinyGPT(vocab=50, hidden=32, heads=4, layers=1, max_seq=16).to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.Adam(master)
    ids = torch.randint(0, 50, (2, 16))
    model.loss(ids, ids).backward()
    for weights, param in zip(master, model.parameters(), strict=True):
        weights.grad = param.grad.float()
    optimizer.step()
    for weights in master:
        weights.grad = None
    psi = sum(p.numel() for p in model.parameters())
    measured = model_state_footprint(model, optimizer)
    predicted = memory.model_state_bytes(psi)
    assert (measured.params, measured.grads) == (2 * psi, 2 * psi)
    assert measured.optimizer == predicted.optimizer + 4 * len(master)


def test_saved_activations_of_our_layer():
    """Our block keeps 16 s·b·h elements, the same tensors Korthikanti counts minus dropout
    masks, with flash attention's logsumexp (a·s·b) instead of the s x s matrices, plus
    LayerNorm's mean and 1/std (2 x 2 s·b)."""
    s, b, h, a = 32, 2, 64, 4
    block = TransformerBlock(h, a, 4 * h)
    x = torch.randn(b, s, h, requires_grad=True)
    saved = saved_activations(block, x)
    total = sum(t.nbytes for t in saved)
    assert total == 4 * (16 * s * b * h + 4 * s * b + a * s * b)
    bf16 = TransformerBlock(h, a, 4 * h).to(torch.bfloat16)
    saved = saved_activations(bf16, x.detach().bfloat16().requires_grad_())
    assert sum(t.nbytes for t in saved) == 2 * (16 * s * b * h + 4 * s * b) + 4 * a * s * b
    without_input = saved_activations(block, x, exclude=[x])
    assert sum(t.nbytes for t in without_input) == total - 4 * s * b * h


def test_storage_bytes_counts_views_once():
    t = torch.zeros(10, 10)
    assert storage_bytes([t, t.T, t[2:], t.view(-1)]) == 400
