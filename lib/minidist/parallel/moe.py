"""Mixture of experts with expert parallelism: tokens travel to their experts by all-to-all.

A mixture-of-experts layer replaces one feed-forward network by `experts` of them and a router
that sends each token to its `top_k` best (GShard, Lepikhin et al. 2020; Switch Transformer,
Fedus et al. 2021). Expert parallelism puts experts/P of them on each of the P ranks of a
group; each rank routes its own tokens, and one forward is

    route           router logits -> softmax -> the top_k experts of each token and their
                    weights (the softmax probabilities, not renormalised)
    capacity        with a capacity_factor, expert e takes at most
                    capacity = ceil(capacity_factor · tokens · top_k / experts)
                    of this rank's token assignments, in token order; the rest are dropped
                    (they contribute zero; the block's residual carries the token on)
    counts          tokens this rank sends to each expert, sorted by expert
    split sizes     tokens to each rank: the counts of the experts it owns, added up
    all-to-all      the counts first (each rank learns what it will receive), then the tokens
    experts         each local expert runs on the tokens sent to it
    all-to-all back the outputs return along the same splits, reversed
    combine         each token's output is the weighted sum of its experts' outputs

How many all-to-alls one layer runs in a training step, and why, is Lab 07's Q3 (GShard;
REFERENCES.md#gshard). Each runs through `minidist.communication.collectives`, recorded as an
"all_to_all" with the bytes that leave the rank, `when` "forward", "backward", or "counts" for the
exchange of the sizes. Each step is a small function here, so that a lab can have students write
it and check it.

`group` is the expert-parallel group (e.g. `mesh.group("ep")`); None: the default process group,
every rank, or this process alone when torch.distributed is not initialized.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minidist.communication import collectives
from minidist.core._checks import positive, positive_int
from minidist.parallel.models import FeedForward

__all__ = [
    "route", "capacity_of", "within_capacity", "tokens_per_expert", "split_sizes",
    "exchange_counts", "AllToAll", "all_to_all", "run_experts", "dispatch_and_combine", "MoELayer",
]


def _group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in the expert-parallel `group`: 1 when torch.distributed is not initialized."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), each [tokens, top_k]: every token's top_k experts by router
    probability, best first, and those probabilities."""
    return F.softmax(logits, dim=-1).topk(top_k, dim=-1)


def capacity_of(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """The most assignments one expert takes from one rank's `tokens` tokens (GShard)."""
    return math.ceil(capacity_factor * tokens * top_k / experts)


def within_capacity(expert_of: torch.Tensor, experts: int, capacity: int | None) -> torch.Tensor:
    """Which assignments an expert keeps: for each expert, the first `capacity` of the
    assignments `expert_of` (one expert id per assignment, in token order) sent to it. All of
    them when `capacity` is None."""
    if capacity is None:
        return torch.ones_like(expert_of, dtype=torch.bool)
    one_hot = F.one_hot(expert_of, experts)
    place_in_queue = (one_hot.cumsum(0) * one_hot).sum(1) - 1  # 0 for an expert's first token
    return place_in_queue < capacity


def tokens_per_expert(expert_of: torch.Tensor, experts: int) -> torch.Tensor:
    """How many assignments go to each expert: [experts] counts (the load of each expert)."""
    return torch.bincount(expert_of, minlength=experts)


def split_sizes(counts: torch.Tensor, ranks: int) -> list[int]:
    """Tokens for each rank of the group: rank r owns experts [r·E/P, (r+1)·E/P), so it gets
    the sum of their counts. `counts` are per expert, in expert order."""
    return counts.view(ranks, -1).sum(1).tolist()


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-to-all of the per-expert counts: returns [P, E/P], row p = how many tokens rank p
    sends to each of this rank's experts. Both sides of the token all-to-all need the sizes."""
    ranks = dist.get_world_size(group)
    rows = counts.view(ranks, -1)  # row p: the counts of rank p's experts
    return collectives.all_to_all(rows, [1] * ranks, [1] * ranks, group=group, when="counts")


class AllToAll(torch.autograd.Function):
    """all_to_all_single of the rows of a [n, hidden] tensor with uneven splits; backward sends
    the gradients back along the same splits, reversed."""

    @staticmethod
    def forward(ctx, x, send_sizes, receive_sizes, group):
        ctx.sizes, ctx.group = (send_sizes, receive_sizes), group
        return _all_to_all(x, send_sizes, receive_sizes, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        send_sizes, receive_sizes = ctx.sizes
        return _all_to_all(grad, receive_sizes, send_sizes, ctx.group, "backward"), None, None, None


def _all_to_all(x: torch.Tensor, send_sizes: list[int], receive_sizes: list[int],
                group: dist.ProcessGroup | None, when: str) -> torch.Tensor:
    return collectives.all_to_all(x, send_sizes, receive_sizes, group=group, when=when)


def all_to_all(x: torch.Tensor, send_sizes: list[int], receive_sizes: list[int],
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Send rows [sum(send_sizes[:p]), sum(send_sizes[:p+1])) of x to rank p of the group;
    return what the ranks sent here, in rank order (differentiable)."""
    return AllToAll.apply(x, send_sizes, receive_sizes, group)


def run_experts(experts: nn.ModuleList, tokens: torch.Tensor, counts: torch.Tensor
                ) -> torch.Tensor:
    """Apply this rank's experts to received tokens. `counts` [P, E/P]: the tokens come
    grouped by source rank, then by expert inside each source (how they were sent)."""
    chunks = tokens.split(counts.flatten().tolist())
    local = len(experts)
    return torch.cat([experts[i % local](chunk) for i, chunk in enumerate(chunks)])


def dispatch_and_combine(outgoing: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleList,
                         group: dist.ProcessGroup | None) -> torch.Tensor:
    """The expert-parallel heart of a forward: `outgoing` holds this rank's token rows sorted
    by expert, `counts` [E] how many go to each expert. Counts -> split sizes -> all-to-all
    -> this rank's experts -> all-to-all back; returns each row's expert output, in
    `outgoing`'s order. In a group of one rank every expert is local and nothing is sent."""
    if _group_size(group) == 1:
        return run_experts(experts, outgoing, counts.view(1, -1))
    received_counts = exchange_counts(counts, group)
    send = split_sizes(counts, dist.get_world_size(group))
    receive = received_counts.sum(1).tolist()
    incoming = all_to_all(outgoing, send, receive, group)
    return all_to_all(run_experts(experts, incoming, received_counts), receive, send, group)


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer: a top-k router over `experts` FeedForward
    networks (hidden -> ffn_hidden -> hidden), on input [..., hidden].

    `group`: the expert-parallel group (see the module doc); each of its P ranks holds
    experts/P experts and routes its own tokens (like data parallelism: different tokens on
    each rank). In a group of one rank (or a single process) every expert is local and nothing
    is sent. `capacity_factor`: None keeps every assignment; otherwise
    each expert takes at most `capacity_of(tokens, top_k, experts, capacity_factor)` of a
    rank's assignments and drops the rest.

    After each forward, `dropped` is the number of this rank's (token, expert) assignments
    dropped, and `load` the number each expert was sent from this rank (before dropping), for
    plots of load imbalance.
    """

    def __init__(self, hidden: int, ffn_hidden: int, experts: int, top_k: int,
                 *, group: dist.ProcessGroup | None = None, capacity_factor: float | None = None):
        super().__init__()
        positive_int(hidden=hidden, ffn_hidden=ffn_hidden, experts=experts, top_k=top_k)
        if top_k > experts:
            raise ValueError(f"top_k={top_k} is more than experts={experts}: a token cannot "
                             f"go to more experts than there are; use top_k <= {experts}")
        if capacity_factor is not None:
            positive(capacity_factor=capacity_factor)
        self.ranks = _group_size(group)
        if experts % self.ranks:
            raise ValueError(
                f"experts={experts} is not divisible by the expert-parallel group's "
                f"{self.ranks} ranks: every rank holds the same number of experts; use a "
                f"multiple of {self.ranks} experts or a group whose size divides {experts}")
        self.group, self.num_experts, self.top_k = group, experts, top_k
        self.capacity_factor = capacity_factor
        local = experts // self.ranks
        self.first_expert = (dist.get_rank(group) if self.ranks > 1 else 0) * local
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(hidden, ffn_hidden) for _ in range(local))
        self.dropped = 0
        self.load = torch.zeros(experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = route(self.router(tokens), self.top_k)
        expert_of = chosen.flatten()  # assignment a is token a // top_k's (a % top_k)-th choice
        self.load = tokens_per_expert(expert_of, self.num_experts)
        capacity = None if self.capacity_factor is None else capacity_of(
            len(tokens), self.top_k, self.num_experts, self.capacity_factor)
        kept = within_capacity(expert_of, self.num_experts, capacity).nonzero().flatten()
        self.dropped = len(expert_of) - len(kept)
        # the kept assignments sorted by expert, so each rank's tokens are one contiguous run
        order = kept[torch.sort(expert_of[kept], stable=True).indices]
        counts = tokens_per_expert(expert_of[order], self.num_experts)
        results = dispatch_and_combine(tokens[order // self.top_k], counts, self.experts,
                                       self.group)
        weighted = results * weights.flatten()[order].unsqueeze(1)
        combined = torch.zeros_like(tokens).index_add(0, order // self.top_k, weighted)
        return combined.view_as(x)

    @torch.no_grad()
    def load_from(self, layer: MoELayer) -> MoELayer:
        """Take the router and this rank's experts from a layer holding all of them (built
        in a single process, or on a group of one rank), e.g. to start from the same weights
        as a single-process layer."""
        if len(layer.experts) != self.num_experts:
            raise ValueError(f"load_from needs a layer holding all {self.num_experts} experts "
                             f"(built on a group of one rank), got one holding "
                             f"{len(layer.experts)}")
        self.router.load_state_dict(layer.router.state_dict())
        for i, expert in enumerate(self.experts):
            expert.load_state_dict(layer.experts[self.first_expert + i].state_dict())
        return self
