"""Data parallelism from scratch: PyTorch's DistributedDataParallel, rebuilt on our own hooks.

Every rank holds the whole model, computes forward and backward on its own slice of the
batch, and the ranks average their gradients before the optimizer step, so every copy takes
the same step (Li et al., "PyTorch Distributed", VLDB 2020). Three ways to average, each
faster than the last (lab 03 builds them in this order):

    all_reduce_gradients(model)        one all-reduce per parameter, after backward: pays the
                                       latency alpha once per tensor
    all_reduce_gradients_flat(model)   copy every gradient into one flat buffer, one
                                       all-reduce: one alpha, but nothing overlaps backward
    DistributedDataParallel(model)     gradients go into buckets as backward produces them, and
                                       each full bucket's all-reduce starts at once, while
                                       backward computes the earlier layers' gradients

    model = DistributedDataParallel(model, bucket_cap_mb=25)
    loss_fn(model(x), y).backward()     # gradients are averaged when backward returns
    optimizer.step()

Each rank sends 2(N-1)/N * Psi * bytes-per-element per step with a ring all-reduce: the "2 Psi
elements" data-parallel volume of ZeRO §7 (Rajbhandari et al. 2020) as N grows. `impl` picks
the all-reduce (`minidist.communication.collectives`): "torch", the backend's own (gloo or NCCL,
which runs in C++: `counting.count_traffic()` sees each call but not its bytes on the wire), or one
of minidist's algorithms from send/recv ("ring", "auto", ...), whose bytes it counts.
`compression=` (a `minidist.parallel.compression.Compression`) sends each bucket compressed instead,
through minidist's send/recv, as PyTorch's DDP communication hooks do.

`group` is the data-parallel process group (e.g. `mesh.group("dp")`); None: every rank.

DistributedDataParallel, in detail:

- `impl` picks the all-reduce: "torch" is the backend's; the others are minidist's own, whose
  bytes `counting.count_traffic()` counts: 2(N-1)/N times each bucket per rank for "ring".
- `compression` (TopK, PowerSGD, Int8 from `minidist.parallel.compression`) replaces each bucket's
  all-reduce with a compressed sum through minidist's send/recv.
- `no_sync()`: backward inside it only accumulates local gradients; the first backward after
  it averages the sum. Run forward and backward both inside. `set_requires_gradient_sync`
  does the same for a pipeline, whose forwards and backwards interleave.
- Frozen parameters are broadcast at wrap time, then left alone; tied parameters are one.
- Buffers are broadcast from rank 0 at wrap time and, with `broadcast_buffers=True`, before
  every forward (BatchNorm's running statistics stay equal across ranks).
- A trainable parameter that gets no gradient raises an error naming it at the end of that
  backward; with `find_unused_parameters=True` it counts as a zero gradient instead.
- `events` records the last synchronized backward (`timeline.Event`s): "gradient" when each
  gradient arrived, "all_reduce" from each bucket's launch to its completion;
  `plot_timeline` draws them.

Differences from torch.nn.parallel.DistributedDataParallel: no smaller first bucket and no
rebuilding of the buckets in gradient-arrival order after the first step; gradients are copied
into buckets and back (its default, gradient_as_bucket_view=False); a parameter unused on
every rank gets a zero gradient under find_unused_parameters (it leaves it None).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minidist.communication import collectives, impls
from minidist.core._checks import require_process_group
from minidist.core.flat import copy_back, flatten
from minidist.core.timeline import Event, clock, plot_events
from minidist.parallel.compression import Compression

__all__ = [
    "check_same_model", "broadcast_parameters", "all_reduce_gradients",
    "all_reduce_gradients_flat", "assign_buckets", "Bucket", "make_buckets",
    "DistributedDataParallel", "plot_timeline",
]


# --- The same model on every rank ----------------------------------------------------------------


def check_same_model(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if the ranks' models differ in names, shapes, dtypes or which
    parameters are trainable: flat buffers and shards would not line up, and collectives
    would mix unrelated tensors or hang."""
    mine = [(f"parameter {name}", tuple(p.shape), str(p.dtype), p.requires_grad)
            for name, p in module.named_parameters()]
    mine += [(f"buffer {name}", tuple(b.shape), str(b.dtype), False)
             for name, b in module.named_buffers()]
    everyone = collectives.all_gather_object(mine, group=group, when="model check")
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for ours, other in zip(reference, theirs, strict=False):  # lengths may differ
            if ours != other:
                raise ValueError(
                    f"the ranks' models differ: rank 0 has {_describe(ours)} where rank {rank} "
                    f"has {_describe(other)}. Build the same model on every rank (the values "
                    f"may differ: rank 0's are copied to all)"
                )
        raise ValueError(
            f"the ranks' models differ: rank 0 has {len(reference)} parameters and buffers, "
            f"rank {rank} has {len(theirs)}. Build the same model on every rank"
        )


def _describe(entry: tuple) -> str:
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad or name.startswith("buffer") else ", frozen"
    return f"{name} of shape {list(shape)}, {dtype}{frozen}"


def broadcast_parameters(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy the group's first rank's parameters and buffers to every rank, in place: one
    broadcast per dtype of all of them at once."""
    require_process_group("broadcast_parameters")
    collectives.broadcast_tensors([t.data for t in [*module.parameters(), *module.buffers()]],
                                  group=group, when="parameters and buffers")


# --- The simple versions -------------------------------------------------------------------------


def all_reduce_gradients(module: nn.Module, *, impl: str = "torch",
                         group: dist.ProcessGroup | None = None) -> None:
    """Average every parameter's gradient across ranks, one all-reduce per parameter.

    Call it after backward. Parameters without a gradient (frozen or unused) are skipped, so
    every rank must have the same ones."""
    require_process_group("all_reduce_gradients")
    impls.check_impl("all_reduce", impl)
    for param in module.parameters():
        if param.grad is not None:
            collectives.all_reduce(param.grad, op="avg", group=group, impl=impl, when="gradients")


def all_reduce_gradients_flat(module: nn.Module, *, impl: str = "torch",
                              group: dist.ProcessGroup | None = None) -> None:
    """Average every gradient across ranks with a single all-reduce of one flat buffer.

    All gradients must have one dtype. One collective pays the latency once, but it can only
    start when backward has finished."""
    require_process_group("all_reduce_gradients_flat")
    impls.check_impl("all_reduce", impl)
    grads = [param.grad for param in module.parameters() if param.grad is not None]
    if not grads:
        return
    flat = flatten(grads)
    collectives.all_reduce(flat, op="avg", group=group, impl=impl, when="gradients")
    copy_back(flat, grads)


# --- Buckets -------------------------------------------------------------------------------------


def assign_buckets(nbytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Group tensors of the given sizes, in the given order, into buckets of at most
    `cap_bytes` bytes; a tensor bigger than the cap gets a bucket to itself.

    assign_buckets([40, 40, 30, 100, 10], 80) == [[0, 1], [2], [3], [4]]
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes={cap_bytes}: must be positive")
    buckets: list[list[int]] = []
    filled = cap_bytes  # no open bucket yet
    for index, size in enumerate(nbytes):
        if filled + size > cap_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets


@dataclass
class Bucket:
    """Gradients that travel in one all-reduce: `names` of the parameters, in the order they
    sit in `buffer` (reverse `parameters()` order, the order backward produces them)."""

    index: int
    names: list[str]
    params: list[nn.Parameter] = field(repr=False)
    offsets: list[int] = field(repr=False)
    buffer: torch.Tensor = field(repr=False)

    @property
    def numel(self) -> int:
        return self.buffer.numel()

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def copy_in(self, position: int, grad: torch.Tensor | None) -> None:
        """Copy parameter `position`'s gradient into its place in the buffer (None: zeros)."""
        start = self.offsets[position]
        end = start + self.params[position].numel()
        if grad is None:
            self.buffer[start:end].zero_()
        else:
            self.buffer[start:end].copy_(grad.reshape(-1))

    def copy_out(self) -> None:
        """Write the buffer back into every parameter's `.grad`."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.empty_like(param)
        copy_back(self.buffer, [param.grad for param in self.params])


def make_buckets(module: nn.Module, cap_bytes: int) -> list[Bucket]:
    """The buckets of `module`'s trainable parameters: in reverse `parameters()` order (the
    order backward produces gradients), at most `cap_bytes` each (`assign_buckets`), one
    dtype and device per bucket."""
    trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    trainable.reverse()
    buckets: list[Bucket] = []
    for kind in dict.fromkeys((p.dtype, p.device) for _, p in trainable):
        of_kind = [(name, p) for name, p in trainable if (p.dtype, p.device) == kind]
        sizes = [p.nbytes for _, p in of_kind]
        for indices in assign_buckets(sizes, cap_bytes):
            names = [of_kind[i][0] for i in indices]
            params = [of_kind[i][1] for i in indices]
            offsets = [sum(p.numel() for p in params[:k]) for k in range(len(params))]
            buffer = torch.zeros(offsets[-1] + params[-1].numel(), dtype=kind[0],
                                 device=kind[1])
            buckets.append(Bucket(len(buckets), names, params, offsets, buffer))
    return buckets


@dataclass
class _Step:
    """What DistributedDataParallel tracks during one synchronized backward."""

    pending: list[int]  # per bucket: gradients not yet copied in
    arrived: set[int] = field(default_factory=set)  # ids of parameters whose gradient came
    next_launch: int = 0  # buckets launch in order, so every rank issues the same sequence
    handles: list[collectives.Handle] = field(default_factory=list)


# --- The wrapper ---------------------------------------------------------------------------------


class DistributedDataParallel(nn.Module):
    """Data parallelism with bucketed all-reduces that overlap backward.

        model = DistributedDataParallel(model, bucket_cap_mb=25)
        loss_fn(model(x), y).backward()     # gradients are averaged when backward returns

    At wrap time every rank's model must have the same parameter and buffer names, shapes and
    dtypes (values may differ: rank 0's are copied to all). A post-accumulate-grad hook on each
    trainable parameter copies its gradient into a bucket as soon as backward produces it
    (`make_buckets`); a full bucket starts an asynchronous all-reduce at once, in bucket order,
    while backward goes on. When backward ends, `finish_gradient_synchronization` runs by
    itself: it waits for every all-reduce and writes the averages back into `.grad`, as
    PyTorch's DDP has them when `loss.backward()` returns. The module docstring lists the
    options and how this differs from PyTorch's.

    Why one unit of about 140 lines: set-up, forward and the hooks of one backward act on the
    same buckets and read best in one place; PyTorch's checks are apart, below."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, *, impl: str = "torch",
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 group: dist.ProcessGroup | None = None,
                 compression: Compression | None = None):
        super().__init__()
        _check_arguments(bucket_cap_mb, impl, compression)
        self.module, self.group = module, group
        self.impl, self.compression = impl, compression
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.events: list[Event] = []
        self._sync = True  # False inside no_sync()
        self._check_forwards = True  # a forward and its backward both in no_sync(), or not
        self._forward_synced: bool | None = None  # was the last training forward synced?
        self._step: _Step | None = None  # the synchronized backward in progress, if any

        check_same_model(module, group)
        broadcast_parameters(module, group)
        self.buckets = make_buckets(module, int(bucket_cap_mb * 2**20))
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self._check_forwards:
            self._forward_synced = self._sync
            self._step = None  # left over only if the last backward raised before its end
        if self.broadcast_buffers and dist.get_world_size(self.group) > 1:
            collectives.broadcast_tensors(list(self.module.buffers()), group=self.group,
                                          when="buffers")
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward inside the block sends nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """Whether the following backwards all-reduce (FSDP2's name for it): a pipeline turns
        it off for all but a stage's last backward of the step, whose forwards ran long
        before. Unlike no_sync(), the forwards are then not checked against it."""
        self._sync, self._check_forwards, self._forward_synced = sync, False, None

    # --- During backward ---------------------------------------------------------------------

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        _check_no_sync_matches(self._forward_synced, self._sync)
        if not self._sync:
            return
        if self._step is None:
            self._start_step()
        step, (bucket, position) = self._step, self._where[id(param)]
        name = bucket.names[position]
        if id(param) in step.arrived:
            self._step = None
            _raise_twice(name)
        step.arrived.add(id(param))
        now = clock()
        self.events.append(Event(dist.get_rank(), "gradient", name, now, now))
        bucket.copy_in(position, param.grad)
        step.pending[bucket.index] -= 1
        self._launch_full_buckets()

    def _start_step(self) -> None:
        self._step = _Step([len(bucket.params) for bucket in self.buckets])
        self.events = []
        # Runs once the whole backward has finished: the engine calls it before returning.
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _launch_full_buckets(self) -> None:
        step = self._step
        while step.next_launch < len(self.buckets) and step.pending[step.next_launch] == 0:
            step.handles.append(self._launch(self.buckets[step.next_launch]))
            step.next_launch += 1

    def _launch(self, bucket: Bucket) -> collectives.Handle:
        """Start the bucket's all-reduce (sum; the average is taken when it is written back)."""
        event = Event(dist.get_rank(), "all_reduce", f"bucket {bucket.index}", clock())
        self.events.append(event)
        if self.compression is None:
            handle = collectives.all_reduce(bucket.buffer, op="sum", group=self.group,
                                            impl=self.impl, when="gradients", async_op=True)
        else:
            shapes = [p.shape for p in bucket.params]
            handle = collectives.Handle(collectives.in_background(
                lambda: self.compression.all_reduce(bucket.index, bucket.buffer, shapes,
                                                    self.group)), lambda: bucket.buffer)
        handle.on_done(lambda: setattr(event, "end", clock()))
        return handle

    def _on_backward_end(self) -> None:
        step = self._step
        missing = [(bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)
                   if id(p) not in step.arrived]
        if missing and not self.find_unused_parameters:
            self._step = None
            _raise_unused(dist.get_rank(), [bucket.names[i] for bucket, i in missing])
        for bucket, position in missing:  # count them as zero (or their accumulated gradient)
            bucket.copy_in(position, bucket.params[position].grad)
            step.pending[bucket.index] -= 1
        self._launch_full_buckets()
        self.finish_gradient_synchronization()

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce, divide by the world size and write the averages
        into `.grad`. Runs by itself at the end of each synchronized backward; calling it
        again does nothing."""
        _check_finish(self._sync, self._step, len(self.buckets))
        step, self._step = self._step, None
        if step is None:
            return
        for bucket, handle in zip(self.buckets, step.handles, strict=True):
            handle.wait()
            bucket.buffer.div_(dist.get_world_size(self.group))
            bucket.copy_out()


# --- What PyTorch's DDP refuses, refused here too ------------------------------------------------


def _check_arguments(bucket_cap_mb: float, impl: str, compression: Compression | None) -> None:
    require_process_group("DistributedDataParallel")
    impls.check_impl("all_reduce", impl)
    if compression is not None and not isinstance(compression, Compression):
        raise ValueError(f"compression={compression!r}: pass a minidist.parallel.compression "
                         f"object (TopK(ratio), PowerSGD(rank), Int8()) or None")
    if isinstance(bucket_cap_mb, bool) or not (
        isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0
    ):
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: must be a positive number of MiB")


def _check_no_sync_matches(forward_synced: bool | None, synced: bool) -> None:
    if forward_synced is not None and forward_synced != synced:
        backward, forward = ("outside", "inside") if synced else ("inside", "outside")
        raise RuntimeError(
            f"backward ran {backward} no_sync() but its forward ran {forward}: put both the "
            f"forward and the backward of each microbatch inside `with model.no_sync():`, or "
            f"both outside it")


def _raise_twice(name: str) -> None:
    raise RuntimeError(
        f"the gradient of {name!r} arrived twice in one backward (reentrant checkpointing, or "
        f"a second backward through part of the graph); DistributedDataParallel all-reduces "
        f"each gradient once per backward")


def _raise_unused(rank: int, names: list[str]) -> None:
    raise RuntimeError(
        f"rank {rank}: parameters got no gradient in this backward: {', '.join(names)}. Make "
        f"every trainable parameter take part in the loss, freeze the unused ones "
        f"(requires_grad=False) before wrapping, or pass find_unused_parameters=True")


def _check_finish(synced: bool, step: _Step | None, buckets: int) -> None:
    if not synced:
        raise RuntimeError(
            "finish_gradient_synchronization() inside no_sync(): nothing was sent; the first "
            "backward after leaving no_sync() averages the accumulated gradients")
    if step is not None and step.next_launch < buckets:
        raise RuntimeError(
            f"finish_gradient_synchronization() before backward finished: buckets "
            f"{step.next_launch}..{buckets - 1} have not been sent")


# --- Looking at it -------------------------------------------------------------------------------


def plot_timeline(events: list[Event], *, ax: Any = None, title: str = "") -> Any:
    """Draw one backward's events, in milliseconds from the first: gradient arrivals as ticks
    on the top lane, and below it one lane per bucket with a bar from the launch of its
    all-reduce to its completion. A dashed line marks the last gradient, the end of
    backward's compute. Returns the axes."""
    gradients = [e for e in events if e.kind == "gradient"]
    all_reduces = [e for e in events if e.kind == "all_reduce"]
    lanes = ["gradients"] + [e.name for e in all_reduces]
    ax = plot_events(events, lane=lambda e: "gradients" if e.kind == "gradient" else e.name,
              style=lambda e: {"facecolor": "tab:blue" if e.kind == "gradient"
                               else "tab:orange"},
              lanes=lanes, ax=ax, title=title,
              unit="ms since the first gradient (dashed: the last gradient)")
    if gradients:
        origin = min(e.start for e in events)
        ax.axvline((gradients[-1].start - origin) * 1e3, color="gray", linestyle="--",
                   linewidth=1)
    return ax
