"""Element-level shards of a flat tensor, and the two collectives ZeRO and FSDP are made of.

Rank r of N owns elements `chunk_bounds(numel, N)[r]` of a flat tensor (sizes differ by at
most one, so "1/N" holds up to one element). A shard is filled by a **reduce-scatter** (each
rank gets the sum of its own slice) and the whole is rebuilt by an **all-gather**; each sends
(N-1)/N of the tensor per rank (REFERENCE: ZeRO §7).

Two implementations, one interface: `ring=False` uses PyTorch's collectives (on uneven sizes
the shards are padded to equal length, as NCCL and gloo need); `ring=True` uses the
send/recv rings of `minidist.comm`, whose bytes `comm.count_traffic()` can count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist import comm
from minidist._checks import require_process_group


def shard_bounds(numel: int, group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(start, end) of this rank's shard of a flat tensor of `numel` elements."""
    require_process_group("shard_bounds")
    return comm.chunk_bounds(numel, dist.get_world_size(group))[dist.get_rank(group)]


def _padded(flat: torch.Tensor, world_size: int) -> tuple[torch.Tensor, int]:
    """`flat` as world_size equal chunks (each chunk_bounds chunk padded to the longest);
    `flat` itself when the chunks are equal already (no copy)."""
    bounds = comm.chunk_bounds(flat.numel(), world_size)
    longest = bounds[0][1] - bounds[0][0]
    if longest * world_size == flat.numel():
        return flat, longest
    pieces = [F.pad(flat[start:end], (0, longest - (end - start))) for start, end in bounds]
    return torch.cat(pieces), longest


def reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup | None = None,
                   ring: bool = False) -> torch.Tensor:
    """This rank's shard of the sum of `flat` over the group (a new tensor)."""
    start, end = shard_bounds(flat.numel(), group)
    if ring:
        return comm.ring_reduce_scatter(flat.clone(), group=group).clone()
    padded, longest = _padded(flat, dist.get_world_size(group))
    comm.record("reduce_scatter", flat, group)
    shard = torch.empty(longest, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter_single(shard, padded, group=group)
    return shard[: end - start]


class PendingGather:
    """An all-gather in flight: `wait()` returns the whole flat tensor."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish()


def start_all_gather(shard: torch.Tensor, numel: int, group: dist.ProcessGroup | None = None,
                     ring: bool = False) -> PendingGather:
    """Start rebuilding the flat tensor of `numel` elements from every rank's shard. PyTorch's
    collective runs in the background (what FSDP's prefetch needs); the ring runs now."""
    world_size = dist.get_world_size(group)
    bounds = comm.chunk_bounds(numel, world_size)
    start, end = bounds[dist.get_rank(group)]
    if ring:
        full = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        full[start:end] = shard
        comm.ring_all_gather(full, group=group)
        return PendingGather(None, lambda: full)
    longest = bounds[0][1] - bounds[0][0]
    comm.record("all_gather", numel * shard.element_size(), group)
    gathered = torch.empty(longest * world_size, dtype=shard.dtype, device=shard.device)
    padding = longest - shard.numel()
    work = dist.all_gather_single(gathered, F.pad(shard, (0, padding)) if padding else shard,
                                  group=group, async_op=True)

    def unpad() -> torch.Tensor:
        if longest * world_size == numel:  # equal chunks: no padding to cut out
            return gathered
        rows = gathered.view(world_size, longest)
        return torch.cat([rows[r, : e - s] for r, (s, e) in enumerate(bounds)])

    return PendingGather(work, unpad)


def all_gather(shard: torch.Tensor, numel: int, group: dist.ProcessGroup | None = None,
               ring: bool = False) -> torch.Tensor:
    """The whole flat tensor of `numel` elements, from every rank's shard."""
    return start_all_gather(shard, numel, group, ring).wait()
