"""Offload: optimizer state off the device, on the host or on NVMe, and every byte that
crosses to it counted.

    optimizer = ZeroOffloadOptimizer(model.parameters(), torch.optim.AdamW, stage=2,
                                     offload="host")
    model = FullyShardedDataParallel(model, compute_dtype=torch.bfloat16, offload="host")
    optimizer = ZeroOffloadOptimizer(params, torch.optim.AdamW, stage=2,
                                     offload=Offload("nvme", folder="/local_nvme/run1"))

ZeRO-Offload (Ren et al. 2021, §4): the fp32 master shards and Adam's m and v live on the
host; each reduced gradient shard is moved to the host as soon as backward produces it; the
CPU runs the optimizer step; the updated parameter shard comes back in the compute dtype.
ZeRO-Infinity (Rajbhandari et al. 2021) adds the NVMe tier: the state lives in files, read
and written shard by shard each step. The formulas for what lives where, what crosses per
step and what it costs are in `minidist.costs.tiers`.

This module holds where the state goes (`Offload`: the tier and its room) and the one door each
way (`to_host`, `to_device`), which every open `transfers()` log counts, as
`counting.count_traffic` counts collectives:

    with offload.transfers() as moved:
        loss.backward(); optimizer.step()
    moved.to_host, moved.to_device        # bytes, this rank, this step

The pieces beside it, in `minidist.parallel`: `nvme` (tensors in files, `NvmeStore`, real I/O on
any machine), `host_optimizer` (AdamW on tensors that live on the host), `device_memory` (the
EMULATED device budget), and `zero_offload` (ZeRO-1/2 with its state placed by them).

On a GPU `to_host` and `to_device` are real copies between GPU memory and pinned host memory;
the gradient copies run on a side CUDA stream so they overlap the rest of backward. **Without a
GPU both tiers are host memory**: the copies still happen and are counted, and
`device_memory.DeviceMemory` accounts for the bytes minidist places on "the device", raising an
out-of-memory error shaped like CUDA's when they pass its capacity. That is bookkeeping, not a
measurement: on a GPU, `torch.cuda.memory_allocated` measures it (bench/gpu_check.py). PyTorch
never offloads by itself: a real GPU that runs out raises `torch.OutOfMemoryError`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minidist.core._checks import one_of, positive
from minidist.core.launch import device as compute_device
from minidist.core.timeline import Event, clock
from minidist.costs import tiers

__all__ = ["Offload", "host_memory_available", "TransferLog", "transfers", "record", "to_host",
           "to_device", "tampered_copies"]

MiB = 2**20


# --- Where the state goes ----------------------------------------------------------------------


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


def record(kind: str, nbytes: int, name: str, start: float) -> None:
    """Count a move of `kind` ("to_host", "to_device", "disk_read", "disk_write") of `nbytes`
    that began at `start` in every open `transfers()` log."""
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


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


_tampering: dict[str, float] = {}  # "to_host"/"to_device" -> added to each copy; see below


@contextlib.contextmanager
def tampered_copies(*, to_host: float | None = None,
                    to_device: float | None = None) -> Iterator[None]:
    """Inside the block every copy `to_host` returns (and every one `to_device` returns) has
    `to_host` (`to_device`) added to each element, as `checking.tampered_receives` changes a
    message on arrival. A check passes float("nan") and requires what the checked function
    computed to follow the copy (NaN wherever it used one): a copy made only to be counted,
    then thrown away, leaves the result as it was."""
    saved = dict(_tampering)
    _tampering.update({kind: delta for kind, delta in
                       (("to_host", to_host), ("to_device", to_device)) if delta is not None})
    try:
        yield
    finally:
        _tampering.clear()
        _tampering.update(saved)


class _Moving:
    """A device-to-host copy in flight on the side stream: `wait()` returns the host tensor."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None,
                 delta: float | None = None):
        self.host, self.done, self.delta = host, done, delta

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        if self.delta is not None:  # tampered (see tampered_copies): once, when it lands
            self.host.add_(self.delta)
            self.delta = None
        return self.host


def to_host(tensor: torch.Tensor, what: str = "", async_op: bool = False):
    """A copy of `tensor` in host memory, counted by every open `transfers()` log under the
    name `what` ("gradient shard").

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
        moving = _Moving(host, stream.record_event(), _tampering.get("to_host"))
    else:
        moving = _Moving(source.clone(), None, _tampering.get("to_host"))
    record("to_host", source.nbytes, what, start)
    return moving if async_op else moving.wait()


def to_device(tensor: torch.Tensor, device: torch.device | str | None = None,
              what: str = "") -> torch.Tensor:
    """A copy of host `tensor` on `device` (default: the one this rank computes on, its GPU
    under NCCL), counted by every open `transfers()` log under the name `what`."""
    start = clock()
    device = torch.device(device) if device is not None else compute_device()
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    copy.copy_(tensor.detach())
    if "to_device" in _tampering:  # see tampered_copies
        copy.add_(_tampering["to_device"])
    record("to_device", tensor.nbytes, what, start)
    return copy
