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
elements" data-parallel volume of ZeRO §7 (Rajbhandari et al. 2020) as N grows.
`all_reduce="ring"` uses minidist's own `comm.ring_all_reduce`, built from send/recv, so that
`comm.count_traffic()` can count those bytes; the default uses the backend's all-reduce (gloo or
NCCL), which runs in C++: `count_traffic()` then sees each call but not its bytes on the wire.
`compression=` (a `minidist.compression.Compression`) sends each bucket compressed instead,
through minidist's send/recv, as PyTorch's DDP communication hooks do.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minidist import comm
from minidist._checks import check_same_model, first_rank, require_process_group
from minidist.compression import Compression

ALL_REDUCES = ("torch", "ring")


def _check_all_reduce(all_reduce: str) -> None:
    if all_reduce not in ALL_REDUCES:
        raise ValueError(
            f"all_reduce={all_reduce!r}: choose 'torch' (the backend's own all-reduce) or "
            f"'ring' (minidist.comm.ring_all_reduce, whose bytes comm.count_traffic counts)"
        )


def _all_reduce_sum(tensor: torch.Tensor, all_reduce: str, group: dist.ProcessGroup | None):
    if all_reduce == "ring":
        comm.ring_all_reduce(tensor, group=group)
    else:
        comm.record("all_reduce", tensor, group)
        dist.all_reduce(tensor, group=group)


# --- The simple versions -------------------------------------------------------------------------


def broadcast_parameters(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy the group's first rank's parameters and buffers to every rank, in place."""
    require_process_group("broadcast_parameters")
    src = first_rank(group)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=src, group=group)


def all_reduce_gradients(module: nn.Module, all_reduce: str = "torch",
                         group: dist.ProcessGroup | None = None) -> None:
    """Average every parameter's gradient across ranks, one all-reduce per parameter.

    Call it after backward. Parameters without a gradient (frozen or unused) are skipped, so
    every rank must have the same ones."""
    require_process_group("all_reduce_gradients")
    _check_all_reduce(all_reduce)
    world_size = dist.get_world_size(group)
    for param in module.parameters():
        if param.grad is not None:
            _all_reduce_sum(param.grad, all_reduce, group)
            param.grad.div_(world_size)


def all_reduce_gradients_flat(module: nn.Module, all_reduce: str = "torch",
                              group: dist.ProcessGroup | None = None) -> None:
    """Average every gradient across ranks with a single all-reduce of one flat buffer.

    All gradients must have one dtype. One collective pays the latency once, but it can only
    start when backward has finished."""
    require_process_group("all_reduce_gradients_flat")
    _check_all_reduce(all_reduce)
    grads = [param.grad for param in module.parameters() if param.grad is not None]
    if not grads:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    _all_reduce_sum(flat, all_reduce, group)
    flat.div_(dist.get_world_size(group))
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


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
        return self.buffer.numel() * self.buffer.element_size()


@dataclass
class Event:
    """Something that happened in the last backward, in `time.perf_counter()` seconds:
    "gradient" (a parameter's gradient was ready; start == end) or "all_reduce" (a bucket's,
    from launch to completion; `end` is None until it completes)."""

    kind: str
    name: str
    start: float
    end: float | None


@dataclass
class _Step:
    """What DistributedDataParallel tracks during one synchronized backward."""

    pending: list[int]  # per bucket: gradients not yet copied in
    arrived: set[int] = field(default_factory=set)  # ids of parameters whose gradient came
    next_launch: int = 0  # buckets launch in order, so every rank issues the same sequence
    handles: list[Any] = field(default_factory=list)


# --- The wrapper ---------------------------------------------------------------------------------


class DistributedDataParallel(nn.Module):
    """Data parallelism with bucketed all-reduces that overlap backward.

    At wrap time, checks that every rank's model has the same parameter and buffer names,
    shapes and dtypes (values may differ) and copies rank 0's values to every rank. Then a
    post-accumulate-grad hook on each trainable parameter copies its gradient into a bucket
    as soon as backward produces it; buckets hold at most `bucket_cap_mb` MiB (a bigger
    parameter gets one to itself) and are filled in reverse `parameters()` order. A full
    bucket starts an asynchronous all-reduce at once, in bucket order, while backward goes on.
    At the end of backward, `finish_gradient_synchronization()` runs by itself: it waits for
    every all-reduce and writes the averaged gradients back into `.grad`. So, as with
    PyTorch's DDP, `.grad` is averaged when `loss.backward()` returns; calling it yourself
    afterwards does nothing.

    - `no_sync()`: backward inside it only accumulates local gradients (no communication);
      the first backward after it averages the sum. Run forward and backward both inside.
    - Frozen parameters (`requires_grad=False`) are broadcast at wrap time, then left alone.
    - Shared (tied) parameters are one parameter: `parameters()` yields them once.
    - Buffers are broadcast from rank 0 at wrap time and, with `broadcast_buffers=True`, before
      every forward (BatchNorm's running statistics stay equal across ranks, as in PyTorch).
    - A trainable parameter that gets no gradient in a backward raises an error naming it at
      the end of that backward; with `find_unused_parameters=True` it counts as a zero
      gradient instead (its rank contributes 0 to the average), so ranks may use different
      parameters.
    - `all_reduce="ring"` runs minidist's ring all-reduce on a background thread, so
      `comm.count_traffic()` sees the bytes sent: 2(N-1)/N times each bucket per rank.
    - `compression` (TopK, PowerSGD, Int8 from `minidist.compression`) replaces each
      bucket's all-reduce with a compressed sum, run like `all_reduce="ring"` on the
      background thread through minidist's send/recv, whatever `all_reduce` says.
    - `events` records the last synchronized backward: when each gradient arrived and when
      each bucket's all-reduce started and ended (`plot_timeline` draws them).

    Differences from torch.nn.parallel.DistributedDataParallel: no smaller first bucket and
    no rebuilding of the buckets in gradient-arrival order after the first step; gradients
    are copied into buckets and back (its default, gradient_as_bucket_view=False); a
    parameter unused on every rank gets a zero gradient under find_unused_parameters (it
    leaves it None).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, *,
                 all_reduce: str = "torch", find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, group: dist.ProcessGroup | None = None,
                 compression: Compression | None = None):
        super().__init__()
        require_process_group("DistributedDataParallel")
        _check_all_reduce(all_reduce)
        if compression is not None and not isinstance(compression, Compression):
            raise ValueError(f"compression={compression!r}: pass a minidist.compression object "
                             f"(TopK(ratio), PowerSGD(rank), Int8()) or None")
        if isinstance(bucket_cap_mb, bool) or not (
            isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0
        ):
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: must be a positive number of MiB")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.all_reduce = all_reduce
        self.compression = compression
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.events: list[Event] = []
        self._sync = True  # False inside no_sync()
        self._forward_synced: bool | None = None  # was the last training forward synced?
        self._step: _Step | None = None  # the synchronized backward in progress, if any
        self._ring_thread = (concurrent.futures.ThreadPoolExecutor(1, "minidist-ddp-ring")
                             if all_reduce == "ring" or compression else None)

        check_same_model(module, group)
        broadcast_parameters(module, group)
        self.buckets = self._make_buckets(int(bucket_cap_mb * 2**20))
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._names = {id(p): b.names[i] for b in self.buckets for i, p in enumerate(b.params)}
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def _make_buckets(self, cap_bytes: int) -> list[Bucket]:
        trainable = [(name, p) for name, p in self.module.named_parameters() if p.requires_grad]
        trainable.reverse()  # backward produces the last layers' gradients first
        buckets: list[Bucket] = []
        # A buffer holds one dtype on one device: bucket each kind separately.
        for kind in dict.fromkeys((p.dtype, p.device) for _, p in trainable):
            of_kind = [(name, p) for name, p in trainable if (p.dtype, p.device) == kind]
            sizes = [p.numel() * p.element_size() for _, p in of_kind]
            for indices in assign_buckets(sizes, cap_bytes):
                names = [of_kind[i][0] for i in indices]
                params = [of_kind[i][1] for i in indices]
                offsets = [sum(p.numel() for p in params[:k]) for k in range(len(params))]
                numel = offsets[-1] + params[-1].numel()
                buffer = torch.zeros(numel, dtype=kind[0], device=kind[1])
                buckets.append(Bucket(len(buckets), names, params, offsets, buffer))
        return buckets

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._forward_synced = self._sync
            self._step = None  # left over only if the last backward raised before its end
        if self.broadcast_buffers and self.world_size > 1:
            src = first_rank(self.group)
            with torch.no_grad():
                for buffer in self.module.buffers():
                    dist.broadcast(buffer, src=src, group=self.group)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward inside the block sends nothing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # --- During backward ---------------------------------------------------------------------

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if self._forward_synced is not None and self._forward_synced != self._sync:
            backward, forward = ("inside", "outside") if self._sync is False else (
                "outside", "inside")
            raise RuntimeError(
                f"backward ran {backward} no_sync() but its forward ran {forward}: put both "
                f"the forward and the backward of each microbatch inside "
                f"`with model.no_sync():`, or both outside it"
            )
        if not self._sync:
            return
        now = time.perf_counter()
        if self._step is None:
            self._start_step()
        step = self._step
        if id(param) in step.arrived:
            self._step = None
            raise RuntimeError(
                f"the gradient of {self._names[id(param)]!r} arrived twice in one backward "
                f"(reentrant checkpointing, or a second backward through part of the graph); "
                f"DistributedDataParallel all-reduces each gradient once per backward"
            )
        step.arrived.add(id(param))
        self.events.append(Event("gradient", self._names[id(param)], now, now))
        bucket, position = self._where[id(param)]
        self._copy_in(bucket, position, param.grad)
        step.pending[bucket.index] -= 1
        self._launch_full_buckets()

    def _start_step(self) -> None:
        self._step = _Step([len(bucket.params) for bucket in self.buckets])
        self.events = []
        # Runs once the whole backward has finished: the engine calls it before returning.
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    @staticmethod
    def _copy_in(bucket: Bucket, position: int, grad: torch.Tensor | None) -> None:
        start = bucket.offsets[position]
        end = start + bucket.params[position].numel()
        if grad is None:
            bucket.buffer[start:end].zero_()
        else:
            bucket.buffer[start:end].copy_(grad.reshape(-1))

    def _launch_full_buckets(self) -> None:
        step = self._step
        while step.next_launch < len(self.buckets) and step.pending[step.next_launch] == 0:
            step.handles.append(self._launch(self.buckets[step.next_launch]))
            step.next_launch += 1

    def _launch(self, bucket: Bucket) -> Any:
        event = Event("all_reduce", f"bucket {bucket.index}", time.perf_counter(), None)
        self.events.append(event)

        def finished(_: Any = None) -> None:
            event.end = time.perf_counter()

        if self._ring_thread is not None:
            def ring() -> None:
                if self.compression is None:
                    comm.ring_all_reduce(bucket.buffer, group=self.group)
                else:
                    self.compression.all_reduce(bucket.index, bucket.buffer,
                                                [p.shape for p in bucket.params], self.group)
                finished()

            return self._ring_thread.submit(ring)
        comm.record("all_reduce", bucket.buffer, self.group)
        work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        work.get_future().then(finished)
        return work

    def _on_backward_end(self) -> None:
        step = self._step
        missing = [(bucket, i) for bucket in self.buckets for i, p in enumerate(bucket.params)
                   if id(p) not in step.arrived]
        if missing and not self.find_unused_parameters:
            self._step = None
            names = ", ".join(bucket.names[i] for bucket, i in missing)
            raise RuntimeError(
                f"rank {dist.get_rank()}: parameters got no gradient in this backward: {names}. "
                f"Make every trainable parameter take part in the loss, freeze the unused ones "
                f"(requires_grad=False) before wrapping, or pass find_unused_parameters=True"
            )
        for bucket, position in missing:  # count them as zero (or their accumulated gradient)
            self._copy_in(bucket, position, bucket.params[position].grad)
            step.pending[bucket.index] -= 1
        self._launch_full_buckets()
        self.finish_gradient_synchronization()

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce, divide by the world size and write the averages
        into `.grad`. Runs by itself at the end of each synchronized backward; calling it
        again does nothing."""
        if not self._sync:
            raise RuntimeError(
                "finish_gradient_synchronization() inside no_sync(): nothing was sent; the "
                "first backward after leaving no_sync() averages the accumulated gradients"
            )
        step, self._step = self._step, None
        if step is None:
            return
        if step.next_launch < len(self.buckets):
            raise RuntimeError(
                f"finish_gradient_synchronization() before backward finished: buckets "
                f"{step.next_launch}..{len(self.buckets) - 1} have not been sent"
            )
        for bucket, handle in zip(self.buckets, step.handles, strict=True):
            _wait(handle)
            bucket.buffer.div_(self.world_size)
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                averaged = bucket.buffer[offset:offset + param.numel()].view_as(param)
                if param.grad is None:
                    param.grad = averaged.clone()
                else:
                    param.grad.copy_(averaged)


def _wait(handle: Any) -> None:
    if isinstance(handle, concurrent.futures.Future):
        handle.result()
    else:
        handle.wait()


# --- Looking at it -------------------------------------------------------------------------------


def plot_timeline(events: list[Event], ax: Any = None, title: str = "") -> Any:
    """Draw one backward's events, in milliseconds from the first: gradient arrivals as ticks
    on the top row, and below it one row per bucket with a bar from the launch of its
    all-reduce to its completion. A dashed line marks the last gradient, the end of backward's
    compute. Returns the axes."""
    import matplotlib.pyplot as plt

    all_reduces = [event for event in events if event.kind == "all_reduce"]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 1.2 + 0.3 * len(all_reduces)))
    t0 = min(event.start for event in events)
    grads = [(event.start - t0) * 1e3 for event in events if event.kind == "gradient"]
    ax.vlines(grads, -0.35, 0.35, color="tab:blue", linewidth=1)
    for row, event in enumerate(all_reduces, start=1):
        end = event.start if event.end is None else event.end
        ax.barh(row, (end - event.start) * 1e3, left=(event.start - t0) * 1e3, height=0.6,
                color="tab:orange")
    if grads:
        ax.axvline(max(grads), color="gray", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(all_reduces) + 1),
                  ["gradients"] + [event.name for event in all_reduces])
    ax.set_ylim(len(all_reduces) + 0.6, -0.6)
    ax.set_xlabel("ms since the first gradient (dashed: the last gradient)")
    if title:
        ax.set_title(title)
    return ax
