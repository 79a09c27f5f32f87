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

Every function works in place on a contiguous tensor, on the default process group or on
`group` (ranks are then counted inside the group, as torch does).

`count_traffic()` is how every parallelism in minidist reports what it sends: inside its block
it counts the point-to-point bytes and messages this rank sends, and keeps one
`minidist.traffic.Collective` record per collective that any minidist module runs (these rings,
`sharding`, `ddp`, `zero`, `fsdp`, `tensor_parallel`), the same records that
`minidist.traffic` predicts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minidist._checks import require_process_group
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


def _ring(group: dist.ProcessGroup | None, what: str) -> _Ring:
    require_process_group(what)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of group {group}")

    def global_rank(group_rank: int) -> int:
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    return _Ring(rank, size, global_rank((rank - 1) % size), global_rank((rank + 1) % size), group)


def _exchange(send: torch.Tensor, recv: torch.Tensor, ring: _Ring) -> None:
    """Send `send` to the right neighbour while receiving `recv` from the left one.

    Both are posted before either is waited on; two blocking calls would deadlock, every
    rank sending while nobody receives.
    """
    requests = [
        dist.isend(send, ring.right, group=ring.group),
        dist.irecv(recv, ring.left, group=ring.group),
    ]
    for request in requests:
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
_recv_buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _recv_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    key = (like.dtype, like.device)
    buffer = _recv_buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _recv_buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buffer[:numel]


def _ring_reduce_scatter_steps(flat: torch.Tensor, ring: _Ring) -> None:
    chunks = chunk_bounds(flat.numel(), ring.size)
    buffer = _recv_buffer(chunks[0][1] - chunks[0][0], flat)  # chunk 0 is the largest
    for step in range(ring.size - 1):
        # Send the chunk finished in the previous step (at step 0: our own copy of chunk r-1).
        # The indices are chosen so that the last chunk this rank finishes is chunk `rank`.
        send_start, send_end = chunks[(ring.rank - step - 1) % ring.size]
        recv_start, recv_end = chunks[(ring.rank - step - 2) % ring.size]
        received = buffer[: recv_end - recv_start]
        _exchange(flat[send_start:send_end], received, ring)
        flat[recv_start:recv_end].add_(received)  # in the tensor's own dtype, as gloo does


def _ring_all_gather_steps(flat: torch.Tensor, ring: _Ring) -> None:
    chunks = chunk_bounds(flat.numel(), ring.size)
    for step in range(ring.size - 1):
        # Forward the chunk received in the previous step (at step 0: our own chunk r); the
        # incoming chunk lands straight in its place, so no buffer and no copy.
        send_start, send_end = chunks[(ring.rank - step) % ring.size]
        recv_start, recv_end = chunks[(ring.rank - step - 1) % ring.size]
        _exchange(flat[send_start:send_end], flat[recv_start:recv_end], ring)


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
    _ring_reduce_scatter_steps(flat, ring)
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
    _ring_all_gather_steps(flat, ring)
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
    _ring_reduce_scatter_steps(flat, ring)
    if op_name == "avg":
        # Divide only the chunk this rank owns, before it is sent around: N times less work.
        start, end = chunk_bounds(flat.numel(), ring.size)[ring.rank]
        flat[start:end].div_(ring.size)
    _ring_all_gather_steps(flat, ring)
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
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    if src not in members:
        raise ValueError(f"src={src} is not a rank of the group; its global ranks are {members}")
    root = src if group is None else dist.get_group_rank(group, src)
    relative = (ring.rank - root) % ring.size  # our position in a tree rooted at 0

    def peer(relative_rank: int) -> int:
        group_rank = (relative_rank + root) % ring.size
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    distance = 1
    while distance < ring.size:
        if relative < distance and relative + distance < ring.size:
            dist.send(flat, peer(relative + distance), group=group)
        elif distance <= relative < 2 * distance:
            dist.recv(flat, peer(relative - distance), group=group)
        distance *= 2
    record("broadcast", flat, group)
    return tensor


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
# Taken from the class dict, not with getattr: pybind stores methods as descriptors there, and
# only the descriptor binds `self` when put back on the class.
_uncounted_send = vars(dist.ProcessGroup)["send"]


def record(op: str, full: torch.Tensor | int, group: dist.ProcessGroup | None = None,
           when: str = "") -> None:
    """Add one `op` collective to every open `count_traffic` log. `full` is the full tensor
    the collective reduces or produces, or its size in bytes. Every minidist module that runs
    a collective calls this once per call."""
    if _active_logs:
        nbytes = full if isinstance(full, int) else full.numel() * full.element_size()
        entry = Collective(op, nbytes, dist.get_world_size(group), 1, when)
        for log in _active_logs:
            log.collectives.append(entry)


def _counting_send(
    self: dist.ProcessGroup, tensors: list[torch.Tensor], *args, **kwargs
) -> dist.Work:
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    for log in _active_logs:
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
    sends. Receives are not counted, nor the bytes of collectives that torch runs as one call
    (dist.all_reduce, ...): those run in C++, where no Python-level send sees them; their
    calls are in `collectives` when a minidist module made them.

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
