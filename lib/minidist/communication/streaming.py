"""`minidist.communication.comm`'s algorithms made fast: messages cut into segments that stream.

`comm` sends each message whole and waits for it before adding it in, so while a message
travels the CPU is idle, and while it adds the link is. gloo and NCCL cut messages into
segments and pipeline them; this module does the same with the same algorithms, and is what
`minidist.communication.collectives` runs for `impl="ring"`, `"tree"`, `"recursive_doubling"`,
`"rabenseifner"` and `"auto"` (through `minidist.communication.impls`, the table that joins each
algorithm to its code here and in comm). Each has comm's name and signature, less `messages`:

    SEGMENTS    comm's `Messages` with each message of 512 KiB or more cut into segments of
                256 KiB to 1 MiB; a segment is added in as soon as it lands, while the next
                one is still on its way. Receives are posted before sends (a gloo send waits
                until its receive is posted); receive buffers are kept between calls; sends
                and receives are posted straight on the process group.
    ring        the reduce-scatter runs straight into the all-gather: each segment is
                forwarded as soon as it has been added, so segments stream around the ring.
    tree        the binomial tree, pipelined in segments of 2-4 MiB: each partial sum goes up
                as soon as it is made, and rank 0 sends each finished segment straight down.
    recursive doubling, Rabenseifner: comm's, with SEGMENTS.

What was measured on the course's 2-core machine, and why each of these choices was kept, is
in `bench/allreduce_busbw.py`'s docstring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.communication import comm
from minidist.communication.comm import Messages, Ring, chunk_bounds

__all__ = ["SEGMENTS", "segment_count", "ring_steps", "reduce_scatter", "all_gather",
           "tree_steps", "recursive_doubling_steps", "rabenseifner_steps", "broadcast_steps",
           "hierarchical_steps"]

_SEGMENTS = 4
_MIN_SEGMENT_BYTES = 1 << 18
_MAX_SEGMENT_BYTES = 1 << 20
_TREE_SEGMENT_BYTES = 1 << 21


def segment_count(nbytes: int) -> int:
    """How many messages a send of `nbytes` travels as: one up to 512 KiB, then up to four of
    at least 256 KiB, and more above 4 MiB so that none exceeds 1 MiB."""
    return max(1, min(_SEGMENTS, nbytes // _MIN_SEGMENT_BYTES), -(-nbytes // _MAX_SEGMENT_BYTES))


def _segments(numel: int, element_size: int) -> list[tuple[int, int]]:
    """(start, end) of the equal segments that carry a message of `numel` elements."""
    return chunk_bounds(numel, segment_count(numel * element_size))


def _isend(ring: Ring, tensor: torch.Tensor, to: int) -> dist.Work:
    """dist.isend(tensor, to, group) without its per-call checks and rank translation."""
    return (ring.group or dist.group.WORLD).send([tensor], ring.members.index(to), 0)


def _irecv(ring: Ring, tensor: torch.Tensor, source: int) -> dist.Work:
    return (ring.group or dist.group.WORLD).recv([tensor], ring.members.index(source), 0)


class Segments(Messages):
    """Messages in segments, each added in as it lands; receive buffers kept between calls."""

    def __init__(self) -> None:
        # Freed blocks over 32 MB go back to the OS, and faulting them in again on every call
        # costs about as much as moving the data: one buffer per dtype, device and slot.
        self._buffers: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}

    def buffer(self, numel: int, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        key = (like.dtype, like.device, slot)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=like.dtype,
                                                      device=like.device)
        return buffer[:numel]

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, ring: Ring, to: int,
                 source: int, add_to: torch.Tensor | None = None) -> None:
        """Both sides cut a message into the same segments (its size is all they depend on),
        and gloo matches messages between two ranks in the order they were posted."""
        element_size = send.element_size()
        segments = _segments(recv.numel(), element_size)
        receives = [_irecv(ring, recv[a:b], source) for a, b in segments]
        sends = [_isend(ring, send[a:b], to) for a, b in _segments(send.numel(), element_size)]
        # Recursive doubling adds into the very tensor it sends: a segment may change only
        # once it has left. Each request is waited on once: a gloo send waited on twice waits
        # for a second send that never comes.
        sent = 0
        adds_into_send = add_to is not None and add_to.data_ptr() == send.data_ptr()
        for (a, b), receive in zip(segments, receives, strict=True):
            receive.wait()
            if add_to is not None:
                if adds_into_send:
                    sends[sent].wait()
                    sent += 1
                add_to[a:b].add_(recv[a:b])
        for request in sends[sent:]:
            request.wait()

    def send(self, tensor: torch.Tensor, ring: Ring, to: int) -> None:
        _isend(ring, tensor, to).wait()

    def recv(self, tensor: torch.Tensor, ring: Ring, source: int) -> None:
        _irecv(ring, tensor, source).wait()


SEGMENTS = Segments()


# --- The ring, streamed -------------------------------------------------------------------------


def _ring_stream(flat: torch.Tensor, ring: Ring, first: int, steps: int, reduce_steps: int,
                average: bool = False) -> None:
    """`steps` steps around the ring: in step t this rank sends chunk `first` - t to its right
    and receives chunk `first` - t - 1 from its left, adding it in during the first
    `reduce_steps` steps (the reduce-scatter) and storing it in place after (the all-gather).

    What a step receives is what the next one sends, so each segment is forwarded as soon as
    it has been added. A step's receives are posted one step ahead, before this rank forwards
    anything; the reduce-scatter receives into two buffers in turn, one filling while the other
    is added. Receiving in place in the all-gather is safe: a chunk comes back only after what
    this rank sent of it has arrived. `average` divides this rank's own chunk, the last one
    reduced, before it goes round.
    """
    if steps == 0:  # one rank: nothing to send
        return
    chunks = chunk_bounds(flat.numel(), ring.size)
    element_size = flat.element_size()
    largest = chunks[0][1] - chunks[0][0]  # chunk 0 is the largest
    buffers = [SEGMENTS.buffer(largest, flat, slot) for slot in range(min(reduce_steps, 2))]

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
        return pieces, targets, [_irecv(ring, target, ring.left) for target in targets]

    upcoming = post_receives(0)
    sends = [_isend(ring, flat[a:b], ring.right) for a, b in segments(first)]
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
                sends.append(_isend(ring, flat[a:b], ring.right))
    for send in sends:  # the tensor must not change before what it sent has left
        send.wait()


def ring_steps(flat: torch.Tensor, ring: Ring, average: bool) -> None:
    """comm.ring_steps, streamed: the reduce-scatter's N-1 steps, then the all-gather's, as one
    stream."""
    _ring_stream(flat, ring, ring.rank - 1, 2 * (ring.size - 1), ring.size - 1, average)


def reduce_scatter(flat: torch.Tensor, ring: Ring) -> None:
    """comm.reduce_scatter_steps, streamed: chunk `ring.rank` of `flat` ends up summed."""
    _ring_stream(flat, ring, ring.rank - 1, ring.size - 1, ring.size - 1)


def all_gather(flat: torch.Tensor, ring: Ring) -> None:
    """comm.all_gather_steps, streamed: every chunk of `flat` filled from its owner."""
    _ring_stream(flat, ring, ring.rank, ring.size - 1, 0)


# --- The tree, pipelined ------------------------------------------------------------------------


def tree_steps(flat: torch.Tensor, ring: Ring, average: bool) -> None:
    """comm's binomial tree, pipelined: tensors of 4 MiB or more travel in segments of 2 to
    4 MiB; a rank adds a segment from each child and sends the sum up at once, and rank 0
    sends each finished segment back down while later ones are still being reduced."""
    parent, children = ring.binomial_tree()
    segments = chunk_bounds(flat.numel(), max(1, flat.nbytes // _TREE_SEGMENT_BYTES))
    buffers = [SEGMENTS.buffer(flat.numel(), flat, slot) for slot in range(len(children))]
    from_children = [[_irecv(ring, buffer[a:b], ring.peer(child)) for a, b in segments]
                     for child, buffer in zip(children, buffers, strict=True)]
    # The result lands in place: segment i comes down only after the parent has received this
    # rank's partial sum of segment i, so the receive never overwrites what is still to leave.
    from_parent = ([] if parent is None else
                   [_irecv(ring, flat[a:b], ring.peer(parent)) for a, b in segments])
    sends = []
    for i, (a, b) in enumerate(segments):  # reduce, segment by segment
        for receives, buffer in zip(from_children, buffers, strict=True):
            receives[i].wait()
            flat[a:b].add_(buffer[a:b])  # in the tensor's own dtype, as gloo does
        if parent is not None:
            sends.append(_isend(ring, flat[a:b], ring.peer(parent)))
        else:  # rank 0 holds the sum of this segment: it goes down at once
            if average:
                flat[a:b].div_(ring.size)
            sends += [_isend(ring, flat[a:b], ring.peer(child)) for child in children]
    if parent is not None:  # broadcast, each segment as it arrives
        for (a, b), receive in zip(segments, from_parent, strict=True):
            receive.wait()
            sends += [_isend(ring, flat[a:b], ring.peer(child)) for child in children]
    for send in sends:
        send.wait()


def broadcast_steps(flat: torch.Tensor, ring: Ring, root: int) -> None:
    """comm.binomial_broadcast from group rank `root`, with SEGMENTS."""
    comm.binomial_broadcast(flat, ring, root, SEGMENTS)


# --- Recursive doubling and Rabenseifner ---------------------------------------------------------


def recursive_doubling_steps(flat: torch.Tensor, ring: Ring, average: bool) -> None:
    """comm.recursive_doubling_steps, with SEGMENTS."""
    comm.recursive_doubling_steps(flat, ring, average, SEGMENTS)


def rabenseifner_steps(flat: torch.Tensor, ring: Ring, average: bool) -> None:
    """comm.rabenseifner_steps, with SEGMENTS."""
    comm.rabenseifner_steps(flat, ring, average, SEGMENTS)


# --- Hierarchical: the ring's pieces on the two tiers -----------------------------------------


def hierarchical_steps(flat: torch.Tensor, node: Ring, across: Ring, average: bool) -> None:
    """Sum (or average) the 1-D `flat` over every rank, in place, in three phases of this
    module's ring: reduce-scatter over `node` (the ranks of this node; rank l ends holding
    chunk l summed over the node), ring all-reduce of that chunk over `across` (the ranks
    holding chunk l on every node), all-gather over `node` (REFERENCES.md#horovod)."""
    reduce_scatter(flat, node)
    start, end = chunk_bounds(flat.numel(), node.size)[node.rank]
    shard = flat[start:end]
    ring_steps(shard, across, False)
    if average:
        shard.div_(node.size * across.size)
    all_gather(flat, node)
