"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020): shard the optimizer, then the gradients.

Every parameter is flattened and split element by element: rank r of N owns its slice
`collectives.shard_bounds`. Each step

    1. reduce-scatter each gradient: rank r receives the sum of its slice (divided by N, the
       average data parallelism needs);
    2. the wrapped optimizer updates only that slice, held as an fp32 master copy, so its state
       (Adam's m and v) is 1/N of the unsharded state;
    3. all-gather the updated slices back into every rank's parameters.

Reduce-scatter + all-gather is an all-reduce in two halves: the same 2Ψ traffic as DDP
(ZeRO §7), for 1/N of the optimizer memory.

Stage 1 keeps whole gradients until the step. Stage 2 reduce-scatters each gradient as soon
as backward has produced it and frees it, so each rank only ever stores its gradient slice
(with gradient accumulation that means one reduce-scatter per backward, not per step).

Tied parameters are one parameter (sharded once), frozen ones (requires_grad=False) are left
alone, and a parameter without a gradient is skipped as torch.optim skips it. Stage 1 first
sums, over the ranks, which parameters have a gradient (one small all-reduce): a parameter
no rank used is skipped, one some ranks used counts as zero on the others, as in DDP's
find_unused_parameters. Stage 2 reduce-scatters during each rank's own backward, so every
rank must use the same parameters; one that no rank used is skipped.

Offload (ZeRO-Offload, Ren et al. 2021, §4; `minidist.parallel.offload`): with `offload="host"` the
fp32 master slices and the optimizer's state live on the host; each reduced gradient slice is
moved there as soon as it is produced (stage 2: during backward, on a side CUDA stream on a
GPU), the wrapped optimizer steps on the host, and each updated slice comes back in the
parameters' dtype before the all-gather: Ψ/N gradient and Ψ/N parameter elements cross per
step (`tiers.offload_transfer_bytes`). `offload=Offload("nvme", folder)` keeps master
weights and AdamW's m and v in files instead, read, updated and written back one parameter's
slice at a time (ZeRO-Infinity). `device_memory=DeviceMemory(bytes)` accounts for what this
optimizer places on the device (parameters, gradients, master weights, optimizer state,
gathered parameters) and raises CUDA's out-of-memory error past its capacity.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from minidist.communication import collectives
from minidist.core._checks import require_process_group
from minidist.costs.memory import OPTIMIZER_STATES
from minidist.parallel.offload import (
    DeviceMemory,
    NvmeStore,
    Offload,
    adamw_step_,
    to_device,
    to_host,
)

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer_cls` (any torch.optim class) so each rank updates 1/N of every parameter.

        optimizer = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)

    Use it like any optimizer: `loss.backward(); optimizer.step(); optimizer.zero_grad()`.
    Do not also average gradients (no DDP): the reduce-scatter does it. `group` is the
    data-parallel group (None: every rank); `impl="ring"` runs minidist's own reduce-scatter
    and all-gather, whose bytes `counting.count_traffic()` counts.
    (About 155 lines: stages 1 and 2 share every method but the gradient hook, and the
    host/NVMe offload only changes where `step` finds its slices; `_NvmeSlices` holds the
    files.)
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer_cls: type,
                 stage: int = 1, group: dist.ProcessGroup | None = None, impl: str = "torch",
                 offload: str | Offload | None = None,
                 device_memory: DeviceMemory | None = None, **optimizer_kwargs: Any):
        if stage not in (1, 2):
            raise ValueError(f"stage={stage}: ZeroOptimizer implements stages 1 and 2 "
                             f"(stage 3 shards parameters too: use minidist.parallel.fsdp)")
        # dict.fromkeys: a parameter listed twice (tied) is still sharded and reduced once
        self.params = list(dict.fromkeys(p for p in params if p.requires_grad))
        if not self.params:
            raise ValueError("ZeroOptimizer got no parameters that require gradients")
        require_process_group("ZeroOptimizer")
        if impl not in collectives.IMPLS["reduce_scatter"]:
            raise ValueError(f"impl={impl!r}: choose one of {collectives.IMPLS['reduce_scatter']}")
        self.stage, self.group, self.impl = stage, group, impl
        self.world_size = dist.get_world_size(group)
        self.offload, self.device_memory = Offload.of(offload), device_memory
        bounds = [collectives.shard_bounds(p.numel(), group) for p in self.params]
        if self.offload is not None:
            _check_offload(self.offload, optimizer_cls, optimizer_kwargs,
                           sum(end - start for start, end in bounds))
        self._place("parameters", sum(_nbytes(p) for p in self.params))
        # The fp32 master slice of each parameter: what the wrapped optimizer updates.
        self.shards = []
        for p, (start, end) in zip(self.params, bounds, strict=True):
            piece = p.detach().reshape(-1)[start:end]
            self.shards.append(to_host(piece, "master weights").float()
                               if self.offload else piece.float().clone())
        if self.offload is None:
            self._place("master weights", sum(_nbytes(shard) for shard in self.shards))
        self.optimizer = optimizer_cls(self.shards, **optimizer_kwargs)
        super().__init__(self.shards, optimizer_kwargs or {"lr": 0.0})
        # torch.optim.Optimizer's machinery is the wrapped optimizer's: share its groups/state.
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
        self._arriving: list[tuple[int, Any]] = []  # gradient slices on their way to the host
        self._reduced = False  # whether this step's gradient slices are all in `shards`
        self.nvme = (_NvmeSlices(self.offload.folder, self.shards)
                     if self.offload is not None and self.offload.tier == "nvme" else None)
        if stage == 2:
            for index, param in enumerate(self.params):
                param.register_post_accumulate_grad_hook(self._scatter_hook(index))

    @property
    def store(self) -> NvmeStore | None:
        """The NVMe tier's files (offload to "nvme" only), with the bytes and time they moved."""
        return self.nvme.store if self.nvme is not None else None

    def _place(self, what: str, nbytes: int) -> None:
        if self.device_memory is not None:
            self.device_memory.place(what, nbytes)

    def _holding(self, what: str, nbytes: int):
        if self.device_memory is None:
            return contextlib.nullcontext()
        return self.device_memory.holding(what, nbytes)

    def _scatter_hook(self, index: int):
        def scatter(param: torch.nn.Parameter) -> None:
            self._reduce_scatter(index, param.grad)
            param.grad = None  # stage 2: only this rank's slice of the gradient is kept

        return scatter

    def _reduce_scatter(self, index: int, grad: torch.Tensor) -> None:
        """Reduce-scatter one gradient; its slice goes to the host at once when offloaded
        (in flight until `_collect_gradients`), else is averaged into the shard's gradient."""
        with self._holding("gradient", _nbytes(grad)):
            mine = collectives.reduce_scatter(grad.reshape(-1), self.group, self.impl,
                                              when="gradients")
        if self.offload is not None:
            self._arriving.append((index, to_host(mine, "gradient shard",
                                                          async_op=True)))
        else:
            self._accumulate(index, mine)

    def _accumulate(self, index: int, mine: torch.Tensor) -> None:
        shard, mine = self.shards[index], mine.float().div_(self.world_size)
        if shard.grad is None and self.offload is None and self.device_memory is not None:
            self.device_memory.add("gradient shards", _nbytes(mine))
        shard.grad = mine if shard.grad is None else shard.grad + mine

    def _collect_gradients(self) -> None:
        """Wait for the gradient slices still being copied to the host, and add them up."""
        for index, moving in self._arriving:
            self._accumulate(index, moving.wait())
        self._arriving.clear()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Make every shard's `.grad` this rank's slice of the averaged gradient now (stage 1
        reduce-scatters here; offloaded slices finish arriving), e.g. to clip them with
        `minidist.parallel.clipping.clip_grad_norm_(optimizer.shards, ...)` before `step`, which
        then
        does not reduce again."""
        if not self._reduced:
            if self.stage == 1:
                self._reduce_scatter_gradients()
            self._collect_gradients()
            self._reduced = True

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 (torch.optim.Optimizer's)
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        self.reduce_gradients()
        self._reduced = False
        if self.nvme is not None:
            self.nvme.step(self.params, self.shards, self.param_groups[0], self._gather_into)
            return
        self.optimizer.step()
        if self.offload is None:
            self._place("optimizer state", sum(
                _nbytes(value) for state in self.optimizer.state.values()
                for value in state.values() if isinstance(value, torch.Tensor)))
        for param, shard in zip(self.params, self.shards, strict=True):
            if shard.grad is not None:  # else no rank had a gradient: the optimizer left it
                self._gather_into(param, shard.to(param.dtype))

    def _gather_into(self, param: torch.nn.Parameter, shard: torch.Tensor) -> None:
        """All-gather the updated slices (in the parameter's dtype) into `param`, the slice
        first moved to the device when it was updated on the host."""
        if self.offload is not None:
            shard = to_device(shard, param.device, "parameter shard")
        with self._holding("gathered parameter", _nbytes(param)):
            full = collectives.all_gather(shard, param.numel(), self.group, self.impl,
                                          when="parameters")
            param.copy_(full.view_as(param))

    def _reduce_scatter_gradients(self) -> None:
        """Stage 1: reduce-scatter every gradient some rank has (zeros where a rank has none)."""
        self._place("gradients", sum(_nbytes(p.grad) for p in self.params if p.grad is not None))
        ranks_with_grad = torch.tensor([p.grad is not None for p in self.params],
                                       dtype=torch.int32)
        collectives.all_reduce(ranks_with_grad, group=self.group,
                               when="which parameters have gradients")
        for index, (param, count) in enumerate(zip(self.params, ranks_with_grad.tolist(),
                                                   strict=True)):
            if count:
                self._reduce_scatter(index, torch.zeros_like(param) if param.grad is None
                                     else param.grad)
            else:
                self.shards[index].grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for tensor in (*self.params, *self.shards):
            tensor.grad = None
        self._reduced = False
        self._place("gradients", 0)
        self._place("gradient shards", 0)


class _NvmeSlices:
    """ZeRO-Infinity's NVMe tier for a ZeroOptimizer: each slice's fp32 master weights and
    AdamW moments live in files; a step reads one slice's, updates it, writes it back and
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
             hyper: dict[str, Any], gather_into: Any) -> None:
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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check_offload(target: Offload, optimizer_cls: type, kwargs: dict[str, Any],
                   shard_numel: int) -> None:
    """Before anything is allocated: the NVMe tier steps AdamW itself, and the tier must hold
    this rank's fp32 master weights and optimizer state (and, on the host, gradient slices)."""
    if target.tier == "nvme" and optimizer_cls is not torch.optim.AdamW:
        raise ValueError(f"offload to NVMe updates each slice with AdamW as it is read "
                         f"(offload.adamw_step_), got optimizer_cls={optimizer_cls.__name__}: "
                         f"use torch.optim.AdamW, or offload='host' for any optimizer")
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
