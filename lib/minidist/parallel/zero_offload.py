"""ZeRO-1/2 with its state placed: the layer beside `minidist.parallel.zero` that Lab 12 adds.

    optimizer = ZeroOffloadOptimizer(model.parameters(), torch.optim.AdamW, stage=2,
                                     offload="host", device_memory=DeviceMemory(8 * MiB))

`ZeroOffloadOptimizer` is a `ZeroOptimizer` whose steps are unchanged; it only changes where
things live and what the device is charged for:

- `offload="host"` (ZeRO-Offload, Ren et al. 2021, §4): the fp32 master slices and the
  optimizer's state live on the host; each reduced gradient slice is moved there as soon as it
  is produced (stage 2: during backward, on a side CUDA stream on a GPU), the wrapped optimizer
  steps on the host, and each updated slice comes back in the parameters' dtype before the
  all-gather: Ψ/N gradient and Ψ/N parameter elements cross per step
  (`tiers.offload_transfer_bytes`).
- `offload=Offload("nvme", folder)` (ZeRO-Infinity, Rajbhandari et al. 2021) keeps master
  weights and AdamW's m and v in files instead, read, updated and written back one parameter's
  slice at a time (`minidist.parallel.nvme`, `minidist.parallel.host_optimizer`).
- `offload=None` keeps everything on the device, as `ZeroOptimizer` does.

`device_memory=DeviceMemory(bytes)` accounts for what this optimizer places on the device
(parameters, gradients, master weights, optimizer state, gathered parameters) and raises CUDA's
out-of-memory error past its capacity; the default is an unbounded budget that still records
its `peak`.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minidist.communication import collectives
from minidist.core._checks import require_process_group
from minidist.costs.memory import OPTIMIZER_STATES
from minidist.parallel.device_memory import DeviceMemory
from minidist.parallel.host_optimizer import adamw_step_
from minidist.parallel.nvme import NvmeStore
from minidist.parallel.offload import Offload, to_device, to_host
from minidist.parallel.zero import ZeroOptimizer

__all__ = ["ZeroOffloadOptimizer"]


class ZeroOffloadOptimizer(ZeroOptimizer):
    """A `ZeroOptimizer` with its master slices and optimizer state on `offload` ("host", the
    default; an `Offload("nvme", folder)`; or None, the device), and every byte it places on
    the device charged to `device_memory`. The arguments before `offload` are
    `ZeroOptimizer`'s. (About 100 lines: one override per place where ZeroOptimizer touches
    memory; `_NvmeSlices` holds the NVMe tier's files.)"""

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer_cls: type,
                 stage: int = 1, group: dist.ProcessGroup | None = None, impl: str = "torch",
                 offload: str | Offload | None = "host",
                 device_memory: DeviceMemory | None = None, **optimizer_kwargs: Any):
        self.offload = Offload.of(offload)
        self.device_memory = device_memory or DeviceMemory(math.inf)
        params = list(dict.fromkeys(p for p in params if p.requires_grad))
        require_process_group("ZeroOffloadOptimizer")
        # Before anything is allocated: the tier has room, the device holds the parameters.
        if self.offload is not None:
            shard_numel = sum(end - start for start, end in
                              (collectives.shard_bounds(p.numel(), group) for p in params))
            _check_offload(self.offload, optimizer_cls, optimizer_kwargs, shard_numel)
        self.device_memory.place("parameters", sum(p.nbytes for p in params))
        self._arriving: list[tuple[int, Any]] = []  # gradient slices on their way to the host
        super().__init__(params, optimizer_cls, stage, group, impl, **optimizer_kwargs)
        if self.offload is None:
            self.device_memory.place("master weights", sum(s.nbytes for s in self.shards))
            self.optimizer.register_step_post_hook(self._place_optimizer_state)
        self.nvme = (_NvmeSlices(self.offload.folder, self.shards)
                     if self.offload is not None and self.offload.tier == "nvme" else None)

    @property
    def store(self) -> NvmeStore | None:
        """The NVMe tier's files (offload to "nvme" only), with the bytes and time they moved."""
        return self.nvme.store if self.nvme is not None else None

    def _master(self, piece: torch.Tensor) -> torch.Tensor:
        if self.offload is None:
            return super()._master(piece)
        return to_host(piece, "master weights").float()

    def _reduce_scatter(self, index: int, grad: torch.Tensor) -> None:
        """The whole gradient is held on the device while it is reduce-scattered; offloaded,
        its slice leaves for the host at once (in flight until `reduce_gradients`)."""
        with self.device_memory.holding("gradient", grad.nbytes):
            mine = collectives.reduce_scatter(grad.reshape(-1), group=self.group, impl=self.impl,
                                              when="gradients")
        if self.offload is not None:
            self._arriving.append((index, to_host(mine, "gradient shard", async_op=True)))
        else:
            self._accumulate(index, mine)

    def _accumulate(self, index: int, mine: torch.Tensor) -> None:
        if self.shards[index].grad is None and self.offload is None:
            self.device_memory.add("gradient shards", 4 * mine.numel())  # its fp32 slice
        super()._accumulate(index, mine)

    def _reduce_scatter_gradients(self) -> None:
        self.device_memory.place("gradients", sum(p.grad.nbytes for p in self.params
                                                  if p.grad is not None))
        super()._reduce_scatter_gradients()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """`ZeroOptimizer.reduce_gradients`, then wait for the slices still being copied to
        the host, and add them up."""
        super().reduce_gradients()
        for index, moving in self._arriving:
            self._accumulate(index, moving.wait())
        self._arriving.clear()

    def _place_optimizer_state(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.device_memory.place("optimizer state", sum(
            value.nbytes for state in optimizer.state.values()
            for value in state.values() if isinstance(value, torch.Tensor)))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch.optim.Optimizer's)
        if self.nvme is None:
            return super().step(closure)
        if closure is not None:
            raise ValueError("ZeroOffloadOptimizer.step does not take a closure")
        self.reduce_gradients()
        self._reduced = False
        self.nvme.step(self.params, self.shards, self.param_groups[0], self._gather_into)

    def _gather_into(self, param: torch.nn.Parameter, shard: torch.Tensor) -> None:
        """The slice first moved to the device when it was updated on the host; the whole
        parameter held on the device while it is gathered."""
        if self.offload is not None:
            shard = to_device(shard, param.device, "parameter shard")
        with self.device_memory.holding("gathered parameter", param.nbytes):
            super()._gather_into(param, shard)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.device_memory.place("gradients", 0)
        self.device_memory.place("gradient shards", 0)


class _NvmeSlices:
    """ZeRO-Infinity's NVMe tier for a ZeroOffloadOptimizer: each slice's fp32 master weights
    and AdamW moments live in files; a step reads one slice's, updates it, writes it back and
    sends it to the device before the next is read, so one slice's state is in host memory
    at a time."""

    def __init__(self, folder: str | None, shards: list[torch.Tensor]):
        folder_path = Path(folder or tempfile.mkdtemp(prefix="minidist-nvme-"))
        self.store = NvmeStore(folder_path / f"rank{dist.get_rank()}")
        self.steps = [0] * len(shards)
        for index, shard in enumerate(shards):
            self.store.write(f"{index}.master", shard)
            shard.untyped_storage().resize_(0)  # only the file holds it now

    def step(self, params: list[torch.nn.Parameter], shards: list[torch.Tensor],
             hyper: dict[str, Any],
             gather_into: Callable[[torch.nn.Parameter, torch.Tensor], None]) -> None:
        for index, (param, shard) in enumerate(zip(params, shards, strict=True)):
            if shard.grad is None:
                continue
            self.steps[index] += 1
            names = [f"{index}.{name}" for name in ("master", "exp_avg", "exp_avg_sq")]
            master = self.store.read(names[0])
            moments = ([self.store.read(name) for name in names[1:]] if names[1] in self.store
                       else [torch.zeros_like(master), torch.zeros_like(master)])
            adamw_step_(master, shard.grad, *moments, self.steps[index], lr=hyper["lr"],
                        betas=hyper["betas"], eps=hyper["eps"],
                        weight_decay=hyper["weight_decay"])
            for name, tensor in zip(names, (master, *moments), strict=True):
                self.store.write(name, tensor)
            gather_into(param, master.to(param.dtype))
            del master, moments, tensor  # freed before the next slice is read


def _check_offload(target: Offload, optimizer_cls: type, kwargs: dict[str, Any],
                   shard_numel: int) -> None:
    """Before anything is allocated: the NVMe tier steps AdamW itself, and the tier must hold
    this rank's fp32 master weights and optimizer state (and, on the host, gradient slices)."""
    if target.tier == "nvme" and optimizer_cls is not torch.optim.AdamW:
        raise ValueError(f"offload to NVMe updates each slice with AdamW as it is read "
                         f"(host_optimizer.adamw_step_), got "
                         f"optimizer_cls={optimizer_cls.__name__}: use torch.optim.AdamW, or "
                         f"offload='host' for any optimizer")
    name = optimizer_cls.__name__.lower()
    if name == "sgd" and kwargs.get("momentum"):
        name = "sgd-momentum"
    states = OPTIMIZER_STATES.get(name, 2)
    nbytes = 4 * (1 + states) * shard_numel  # fp32 master weights and states
    what = "the fp32 master weights and optimizer state"
    if target.tier == "host":
        nbytes += 4 * shard_numel
        what += " and the gradient slices"
    target.check_room(nbytes, what)
