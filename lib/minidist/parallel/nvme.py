"""The NVMe tier (ZeRO-Infinity, Rajbhandari et al. 2021): tensors in files, written and read
for real, shard by shard, on any machine; and the disk's bandwidth measured the same way.

    store = NvmeStore(folder)
    store.write("0.master", shard); master = store.read("0.master")
    write_bandwidth, read_bandwidth = measure_disk(folder)     # bytes/s

Every read and write is counted by the open `offload.transfers()` logs (kinds "disk_read" and
"disk_write"), for comparison with `minidist.costs.tiers.nvme_bytes`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import weakref
from pathlib import Path

import torch

from minidist.core.timeline import clock
from minidist.parallel.offload import record

__all__ = ["NvmeStore", "measure_disk"]

MiB = 2**20


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
        self._count("disk_write", data.nbytes, name, start)

    def read(self, name: str) -> torch.Tensor:
        """A new host tensor holding what was last written as `name`."""
        if name not in self.layout:
            raise KeyError(f"{name!r} was never written to {self.folder}; written: "
                           f"{sorted(self.layout) or 'nothing yet'}")
        start = clock()
        shape, dtype = self.layout[name]
        tensor = torch.empty(shape, dtype=dtype)
        nbytes = tensor.nbytes
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
        record(kind, nbytes, name, start)


def _buffer(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without numpy (which would pin its storage's
    size for good)."""
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


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
