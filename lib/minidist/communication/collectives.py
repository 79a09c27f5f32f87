"""Every collective minidist runs, through one layer: recorded, and run by torch or by minidist.

    collectives.all_reduce(t)                          # the backend's all-reduce (gloo, NCCL)
    collectives.all_reduce(t, impl="ring")             # minidist's ring, from send/recv
    collectives.all_reduce(t, impl="auto")             # the fastest of minidist's algorithms
    collectives.all_reduce(t, impl="hierarchical", network=mesh.network)  # nodes, then across
    shard = collectives.reduce_scatter(flat)           # this rank's shard of the sum
    full = collectives.all_gather(shard, flat.numel()) # the whole flat tensor again

Every module of minidist that communicates calls these functions and nothing else, so that:

- **count_traffic sees every collective.** Each call adds one `traffic.Collective` record to
  the open `counting.count_traffic()` logs: the op, the bytes of the full tensor reduced or
  produced, the group's size and global ranks, and `when` (e.g. "forward").
- **the implementation is chosen with one word, `impl`.** "torch" runs torch.distributed's
  collective (gloo or NCCL, in C++: a log sees the call but not its bytes on the wire); an
  algorithm name runs minidist's own, built from point-to-point sends, whose every byte a log
  counts. Which names each collective takes, and the code each runs, is one table:
  `minidist.costs.algorithms` (names, costs, where each applies) joined to its code in
  `minidist.communication.impls`: all_reduce "ring", "recursive_doubling", "tree",
  "rabenseifner", "hierarchical" (reduce-scatter inside each node, all-reduce across nodes,
  all-gather inside, on the nodes of the `network` given, `mesh.network`) or "auto" (the one
  `impls.fit_links` predicts fastest on this group, or, given the job's `network`, the one its
  two-tier alpha-beta model does); reduce_scatter and all_gather "ring"; broadcast "tree";
  all_to_all "pairwise".
- **`group` means one thing.** A process group (such as `mesh.group("dp")` of a
  `minidist.communication.mesh.Mesh`, the one place groups are made), or None: the default process
  group, every rank of the job.

Ranks must make the same calls in the same order, with the same `impl`: a collective is a
meeting of every rank of its group.
"""

from __future__ import annotations

import concurrent.futures
import math
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.communication import impls
from minidist.communication.comm import Ring, chunk_bounds, ring_of
from minidist.communication.counting import record
from minidist.communication.emulation import Network
from minidist.core._checks import reduce_op, require_process_group
from minidist.core.agreement import CallMismatch, exchange
from minidist.core.flat import copy_back, flat_view, flatten
from minidist.core.refusal import watched_as_here
from minidist.core.timeline import Event, clock, note
from minidist.costs.cost import AlgorithmLinks, AlphaBeta

__all__ = [
    "Handle", "shard_bounds", "all_reduce", "reduce_scatter", "all_gather",
    "all_gather_along", "reduce_scatter_along", "all_gather_overlapped",
    "reduce_scatter_overlapped", "broadcast", "broadcast_tensors", "all_to_all", "shift",
    "all_gather_object", "barrier", "in_background", "record_torch_collective",
]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


# --- Running later --------------------------------------------------------------------------------


class Handle:
    """A collective in flight (`async_op=True`): `wait()` returns its result."""

    def __init__(self, work: dist.Work | concurrent.futures.Future | None,
                 finish: Callable[[], Any]):
        self._work, self._finish = work, finish

    def wait(self) -> Any:
        if isinstance(self._work, concurrent.futures.Future):
            self._work.result()
        elif self._work is not None:
            self._work.wait()
        return self._finish()

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (on any thread) once the transfer has completed."""
        if isinstance(self._work, concurrent.futures.Future):
            self._work.add_done_callback(lambda _: callback())
        elif self._work is not None:
            self._work.get_future().then(lambda _: callback())
        else:
            callback()


_WORKER = "minidist-collectives"
_worker: concurrent.futures.ThreadPoolExecutor | None = None
_queued: list[concurrent.futures.Future] = []


def in_background(function: Callable[[], Any]) -> concurrent.futures.Future:
    """Run `function` on minidist's one communication thread, after whatever is queued there.

    minidist's own collectives are point-to-point messages that ranks match in the order they
    post them; one thread, in submission order, keeps that order the same on every rank."""
    global _worker
    if _worker is None:
        _worker = concurrent.futures.ThreadPoolExecutor(1, _WORKER)
    _queued[:] = [future for future in _queued if not future.done()]
    future = _worker.submit(watched_as_here(function))  # a check's watch goes with the work
    _queued.append(future)
    return future


def _run(function: Callable[[], Any], async_op: bool, finish: Callable[[], Any]) -> Any:
    """Run one of minidist's collectives now, or after what is queued on the communication
    thread (where a compression hook running there is already)."""
    on_worker = threading.current_thread().name.startswith(_WORKER)
    if not on_worker and (async_op or any(not future.done() for future in _queued)):
        handle = Handle(in_background(function), finish)
        return handle if async_op else handle.wait()
    function()
    return Handle(None, finish) if async_op else finish()


# --- The collectives ------------------------------------------------------------------------------


def shard_bounds(numel: int, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(start, end) of this rank's shard of a flat tensor of `numel` elements: the slice
    `reduce_scatter` returns and `all_gather` takes (sizes differ by at most one)."""
    ring = ring_of(group, "shard_bounds")
    return chunk_bounds(numel, ring.size)[ring.rank]


def _call(size: int | str, dtype: torch.dtype, **options: object) -> str:
    """What every rank of a collective's group must agree on, as `minidist.core.agreement`
    compares it: "8 float32, op='sum', impl='ring'"."""
    return ", ".join([f"{size} {str(dtype).removeprefix('torch.')}",
                      *(f"{name}={value!r}" for name, value in options.items())])


def all_reduce(tensor: torch.Tensor, *, op: str | dist.ReduceOp.RedOpType = "sum",
               group: dist.ProcessGroup | None = None, impl: str = "torch", when: str = "",
               async_op: bool = False, link: AlphaBeta | AlgorithmLinks | None = None,
               network: Network | None = None) -> Any:
    """Sum, average or (impl="torch" only) take the max of `tensor` over `group`, in place;
    returns it (a `Handle` with async_op=True). "auto" decides with `link`, by default the
    links `impls.fit_links(group)` measures on the first call and keeps per group, or,
    given the job's `network` (`mesh.network`) and a group spanning the job, with that
    network's two-tier model: a pure function of the size, the group and those links.
    "hierarchical" takes its nodes from `network` (without one, every rank counts as one
    node's: the ring)."""
    impls.check_impl("all_reduce", impl)
    flat = flat_view(tensor, "all_reduce")
    name = (reduce_op(op, tensor, ("sum", "avg", "max")) if impl == "torch" else
            reduce_op(op, tensor, ("sum", "avg"), "; 'max' runs with impl='torch'"))
    ring = ring_of(group, "all_reduce")
    record("all_reduce", flat.nbytes, group, when,
           call=_call(flat.numel(), flat.dtype, op=name, impl=impl))

    def finish() -> torch.Tensor:
        if impl == "torch" and name == "avg":  # gloo has no AVG: sum, then divide
            tensor.div_(ring.size)
        return tensor

    if impl == "torch":
        work = dist.all_reduce(tensor, op=_OPS[name], group=group, async_op=async_op)
        return Handle(work, finish) if async_op else finish()
    if ring.size == 1:
        return Handle(None, finish) if async_op else finish()
    chosen = impls.choose(impl, flat.nbytes, ring, link, network)
    steps = chosen.streamed["all_reduce"]
    if chosen.algorithm.needs_nodes:  # without a network every rank is its own node's: the ring
        node, across = (network.rings(group) if network is not None else
                        (ring, Ring(0, 1, (ring.peer(ring.rank),), group)))
        return _run(lambda: steps(flat, node, across, name == "avg"), async_op, finish)
    return _run(lambda: steps(flat, ring, name == "avg"), async_op, finish)


def reduce_scatter(flat: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                   impl: str = "torch", op: str = "sum", when: str = "") -> torch.Tensor:
    """This rank's shard (`shard_bounds`) of the sum (or average) of the 1-D `flat` over
    `group`, as a new tensor; `flat` is left as it was."""
    impls.check_impl("reduce_scatter", impl)
    name = reduce_op(op, flat, ("sum", "avg"))
    ring = ring_of(group, "reduce_scatter")
    bounds = chunk_bounds(flat.numel(), ring.size)
    start, end = bounds[ring.rank]
    record("reduce_scatter", flat.nbytes, group, when,
           call=_call(flat.numel(), flat.dtype, op=name, impl=impl))
    if impl != "torch":
        steps = impls.implementation(impl).streamed["reduce_scatter"]
        summed = flat.reshape(-1).clone()
        _run(lambda: steps(summed, ring), False, lambda: None)
        shard = summed[start:end].clone()
    else:
        longest = bounds[0][1] - bounds[0][0]
        shard = torch.empty(longest, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_single(shard, _padded(flat.reshape(-1), bounds), group=group)
        shard = shard[: end - start]
    return shard.div_(ring.size) if name == "avg" else shard


def _padded(flat: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    """`flat` as equal chunks, each padded to the longest (torch's collectives need equal
    chunks); `flat` itself when they are equal already."""
    longest = bounds[0][1] - bounds[0][0]
    if longest * len(bounds) == flat.numel():
        return flat
    return torch.cat([F.pad(flat[start:end], (0, longest - (end - start)))
                      for start, end in bounds])


def all_gather(shard: torch.Tensor, numel: int, *, group: dist.ProcessGroup | None = None,
               impl: str = "torch", when: str = "", async_op: bool = False) -> Any:
    """The whole flat tensor of `numel` elements from every rank's shard (`shard_bounds`), as
    a new tensor; a `Handle` whose wait() returns it with async_op=True."""
    impls.check_impl("all_gather", impl)
    ring = ring_of(group, "all_gather")
    bounds = chunk_bounds(numel, ring.size)
    start, end = bounds[ring.rank]
    if shard.numel() != end - start:
        raise ValueError(f"rank {ring.rank}'s shard of a {numel}-element tensor has "
                         f"{end - start} elements (shard_bounds), got {shard.numel()}")
    record("all_gather", numel * shard.element_size(), group, when,
           call=_call(numel, shard.dtype, impl=impl))
    if impl != "torch":
        steps = impls.implementation(impl).streamed["all_gather"]
        full = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        full[start:end] = shard.reshape(-1)
        return _run(lambda: steps(full, ring), async_op, lambda: full)
    longest = bounds[0][1] - bounds[0][0]
    gathered = torch.empty(longest * ring.size, dtype=shard.dtype, device=shard.device)
    mine = shard.reshape(-1)
    work = dist.all_gather_single(gathered, F.pad(mine, (0, longest - mine.numel())),
                                  group=group, async_op=async_op)

    def unpad() -> torch.Tensor:
        if longest * ring.size == numel:
            return gathered
        rows = gathered.view(ring.size, longest)
        return torch.cat([rows[r, : e - s] for r, (s, e) in enumerate(bounds)])

    return Handle(work, unpad) if async_op else unpad()


def all_gather_along(x: torch.Tensor, dim: int, *, group: dist.ProcessGroup | None = None,
                     when: str = "") -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (tensor and sequence
    parallelism's all-gather); every rank's `x` has the same shape."""
    ring = ring_of(group, "all_gather_along")
    rows = x.movedim(dim, 0).contiguous()  # [x.shape[dim], ...]: each rank's piece is whole
    full = all_gather(rows.view(-1), rows.numel() * ring.size, group=group, when=when)
    return full.view(ring.size * rows.shape[0], *rows.shape[1:]).movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, *, group: dist.ProcessGroup | None = None,
                         when: str = "") -> torch.Tensor:
    """Rank r's r-th of t equal pieces of `x` along `dim`, summed over the group (tensor and
    sequence parallelism's reduce-scatter)."""
    ring = ring_of(group, "reduce_scatter_along")
    if x.shape[dim] % ring.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by the group's "
                         f"{ring.size} ranks")
    rows = x.movedim(dim, 0).contiguous()
    shard = reduce_scatter(rows.view(-1), group=group, when=when)
    return shard.view(rows.shape[0] // ring.size, *rows.shape[1:]).movedim(0, dim)


def all_gather_overlapped(x: torch.Tensor, on_piece: Callable[[int, torch.Tensor], Any],
                          *, group: dist.ProcessGroup | None = None, when: str = "") -> None:
    """All-gather every rank's `x` (all the same shape) around the ring, calling
    `on_piece(source group rank, piece)` on each piece as it arrives, this rank's own first,
    while the next one travels: the transfer hides behind the work done on each piece
    (asynchronous tensor parallelism, Wang et al. 2023). Recorded as one all_gather."""
    ring = ring_of(group, "all_gather_overlapped")
    record("all_gather", x.nbytes * ring.size, group, when, call=_call(x.numel(), x.dtype))

    def steps() -> None:
        piece = x.contiguous()
        for step in range(ring.size):
            requests = []
            if step < ring.size - 1:
                incoming = torch.empty_like(piece)
                requests = [dist.isend(piece, ring.right, group=group),
                            dist.irecv(incoming, ring.left, group=group)]
            on_piece((ring.rank - step) % ring.size, piece)  # while the next one travels
            for request in requests:
                request.wait()
            if requests:
                piece = incoming

    _run(steps, False, lambda: None)


def reduce_scatter_overlapped(partial: Callable[[int], torch.Tensor],
                              *, group: dist.ProcessGroup | None = None,
                              when: str = "") -> torch.Tensor:
    """Reduce-scatter around the ring where `partial(c)` computes this rank's addend for
    piece c just before it is needed, while the running sum for it travels; returns piece
    `rank` of the sum. Recorded as one reduce_scatter of t pieces."""
    ring = ring_of(group, "reduce_scatter_overlapped")
    result: list[torch.Tensor] = []

    def steps() -> None:
        running = partial((ring.rank - 1) % ring.size)
        record("reduce_scatter", running.nbytes * ring.size, group, when,
               call=_call(running.numel(), running.dtype))
        for step in range(ring.size - 1):
            incoming = torch.empty_like(running)
            requests = [dist.isend(running, ring.right, group=group),
                        dist.irecv(incoming, ring.left, group=group)]
            mine = partial((ring.rank - step - 2) % ring.size)  # while the sums travel
            for request in requests:
                request.wait()
            running = incoming.add_(mine)
        result.append(running)  # with one rank, piece (rank - 1) % 1 is piece 0 = rank

    return _run(steps, False, lambda: result[0])


def broadcast(tensor: torch.Tensor, *, src: int | None = None,
              group: dist.ProcessGroup | None = None, impl: str = "torch",
              when: str = "") -> torch.Tensor:
    """Copy `tensor` from global rank `src` (default: the group's first rank) to every rank of
    `group`, in place; returns it."""
    impls.check_impl("broadcast", impl)
    ring = ring_of(group, "broadcast")
    src = ring.members[0] if src is None else src
    if src not in ring.members:
        raise ValueError(f"src={src} is not a rank of the group; its global ranks are "
                         f"{list(ring.members)}")
    record("broadcast", tensor.nbytes, group, when,
           call=_call(tensor.numel(), tensor.dtype, src=src, impl=impl))
    if impl == "torch":
        dist.broadcast(tensor, src, group=group)
    else:
        steps = impls.implementation(impl).streamed["broadcast"]
        flat = flat_view(tensor, "broadcast")
        root = ring.members.index(src)
        _run(lambda: steps(flat, ring, root), False, lambda: None)
    return tensor


def broadcast_tensors(tensors: Sequence[torch.Tensor], *, src: int | None = None,
                      group: dist.ProcessGroup | None = None, when: str = "") -> None:
    """Broadcast `tensors` in place from `src` (default: the group's first rank), one
    broadcast per dtype and device: they are copied into one flat buffer, sent, copied back."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same_kind in kinds.values():
        flat = flatten(same_kind)
        broadcast(flat, src=src, group=group, when=when)
        copy_back(flat, same_kind)


def all_to_all(x: torch.Tensor, send_sizes: Sequence[int], receive_sizes: Sequence[int],
               *, group: dist.ProcessGroup | None = None, impl: str = "torch",
               when: str = "") -> torch.Tensor:
    """Send rows [sum(send_sizes[:p]), sum(send_sizes[:p+1])) of `x` to group rank p; return
    what the ranks sent here, in rank order. Recorded with the bytes that leave this rank.
    impl="pairwise" is minidist's: every rank posts a send to and a receive from every other
    rank at once, then waits for them all."""
    impls.check_impl("all_to_all", impl)
    ring = ring_of(group, "all_to_all")
    _check_splits(x, send_sizes, receive_sizes, ring, group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    leaving = sum(send_sizes) - send_sizes[ring.rank]
    record("all_to_all", leaving * row_bytes, group, when,
           call=_call(f"rows of {list(x.shape[1:])}", x.dtype, impl=impl))
    x = x.contiguous()
    out = x.new_empty(sum(receive_sizes), *x.shape[1:])
    if impl == "torch":
        dist.all_to_all_single(out, x, list(receive_sizes), list(send_sizes), group=group)
        return out
    steps = impls.implementation(impl).streamed["all_to_all"]
    sends = list(x.split(list(send_sizes)))
    receives = list(out.split(list(receive_sizes)))
    return _run(lambda: steps(sends, receives, ring), False, lambda: out)


def _check_splits(x: torch.Tensor, send_sizes: Sequence[int], receive_sizes: Sequence[int],
                  ring: Ring, group: dist.ProcessGroup | None) -> None:
    """Every rank's splits against every other's, before any row moves: a rank that expects
    more rows than a peer sends it would get uninitialised memory back, one that expects fewer
    a shape error inside torch. The splits meet in the group's store (`agreement.exchange`),
    not on its links, so no count of messages or bytes sees them; every rank raises the same
    error."""
    me = ring.members[ring.rank]
    if len(send_sizes) != ring.size or len(receive_sizes) != ring.size:
        raise ValueError(f"all_to_all on rank {me}: send_sizes {list(send_sizes)} and "
                         f"receive_sizes {list(receive_sizes)} need one entry per rank of the "
                         f"group ({ring.size})")
    if sum(send_sizes) != x.shape[0] or min(send_sizes, default=0) < 0:
        raise ValueError(f"all_to_all on rank {me}: send_sizes {list(send_sizes)} should be "
                         f"row counts that add up to the tensor's {x.shape[0]} rows")
    if ring.size == 1:
        return
    splits = exchange(group, "all_to_all", {"send": list(map(int, send_sizes)),
                                            "receive": list(map(int, receive_sizes))})
    for receiver, theirs in enumerate(splits):
        for sender, expected in enumerate(theirs["receive"]):
            sent = splits[sender]["send"][receiver]
            if sent != expected:
                raise CallMismatch(
                    f"all_to_all with mismatched splits: rank {ring.members[receiver]} expects "
                    f"{expected} rows from rank {ring.members[sender]}, which sends it {sent} "
                    f"(rank {ring.members[sender]} called it with send_sizes="
                    f"{splits[sender]['send']}, rank {ring.members[receiver]} with "
                    f"receive_sizes={theirs['receive']}); each rank's receive_sizes[p] must be "
                    f"what rank p's send_sizes sends it")


def shift(tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None, when: str = "",
          async_op: bool = False) -> Any:
    """One step around the ring: every rank sends `tensor` to its right neighbour and receives
    its left neighbour's (same shape and dtype), which it returns; a `Handle` whose wait()
    returns it with async_op=True, so that work done before wait() overlaps the transfer (ring
    attention's key/value blocks, Liu et al. 2023). Recorded as one "shift" of the tensor's
    bytes; the wait notes a `timeline.Event` of kind "transfer" from the send to the wait's
    return. With one rank the tensor itself comes back: there is nobody to send to."""
    ring = ring_of(group, "shift")
    record("shift", tensor.nbytes, group, when, call=_call(tensor.numel(), tensor.dtype))
    if ring.size == 1:
        return Handle(None, lambda: tensor) if async_op else tensor
    outgoing = tensor.contiguous()
    incoming = torch.empty_like(outgoing)
    start = clock()
    receiving = dist.irecv(incoming, ring.left, group=group)
    sending = dist.isend(outgoing, ring.right, group=group)

    def finish() -> torch.Tensor:
        sending.wait()
        note(Event(ring.members[ring.rank], "transfer", when or "shift", start, clock(),
                   outgoing.nbytes))
        return incoming

    handle = Handle(receiving, finish)
    return handle if async_op else handle.wait()


def all_gather_object(obj: Any, *, group: dist.ProcessGroup | None = None,
                      when: str = "") -> list[Any]:
    """Every rank's picklable `obj`, in rank order. Recorded with this rank's pickled size."""
    ring = ring_of(group, "all_gather_object")
    record("all_gather_object", len(pickle.dumps(obj)), group, when)
    everyone: list[Any] = [None] * ring.size
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def barrier(*, group: dist.ProcessGroup | None = None, when: str = "") -> None:
    """Wait until every rank of `group` has arrived."""
    require_process_group("barrier")
    record("barrier", 0, group, when)
    dist.barrier(group=group)


def record_torch_collective(name: str, tensor: torch.Tensor,
                            group: dist.ProcessGroup | None) -> None:
    """Record a torch.distributed collective that code outside minidist runs itself (Lab 14's
    pieces: a student's own code, bound to a group), as this layer records its own: the full
    tensor's bytes, once per call."""
    record(name, tensor.nbytes, group, call=_call(tensor.numel(), tensor.dtype))
