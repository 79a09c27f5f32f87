"""Megatron-style tensor parallelism: each layer's weight matrices split across t ranks.

Shoeybi et al. 2019 ("Megatron-LM", §3) split a transformer with two conjugate operators:

    f   identity forward, all-reduce backward   (where a replicated input enters split layers)
    g   all-reduce forward, identity backward   (where split partial sums leave them)

A column-parallel linear splits the output features (`nn.Linear.weight` dim 0): each rank
computes a slice of the output from the whole input. A row-parallel linear splits the input
features (weight dim 1): each rank computes a partial sum of the whole output. Column then row
needs nothing in between, so an MLP (fc1 column, fc2 row) or attention (q, k, v column by heads,
out row) costs one f and one g: per block 2 all-reduces forward and 2 backward, b·s·h elements
each.

Sequence parallelism (Korthikanti et al. 2022, §4.2.2) also splits the LayerNorm and residual
regions along the sequence (dim 1 of the batch-first [b, s, h]): f becomes an all-gather
forward / reduce-scatter backward, g a reduce-scatter forward / all-gather backward. Same bytes,
but the activations outside the split layers are no longer replicated t times.

Asynchronous tensor parallelism (Wang et al., ASPLOS 2023; PyTorch's micro-pipelined async TP)
hides that all-gather behind the matmul it feeds: `AsyncColumnParallelLinear` passes the sequence
shards around the ring one step at a time and multiplies the shard it already holds while the
next one travels; backward does the same for the weight gradient, and cuts the input gradient's
reduce-scatter into ring steps, each computing the partial sum it sends next.

Every collective here goes through `minidist.communication.collectives` with `when` set to
"forward" or "backward", so `counting.count_traffic()` lists what a block really sends. `group` is
the tensor-parallel group (e.g. `mesh.group("tp")`); None: every rank.

Why one module of about 540 lines: f and g and the layers built from them (column, row, vocabulary-
parallel, attention, sequence-parallel), Megatron's set, which Lab 05 builds in this order."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minidist.communication import collectives
from minidist.core._checks import require_process_group
from minidist.parallel.models import TransformerBlock, attend

__all__ = [
    "SEQUENCE_DIM", "CopyToParallel", "ReduceFromParallel", "ReduceScatterToSequenceParallel",
    "GatherAlong", "SplitAlong", "GatherSequenceThenLinears", "ColumnParallelLinear",
    "ChunkedGatherThenLinear", "AsyncColumnParallelLinear", "RowParallelLinear",
    "exit_parallel_region", "ParallelMLP", "ParallelAttention", "ParallelTransformerBlock",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
]

SEQUENCE_DIM = 1  # batch-first activations [batch, seq, hidden]


# --- The collectives, on the last dim (features) or the sequence dim -----------------------------


def _group_size(group: dist.ProcessGroup | None) -> int:
    require_process_group("a tensor-parallel layer")
    return dist.get_world_size(group)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    t, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % t:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by t={t}")
    return x.chunk(t, dim=dim)[rank].contiguous()


# --- Megatron's operators as autograd Functions ---------------------------------------------------


class CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce backward (each rank's input gradient is partial)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_reduce(grad.contiguous(), group=ctx.group, when="backward"), None


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return collectives.all_reduce(x.contiguous(), group=group, when="forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """g with sequence parallel: reduce-scatter the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return collectives.reduce_scatter_along(x, SEQUENCE_DIM, group=group, when="forward")

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather_along(grad, SEQUENCE_DIM, group=ctx.group,
                                            when="backward"), None


class GatherAlong(torch.autograd.Function):
    """All-gather dim `dim` forward; backward keeps this rank's slice of the gradient, which
    every rank computed whole and alike. On the features (dim -1): a column-parallel layer's
    gathered output. On the sequence (`SEQUENCE_DIM`): leaving the sequence-parallel region
    for replicated layers."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return collectives.all_gather_along(x, dim, group=group, when="forward")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class SplitAlong(torch.autograd.Function):
    """Keep this rank's slice of dim `dim` forward (no communication); all-gather the
    gradient backward. On the sequence: entering the sequence-parallel region from a
    replicated activation. On the features: a row-parallel layer's input, split here."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return collectives.all_gather_along(grad, ctx.dim, group=ctx.group,
                                            when="backward"), None, None


class GatherSequenceThenLinears(torch.autograd.Function):
    """All-gather the sequence, then apply column-parallel linears to the gathered input,
    saving only this rank's slice: backward gathers it again (Korthikanti et al. §4.2.2).

    Storing the gathered [b, s, h] input for the weight gradients would keep a full copy per
    rank and lose most of what sequence parallelism saves; one more all-gather is cheaper."""

    @staticmethod
    def forward(ctx, x, group, *weights_and_biases):
        ctx.group = group
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        full = collectives.all_gather_along(x, SEQUENCE_DIM, group=group, when="forward")
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = [bias is not None for bias in biases]
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = collectives.all_gather_along(x, SEQUENCE_DIM, group=ctx.group,
                                            when="backward").flatten(0, -2)
        grad_full = sum(grad @ w for grad, w in zip(grads, weights, strict=True))
        grad_x = collectives.reduce_scatter_along(grad_full, SEQUENCE_DIM, group=ctx.group,
                                                  when="backward")
        param_grads = []
        for grad, has_bias in zip(grads, ctx.has_bias, strict=True):
            grad = grad.flatten(0, -2)
            param_grads += [grad.T @ full, grad.sum(0) if has_bias else None]
        return grad_x, None, *param_grads


def _divide(total: int, t: int, what: str) -> int:
    if total < 1:
        raise ValueError(f"{what}={total} must be positive")
    if total % t:
        raise ValueError(f"{what}={total} is not divisible by t={t} (the group's size): "
                         f"choose a tensor-parallel degree that divides {what}")
    return total // t


def _init_like_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's default initialisation for a shard of a fan_in-input layer."""
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


def _sum_gradient_over_group(param: nn.Parameter, group) -> None:
    """Parameters applied to only this rank's part of the sequence get a partial gradient."""
    param.register_hook(lambda grad: collectives.all_reduce(
        grad.clone(memory_format=torch.contiguous_format), group=group, when="backward"))


# --- Layers ---------------------------------------------------------------------------------------


class _ShardedLinear(nn.Module):
    """What column- and row-parallel linears share: this rank's shard of an nn.Linear, loaded
    from the unsharded layer and gathered back. `split_dim` is the weight's dimension split
    across the group: 0, the output features (column), or 1, the input features (row); the
    bias is split with the outputs, and whole when the inputs are split."""

    split_dim: int
    group: dist.ProcessGroup | None
    in_features: int
    out_features: int
    weight: nn.Parameter
    bias: nn.Parameter | None

    @torch.no_grad()
    def load_from(self, linear: nn.Linear) -> _ShardedLinear:
        """Take this rank's shard of an unsharded layer's weight and bias."""
        _check_shape(linear, self.out_features, self.in_features, type(self).__name__)
        self.weight.copy_(_split(linear.weight, self.split_dim, self.group))
        if self.bias is not None:
            split = self.split_dim == 0
            self.bias.copy_(_split(linear.bias, 0, self.group) if split else linear.bias)
        return self

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded layer's weight (and bias), gathered on every rank."""
        def gathered(tensor: torch.Tensor, dim: int) -> torch.Tensor:
            return collectives.all_gather_along(tensor, dim, group=self.group, when="forward")

        full = {"weight": gathered(self.weight, self.split_dim)}
        if self.bias is not None:
            full["bias"] = (gathered(self.bias, 0) if self.split_dim == 0
                            else self.bias.detach().clone())
        return full


class ColumnParallelLinear(_ShardedLinear):
    """y = x Wᵀ + b with W's output rows split: this rank computes out_features/t outputs.

    The input is replicated on every rank and passes through `f` first, unless
    `copy_input=False` (the caller applied f once for several layers sharing the input). With
    `sequence_parallel` the input is this rank's slice of the sequence, all-gathered first
    (GatherSequenceThenLinears). With `gather_output` the full output is all-gathered.
    """

    split_dim = 0

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 gather_output: bool = False, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False, copy_input: bool = True):
        super().__init__()
        t = _group_size(group)
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.copy_input = sequence_parallel, copy_input
        self.in_features, self.out_features = in_features, out_features
        self.local_out = _divide(out_features, t, "out_features")
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features))
        self.bias = nn.Parameter(torch.empty(self.local_out)) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input and self.sequence_parallel:
            (y,) = GatherSequenceThenLinears.apply(x, self.group, self.weight, self.bias)
        else:
            if self.copy_input:
                x = CopyToParallel.apply(x, self.group)
            y = F.linear(x, self.weight, self.bias)
        return GatherAlong.apply(y, -1, self.group) if self.gather_output else y


class ChunkedGatherThenLinear(torch.autograd.Function):
    """GatherSequenceThenLinears for one linear, with every collective cut into ring steps that
    overlap the matmuls: the same results, the same bytes, the transfers hidden."""

    @staticmethod
    def forward(ctx, x, group, weight, bias):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        outputs = [None] * dist.get_world_size(group)
        collectives.all_gather_overlapped(
            x, lambda source, shard: outputs.__setitem__(source, F.linear(shard, weight, bias)),
            group=group, when="forward")
        return torch.cat(outputs, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, t = ctx.group, dist.get_world_size(ctx.group)
        grads = [g.flatten(0, -2) for g in grad.chunk(t, dim=SEQUENCE_DIM)]
        grad_weight = torch.zeros_like(weight)
        collectives.all_gather_overlapped(x, lambda source, shard: grad_weight.addmm_(
            grads[source].T, shard.flatten(0, -2)), group=group, when="backward")
        grad_x = collectives.reduce_scatter_overlapped(
            lambda source: (grads[source] @ weight).view_as(x), group=group, when="backward")
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, None, grad_weight, grad_bias


class AsyncColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear with sequence parallelism whose all-gather overlaps its matmul.

    Same constructor and `load_from`; always sequence parallel: the input is this rank's
    slice of the sequence. Instead of gathering the whole sequence and then multiplying, the t
    shards go around the ring one step at a time, and the matmul of the shard already here runs
    while the next travels (ChunkedGatherThenLinear). Equal to ColumnParallelLinear(...,
    sequence_parallel=True) up to the order of floating-point additions."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 gather_output: bool = False, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = True, copy_input: bool = True):
        if not (sequence_parallel and copy_input):
            raise ValueError(
                f"AsyncColumnParallelLinear overlaps the sequence all-gather, so it needs "
                f"sequence_parallel=True and copy_input=True (got {sequence_parallel}, "
                f"{copy_input}); use ColumnParallelLinear without sequence parallelism")
        super().__init__(in_features, out_features, bias=bias, gather_output=gather_output,
                         group=group, sequence_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ChunkedGatherThenLinear.apply(x, self.group, self.weight, self.bias)
        return GatherAlong.apply(y, -1, self.group) if self.gather_output else y


class RowParallelLinear(_ShardedLinear):
    """y = x Wᵀ + b with W's input columns split: this rank computes a partial sum of y.

    The input is this rank's slice of the features (`input_is_parallel`, typically a column
    layer's output); otherwise it is split here. The partial sums are added by `g` (an
    all-reduce), or with `sequence_parallel` reduce-scattered along the sequence. The bias is
    added once, after the sum.
    """

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 input_is_parallel: bool = True, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        t = _group_size(group)
        self.group, self.input_is_parallel = group, input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _divide(in_features, t, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)
        if sequence_parallel and self.bias is not None:
            _sum_gradient_over_group(self.bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = SplitAlong.apply(x, -1, self.group)
        if x.shape[-1] != self.local_in:
            raise ValueError(
                f"RowParallelLinear expects this rank's {self.local_in} of {self.in_features} "
                f"input features, got {x.shape[-1]}: was the input split over a different group?"
            )
        y = exit_parallel_region(F.linear(x, self.weight), self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias



def exit_parallel_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """g, or with sequence parallel its reduce-scatter form: where partial sums leave."""
    if sequence_parallel:
        return ReduceScatterToSequenceParallel.apply(x, group)
    return ReduceFromParallel.apply(x, group)


def _check_shape(linear: nn.Linear, out_features: int, in_features: int, name: str) -> None:
    if tuple(linear.weight.shape) != (out_features, in_features):
        raise ValueError(f"{name}({in_features}, {out_features}) cannot load an nn.Linear of "
                         f"weight shape {tuple(linear.weight.shape)}")


class ParallelMLP(nn.Module):
    """fc1 column-parallel, GELU (elementwise: no communication), fc2 row-parallel."""

    def __init__(self, hidden: int, ffn_hidden: int, *, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, group=group,
                                        sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, group=group,
                                     sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelAttention(nn.Module):
    """Causal self-attention with the heads split: this rank owns heads/t of them.

    q, k and v are column-parallel (a rank's rows are whole heads) and share one f; the
    output projection is row-parallel. `core` is the attention itself, as in
    `minidist.parallel.models.Attention`."""

    def __init__(self, hidden: int, heads: int, *, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        t = _group_size(group)
        if hidden % heads:
            raise ValueError(f"heads={heads} must divide hidden={hidden}")
        self.local_heads = _divide(heads, t, "heads")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.q_proj, self.k_proj, self.v_proj = (
            ColumnParallelLinear(hidden, hidden, group=group, copy_input=False)
            for _ in range(3)
        )
        self.out_proj = RowParallelLinear(hidden, hidden, group=group,
                                          sequence_parallel=sequence_parallel)
        self.core = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if self.sequence_parallel:
            params = [p for proj in projections for p in (proj.weight, proj.bias)]
            q, k, v = GatherSequenceThenLinears.apply(x, self.group, *params)
        else:
            x = CopyToParallel.apply(x, self.group)
            q, k, v = (proj(x) for proj in projections)
        return self.out_proj(self.core(q, k, v, self.local_heads))


class ParallelTransformerBlock(nn.Module):
    """minidist.parallel.models.TransformerBlock, tensor-parallel over `group`.

    Without sequence parallel, input and output are the full [batch, seq, hidden] on every
    rank. With it, each rank holds its seq/t slice of the sequence in and out, and the
    LayerNorms run on that slice only."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int,
                 *, group: dist.ProcessGroup | None = None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = ParallelAttention(hidden, heads, group=group,
                                      sequence_parallel=sequence_parallel)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = ParallelMLP(hidden, ffn_hidden, group=group, sequence_parallel=sequence_parallel)
        if sequence_parallel:
            for norm in (self.norm1, self.norm2):
                for param in norm.parameters():
                    _sum_gradient_over_group(param, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    @torch.no_grad()
    def load_from(self, block: TransformerBlock) -> ParallelTransformerBlock:
        """Take this rank's shards of an unsharded block's weights."""
        self.norm1.load_state_dict(block.norm1.state_dict())
        self.norm2.load_state_dict(block.norm2.state_dict())
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            getattr(self.attn, name).load_from(getattr(block.attn, name))
        self.mlp.fc1.load_from(block.mlp.fc1)
        self.mlp.fc2.load_from(block.mlp.fc2)
        return self

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded block's state dict (keyed like TransformerBlock's), on every rank."""
        state = {f"{name}.{key}": value for name in ("norm1", "norm2")
                 for key, value in getattr(self, name).state_dict().items()}
        layers = {"attn." + n: getattr(self.attn, n) for n in ("q_proj", "k_proj", "v_proj",
                                                              "out_proj")}
        layers |= {"mlp.fc1": self.mlp.fc1, "mlp.fc2": self.mlp.fc2}
        for prefix, layer in layers.items():
            state |= {f"{prefix}.{key}": value for key, value in layer.full_state_dict().items()}
        return state


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows: this rank owns ids [r·V/t, (r+1)·V/t).

    Ids outside this rank's range look up zeros; `g` sums the ranks' lookups."""

    def __init__(self, vocab: int, hidden: int, *, group: dist.ProcessGroup | None = None):
        super().__init__()
        t, rank = _group_size(group), dist.get_rank(group)
        self.group, self.vocab = group, vocab
        local = _divide(vocab, t, "vocab")
        self.start, self.end = rank * local, (rank + 1) * local
        self.weight = nn.Parameter(torch.randn(local, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return ReduceFromParallel.apply(rows, self.group)

    @torch.no_grad()
    def load_from(self, embedding: nn.Embedding) -> VocabParallelEmbedding:
        if embedding.weight.shape[0] != self.vocab:
            raise ValueError(f"VocabParallelEmbedding(vocab={self.vocab}) cannot load an "
                             f"embedding of {embedding.weight.shape[0]} rows")
        self.weight.copy_(embedding.weight[self.start:self.end])
        return self


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group):
        vocab_local = logits.shape[-1]
        start = dist.get_rank(group) * vocab_local
        # A numerically stable softmax needs the max over the whole vocabulary.
        logits_max = collectives.all_reduce(logits.max(dim=-1).values.contiguous(), op="max",
                                            group=group, when="forward")
        shifted = logits - logits_max.unsqueeze(-1)
        mine = (targets >= start) & (targets < start + vocab_local)
        local_targets = (targets - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sums = collectives.all_reduce(torch.stack([target_logit, exp.sum(dim=-1)]), group=group,
                                      when="forward")
        target_logit, sum_exp = sums
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_targets, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local_targets, mine = ctx.saved_tensors
        # d loss / d logit = softmax - one_hot(target); the one-hot lives on the target's owner.
        one_hot = F.one_hot(local_targets, softmax.shape[-1]) * mine.unsqueeze(-1)
        return (softmax - one_hot) * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Per-token cross-entropy from this rank's vocab slice of the logits [..., V/t].

    Never gathers the V-wide logits: an all-reduce MAX of the row maxima, then one all-reduce
    SUM of the target's logit and of Σexp (Megatron-LM's cross_entropy.py)."""
    _group_size(group)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} need targets of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    return _VocabParallelCrossEntropy.apply(logits, targets, group)
