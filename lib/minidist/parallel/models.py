"""The small models the labs parallelise: an MLP, a pre-norm transformer block, a tiny GPT.

Plain PyTorch on purpose: every parallel version in minidist (DDP, FSDP, tensor and pipeline
parallel) is checked against these unsharded modules. No dropout, so that runs are
deterministic and sharded and unsharded outputs can be compared exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from minidist.core._checks import positive_int

__all__ = ["MLP", "Attention", "attend", "FeedForward", "TransformerBlock", "TinyGPT", "lm_loss"]


class MLP(nn.Module):
    """`depth` Linear+GELU layers of width `hidden`, then a Linear to `out_features`."""

    def __init__(self, in_features: int, hidden: int, out_features: int, depth: int = 2):
        super().__init__()
        positive_int(in_features=in_features, hidden=hidden, out_features=out_features,
                        depth=depth)
        widths = [in_features] + [hidden] * depth
        self.layers = nn.Sequential(
            *(nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in pairwise(widths)),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v and output projections
    (separate so that tensor parallelism can split each by heads). `core(q, k, v, heads)` is
    the attention itself, `attend`; context parallelism swaps in an attention over the
    sequence split across ranks (`minidist.parallel.context_parallel.ContextParallelCore`)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        positive_int(hidden=hidden, heads=heads)
        if hidden % heads:
            raise ValueError(f"heads={heads} must divide hidden={hidden}")
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)
        self.core = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.core(self.q_proj(x), self.k_proj(x), self.v_proj(x),
                                       self.heads))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal attention of [batch, seq, heads·head_dim] projections, result in the same shape."""
    batch, seq, width = q.shape
    split = [t.view(batch, seq, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*split, is_causal=True)
    return out.transpose(1, 2).reshape(batch, seq, width)


class FeedForward(nn.Module):
    """fc1 (hidden → ffn_hidden), GELU, fc2 (ffn_hidden → hidden)."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        positive_int(hidden=hidden, ffn_hidden=ffn_hidden)
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)). Input [batch, seq, hidden]."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = FeedForward(hidden, ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, `layers` TransformerBlocks, a final norm and an LM head.

    `forward(ids)` returns logits [batch, seq, vocab]; `loss(ids, targets)` the mean
    cross-entropy."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, max_seq: int,
                 ffn_hidden: int | None = None):
        super().__init__()
        positive_int(vocab=vocab, layers=layers, max_seq=max_seq)
        self.max_seq = max_seq
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(
            TransformerBlock(hidden, heads, ffn_hidden or 4 * hidden) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def layers(self) -> list[nn.Module]:
        """The model as a list of layers, e.g. for `minidist.parallel.pipeline_exec.split_layers`:
        the embeddings, each transformer block, then the final norm and LM head. They share the
        model's parameters; running them in order is `model(ids)`."""
        return [_Embeddings(self.tok_emb, self.pos_emb), *self.blocks,
                nn.Sequential(OrderedDict(norm=self.norm, head=self.head))]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        if seq > self.max_seq:
            raise ValueError(f"sequence length {seq} exceeds max_seq={self.max_seq}")
        x = ids
        for layer in self.layers():
            x = layer(x)
        return x

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self(ids), targets)


class _Embeddings(nn.Module):
    """Token plus position embeddings: TinyGPT's first layer."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding):
        super().__init__()
        self.tok_emb, self.pos_emb = tok_emb, pos_emb

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [batch, seq, vocab] against targets [batch, seq]."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
