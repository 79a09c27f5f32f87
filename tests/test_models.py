import pytest
import torch

from minidist.parallel.models import MLP, TinyGPT, TransformerBlock


def test_transformer_block_is_causal_and_keeps_shape():
    torch.manual_seed(0)
    block = TransformerBlock(hidden=16, heads=4, ffn_hidden=32)
    x = torch.randn(2, 5, 16)
    y = block(x)
    assert y.shape == x.shape
    x2 = x.clone()
    x2[:, -1] += 1.0  # changing the last token must not change earlier outputs
    assert torch.allclose(block(x2)[:, :-1], y[:, :-1])


def test_tiny_gpt_and_mlp_train():
    torch.manual_seed(0)
    gpt = TinyGPT(vocab=11, hidden=16, heads=2, layers=2, max_seq=8)
    ids = torch.randint(0, 11, (3, 8))
    assert gpt(ids).shape == (3, 8, 11)
    gpt.loss(ids, ids).backward()
    assert all(p.grad is not None for p in gpt.parameters())
    assert MLP(4, 8, 3, depth=3)(torch.randn(5, 4)).shape == (5, 3)


@pytest.mark.parametrize("make, message", [
    (lambda: TransformerBlock(10, 3, 8), "heads=3 must divide hidden=10"),
    (lambda: MLP(4, 0, 2), "hidden=0"),
])
def test_bad_sizes_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()
