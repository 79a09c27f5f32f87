"""The EMULATED device memory: a budget of bytes, and what minidist has placed in it.

Without a GPU, "the device" is host memory, so nothing runs out by itself. `DeviceMemory`
accounts for the bytes minidist places on the device (`zero_offload.ZeroOffloadOptimizer`
places parameters, gradients, master weights, optimizer state and gathered buffers in it) and
raises `torch.OutOfMemoryError`, worded like CUDA's, when they would pass its capacity: what
Lab 12 fits a model under by offloading. On a GPU, `torch.cuda.memory_allocated` measures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from minidist.core._checks import positive

__all__ = ["DeviceMemory"]

MiB = 2**20


class DeviceMemory:
    """A budget of `capacity` bytes of device memory, and what minidist has placed in it.

        budget = DeviceMemory(8 * MiB)
        optimizer = ZeroOffloadOptimizer(params, torch.optim.AdamW, stage=2, offload=None,
                                         device_memory=budget)

    Each placement (`place` for what stays, `holding` for what is freed soon) adds to `used`;
    one that would pass `capacity` raises `torch.OutOfMemoryError`, worded like CUDA's. It is
    accounting of the tensors minidist knows it puts on the device (parameters, gradients,
    master weights, optimizer state, gathered buffers), not a measurement: activations and the
    allocator's caching are not in it. On a GPU, `torch.cuda.memory_allocated` measures."""

    def __init__(self, capacity: float):
        positive(capacity=capacity)
        self.capacity = capacity
        self.held: dict[str, int] = {}
        self.peak = 0

    @property
    def used(self) -> int:
        return sum(self.held.values())

    def place(self, what: str, nbytes: int) -> None:
        """From now on `what` takes `nbytes` (0 frees it)."""
        grows = nbytes - self.held.get(what, 0)
        if self.used + grows > self.capacity:
            self._out_of_memory(what, grows)
        self.held[what] = nbytes
        if not nbytes:
            del self.held[what]
        self.peak = max(self.peak, self.used)

    def add(self, what: str, nbytes: int) -> None:
        self.place(what, self.held.get(what, 0) + nbytes)

    @contextlib.contextmanager
    def holding(self, what: str, nbytes: int) -> Iterator[None]:
        """`nbytes` more of `what` for the duration of the block."""
        self.add(what, nbytes)
        try:
            yield
        finally:
            self.place(what, self.held.get(what, 0) - nbytes)

    def _out_of_memory(self, what: str, nbytes: int) -> None:
        held = ", ".join(f"{name} {size / MiB:.2f} MiB" for name, size in self.held.items())
        raise torch.OutOfMemoryError(
            f"CUDA out of memory (emulated: minidist.parallel.device_memory.DeviceMemory, a "
            f"budget of {self.capacity / MiB:.2f} MiB; no GPU memory was measured). Tried to "
            f"allocate {nbytes / MiB:.2f} MiB for {what}. The device has a total capacity of "
            f"{self.capacity / MiB:.2f} MiB of which {(self.capacity - self.used) / MiB:.2f} MiB "
            f"is free. minidist holds {self.used / MiB:.2f} MiB on it: {held or 'nothing'}. "
            f"Offload the optimizer state (offload='host' or 'nvme'), shard more (a higher "
            f"ZeRO stage or more ranks), or give the device more memory.")
