"""Collectives built only from point-to-point send/recv, and the one counter of communication.

Ring all-reduce (Patarasuk & Yuan 2009) on N ranks cuts the tensor into N chunks and makes two
trips around the ring rank 0 -> 1 -> ... -> N-1 -> 0:

    reduce-scatter  N-1 steps: each rank sends one chunk to its right neighbour, receives one
                    from its left and adds it in. Afterwards rank r holds the sum of chunk r.
    all-gather      N-1 steps: each rank forwards the last finished chunk it got, so every
                    finished chunk travels once around the ring.

Each rank sends 2(N-1) chunks of S/N bytes, 2(N-1)/N * S in all, which tends to 2S whatever N
is: time ~ 2(N-1)*alpha + 2(N-1)/N * S * beta (Thakur, Rabenseifner & Gropp 2005). Every link
carries the same load at every step, so no link is the bottleneck; that is why NCCL and gloo
use rings for large messages. `minidist.cost` turns these formulas into numbers.

A message of 512 KiB or more travels as several equal segments (`segment_count`), added in as
soon as it lands while the next is still on its way, as gloo and NCCL pipeline theirs: the
same bytes in a few more messages, with the additions hidden behind the transfers.

Every function works in place on a contiguous tensor, on the default process group or on
`group` (ranks are then counted inside the group, as torch does).

The ring pays 2(N-1) latencies whatever the size, so small tensors go faster with fewer,
larger steps. `all_reduce(tensor, algorithm=...)` offers, besides "ring", "recursive_doubling"
(log2 N steps of the whole tensor), "tree" (a binomial-tree reduce, then a broadcast) and
"rabenseifner" (reduce-scatter by recursive halving, all-gather by recursive doubling: the
ring's bytes in 2 log2 N steps), all from the same point-to-point sends; "auto" picks by the
alpha-beta model, each algorithm's own alpha and beta fitted on this machine (`fit_links`).
`minidist.cost` has their costs.

`count_traffic()` is how every parallelism in minidist reports what it sends: inside its block
it counts the point-to-point bytes and messages this rank sends, and keeps one
`minidist.traffic.Collective` record per collective that any minidist module runs (these rings,
`sharding`, `ddp`, `zero`, `fsdp`, `tensor_parallel`), the same records that
`minidist.traffic` predicts.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minidist._checks import require_process_group
from minidist.cost import ALL_REDUCE_ALGORITHMS, AlgorithmLinks, AlphaBeta
from minidist.traffic import Collective, Traffic

_TORCH_OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}


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


# --- The ring -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ring:
    rank: int  # this rank's position in the group
    size: int
    left: int  # global ranks of the neighbours: send/recv address peers by global rank
    right: int
    group: dist.ProcessGroup | None
    members: tuple[int, ...]  # global rank of each group rank
    process_group: dist.ProcessGroup  # `group`, or the default group when it is None

    def peer(self, group_rank: int) -> int:
        """The global rank of group rank `group_rank`, the address send/recv want."""
        return self.members[group_rank]

    # dist.isend and dist.irecv check their arguments and translate ranks on every call, tens
    # of microseconds that each segment would pay; these go straight to the process group's
    # own send and recv (where count_traffic counts), with ranks checked once per group.
    def isend(self, tensor: torch.Tensor, to: int) -> dist.Work:
        """dist.isend(tensor, to, group) for global rank `to`."""
        return self.process_group.send([tensor], self.members.index(to), 0)

    def irecv(self, tensor: torch.Tensor, source: int) -> dist.Work:
        """dist.irecv(tensor, source, group) for global rank `source`."""
        return self.process_group.recv([tensor], self.members.index(source), 0)


# Each group's ring, built once: all_reduce of a small tensor takes only tens of microseconds,
# and asking torch for ranks and members on every call would add as much again.
_rings: dict[dist.ProcessGroup, _Ring] = {}


def _ring(group: dist.ProcessGroup | None, what: str) -> _Ring:
    require_process_group(what)
    key = group or dist.group.WORLD
    ring = _rings.get(key)
    if ring is not None:
        return ring
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of group {group} (its ranks are "
            f"{dist.get_process_group_ranks(group)}); call {what} only on the group's members"
        )
    members = tuple(dist.get_process_group_ranks(key))
    ring = _rings[key] = _Ring(rank, size, members[(rank - 1) % size],
                               members[(rank + 1) % size], group, members, key)
    return ring


# A message is cut into equal segments so that the receiver adds each one while the next is
# still arriving. Whole messages left the link idle during every addition and the CPU idle
# during every transfer: on 2 ranks the ring reached only ~0.7x gloo's busbw from 8 MiB. Timed
# on 2 otherwise idle ranks, about four segments of 256 KiB to 1 MiB traded that overlap best
# against the tens of microseconds each message costs.
_SEGMENTS = 4
_MIN_SEGMENT_BYTES = 1 << 18
_MAX_SEGMENT_BYTES = 1 << 20


def segment_count(nbytes: int) -> int:
    """How many messages a send of `nbytes` travels as: one up to 512 KiB, then up to four of
    at least 256 KiB, and more above 4 MiB so that none exceeds 1 MiB."""
    return max(1, min(_SEGMENTS, nbytes // _MIN_SEGMENT_BYTES), -(-nbytes // _MAX_SEGMENT_BYTES))


def _segments(numel: int, element_size: int) -> list[tuple[int, int]]:
    """(start, end) of the equal segments that carry a message of `numel` elements."""
    return chunk_bounds(numel, segment_count(numel * element_size))


def _exchange(send: torch.Tensor, recv: torch.Tensor, ring: _Ring,
              to: int | None = None, source: int | None = None,
              add_to: torch.Tensor | None = None) -> None:
    """Send `send` to global rank `to` while receiving `recv` from `source` (by default the
    right and the left neighbour); with `add_to`, add what arrives into it, segment by
    segment as each one lands.

    Every send and receive is posted before any is waited on: two blocking calls would
    deadlock, every rank sending while nobody receives. Both sides cut a message into the same
    segments (its size is all they depend on), and gloo matches the messages between two ranks
    in the order they were posted.
    """
    to = ring.right if to is None else to
    source = ring.left if source is None else source
    element_size = send.element_size()
    # Receives are posted before sends: a gloo send waits until the peer has posted the
    # matching receive, so posting ours first lets the peer's data start moving at once.
    # Measured on 2 ranks, 256 KiB to 4 MiB: recursive doubling 0.75-0.9x -> 0.9-1.05x gloo.
    segments = _segments(recv.numel(), element_size)
    receives = [ring.irecv(recv[start:end], source) for start, end in segments]
    sends = [ring.isend(send[start:end], to)
             for start, end in _segments(send.numel(), element_size)]
    # Recursive doubling adds into the very tensor it sends: a segment may change only once
    # it has left. (Each request is waited on exactly once: a gloo send waited on twice waits
    # for a second send that never comes.)
    sent = 0
    adds_into_send = add_to is not None and add_to.data_ptr() == send.data_ptr()
    for (start, end), receive in zip(segments, receives, strict=True):
        receive.wait()
        if add_to is not None:
            if adds_into_send:
                sends[sent].wait()
                sent += 1
            add_to[start:end].add_(recv[start:end])  # in the tensor's own dtype, as gloo does
    for request in sends[sent:]:
        request.wait()


def _flat(tensor: torch.Tensor, caller: str) -> torch.Tensor:
    """The 1-D view that the ring cuts into chunks; it shares memory with `tensor`."""
    if not tensor.is_contiguous():
        raise ValueError(
            f"{caller} works in place on a contiguous tensor, got one with shape "
            f"{tuple(tensor.shape)} and strides {tensor.stride()}; pass t.contiguous() "
            f"and copy the result back"
        )
    return tensor.view(-1)


def _reduce_op(op: str | dist.ReduceOp.RedOpType, tensor: torch.Tensor) -> str:
    name = _TORCH_OP_NAMES.get(op) if isinstance(op, dist.ReduceOp.RedOpType) else op
    if name not in ("sum", "avg"):
        raise ValueError(
            f"op must be 'sum' or 'avg' (or dist.ReduceOp.SUM / AVG), got {op!r}; "
            f"for other reductions use torch.distributed.all_reduce"
        )
    if name == "avg" and not tensor.is_floating_point():
        raise ValueError(
            f"op='avg' needs a floating-point tensor, got {tensor.dtype}; "
            f"use op='sum' and divide by the world size yourself"
        )
    return name


# One receive buffer per dtype and device, kept between calls (it grows to the largest chunk
# seen, S/N bytes). A fresh buffer per call would cost more than it looks: glibc hands blocks
# over 32 MB back to the OS when freed, and page-faulting one back in on every call took about
# as long as moving the data (ring all-reduce of 64 MB on 2 ranks ran at 0.6x gloo, now ~0.9x).
# The ring keeps two (`slot` 0 and 1): it receives a step ahead while adding the last one.
_recv_buffers: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}


def _recv_buffer(numel: int, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
    key = (like.dtype, like.device, slot)
    buffer = _recv_buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _recv_buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


def _ring_steps(flat: torch.Tensor, ring: _Ring, first: int, steps: int, reduce_steps: int,
                average: bool = False) -> None:
    """`steps` steps around the ring: in step t this rank sends chunk `first` - t to its right
    and receives chunk `first` - t - 1 from its left, adding it into its own copy in the first
    `reduce_steps` steps (the reduce-scatter) and storing it in place after (the all-gather).

    What a step receives is what the next one sends, so each segment is forwarded as soon as
    it has been added: segments stream around the ring, the reduce-scatter runs straight into
    the all-gather, and no rank waits for a whole chunk before passing it on. `average`
    divides the last chunk reduced, this rank's own, before it goes round: N times less work
    than dividing the whole tensor.

    A step's receives are posted one step ahead, before this rank forwards anything: a gloo
    send waits until its receive is posted, so each forwarded segment can leave at once
    instead of waiting for the neighbour to finish its own step. The reduce-scatter receives
    into two buffers in turn, one filling while the other is added. (Receiving in place in
    the all-gather is safe too: a chunk comes back only after what this rank sent of it
    has arrived.) Measured in alternating runs, the ring gained ~5% at N = 2 and N = 4.
    """
    if steps == 0:  # one rank: nothing to send
        return
    chunks = chunk_bounds(flat.numel(), ring.size)
    element_size = flat.element_size()
    largest = chunks[0][1] - chunks[0][0]  # chunk 0 is the largest
    buffers = [_recv_buffer(largest, flat, slot) for slot in range(min(reduce_steps, 2))]

    def segments(chunk: int) -> list[tuple[int, int]]:
        start, end = chunks[chunk % ring.size]
        return [(start + a, start + b) for a, b in _segments(end - start, element_size)]

    def post_receives(step: int) -> tuple[list[tuple[int, int]], list, list[dist.Work]]:
        """Step `step`'s segments, where they land (a buffer to be added, or in place), and
        their posted receives."""
        pieces = segments(first - step - 1)
        offset = pieces[0][0]
        if step < reduce_steps:
            buffer = buffers[step % 2]
            targets = [buffer[a - offset: b - offset] for a, b in pieces]
        else:
            targets = [flat[a:b] for a, b in pieces]
        return pieces, targets, [ring.irecv(target, ring.left) for target in targets]

    upcoming = post_receives(0)
    sends = [ring.isend(flat[a:b], ring.right) for a, b in segments(first)]
    for step in range(steps):
        pieces, targets, receives = upcoming
        if step < steps - 1:  # its buffer's additions, two steps back, are done
            upcoming = post_receives(step + 1)
        reduce = step < reduce_steps
        for (a, b), target, receive in zip(pieces, targets, receives, strict=True):
            receive.wait()
            if reduce:
                flat[a:b].add_(target)  # in the tensor's own dtype, as gloo does
                if average and step == reduce_steps - 1:
                    flat[a:b].div_(ring.size)
            if step < steps - 1:
                sends.append(ring.isend(flat[a:b], ring.right))
    for send in sends:  # the tensor must not change before what it sent has left
        send.wait()


# --- Public collectives -------------------------------------------------------------------------


def ring_reduce_scatter(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp.RedOpType = "sum",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Reduce `tensor` across ranks so that rank r ends up with the reduced chunk r.

    Works in place on the flat view of a contiguous tensor of any size, with chunks given by
    `chunk_bounds(tensor.numel(), world_size)`, and returns chunk r (a view into `tensor`); the
    other chunks are left holding partial sums. Rank r owning chunk r matches
    torch.distributed.reduce_scatter_single (formerly reduce_scatter_tensor). N-1 steps,
    (N-1)/N * S bytes sent per rank.
    """
    flat = _flat(tensor, "ring_reduce_scatter")
    op_name = _reduce_op(op, tensor)
    ring = _ring(group, "ring_reduce_scatter")
    record("reduce_scatter", flat, group)
    # Our own copy of chunk r-1 goes first; the last chunk this rank finishes is chunk r.
    _ring_steps(flat, ring, ring.rank - 1, ring.size - 1, reduce_steps=ring.size - 1)
    start, end = chunk_bounds(flat.numel(), ring.size)[ring.rank]
    if op_name == "avg":
        flat[start:end].div_(ring.size)
    return flat[start:end]


def ring_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Fill every chunk of `tensor` from the rank that owns it; returns `tensor`.

    On entry chunk r (per `chunk_bounds`) must be valid on rank r; the other chunks are
    overwritten. N-1 steps, (N-1)/N * S bytes sent per rank.
    """
    flat = _flat(tensor, "ring_all_gather")
    ring = _ring(group, "ring_all_gather")
    record("all_gather", flat, group)
    # Our chunk r goes first; every chunk travels once around the ring.
    _ring_steps(flat, ring, ring.rank, ring.size - 1, reduce_steps=0)
    return tensor


def ring_all_reduce(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp.RedOpType = "sum",
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Sum (op="sum") or average (op="avg") `tensor` over all ranks, in place; returns it.

    A reduce-scatter then an all-gather: 2(N-1) steps, 2(N-1)/N * S bytes sent per rank.
    Additions happen in the tensor's own dtype (bfloat16 stays bfloat16, as in gloo), so
    results may differ from dist.all_reduce in the last bits: the order of additions differs.
    """
    flat = _flat(tensor, "ring_all_reduce")
    op_name = _reduce_op(op, tensor)
    ring = _ring(group, "ring_all_reduce")
    record("all_reduce", flat, group)
    _ring_algorithm(flat, ring, op_name == "avg")
    return tensor


def tree_broadcast(
    tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Copy `tensor` from rank `src` to every rank along a binomial tree; returns `tensor`.

    `src` is a global rank, as in torch.distributed.broadcast. In round k = 0, 1, ... every rank
    that already has the data sends it to the rank 2^k places further on (counted from `src`),
    so the number of ranks holding it doubles each round: ceil(log2 N) rounds, each moving the
    whole tensor, time ceil(log2 N) * (alpha + S * beta) (Thakur et al. 2005). It is
    latency-optimal, but `src` sends ceil(log2 N) * S bytes; for large tensors a pipelined
    chain or a scatter + all-gather (~2S * beta) wins.
    """
    flat = _flat(tensor, "tree_broadcast")
    ring = _ring(group, "tree_broadcast")
    if src not in ring.members:
        raise ValueError(
            f"src={src} is not a rank of the group; its global ranks are {list(ring.members)}"
        )
    _binomial_broadcast(flat, ring, root=ring.members.index(src))
    record("broadcast", flat, group)
    return tensor


def _binomial_broadcast(flat: torch.Tensor, ring: _Ring, root: int) -> None:
    relative = (ring.rank - root) % ring.size  # our position in a tree rooted at 0
    distance = 1
    while distance < ring.size:
        if relative < distance and relative + distance < ring.size:
            dist.send(flat, ring.peer((relative + distance + root) % ring.size), group=ring.group)
        elif distance <= relative < 2 * distance:
            dist.recv(flat, ring.peer((relative - distance + root) % ring.size), group=ring.group)
        distance *= 2


# --- Latency-optimal all-reduce algorithms ------------------------------------------------------
#
# Recursive doubling and Rabenseifner's algorithm pair rank c with rank c XOR 2^k, so they need
# a power of two of ranks p. With N = p + r ranks, the first 2r ranks pair up (0 with 1, 2 with
# 3, ...): the even one hands its tensor to the odd one and sits out, and gets the result back
# at the end (Thakur, Rabenseifner & Gropp 2005). The p ranks left are numbered
# 0..p-1 ("core" ranks): odd rank i < 2r is core rank i // 2, rank i >= 2r is core rank i - r.


def _core_size(world_size: int) -> int:
    """p, the largest power of two not above the world size: the ranks the exchanges run on."""
    return 1 << (world_size.bit_length() - 1)


def _core_rank(ring: _Ring) -> tuple[int | None, int]:
    """(this rank's core rank, or None if it sits out; p)."""
    p = _core_size(ring.size)
    extra = ring.size - p
    if ring.rank >= 2 * extra:
        return ring.rank - extra, p
    return (ring.rank // 2 if ring.rank % 2 else None), p


def _group_rank_of_core(core: int, ring: _Ring, p: int) -> int:
    extra = ring.size - p
    return 2 * core + 1 if core < extra else core + extra


def _fold_in(flat: torch.Tensor, ring: _Ring, buffer: torch.Tensor) -> int | None:
    """The first step for N not a power of two; returns this rank's core rank (None: sit out)."""
    core, p = _core_rank(ring)
    if ring.rank < 2 * (ring.size - p):
        partner = ring.peer(ring.rank ^ 1)
        if core is None:
            dist.send(flat, partner, group=ring.group)
        else:
            dist.recv(buffer, partner, group=ring.group)
            flat.add_(buffer)
    return core


def _fold_out(flat: torch.Tensor, ring: _Ring, core: int | None) -> None:
    """The last step for N not a power of two: hand the result to the ranks that sat out."""
    p = _core_size(ring.size)
    if ring.rank < 2 * (ring.size - p):
        partner = ring.peer(ring.rank ^ 1)
        if core is None:
            dist.recv(flat, partner, group=ring.group)
        else:
            dist.send(flat, partner, group=ring.group)


def _recursive_doubling(flat: torch.Tensor, ring: _Ring, average: bool) -> None:
    buffer = _recv_buffer(flat.numel(), flat)
    core = _fold_in(flat, ring, buffer)
    if core is not None:
        p = _core_size(ring.size)
        distance = 1
        while distance < p:
            partner = ring.peer(_group_rank_of_core(core ^ distance, ring, p))
            # a + b == b + a exactly in floating point, so both partners hold the same bits.
            _exchange(flat, buffer, ring, to=partner, source=partner, add_to=flat)
            distance *= 2
        if average:
            flat.div_(ring.size)
    _fold_out(flat, ring, core)


def _rabenseifner(flat: torch.Tensor, ring: _Ring, average: bool) -> None:
    core = _fold_in(flat, ring, _recv_buffer(flat.numel(), flat))
    if core is not None:
        p = _core_size(ring.size)
        # Where each of the p chunks starts: chunks lo..hi-1 are flat[starts[lo]:starts[hi]].
        starts = [start for start, _ in chunk_bounds(flat.numel(), p)] + [flat.numel()]
        buffer = _recv_buffer(starts[p // 2], flat)  # the first half, the largest
        lo, hi = 0, p
        distance = p // 2
        while distance >= 1:  # reduce-scatter by recursive halving
            partner = ring.peer(_group_rank_of_core(core ^ distance, ring, p))
            middle = lo + distance
            if core & distance:
                (send_lo, send_hi), (lo, hi) = (lo, middle), (middle, hi)
            else:
                (send_lo, send_hi), (lo, hi) = (middle, hi), (lo, middle)
            kept = flat[starts[lo]:starts[hi]]
            _exchange(flat[starts[send_lo]:starts[send_hi]], buffer[: kept.numel()], ring,
                      partner, partner, add_to=kept)
            distance //= 2
        if average:
            flat[starts[lo]:starts[hi]].div_(ring.size)  # chunk `core`: N times less work
        distance = 1
        while distance < p:  # all-gather by recursive doubling, straight into place
            partner = ring.peer(_group_rank_of_core(core ^ distance, ring, p))
            theirs = (lo - distance, lo) if core & distance else (hi, hi + distance)
            _exchange(flat[starts[lo]:starts[hi]], flat[starts[theirs[0]]:starts[theirs[1]]],
                      ring, partner, partner)
            lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
            distance *= 2
    _fold_out(flat, ring, core)


_TREE_SEGMENT_BYTES = 1 << 21


def _tree(flat: torch.Tensor, ring: _Ring, average: bool) -> None:
    """A binomial-tree reduce to rank 0, then the broadcast's tree from rank 0, both pipelined.

    Rank r's parent is r minus its highest set bit; its children are r + 2^k for every 2^k > r
    (`tree_broadcast`'s tree). A tensor of 4 MiB or more travels in segments of 2 to 4 MiB:
    a rank adds a segment from each child and sends the sum up at once, while the next
    segments are still arriving, and rank 0 starts sending each finished segment back down
    while later ones are still being reduced, as NCCL pipelines its trees. Measured on 2
    ranks sharing 2 cores: whole messages left the link idle during every addition (~0.8x
    gloo at 32-64 MiB, ~1.0x pipelined), but pipelining turns the tree's one-way sends into
    two-way traffic, which costs more on shared cores: with the ring's segments (256 KiB
    from 512 KiB up) the tree lost half its speed at 512 KiB to 1 MiB.
    """
    rank, size = ring.rank, ring.size
    parent = rank - (1 << (rank.bit_length() - 1)) if rank else None
    children = [rank + (1 << k) for k in range(size.bit_length())
                if (1 << k) > rank and rank + (1 << k) < size]
    nbytes = flat.numel() * flat.element_size()
    segments = chunk_bounds(flat.numel(), max(1, nbytes // _TREE_SEGMENT_BYTES))
    buffers = [_recv_buffer(flat.numel(), flat, slot) for slot in range(len(children))]
    from_children = [[ring.irecv(buffer[a:b], ring.peer(child)) for a, b in segments]
                     for child, buffer in zip(children, buffers, strict=True)]
    # The result lands in place: segment i comes down only after the parent has received this
    # rank's partial sum of segment i, so the receive never overwrites what is still to leave.
    from_parent = ([] if parent is None else
                   [ring.irecv(flat[a:b], ring.peer(parent)) for a, b in segments])
    sends = []
    for i, (a, b) in enumerate(segments):  # reduce, segment by segment
        for receives, buffer in zip(from_children, buffers, strict=True):
            receives[i].wait()
            flat[a:b].add_(buffer[a:b])  # in the tensor's own dtype, as gloo does
        if parent is not None:
            sends.append(ring.isend(flat[a:b], ring.peer(parent)))
        else:  # rank 0 holds the sum of this segment: it goes down at once
            if average:
                flat[a:b].div_(size)
            sends += [ring.isend(flat[a:b], ring.peer(child)) for child in children]
    if parent is not None:  # broadcast, each segment as it arrives
        for (a, b), receive in zip(segments, from_parent, strict=True):
            receive.wait()
            sends += [ring.isend(flat[a:b], ring.peer(child)) for child in children]
    for send in sends:
        send.wait()


def _ring_algorithm(flat: torch.Tensor, ring: _Ring, average: bool) -> None:
    # The reduce-scatter's N-1 steps, then the all-gather's, as one stream.
    _ring_steps(flat, ring, ring.rank - 1, 2 * (ring.size - 1), ring.size - 1, average)


@functools.lru_cache(maxsize=4096)
def _best_all_reduce(link: AlphaBeta | AlgorithmLinks, nbytes: int, world_size: int) -> str:
    """link.best_all_reduce, remembered: training all-reduces the same sizes every step, and
    small tensors take only tens of microseconds to all-reduce."""
    return link.best_all_reduce(nbytes, world_size)


_ALGORITHMS = {
    "ring": _ring_algorithm,
    "recursive_doubling": _recursive_doubling,
    "tree": _tree,
    "rabenseifner": _rabenseifner,
}


def all_reduce(
    tensor: torch.Tensor,
    op: str | dist.ReduceOp.RedOpType = "sum",
    group: dist.ProcessGroup | None = None,
    algorithm: str = "auto",
    link: AlphaBeta | AlgorithmLinks | None = None,
) -> torch.Tensor:
    """Sum or average `tensor` over all ranks in place with `algorithm`; returns it.

    algorithm            steps, N = 2^k   bytes sent by the busiest rank
    "ring"               2(N-1)           2(N-1)/N * S
    "recursive_doubling" log2 N           log2 N * S
    "tree"               2 log2 N         log2 N * S (rank 0, in the broadcast)
    "rabenseifner"       2 log2 N         2(N-1)/N * S
    "auto"               whichever `link.best_all_reduce` predicts fastest

    `link` is what "auto" decides with: an `AlgorithmLinks` (each algorithm's own alpha and
    beta), by default the one `fit_links(group)` measures on the first "auto" call and keeps
    for the group, or one `AlphaBeta` for every algorithm (the textbook model, with the
    additions' gamma). Every rank must pass the same `algorithm`, `link` and tensor size. Full
    costs, N not a power of two included, are in `minidist.cost` (Thakur, Rabenseifner &
    Gropp 2005). Additions happen in the tensor's own dtype, in an order that differs between
    algorithms, so floating-point results may differ in the last bits.
    """
    if algorithm != "auto" and algorithm not in _ALGORITHMS:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r}; valid ones are 'auto', "
            f"{', '.join(map(repr, ALL_REDUCE_ALGORITHMS))}"
        )
    flat = _flat(tensor, "all_reduce")
    op_name = _reduce_op(op, tensor)
    ring = _ring(group, "all_reduce")
    if algorithm == "auto":
        algorithm = _best_all_reduce(link or fit_links(group),
                                     flat.numel() * flat.element_size(), ring.size)
    record("all_reduce", flat, group)
    if ring.size > 1:
        _ALGORITHMS[algorithm](flat, ring, op_name == "avg")
    return tensor


# Sizes each algorithm is timed at; its links are fitted on each range between two of them.
_FIT_SIZES = (2**12, 2**16, 2**18, 2**20, 2**22)
_links: dict[dist.ProcessGroup, AlgorithmLinks] = {}


def fit_links(group: dist.ProcessGroup | None = None, repeats: int = 9) -> AlgorithmLinks:
    """Each all-reduce algorithm's own link on `group`, as "auto" sees it: measured on the
    first call and kept per group.

    Every algorithm is timed at five sizes from 4 KiB to 4 MiB, its additions included, and
    fitted to its own a * alpha + b * S * beta on each range between two of them
    (`cost.AlgorithmLinks`). One link fitted on the ring alone would say what the ring pays
    per step and per byte, but where ranks share cores the tree's one-way sends and the
    exchanges of the others pay differently, and differently at different sizes. Each point
    is the median of `repeats` timings, what a call typically costs: an algorithm whose calls
    are fast only now and then is not the one to pick. The timings are taken in rounds in
    which every algorithm and size has a turn, so that a moment when other processes had the
    CPU cannot spoil one algorithm's every timing, and on the slowest rank, so that every rank
    fits the same links and "auto" makes the same choice everywhere. Nine rounds, not five:
    with five, one of three bench runs picked the ring at 1 MiB on 2 ranks, at about half the
    tree's speed. About 1.5 s on 2 ranks of a 2-core laptop, 4 s on 4; every member of the
    group must call it (as "auto" does), at the same time. What it sends is not counted by
    `count_traffic`.
    """
    ring = _ring(group, "fit_links")
    key = group or dist.group.WORLD
    if key not in _links:
        _links[key] = _fit_links(ring, repeats)
    return _links[key]


def _fit_links(ring: _Ring, repeats: int) -> AlgorithmLinks:
    if ring.size == 1:  # nothing is ever sent
        free = (AlphaBeta(0.0, 0.0),) * (len(_FIT_SIZES) - 1)
        return AlgorithmLinks(1, _FIT_SIZES, tuple((name, free) for name in _ALGORITHMS))
    tensors = [torch.zeros(nbytes // 4) for nbytes in _FIT_SIZES]  # zeros never overflow
    # A timing of a small size spans several calls: one call of 4 KiB lasts about as long as
    # the timer's and the barrier's own jitter.
    calls = [max(1, 2**14 // nbytes) for nbytes in _FIT_SIZES]
    points = [(algorithm, tensor, count) for algorithm in _ALGORITHMS.values()
              for tensor, count in zip(tensors, calls, strict=True)]
    timings = torch.empty(repeats, len(points), dtype=torch.float64)
    with uncounted():
        for round_ in range(-1, repeats):  # round -1 warms up: connections, buffers, pages
            for i, (algorithm, tensor, count) in enumerate(points):
                dist.barrier(group=ring.group)
                # Ranks leave a barrier at different times, and a call right after one pays
                # for that (up to a millisecond here): one untimed call lines them up.
                algorithm(tensor, ring, False)
                start = time.perf_counter()
                for _ in range(count):
                    algorithm(tensor, ring, False)
                if round_ >= 0:
                    timings[round_, i] = (time.perf_counter() - start) / count
    # A call ends when its slowest rank does; every rank gets the same numbers.
    dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=ring.group)
    per_algorithm = timings.median(dim=0).values.view(len(_ALGORITHMS), len(_FIT_SIZES))
    return AlgorithmLinks.fit(ring.size, _FIT_SIZES,
                              dict(zip(_ALGORITHMS, per_algorithm.tolist(), strict=True)))


# --- Counting what is sent ----------------------------------------------------------------------


@dataclass
class TrafficLog:
    """What this rank sent inside one `count_traffic` block.

    `bytes_sent` and `messages`: the point-to-point payload bytes and sends that left this
    process. `collectives`: one `Collective` record per collective call a minidist module made,
    with the bytes of the full tensor it reduced or produced, the size of its group and, for
    tensor parallelism, whether it ran "forward" or "backward" (`when`)."""

    bytes_sent: int = 0
    messages: int = 0
    collectives: list[Collective] = field(default_factory=list)

    def calls(self, op: str, when: str | None = None) -> int:
        """How many `op` collectives ran (only those of phase `when`, if given)."""
        return sum(c.count for c in self._matching(op, when))

    def nbytes(self, op: str, when: str | None = None) -> int:
        """Bytes of the full tensors those collectives carried, added up."""
        return sum(c.count * c.nbytes for c in self._matching(op, when))

    def per_collective(self) -> dict[tuple[str, int], tuple[int, int]]:
        """{(op, group size): (calls, bytes of the full tensors)}, in the order first seen."""
        totals: dict[tuple[str, int], tuple[int, int]] = {}
        for c in self.collectives:
            calls, nbytes = totals.get((c.op, c.group), (0, 0))
            totals[(c.op, c.group)] = (calls + c.count, nbytes + c.count * c.nbytes)
        return totals

    @property
    def traffic(self) -> Traffic:
        """The records as a `Traffic`, to compare with `minidist.traffic`'s predictions."""
        return Traffic(tuple(self.collectives))

    def _matching(self, op: str, when: str | None) -> list[Collective]:
        return [c for c in self.collectives if c.op == op and when in (None, c.when)]


_active_logs: list[TrafficLog] = []
_paused = 0  # how many uncounted() blocks are open
# Taken from the class dict, not with getattr: pybind stores methods as descriptors there, and
# only the descriptor binds `self` when put back on the class.
_uncounted_send = vars(dist.ProcessGroup)["send"]


def record(op: str, full: torch.Tensor | int, group: dist.ProcessGroup | None = None,
           when: str = "") -> None:
    """Add one `op` collective to every open `count_traffic` log. `full` is the full tensor
    the collective reduces or produces, or its size in bytes. Every minidist module that runs
    a collective calls this once per call."""
    if _active_logs and not _paused:
        nbytes = full if isinstance(full, int) else full.numel() * full.element_size()
        entry = Collective(op, nbytes, dist.get_world_size(group), 1, when)
        for log in _active_logs:
            log.collectives.append(entry)


def _counting_send(
    self: dist.ProcessGroup, tensors: list[torch.Tensor], *args, **kwargs
) -> dist.Work:
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    for log in _active_logs if not _paused else ():
        log.bytes_sent += nbytes
        log.messages += 1
    return _uncounted_send(self, tensors, *args, **kwargs)


@contextlib.contextmanager
def count_traffic() -> Iterator[TrafficLog]:
    """Count what this rank sends inside the block: point-to-point bytes and messages, and
    every collective a minidist module runs.

        with count_traffic() as log:
            ring_all_reduce(t)
        log.bytes_sent              # 2(N-1)/N * t.nbytes when N divides t.numel()
        log.calls("all_reduce")     # 1

    Point-to-point: every send this process makes through torch.distributed's point-to-point
    API while the block runs: dist.send, dist.isend, dist.batch_isend_irecv (each P2POp with
    dist.isend), send_object_list, and the rings of this module. `bytes_sent` adds up
    numel * element_size of each sent tensor (payload only, no headers); `messages` counts
    sends (a message sent in segments counts once per segment). Receives are not counted,
    nor the bytes of collectives that torch runs as one call (dist.all_reduce, ...): those
    run in C++, where no Python-level send sees them; their calls are in `collectives` when a
    minidist module made them.

    How: all of those point-to-point functions end in one method, ProcessGroup.send, and the
    block replaces that method. Counting there counts each message once however it was sent
    (dist.send itself calls dist.isend, so wrapping both would count twice), and it leaves
    dist.isend untouched, so P2POp's check that its op is dist.isend still passes for ops
    made before, inside or after the block. Blocks nest: an outer log includes what inner
    ones count. The original method is back as soon as the outermost block exits.
    """
    log = TrafficLog()
    if not _active_logs:
        dist.ProcessGroup.send = _counting_send
    _active_logs.append(log)
    try:
        yield log
    finally:
        _active_logs.remove(log)
        if not _active_logs:
            dist.ProcessGroup.send = _uncounted_send


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Inside the block the open `count_traffic` logs count nothing: for set-up work that is
    not part of what they measure (pipeline_exec's shape exchange and warm-up step)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1
