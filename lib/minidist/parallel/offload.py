"""Offload: optimizer state on the host or on NVMe, the device keeping only what compute needs.

    optimizer = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, offload="host")
    model = FullyShardedDataParallel(model, compute_dtype=torch.bfloat16, offload="host")
    optimizer = ZeroOptimizer(params, torch.optim.AdamW, stage=2,
                              offload=Offload("nvme", folder="/local_nvme/run1"))

ZeRO-Offload (Ren et al. 2021, §4): the fp32 master shards and Adam's m and v live on the
host; each reduced gradient shard is moved to the host as soon as backward produces it; the
CPU runs the optimizer step; the updated parameter shard comes back in the compute dtype.
ZeRO-Infinity (Rajbhandari et al. 2021) adds the NVMe tier: the state lives in files, read
and written shard by shard each step (`NvmeStore`, real I/O on any machine). The formulas for
what lives where, what crosses per step and what it costs are in `minidist.costs.tiers`.

Every crossing goes through `to_host` and `to_device`, which every open `transfers()` log
counts, as `counting.count_traffic` counts collectives:

    with offload.transfers() as moved:
        loss.backward(); optimizer.step()
    moved.to_host, moved.to_device        # bytes, this rank, this step

On a GPU they are real copies between GPU memory and pinned host memory; the gradient copies
run on a side CUDA stream so they overlap the rest of backward. **Without a GPU both tiers
are host memory**: the copies still happen and are counted, and `DeviceMemory` accounts for
the bytes minidist places on "the device", raising an out-of-memory error shaped like CUDA's
when they pass its capacity. That is bookkeeping, not a measurement: on a GPU,
`torch.cuda.memory_allocated` measures it (bench/gpu_check.py). PyTorch never offloads by
itself: a real GPU that runs out raises `torch.OutOfMemoryError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.optim import adamw

from minidist.core._checks import one_of, positive
from minidist.core.launch import device as compute_device
from minidist.core.timeline import Event, clock
from minidist.costs import tiers

__all__ = ["Offload", "DeviceMemory", "TransferLog", "transfers", "to_host", "to_device",
           "NvmeStore", "adamw_step_", "measure_disk", "measure_optimizer_throughput",
           "host_memory_available"]

MiB = 2**20


# --- What crosses the host <-> device boundary ------------------------------------------------


@dataclass(eq=False)  # logs are told apart by identity (nested blocks may hold equal counts)
class TransferLog:
    """What this rank moved inside one `transfers()` block: bytes across PCIe each way, bytes
    read from and written to disk, and one `timeline.Event` per move (kind "to_host",
    "to_device", "disk_read" or "disk_write"; `name` says what moved)."""

    to_host: int = 0
    to_device: int = 0
    disk_read: int = 0
    disk_written: int = 0
    events: list[Event] = field(default_factory=list)

    def calls(self, kind: str) -> int:
        """How many moves of `kind` ("to_host", "to_device", "disk_read", "disk_write")."""
        return sum(event.kind == kind for event in self.events)

    @property
    def totals(self) -> tiers.Transfers:
        """The bytes, to compare with `tiers.offload_transfer_bytes`."""
        return tiers.Transfers(self.to_host, self.to_device, self.disk_read, self.disk_written)


_open_logs: list[TransferLog] = []
_FIELDS = {"to_host": "to_host", "to_device": "to_device", "disk_read": "disk_read",
           "disk_write": "disk_written"}


def _record(kind: str, nbytes: int, name: str, start: float) -> None:
    if not _open_logs:
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    event = Event(rank, kind, name, start, clock(), nbytes)
    for log in _open_logs:
        setattr(log, _FIELDS[kind], getattr(log, _FIELDS[kind]) + nbytes)
        log.events.append(event)


@contextlib.contextmanager
def transfers() -> Iterator[TransferLog]:
    """Count every `to_host`, `to_device` and NVMe read or write this rank makes inside the
    block. Blocks nest: an outer log includes what inner ones count."""
    log = TransferLog()
    _open_logs.append(log)
    try:
        yield log
    finally:
        _open_logs.remove(log)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


class _Moving:
    """A device-to-host copy in flight on the side stream: `wait()` returns the host tensor."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None):
        self.host, self.done = host, done

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host


def to_host(tensor: torch.Tensor, when: str = "", async_op: bool = False):
    """A copy of `tensor` in host memory, counted by every open `transfers()` log.

    From a GPU the copy goes to pinned memory on a side CUDA stream, after the work already
    queued on the current stream, so the backward kernels queued next run while it copies;
    with `async_op=True` it returns at once and `.wait()` gives the tensor. Without a GPU it is
    a copy within host memory: the emulated device and the host share it."""
    start, source = clock(), tensor.detach()
    if source.is_cuda:
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        stream = _side_streams.setdefault(source.device, torch.cuda.Stream(source.device))
        stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(stream):
            host.copy_(source, non_blocking=True)
        source.record_stream(stream)  # the caching allocator must not reuse it before the copy
        moving = _Moving(host, stream.record_event())
    else:
        moving = _Moving(source.clone(), None)
    _record("to_host", _nbytes(source), when, start)
    return moving if async_op else moving.wait()


def to_device(tensor: torch.Tensor, device: torch.device | str | None = None,
              when: str = "") -> torch.Tensor:
    """A copy of host `tensor` on `device` (default: the one this rank computes on, its GPU
    under NCCL), counted by every open `transfers()` log."""
    start = clock()
    device = torch.device(device) if device is not None else compute_device()
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    copy.copy_(tensor.detach())
    _record("to_device", _nbytes(tensor), when, start)
    return copy


# --- The tiers a state can go to --------------------------------------------------------------


def host_memory_available() -> int:
    """Bytes of host memory free for new data (psutil's `available`, else the physical
    memory)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Offload:
    """Where the optimizer state goes: `tier` "host" or "nvme"; for "nvme" the `folder` its
    files go in (default: a new folder in the system's temporary directory); `capacity` the
    bytes the tier may hold (default: the host's available memory, or the disk's free
    space)."""

    tier: str = "host"
    folder: str | os.PathLike | None = None
    capacity: float | None = None

    def __post_init__(self) -> None:
        one_of("tier", self.tier, ("host", "nvme"))
        if self.capacity is not None:
            positive(capacity=self.capacity)
        if self.folder is not None and self.tier != "nvme":
            raise ValueError(f"folder={str(self.folder)!r} is for the NVMe tier: use "
                             f"Offload('nvme', folder=...) or leave folder out")

    @classmethod
    def of(cls, value: str | Offload | None) -> Offload | None:
        """None, an Offload, or a tier's name ("host", "nvme") as an Offload."""
        if value is None or isinstance(value, Offload):
            return value
        if value not in ("host", "nvme"):
            raise ValueError(f"offload={value!r}: choose None (state on the device), 'host' or "
                             f"'nvme', or pass an Offload(...)")
        return cls(value)

    def room(self) -> float:
        """The bytes this tier can hold."""
        if self.capacity is not None:
            return self.capacity
        if self.tier == "host":
            return host_memory_available()
        folder = Path(self.folder or tempfile.gettempdir())
        while not folder.exists():  # the folder is created later: ask the disk it will be on
            folder = folder.parent
        return shutil.disk_usage(folder).free

    def check_room(self, nbytes: float, what: str) -> None:
        """ValueError, before anything is allocated, when `nbytes` do not fit the tier."""
        room = self.room()
        if nbytes > room:
            other = ("Offload('nvme', folder=...) on a disk with room" if self.tier == "host"
                     else "a folder on a larger disk")
            raise ValueError(
                f"offload to the {self.tier} tier: {what} needs {nbytes / MiB:.2f} MiB per rank "
                f"but the tier holds {room / MiB:.2f} MiB (capacity={self.capacity!r}); use "
                f"more ranks (each holds 1/N), {other}, or a larger capacity")


# --- The emulated device memory ---------------------------------------------------------------


class DeviceMemory:
    """A budget of `capacity` bytes of device memory, and what minidist has placed in it.

        budget = DeviceMemory(8 * MiB)
        optimizer = ZeroOptimizer(params, torch.optim.AdamW, stage=2, device_memory=budget)

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
            f"CUDA out of memory (emulated: minidist.parallel.offload.DeviceMemory, a budget of "
            f"{self.capacity / MiB:.2f} MiB; no GPU memory was measured). Tried to allocate "
            f"{nbytes / MiB:.2f} MiB for {what}. The device has a total capacity of "
            f"{self.capacity / MiB:.2f} MiB of which {(self.capacity - self.used) / MiB:.2f} MiB "
            f"is free. minidist holds {self.used / MiB:.2f} MiB on it: {held or 'nothing'}. "
            f"Offload the optimizer state (offload='host' or 'nvme'), shard more (a higher "
            f"ZeRO stage or more ranks), or give the device more memory.")


# --- The NVMe tier ----------------------------------------------------------------------------


class NvmeStore:
    """Tensors in files, one per name, in `folder`: written and read for real.

    Each write is flushed to the disk (fsync) and each file dropped from the page cache
    afterwards (posix_fadvise DONTNEED, where the OS has it), so the next read comes from the
    disk, not from memory. Every read and write is counted by open `transfers()` logs and in
    `bytes_read`, `bytes_written` and `seconds`. Tensors returned by `read` are tracked while
    they live: `resident` is their bytes now, `peak_resident` the most at once."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.layout: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.bytes_read = self.bytes_written = 0
        self.seconds = 0.0
        self.resident = self.peak_resident = 0

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.bin"

    def __contains__(self, name: str) -> bool:
        return name in self.layout

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Store `tensor` (on the host) as `name`, replacing what was there."""
        start = clock()
        data = tensor.detach().contiguous()
        with open(self.path(name), "wb", buffering=0) as file:
            file.write(_buffer(data))
            os.fsync(file.fileno())
            _drop_from_cache(file.fileno())
        self.layout[name] = (tensor.shape, tensor.dtype)
        self._count("disk_write", _nbytes(data), name, start)

    def read(self, name: str) -> torch.Tensor:
        """A new host tensor holding what was last written as `name`."""
        if name not in self.layout:
            raise KeyError(f"{name!r} was never written to {self.folder}; written: "
                           f"{sorted(self.layout) or 'nothing yet'}")
        start = clock()
        shape, dtype = self.layout[name]
        tensor = torch.empty(shape, dtype=dtype)
        nbytes = _nbytes(tensor)
        with open(self.path(name), "rb", buffering=0) as file:
            got = file.readinto(_buffer(tensor))
            _drop_from_cache(file.fileno())
        if got != nbytes:
            raise OSError(f"{self.path(name)} holds {got} bytes, expected {nbytes}")
        self._count("disk_read", nbytes, name, start)
        self.resident += nbytes
        self.peak_resident = max(self.peak_resident, self.resident)
        weakref.finalize(tensor, self._release, nbytes)
        return tensor

    def _release(self, nbytes: int) -> None:
        self.resident -= nbytes

    def _count(self, kind: str, nbytes: int, name: str, start: float) -> None:
        self.seconds += clock() - start
        if kind == "disk_read":
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
        _record(kind, nbytes, name, start)


def _buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without numpy (which would pin its storage's
    size for good)."""
    return memoryview((ctypes.c_char * _nbytes(tensor)).from_address(tensor.data_ptr())).cast("B")


def _drop_from_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def measure_disk(folder: str | os.PathLike, nbytes: int = 32 * MiB,
                 repeat: int = 3) -> tuple[float, float]:
    """(write, read) bandwidth in bytes/s of the disk under `folder`, measured the way the
    NVMe tier uses it (fsync after writing, page cache dropped): the median of `repeat`
    rounds of one `nbytes` file. Without DONTNEED (macOS) reads may come from memory."""
    store = NvmeStore(Path(folder) / "bandwidth_probe")
    data = torch.ones(nbytes // 4)
    writes, reads = [], []
    try:
        for _ in range(repeat):
            store.write("probe", data)
            writes.append(nbytes / max(store.seconds, 1e-9))
            store.seconds = 0.0
            store.read("probe")
            reads.append(nbytes / max(store.seconds, 1e-9))
            store.seconds = 0.0
    finally:
        shutil.rmtree(store.folder, ignore_errors=True)
    return sorted(writes)[repeat // 2], sorted(reads)[repeat // 2]


# --- The optimizer step on the host -----------------------------------------------------------


@torch.no_grad()
def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, lr: float = 1e-3,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 1e-2) -> None:
    """One AdamW update of `param`, `exp_avg` and `exp_avg_sq` in place, `step` counting from 1:
    torch.optim.AdamW's own arithmetic (its functional form), on tensors that need not belong
    to an optimizer, such as a shard just read from disk."""
    taken = torch.tensor(float(step - 1))  # steps taken before: the functional adds this one
    adamw.adamw([param], [grad], [exp_avg], [exp_avg_sq], [], [taken], foreach=False,
                amsgrad=False, beta1=betas[0], beta2=betas[1], lr=lr,
                weight_decay=weight_decay, eps=eps, maximize=False)


def measure_optimizer_throughput(numel: int = 2**22, steps: int = 5, threads: int = 1) -> float:
    """Parameters per second AdamW updates on this host with `threads` torch threads (one by
    default, as the ranks run): the CPU optimizer's throughput, for `tiers.offload_step_time`.
    The median of `steps` steps over `numel` fp32 parameters, after one warm-up step. The
    caller's thread count is restored afterwards."""
    param = torch.zeros(numel)
    param.grad = torch.full((numel,), 1e-3)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        optimizer.step()
        times = []
        for _ in range(steps):
            start = clock()
            optimizer.step()
            times.append(clock() - start)
    finally:
        torch.set_num_threads(before)
    return numel / sorted(times)[steps // 2]
