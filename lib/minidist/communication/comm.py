"""Collectives built only from point-to-point send/recv, written as Lab 01 builds them.

Ring all-reduce (Patarasuk & Yuan 2009) on N ranks cuts the tensor into N chunks and makes two
trips around the ring rank 0 -> 1 -> ... -> N-1 -> 0:

    reduce-scatter  N-1 steps: each rank sends one chunk to its right neighbour, receives one
                    from its left and adds it in. Afterwards rank r holds the sum of chunk r.
    all-gather      N-1 steps: each rank forwards the last finished chunk it got, so every
                    finished chunk travels once around the ring.

What each rank sends, and the time that takes on an alpha-beta link (Thakur, Rabenseifner &
Gropp 2005), Lab 01 has you count from these steps. Every link carries the same load at every
step, so no link is the bottleneck; that is why NCCL and gloo use rings for large messages.
`minidist.costs.cost` turns the counts into numbers.

The ring pays a latency per step whatever the size, so small tensors go faster with fewer,
larger steps: recursive doubling (exchanges of the whole tensor with rank r XOR 2^k), a binomial
tree (reduce to rank 0, then broadcast) and Rabenseifner's algorithm (reduce-scatter by
recursive halving, all-gather by recursive doubling: the ring's bytes in fewer steps), below.

Every function works in place on a contiguous tensor, on `group` (None: the default process
group, every rank of the job); ranks are counted inside the group, as torch does, and `Ring`
is the one place that turns a group rank into the global rank send/recv address.

Each all-reduce algorithm is a function f(flat, ring, average, messages) named after it
(`ring_steps`, `tree_steps`, `recursive_doubling_steps`, `rabenseifner_steps`): sum (or average)
the 1-D tensor `flat` over `ring`'s group in place, with `messages` carrying the point-to-point
sends. `minidist.communication.impls` joins each to its row of `minidist.costs.algorithms`' table.

This module is for reading. Every message here travels whole, one step after another.
`minidist.communication.streaming` runs the same algorithms with messages cut into segments that
stream, the way gloo and NCCL do; `minidist.communication.collectives` is what the rest of minidist
calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from minidist.core._checks import reduce_op, require_process_group
from minidist.core._groups import members, per_group_cache
from minidist.core.flat import flat_view

__all__ = [
    "chunk_bounds", "Ring", "ring_of", "Messages", "WHOLE", "ring_reduce_scatter",
    "ring_all_gather", "ring_all_reduce", "tree_broadcast", "reduce_scatter_steps",
    "all_gather_steps", "binomial_broadcast", "ring_steps", "tree_steps",
    "recursive_doubling_steps", "rabenseifner_steps", "pairwise_steps",
]


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """(start, end) of `world_size` contiguous chunks covering `numel` elements.

    The first numel % world_size chunks are one element longer, so chunk sizes differ by at
    most one; when numel < world_size the last chunks are empty.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


# --- Where a rank sits --------------------------------------------------------------------------


@dataclass(frozen=True)
class Ring:
    """This rank's place in `group` seen as a ring 0 -> 1 -> ... -> size-1 -> 0."""

    rank: int  # this rank's position in the group
    size: int
    members: tuple[int, ...]  # the global rank of each group rank
    group: dist.ProcessGroup | None

    def peer(self, group_rank: int) -> int:
        """The global rank of group rank `group_rank` (taken modulo the size), the address
        send and recv want."""
        return self.members[group_rank % self.size]

    @property
    def left(self) -> int:
        """The global rank this rank receives from in a ring step."""
        return self.peer(self.rank - 1)

    @property
    def right(self) -> int:
        """The global rank this rank sends to in a ring step."""
        return self.peer(self.rank + 1)

    def binomial_tree(self) -> tuple[int | None, list[int]]:
        """This rank's parent (None for group rank 0, the root) and children, as group ranks,
        in the binomial tree over the group: rank r's parent is r minus its highest set bit,
        its children are r + 2^k for every 2^k > r."""
        rank, size = self.rank, self.size
        parent = rank - (1 << (rank.bit_length() - 1)) if rank else None
        children = [rank + (1 << k) for k in range(size.bit_length())
                    if (1 << k) > rank and rank + (1 << k) < size]
        return parent, children


# Kept per group: a small collective takes tens of microseconds.
_rings: dict[dist.ProcessGroup, Ring] = per_group_cache()


def ring_of(group: dist.ProcessGroup | None = None, what: str = "a collective") -> Ring:
    """This rank's `Ring` in `group` (None: the default process group)."""
    require_process_group(what)
    key = group or dist.group.WORLD
    if key not in _rings:
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of group {group} (its ranks are "
                f"{list(members(group))}); call {what} only on the group's members"
            )
        ranks = members(group)
        _rings[key] = Ring(rank, len(ranks), ranks, group)
    return _rings[key]


# --- How messages travel ------------------------------------------------------------------------


class Messages:
    """Point-to-point messages sent whole, each step waited for before the next: the simplest
    way to move data, and the one the algorithms below are written against.
    `minidist.communication.streaming` replaces it by segments that overlap their additions."""

    def buffer(self, numel: int, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """A receive buffer of `numel` elements of `like`'s dtype and device."""
        return torch.empty(numel, dtype=like.dtype, device=like.device)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, ring: Ring, to: int,
                 source: int, add_to: torch.Tensor | None = None) -> None:
        """Send `send` to global rank `to` while receiving `recv` from `source`; with
        `add_to`, add what arrived into it. Both are posted before either is waited on: two
        blocking calls would deadlock, every rank sending while nobody receives."""
        requests = [dist.irecv(recv, source, group=ring.group),
                    dist.isend(send, to, group=ring.group)]
        for request in requests:
            request.wait()
        if add_to is not None:
            add_to.add_(recv)  # in the tensor's own dtype, as gloo does

    def send(self, tensor: torch.Tensor, ring: Ring, to: int) -> None:
        dist.send(tensor, to, group=ring.group)

    def recv(self, tensor: torch.Tensor, ring: Ring, source: int) -> None:
        dist.recv(tensor, source, group=ring.group)


WHOLE = Messages()


_OTHER_REDUCTIONS = ("; for other reductions use "
                     "minidist.communication.collectives.all_reduce(..., impl='torch')")


# --- The ring -----------------------------------------------------------------------------------


def reduce_scatter_steps(flat: torch.Tensor, ring: Ring, messages: Messages = WHOLE) -> None:
    """The ring's first trip: in step t this rank sends chunk rank-t-1 to its right, receives
    chunk rank-t-2 from its left and adds it in. After N-1 steps chunk `rank` holds the sum."""
    bounds = chunk_bounds(flat.numel(), ring.size)
    incoming = messages.buffer(bounds[0][1] - bounds[0][0], flat)  # chunk 0 is the largest
    for step in range(ring.size - 1):
        send_start, send_end = bounds[(ring.rank - step - 1) % ring.size]
        recv_start, recv_end = bounds[(ring.rank - step - 2) % ring.size]
        mine = flat[recv_start:recv_end]
        messages.exchange(flat[send_start:send_end], incoming[:mine.numel()], ring,
                          ring.right, ring.left, add_to=mine)


def all_gather_steps(flat: torch.Tensor, ring: Ring, messages: Messages = WHOLE) -> None:
    """The ring's second trip: in step t this rank forwards chunk rank-t to its right and
    receives chunk rank-t-1, in place, from its left."""
    bounds = chunk_bounds(flat.numel(), ring.size)
    for step in range(ring.size - 1):
        send_start, send_end = bounds[(ring.rank - step) % ring.size]
        recv_start, recv_end = bounds[(ring.rank - step - 1) % ring.size]
        messages.exchange(flat[send_start:send_end], flat[recv_start:recv_end], ring,
                          ring.right, ring.left)


def ring_reduce_scatter(tensor: torch.Tensor, op: str = "sum",
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce `tensor` across ranks so that rank r ends up with the reduced chunk r.

    Works in place on the flat view of a contiguous tensor of any size, with chunks given by
    `chunk_bounds(tensor.numel(), world_size)`, and returns chunk r (a view into `tensor`); the
    other chunks are left holding partial sums. N-1 steps, (N-1)/N * S bytes sent per rank.
    """
    flat = flat_view(tensor, "ring_reduce_scatter")
    average = reduce_op(op, tensor, ("sum", "avg"), _OTHER_REDUCTIONS) == "avg"
    ring = ring_of(group, "ring_reduce_scatter")
    reduce_scatter_steps(flat, ring)
    start, end = chunk_bounds(flat.numel(), ring.size)[ring.rank]
    if average:
        flat[start:end].div_(ring.size)
    return flat[start:end]


def ring_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Fill every chunk of `tensor` from the rank that owns it; returns `tensor`.

    On entry chunk r (per `chunk_bounds`) must be valid on rank r; the other chunks are
    overwritten. N-1 steps, (N-1)/N * S bytes sent per rank.
    """
    all_gather_steps(flat_view(tensor, "ring_all_gather"), ring_of(group, "ring_all_gather"))
    return tensor


def ring_all_reduce(tensor: torch.Tensor, op: str = "sum",
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum (op="sum") or average (op="avg") `tensor` over all ranks, in place; returns it.

    A reduce-scatter then an all-gather, N-1 steps each, one chunk sent per step.
    Additions happen in the tensor's own dtype (bfloat16 stays bfloat16, as in gloo), in an
    order that differs from dist.all_reduce's, so results may differ in the last bits.
    """
    flat = flat_view(tensor, "ring_all_reduce")
    average = reduce_op(op, tensor, ("sum", "avg"), _OTHER_REDUCTIONS) == "avg"
    ring_steps(flat, ring_of(group, "ring_all_reduce"), average)
    return tensor


def ring_steps(flat: torch.Tensor, ring: Ring, average: bool, messages: Messages = WHOLE) -> None:
    """Ring all-reduce of the 1-D `flat`: the reduce-scatter's trip, then the all-gather's."""
    reduce_scatter_steps(flat, ring, messages)
    if average:
        start, end = chunk_bounds(flat.numel(), ring.size)[ring.rank]
        flat[start:end].div_(ring.size)  # this rank's chunk only: N times less work
    all_gather_steps(flat, ring, messages)


# --- Trees --------------------------------------------------------------------------------------


def tree_broadcast(tensor: torch.Tensor, src: int = 0,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Copy `tensor` from global rank `src` to every rank along a binomial tree; returns it.

    In round k = 0, 1, ... every rank that already has the data sends it to the rank 2^k places
    further on (counted from `src`), so the number of ranks holding it doubles each round:
    ceil(log2 N) rounds, each moving the whole tensor, time ceil(log2 N) * (alpha + S * beta)
    (Thakur et al. 2005). It is latency-optimal, but `src` sends ceil(log2 N) * S bytes; for
    large tensors a scatter + all-gather (~2S * beta) wins.
    """
    flat, ring = flat_view(tensor, "tree_broadcast"), ring_of(group, "tree_broadcast")
    if src not in ring.members:
        raise ValueError(f"src={src} is not a rank of the group; its global ranks are "
                         f"{list(ring.members)}")
    binomial_broadcast(flat, ring, ring.members.index(src))
    return tensor


def binomial_broadcast(flat: torch.Tensor, ring: Ring, root: int,
                       messages: Messages = WHOLE) -> None:
    """The broadcast's rounds, from group rank `root`."""
    relative = (ring.rank - root) % ring.size  # our position in a tree rooted at 0
    distance = 1
    while distance < ring.size:
        if relative < distance and relative + distance < ring.size:
            messages.send(flat, ring, ring.peer(relative + distance + root))
        elif distance <= relative < 2 * distance:
            messages.recv(flat, ring, ring.peer(relative - distance + root))
        distance *= 2


def tree_steps(flat: torch.Tensor, ring: Ring, average: bool, messages: Messages = WHOLE) -> None:
    """A binomial-tree reduce to group rank 0, then the broadcast's tree back down.

    Each rank adds its children's sums (`Ring.binomial_tree`) into its own and sends the total
    up."""
    parent, children = ring.binomial_tree()
    incoming = messages.buffer(flat.numel(), flat)
    for child in children:
        messages.recv(incoming, ring, ring.peer(child))
        flat.add_(incoming)  # in the tensor's own dtype, as gloo does
    if parent is not None:
        messages.send(flat, ring, ring.peer(parent))
    elif average:
        flat.div_(ring.size)
    binomial_broadcast(flat, ring, 0, messages)


# --- Recursive doubling and Rabenseifner --------------------------------------------------------
#
# Both pair rank c with rank c XOR 2^k, so they need a power of two of ranks p. With N = p + r
# ranks, the first 2r ranks pair up (0 with 1, 2 with 3, ...): the even one hands its tensor to
# the odd one and sits out, and gets the result back at the end (Thakur, Rabenseifner & Gropp
# 2005). The p ranks left are numbered 0..p-1 ("core" ranks): odd rank i < 2r is core rank
# i // 2, rank i >= 2r is core rank i - r.


def _core_size(world_size: int) -> int:
    """p, the largest power of two not above the world size: the ranks the exchanges run on."""
    return 1 << (world_size.bit_length() - 1)


def _core_peer(core: int, ring: Ring) -> int:
    """The global rank of core rank `core`."""
    extra = ring.size - _core_size(ring.size)
    return ring.peer(2 * core + 1 if core < extra else core + extra)


def _fold_in(flat: torch.Tensor, ring: Ring, messages: Messages) -> int | None:
    """The first step for N not a power of two; returns this rank's core rank (None: it sits
    out, having handed its tensor over)."""
    extra = ring.size - _core_size(ring.size)
    if ring.rank >= 2 * extra:
        return ring.rank - extra
    partner = ring.peer(ring.rank ^ 1)
    if ring.rank % 2 == 0:
        messages.send(flat, ring, partner)
        return None
    incoming = messages.buffer(flat.numel(), flat)
    messages.recv(incoming, ring, partner)
    flat.add_(incoming)
    return ring.rank // 2


def _fold_out(flat: torch.Tensor, ring: Ring, core: int | None, messages: Messages) -> None:
    """The last step for N not a power of two: hand the result to the ranks that sat out."""
    if ring.rank < 2 * (ring.size - _core_size(ring.size)):
        partner = ring.peer(ring.rank ^ 1)
        if core is None:
            messages.recv(flat, ring, partner)
        else:
            messages.send(flat, ring, partner)


def recursive_doubling_steps(flat: torch.Tensor, ring: Ring, average: bool,
                             messages: Messages = WHOLE) -> None:
    """log2 p exchanges of the whole tensor with the partner 1, 2, 4, ... core ranks away."""
    core = _fold_in(flat, ring, messages)
    if core is not None:
        incoming = messages.buffer(flat.numel(), flat)
        distance = 1
        while distance < _core_size(ring.size):
            partner = _core_peer(core ^ distance, ring)
            # a + b == b + a exactly in floating point, so both partners hold the same bits.
            messages.exchange(flat, incoming, ring, partner, partner, add_to=flat)
            distance *= 2
        if average:
            flat.div_(ring.size)
    _fold_out(flat, ring, core, messages)


def rabenseifner_steps(flat: torch.Tensor, ring: Ring, average: bool,
                       messages: Messages = WHOLE) -> None:
    """Reduce-scatter by recursive halving (each exchange sends half of what is left to the
    partner and keeps the other half), then all-gather by recursive doubling, straight into
    place: core rank c ends the first half holding the sum of chunk c."""
    core = _fold_in(flat, ring, messages)
    if core is not None:
        p = _core_size(ring.size)
        # Where each of the p chunks starts: chunks lo..hi-1 are flat[starts[lo]:starts[hi]].
        starts = [start for start, _ in chunk_bounds(flat.numel(), p)] + [flat.numel()]
        incoming = messages.buffer(starts[p // 2], flat)  # the first half, the largest
        lo, hi = 0, p
        distance = p // 2
        while distance >= 1:
            middle = lo + distance
            if core & distance:
                (send_lo, send_hi), (lo, hi) = (lo, middle), (middle, hi)
            else:
                (send_lo, send_hi), (lo, hi) = (middle, hi), (lo, middle)
            kept = flat[starts[lo]:starts[hi]]
            partner = _core_peer(core ^ distance, ring)
            messages.exchange(flat[starts[send_lo]:starts[send_hi]], incoming[:kept.numel()],
                              ring, partner, partner, add_to=kept)
            distance //= 2
        if average:
            flat[starts[lo]:starts[hi]].div_(ring.size)  # chunk `core` only
        distance = 1
        while distance < p:
            theirs = (lo - distance, lo) if core & distance else (hi, hi + distance)
            partner = _core_peer(core ^ distance, ring)
            messages.exchange(flat[starts[lo]:starts[hi]],
                              flat[starts[theirs[0]]:starts[theirs[1]]], ring, partner, partner)
            lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
            distance *= 2
    _fold_out(flat, ring, core, messages)


# --- All-to-all -----------------------------------------------------------------------------------


def pairwise_steps(sends: list[torch.Tensor], receives: list[torch.Tensor], ring: Ring) -> None:
    """All-to-all, pairwise: `sends[p]` goes to group rank p and `receives[p]` is filled from
    it. Every rank posts a send to and a receive from every other rank at once, then waits
    for them all; its own piece it copies."""
    receives[ring.rank].copy_(sends[ring.rank])
    requests = [request for peer in range(ring.size) if peer != ring.rank for request in (
        dist.irecv(receives[peer], ring.peer(peer), group=ring.group),
        dist.isend(sends[peer], ring.peer(peer), group=ring.group))]
    for request in requests:
        request.wait()
