"""Context parallelism: attention over a sequence split across cp ranks, by ring attention or by
DeepSpeed-Ulysses, and the zigzag layout that gives every rank the same causal work.

    parts = split_sequence(q_full, cp, layout="zigzag")     # [b, h, s/cp, d] for each rank
    q = parts[rank]                                          # (and k, v alike)
    out = ring_attention(q, k, v, causal=True, group=group, layout="zigzag")
    out = ulysses_attention(q, k, v, causal=True, group=group, layout="zigzag")
    gather_sequence(every_ranks_out, layout="zigzag")        # the whole [b, h, s, d] again

Every rank holds its s/cp tokens of q, k and v ([batch, heads, tokens, head_dim], as
F.scaled_dot_product_attention takes them); each returns the attention output of its own
tokens, equal to attention over the whole sequence (and so are the gradients).

Ring attention (Liu, Zaharia & Abbeel 2023; REFERENCES.md#ring-attention). A rank keeps its
query block and the key/value blocks go around the ring: at each of cp steps it attends its
queries to the block it holds while that block travels on to its right neighbour
(`collectives.shift`, posted before the compute and waited on after it: the transfer hides
behind the compute). Each step gives a partial result, the output and the log-sum-exp of its
scores per query, and `merge_partials` folds it into the running one exactly: the online
softmax (Milakov & Gimelshein 2018; REFERENCES.md#online-softmax). Backward is its own ring:
the key/value blocks go around again and their gradients travel with them, each rank adding
its share, until one last step brings each block's gradient home. Bytes per rank:
`traffic.ring_attention_traffic`.

Causal balance. With a causal mask a query sees only earlier keys. Split the sequence into cp
contiguous blocks ("contiguous") and rank 0 attends to one block while rank cp-1 attends to
cp: the ring runs at the pace of the busiest rank. "zigzag" cuts the sequence into 2·cp chunks
and gives rank r chunk r and a late one that evens out the work (Lab 13's Exercise 4 works out
which), so every rank scores the same number of query-key pairs (Brandon et al. 2023,
REFERENCES.md#striped-attention; the layout of Llama 3 and Megatron-LM's context parallelism).
A layout can also be given as the positions of this rank's tokens in the sequence (a 1-D
tensor); any split of 0..s-1 works.

DeepSpeed-Ulysses (Jacobs et al. 2023; REFERENCES.md#ulysses). An all-to-all turns q, k and v
from sequence-sharded ([b, h, s/cp, d]) into head-sharded ([b, h/cp, s, d]): each rank then
attends over the whole sequence for 1/cp of the heads (with ring attention's blockwise
arithmetic, so that the two differ only in what they send), and a fourth
all-to-all brings the output back. It needs the heads divisible by cp. Bytes per rank:
`traffic.ulysses_traffic`.

Memory. Neither keeps any s x s matrix for backward: ring attention keeps q, k, v and the
output (b·h·(s/cp)·d each) and the log-sum-exp (b·h·s/cp), Ulysses the same sizes
head-sharded: per rank, proportional to s/cp.

Work. Each block of attention notes a `timeline.Event` of kind "attention" whose detail is the
number of query-key pairs it scored, and each transfer one of kind "transfer": inside
`timeline.collect()` they show the work per rank and what overlapped.

Time. `forward_times` is the α-β model of one forward of each: which wins at which cp and
sequence length.

Checks. Before anything travels, the ranks exchange the shapes of q, k and v, and the layout
(an uncounted set-up exchange, like a pipeline's shapes), so that a mismatch raises the same
ValueError on every rank instead of a hang.

Why one module of about 620 lines: ring attention and Ulysses share the sequence layouts, the shape
exchange and the blockwise attention with its backward; Lab 13 compares them side by side."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minidist.communication import collectives, counting
from minidist.communication.comm import ring_of
from minidist.core.flat import accumulation_dtype
from minidist.core.timeline import Event, clock, note
from minidist.costs.cost import AlphaBeta

__all__ = [
    "LAYOUTS", "chunks_of", "positions", "split_sequence", "gather_sequence",
    "block_attention", "merge_partials", "ring_forward", "ring_backward", "ring_attention",
    "seq_to_heads", "heads_to_seq", "ulysses_attention", "ContextParallelCore",
    "forward_times",
]

LAYOUTS = ("contiguous", "zigzag")
"""The named ways to split a sequence over cp ranks (see the module doc)."""

Group = dist.ProcessGroup | None
Layout = str | torch.Tensor
RingForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


# --- Layouts ------------------------------------------------------------------------------------


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {', '.join(map(repr, LAYOUTS))}, or "
                         f"pass this rank's token positions as a 1-D tensor")


def chunks_of(cp_rank: int, cp: int, *, layout: str = "contiguous") -> tuple[int, ...]:
    """Which chunks of the sequence rank `cp_rank` of the cp group holds: ("contiguous") chunk
    r of cp, ("zigzag") two of 2·cp, chunk r and the later one that evens out causal work (Lab
    13's Exercise 4 works out which)."""
    _check_layout(layout)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank={cp_rank}: must be in 0..{cp - 1}")
    return (cp_rank,) if layout == "contiguous" else (cp_rank, 2 * cp - 1 - cp_rank)


def _check_divisible(seq_len: int, cp: int, layout: str) -> None:
    pieces = cp if layout == "contiguous" else 2 * cp
    if seq_len % pieces:
        what = "cp" if layout == "contiguous" else "2·cp"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {what} = {pieces}: the "
            f"{layout} layout cuts the sequence into {pieces} equal chunks; pad or trim the "
            f"sequence to a multiple of {pieces}"
            + (", or use layout='contiguous' (a multiple of cp)" if layout == "zigzag" else ""))


def positions(seq_len: int, cp_rank: int, cp: int, *,
              layout: str = "contiguous") -> torch.Tensor:
    """The positions in the whole sequence of the tokens of rank `cp_rank` of the cp group, in
    the order it holds them."""
    _check_divisible(seq_len, cp, layout)
    chunks = chunks_of(cp_rank, cp, layout=layout)
    size = seq_len // (cp * len(chunks))
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def split_sequence(x: torch.Tensor, cp: int, *, layout: str = "contiguous",
                   dim: int = 2) -> list[torch.Tensor]:
    """Every rank's part of `x` along `dim` (the tokens; 2 for [b, h, s, d]), in rank order."""
    _check_layout(layout)
    _check_divisible(x.shape[dim], cp, layout)
    chunks = x.chunk(cp if layout == "contiguous" else 2 * cp, dim=dim)
    return [torch.cat([chunks[c] for c in chunks_of(r, cp, layout=layout)], dim=dim)
            for r in range(cp)]


def gather_sequence(parts: Sequence[torch.Tensor], *, layout: str = "contiguous",
                    dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's part (`split_sequence` undone)."""
    _check_layout(layout)
    cp = len(parts)
    if layout == "contiguous":
        return torch.cat(list(parts), dim=dim)
    halves = [part.chunk(2, dim=dim) for part in parts]
    ordered = [halves[c][0] if c < cp else halves[2 * cp - 1 - c][1] for c in range(2 * cp)]
    return torch.cat(ordered, dim=dim)


# --- One block, and the online-softmax merge ----------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


TILE = 256
"""Queries per tile: a tile's scores against a block of keys stay in cache."""


def _pairs_scored(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> int:
    return q.shape[0] * q.shape[1] * (int(mask.sum()) if mask is not None
                                      else q.shape[2] * k.shape[2])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            phase: str) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ/√d) v over the keys `mask` allows (all, if None), in fp32 or wider
    (`accumulation_dtype`), TILE queries at a time: the output and the log-sum-exp of each
    query's scores. Notes an "attention" Event."""
    start = clock()
    acc = accumulation_dtype(q.dtype, k.dtype, v.dtype)
    keys, values = k.to(acc).transpose(-2, -1), v.to(acc)
    outs, lses = [], []
    for first in range(0, q.shape[2], TILE):
        rows = slice(first, first + TILE)
        scores = (q[:, :, rows].to(acc) / math.sqrt(q.shape[-1])) @ keys
        if mask is not None:
            scores.masked_fill_(~mask[rows], float("-inf"))
        lse = scores.logsumexp(dim=-1)
        outs.append(scores.sub_(lse.unsqueeze(-1)).exp_() @ values)
        lses.append(lse)
    note(Event(_rank(), "attention", phase, start, clock(), _pairs_scored(q, k, mask)))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    *, diagonal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [b, h, n, d] over one block of keys and values [b, h, m, d]:
    (output [b, h, n, d] in fp32 or wider, log-sum-exp of each query's scores [b, h, n]). With
    `diagonal` the queries and keys are the same tokens and the causal mask applies (query i
    sees keys 0..i); otherwise every key is seen. Notes an "attention" `timeline.Event` whose
    detail is the number of query-key pairs scored."""
    mask = None
    if diagonal:
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"diagonal=True needs queries and keys of the same tokens, got "
                             f"{q.shape[2]} queries and {k.shape[2]} keys")
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return _attend(q, k, v, mask, "forward")


def merge_partials(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention results of the same queries over disjoint sets of keys, each an
    output [..., n, d] and a log-sum-exp [..., n], as one: the result over both sets.

    Each output is its softmax-weighted average of values; over both sets the weights are
    renormalised by exp(lse_i - lse), where lse = log(e^lse1 + e^lse2), computed as
    max + log(e^(lse1-max) + e^(lse2-max)) so that nothing overflows. A log-sum-exp of -inf
    (no keys yet) contributes nothing."""
    new_lse = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(new_lse)  # both -inf: no keys at all, keep zeros
    safe = torch.where(finite, new_lse, torch.zeros_like(new_lse))
    weight = torch.where(finite, (lse - safe).exp(), torch.zeros_like(lse))
    block_weight = torch.where(finite, (block_lse - safe).exp(), torch.zeros_like(lse))
    return out * weight.unsqueeze(-1) + block_out * block_weight.unsqueeze(-1), new_lse


# --- Who holds what: the set-up exchange --------------------------------------------------------


@dataclass(frozen=True)
class _Runs:
    """A rank's tokens as runs of consecutive positions: (first local index, length, first
    position) each."""

    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, where: torch.Tensor) -> _Runs:
        runs, start = [], 0
        where = where.tolist()
        for i in range(1, len(where) + 1):
            if i == len(where) or where[i] != where[i - 1] + 1:
                runs.append((start, i - start, where[start]))
                start = i
        return cls(tuple(runs))


@dataclass(frozen=True)
class _Plan:
    """The cp group as this call sees it, checked on every rank alike."""

    group: Group
    cp: int
    cp_rank: int  # this rank's place in the cp group
    runs: tuple[_Runs, ...]  # every rank's tokens
    order: torch.Tensor | None  # where each token of the rank-major sequence sits; None: in order


_LAYOUT_CODES = {"contiguous": 0, "zigzag": 1}


def _header(tensors: dict[str, torch.Tensor], causal: bool, layout: Layout) -> list[int]:
    code = 2 if isinstance(layout, torch.Tensor) else _LAYOUT_CODES.get(layout, -1)
    header = [int(causal), code]
    for tensor in tensors.values():
        shape = list(tensor.shape)[:4]
        header += [tensor.dim(), *shape, *[-1] * (4 - len(shape))]
    return header


def _describe(header: list[int], names: Sequence[str]) -> str:
    shapes = []
    for i, name in enumerate(names):
        ndim, *shape = header[2 + 5 * i: 7 + 5 * i]
        shapes.append(f"{name} {tuple(shape[:ndim]) if ndim <= 4 else f'{ndim}-D'}")
    return ", ".join(shapes)


def _plan(tensors: dict[str, torch.Tensor], causal: bool, group: Group, layout: Layout,
          what: str) -> _Plan:
    """Check the call on every rank of `group` alike (one uncounted exchange of shapes and
    layout) and work out who holds which tokens. Raises the same ValueError everywhere."""
    header = _header(tensors, causal, layout)
    if dist.is_initialized():
        ring = ring_of(group, what)
        cp, cp_rank = ring.size, ring.rank
        mine = torch.tensor(header, dtype=torch.int64)
        with counting.uncounted():
            everyone = collectives.all_gather(mine, mine.numel() * cp, group=group,
                                              when="shapes").view(cp, -1).tolist()
    else:
        cp, cp_rank, everyone = 1, 0, [header]
    names = list(tensors)
    for r, theirs in enumerate(everyone):  # the same checks, in the same order, on every rank
        if theirs[1] == -1:
            if header[1] == -1:
                _check_layout(layout)
            raise ValueError(f"{what}: rank {r} of the cp group passed an unknown layout")
        if theirs[:2] != everyone[0][:2]:
            raise ValueError(f"{what}: rank {r} of the cp group passed causal={bool(theirs[0])} "
                             f"and a different layout than rank 0 (causal="
                             f"{bool(everyone[0][0])}): every rank must pass the same ones")
        dims = theirs[2::5]
        if any(d != 4 for d in dims) or len({tuple(theirs[3 + 5 * i: 7 + 5 * i])
                                             for i in range(len(names))}) != 1:
            raise ValueError(
                f"{what}: q, k and v must all be [batch, heads, tokens, head_dim] of one shape; "
                f"rank {r} passed {_describe(theirs, names)}")
        if theirs[2:] != everyone[0][2:]:
            raise ValueError(
                f"{what}: rank {r} passed {_describe(theirs, names)} but rank 0 passed "
                f"{_describe(everyone[0], names)}: every rank of the cp group passes the same "
                f"batch, heads and head_dim, and the same number of tokens (s/cp)")
    tokens = header[5]
    if isinstance(layout, torch.Tensor):
        where = _gather_positions(layout, tokens, cp, group, what)
    else:
        _check_divisible(tokens * cp, cp, layout)
        where = [positions(tokens * cp, r, cp, layout=layout) for r in range(cp)]
    every = torch.cat(where)
    if not torch.equal(every.sort().values, torch.arange(tokens * cp)):
        raise ValueError(f"{what}: the ranks' positions must cover 0..{tokens * cp - 1} once "
                         f"each; got {[w.tolist() for w in where]}")
    in_order = torch.equal(every, torch.arange(tokens * cp))
    return _Plan(group, cp, cp_rank, tuple(_Runs.of(w) for w in where),
                 None if in_order else every)


def _gather_positions(layout: torch.Tensor, tokens: int, cp: int, group: Group,
                      what: str) -> list[torch.Tensor]:
    if layout.dim() != 1 or layout.numel() != tokens or layout.is_floating_point():
        problem = (f"layout of shape {tuple(layout.shape)} and dtype {layout.dtype}: a positions "
                   f"layout is a 1-D integer tensor of this rank's {tokens} token positions")
    else:
        problem = ""
    flag = torch.tensor([int(bool(problem))], dtype=torch.int64)
    if dist.is_initialized():
        with counting.uncounted():
            collectives.all_reduce(flag, op="max", group=group, when="shapes")
    if flag.item():
        raise ValueError(f"{what}: {problem or 'another rank passed a bad positions layout'}")
    mine = layout.to(torch.int64).cpu()
    if not dist.is_initialized():
        return [mine]
    with counting.uncounted():
        everyone = collectives.all_gather(mine, tokens * cp, group=group, when="positions")
    return list(everyone.view(cp, tokens))


def _pairs(plan: _Plan, source: int, causal: bool) -> Iterator[tuple[slice, slice, str]]:
    """The (query rows, key rows, kind) to compute when this rank holds `source`'s block:
    kind "full", or "mask" where the causal mask cuts the pair; pairs the mask hides entirely
    are skipped."""
    for q_start, q_len, q_first in plan.runs[plan.cp_rank].runs:
        for k_start, k_len, k_first in plan.runs[source].runs:
            rows, cols = slice(q_start, q_start + q_len), slice(k_start, k_start + k_len)
            if not causal or k_first + k_len - 1 <= q_first:
                yield rows, cols, "full"
            elif k_first <= q_first + q_len - 1:
                yield rows, cols, "mask"


def _mask(plan: _Plan, source: int, rows: slice, cols: slice, device: torch.device) -> torch.Tensor:
    q_pos = _positions_of(plan, plan.cp_rank)[rows]
    k_pos = _positions_of(plan, source)[cols]
    return (q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)).to(device)


def _positions_of(plan: _Plan, rank: int) -> torch.Tensor:
    return torch.cat([torch.arange(first, first + length)
                      for _, length, first in plan.runs[rank].runs])


# --- Ring attention: forward, backward, autograd ------------------------------------------------


def _ring_forward(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q.dtype, k.dtype, v.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    block = torch.stack([k, v])  # one message per step: the key and value blocks together
    for step in range(plan.cp):
        source = (plan.cp_rank - step) % plan.cp
        travelling = (collectives.shift(block, group=plan.group, when="forward, key/value blocks",
                                        async_op=True) if step < plan.cp - 1 else None)
        for rows, cols, kind in _pairs(plan, source, causal):  # while the next block travels
            mask = _mask(plan, source, rows, cols, q.device) if kind == "mask" else None
            part = _attend(q[:, :, rows], block[0][:, :, cols], block[1][:, :, cols], mask,
                           "forward")
            out[:, :, rows], lse[:, :, rows] = merge_partials(out[:, :, rows], lse[:, :, rows],
                                                         *part)
        if travelling is not None:
            block = travelling.wait()
    return out.to(q.dtype), lse


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                 group: Group = None, layout: Layout = "contiguous"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention's forward without autograd: (this rank's output [b, h, s/cp, d], the
    log-sum-exp of each of its queries [b, h, s/cp] in fp32, or fp64 for fp64 inputs). See the
    module doc."""
    plan = _plan({"q": q, "k": k, "v": v}, causal, group, layout, "ring_forward")
    return _ring_forward(plan, q, k, v, causal)


def _attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                     lse: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (q, k, v) of one block's share of the attention output, from the final
    log-sum-exp, TILE queries at a time: the probabilities are recomputed, never stored."""
    start = clock()
    scale = 1 / math.sqrt(q.shape[-1])
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for first in range(0, q.shape[2], TILE):
        rows = slice(first, first + TILE)
        probs = q[:, :, rows] @ k.transpose(-2, -1) * scale
        if mask is not None:
            probs.masked_fill_(~mask[rows], float("-inf"))
        probs.sub_(lse[:, :, rows].unsqueeze(-1)).exp_()
        grad_v += probs.transpose(-2, -1) @ grad_out[:, :, rows]
        grad_scores = probs.mul_(grad_out[:, :, rows] @ v.transpose(-2, -1)
                                 - delta[:, :, rows].unsqueeze(-1))
        grad_q[:, :, rows] = grad_scores @ k * scale
        grad_k += grad_scores.transpose(-2, -1) @ q[:, :, rows] * scale
    note(Event(_rank(), "attention", "backward", start, clock(), _pairs_scored(q, k, mask)))
    return grad_q, grad_k, grad_v


def _ring_backward(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, causal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q.dtype, k.dtype, v.dtype, grad_out.dtype)
    q_acc, grad_out_acc = q.to(acc), grad_out.to(acc)
    delta = (grad_out_acc * out.to(acc)).sum(-1)  # D_i = Σ_d dO·O: softmax's backward term
    grad_q = torch.zeros_like(q_acc)
    block = torch.stack([k, v])
    coming = None  # the gradient of the block held now, accumulated by the ranks before
    for step in range(plan.cp):
        source = (plan.cp_rank - step) % plan.cp
        travelling = (collectives.shift(block, group=plan.group, when="backward, key/value blocks",
                                        async_op=True) if step < plan.cp - 1 else None)
        grads = torch.zeros(block.shape, dtype=acc, device=block.device)
        for rows, cols, kind in _pairs(plan, source, causal):
            mask = _mask(plan, source, rows, cols, q.device) if kind == "mask" else None
            dq, dk, dv = _attend_backward(q_acc[:, :, rows], block[0][:, :, cols].to(acc),
                                          block[1][:, :, cols].to(acc), grad_out_acc[:, :, rows],
                                          lse[:, :, rows], delta[:, :, rows], mask)
            grad_q[:, :, rows] += dq
            grads[0][:, :, cols] += dk
            grads[1][:, :, cols] += dv
        if plan.cp == 1:
            return grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype)
        if coming is not None:
            grads += coming.wait()  # accumulated in `acc`; the messages in the inputs' dtype
        coming = collectives.shift(grads.to(block.dtype), group=plan.group,
                                   when="backward, key/value gradients", async_op=True)
        if travelling is not None:
            block = travelling.wait()
    home = coming.wait()  # this rank's own block, with every rank's share added
    return grad_q.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)


def ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, grad_out: torch.Tensor, *, causal: bool = True,
                  group: Group = None, layout: Layout = "contiguous"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention's backward: the gradients of this rank's q, k and v from its output,
    log-sum-exp and output gradient. The key/value blocks go around the ring once more, and
    each block's gradient travels with it."""
    plan = _plan({"q": q, "k": k, "v": v}, causal, group, layout, "ring_backward")
    return _ring_backward(plan, q, k, v, out, lse, grad_out, causal)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, plan, forward):
        if forward is None:
            out, lse = _ring_forward(plan, q, k, v, causal)
        else:
            out, lse = forward(q, k, v, causal, plan.group)
            out = out.to(q.dtype)
        ctx.causal, ctx.plan = causal, plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _ring_backward(ctx.plan, q, k, v, out, lse, grad_out, ctx.causal)
        return *grads, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   group: Group = None, layout: Layout = "contiguous",
                   forward: RingForward | None = None) -> torch.Tensor:
    """Ring attention over `group` (None: every rank; one process alone without a process
    group): this rank's output [b, h, s/cp, d] for its tokens q, k, v [b, h, s/cp, d], held as
    `layout` says ("contiguous", "zigzag", or this rank's positions). Differentiable: backward
    runs the ring again (`ring_backward`).

    `forward(q, k, v, causal, group) -> (out, lse)` replaces the library's forward (a lab's
    own, checked against it); it gets contiguous blocks."""
    if forward is not None and not (isinstance(layout, str) and layout == "contiguous"):
        raise ValueError(f"a forward of your own runs on the contiguous layout; got "
                         f"layout={layout!r}")
    plan = _plan({"q": q, "k": k, "v": v}, causal, group, layout, "ring_attention")
    return _RingAttention.apply(q, k, v, causal, plan, forward)


# --- Ulysses: all-to-all to heads and back ------------------------------------------------------


def seq_to_heads(x: torch.Tensor, group: Group = None, when: str = "") -> torch.Tensor:
    """[b, h, s/cp, d] of this rank's tokens -> [b, h/cp, s, d]: rank p's heads
    p·h/cp..(p+1)·h/cp for every rank's tokens, rank 0's first (one all-to-all)."""
    cp = ring_of(group, "seq_to_heads").size
    b, h, n, d = x.shape
    rows = x.transpose(0, 1).contiguous()  # [h, b, n, d]: rank p's heads are rows p·h/cp...
    got = collectives.all_to_all(rows, [h // cp] * cp, [h // cp] * cp, group=group,
                                 impl="pairwise", when=when)
    return got.view(cp, h // cp, b, n, d).permute(2, 1, 0, 3, 4).reshape(b, h // cp, cp * n, d)


def heads_to_seq(x: torch.Tensor, group: Group = None, when: str = "") -> torch.Tensor:
    """[b, h/cp, s, d] -> [b, h, s/cp, d]: `seq_to_heads` undone (one all-to-all)."""
    cp = ring_of(group, "heads_to_seq").size
    b, heads, s, d = x.shape
    n = s // cp
    rows = x.view(b, heads, cp, n, d).permute(2, 1, 0, 3, 4).contiguous()  # [cp, h/cp, b, n, d]
    got = collectives.all_to_all(rows.view(cp * heads, b, n, d), [heads] * cp, [heads] * cp,
                                 group=group, impl="pairwise", when=when)
    return got.view(cp * heads, b, n, d).transpose(0, 1)


AllToAll = Callable[[torch.Tensor, Group, str], torch.Tensor]


class _Exchange(torch.autograd.Function):
    """`there` forward, `back` (its inverse, and so its transpose) backward."""

    @staticmethod
    def forward(ctx, x, group, there, back):
        ctx.group, ctx.back = group, back
        return there(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.group, "backward"), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      group: Group = None, layout: Layout = "contiguous",
                      all_to_alls: tuple[AllToAll, AllToAll] | None = None) -> torch.Tensor:
    """DeepSpeed-Ulysses over `group`: q, k, v [b, h, s/cp, d] of this rank's tokens go
    head-sharded by an all-to-all each, attention runs over the whole sequence on h/cp heads,
    and the output comes back by a fourth all-to-all. Differentiable
    (backward runs the four the other way). Needs h divisible by cp.

    `all_to_alls` = (to heads, to the sequence), each f(x, group, when), replaces the
    library's `seq_to_heads` and `heads_to_seq` (a lab's own, checked against them)."""
    there, back = all_to_alls or (seq_to_heads, heads_to_seq)
    plan = _plan({"q": q, "k": k, "v": v}, causal, group, layout, "ulysses_attention")
    heads = q.shape[1]
    if heads % plan.cp:
        raise ValueError(
            f"ulysses_attention: heads={heads} is not divisible by cp={plan.cp}: Ulysses gives "
            f"each rank heads/cp whole heads; use a cp that divides {heads} (ring attention has "
            f"no such limit)")
    if plan.cp == 1:
        return _RingAttention.apply(q, k, v, causal, plan, None)
    q, k, v = (_Exchange.apply(t, plan.group, there, back) for t in (q, k, v))
    # The whole sequence, every rank's tokens in rank order, attended by the same blockwise
    # arithmetic as ring attention's (so that the two differ only in what they send).
    held = plan.order if causal and plan.order is not None else torch.arange(q.shape[2])
    whole = _Plan(None, 1, 0, (_Runs.of(held),), None)
    out = _RingAttention.apply(q, k, v, causal, whole, None)
    return _Exchange.apply(out.contiguous(), plan.group, back, there)


# --- Which is faster ----------------------------------------------------------------------------


def forward_times(seq_len: int, batch: int, heads: int, head_dim: int, cp: int,
                  link: AlphaBeta, flops_per_second: float,
                  bytes_per_element: int = 4) -> dict[str, float]:
    """Seconds of one forward of attention without a causal mask on each of cp ranks, by the
    α-β model: {"ring": ..., "ulysses": ...}.

    Ring attention overlaps each key/value transfer with a block's attention; Ulysses' all-to-
    alls are not hidden. The model itself is Lab 13's Exercise 6, which derives it.
    """
    step = 4 * batch * heads * (seq_len / cp) ** 2 * head_dim / flops_per_second
    if cp == 1:
        return {"ring": step, "ulysses": step}
    block = batch * heads * seq_len / cp * head_dim * bytes_per_element
    transfer = link.alpha + 2 * block * link.beta
    all_to_all = link.alpha + (cp - 1) / cp * block * link.beta
    return {"ring": step + (cp - 1) * max(step, transfer), "ulysses": 4 * all_to_all + cp * step}


# --- Inside a model -----------------------------------------------------------------------------


class ContextParallelCore:
    """The attention core of a `minidist.parallel.models.Attention` (or tensor-parallel
    `ParallelAttention`, set as its `core`) over a cp group: q, k, v [b, s/cp, heads·d] of
    this rank's tokens in `layout`, causal, by "ring" or "ulysses"."""

    def __init__(self, group: Group, *, layout: str = "zigzag", method: str = "ring"):
        if method not in ("ring", "ulysses"):
            raise ValueError(f"method={method!r}: choose 'ring' or 'ulysses'")
        _check_layout(layout)
        self.group, self.layout, self.method = group, layout, method

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 heads: int) -> torch.Tensor:
        batch, tokens, width = q.shape
        split = [t.view(batch, tokens, heads, width // heads).transpose(1, 2) for t in (q, k, v)]
        attention = ring_attention if self.method == "ring" else ulysses_attention
        out = attention(*split, causal=True, group=self.group, layout=self.layout)
        return out.transpose(1, 2).reshape(batch, tokens, width)
