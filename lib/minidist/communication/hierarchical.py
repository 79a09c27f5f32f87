"""The flat ring on g channels, one per node port, as NCCL runs a channel per NIC
(REFERENCES.md#nccl-channels): the all-reduce that uses every port of a node, beside the
hierarchical one (`streaming.hierarchical_steps`, run by `collectives.all_reduce(...,
impl="hierarchical", network=mesh.network)`). It takes the job's network, `mesh.network`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minidist.communication.comm import chunk_bounds
from minidist.communication.emulation import Network

__all__ = ["channels_all_reduce"]


def channels_all_reduce(tensor: torch.Tensor, *, network: Network, channels: int | None = None,
                        average: bool = False) -> torch.Tensor:
    """Sum (or average) the contiguous `tensor` over every rank of the job with the flat ring
    on `channels` channels (default: g, one per rank of a node, as NCCL runs a channel per
    NIC), in place, and return it. `network` is the job's (`mesh.network`, of a Mesh built
    with network=TwoTier(...)); channels=1 is the plain ring.

    The tensor is cut into `channels` parts and part c goes round ring c of
    `TwoTier.rings`: reduce-scatter, then all-gather, 2(N-1) steps in which every channel
    sends one chunk (1/N of its part) to its right, whole, the channels side by side; a step
    ends when all of its messages have arrived (comm.ring_all_reduce's schedule, per channel).
    Each channel's messages carry its own tag, so two channels between the same two ranks
    never take each other's."""
    if not isinstance(network, Network):
        raise ValueError(f"network={network!r}: channels_all_reduce runs over the job's nodes; "
                         "pass network=mesh.network, the mesh built with one, e.g. "
                         "Mesh(dp=4, network=TwoTier(ranks_per_node=2))")
    if not tensor.is_contiguous():
        raise ValueError("channels_all_reduce works in place on a contiguous tensor; pass "
                         "tensor.contiguous() and copy the result back")
    world, rank = dist.get_world_size(), dist.get_rank()
    channels = network.tiers.ranks_per_node if channels is None else channels
    flat = tensor.view(-1)
    parts = chunk_bounds(flat.numel(), channels)
    lanes = []  # per channel: this rank's place in its ring and the chunks of its part
    for (start, end), ring in zip(parts, network.tiers.rings(world, channels), strict=True):
        place = ring.index(rank)
        chunks = [(start + a, start + b) for a, b in chunk_bounds(end - start, world)]
        buffer = flat.new_empty(chunks[0][1] - chunks[0][0])  # chunk 0 is the largest
        lanes.append((ring[place - 1], ring[(place + 1) % world], place, chunks, buffer))
    for step in range(2 * (world - 1)):
        reduce = step < world - 1
        receives, sends, adds = [], [], []
        for tag, (left, _, place, chunks, buffer) in enumerate(lanes):
            a, b = chunks[(place - 2 - step) % world]
            if b > a:  # an empty chunk is sent by neither side
                target = buffer[: b - a] if reduce else flat[a:b]
                receives.append(dist.irecv(target, left, tag=tag))
                adds.append((a, b, target))
        for tag, (_, right, place, chunks, _) in enumerate(lanes):
            a, b = chunks[(place - 1 - step) % world]
            if b > a:
                sends.append(dist.isend(flat[a:b], right, tag=tag))
        for receive, (a, b, target) in zip(receives, adds, strict=True):
            receive.wait()
            if reduce:
                flat[a:b].add_(target)
        for send in sends:  # a chunk must not change before it has left
            send.wait()
    if average:
        flat.div_(world)
    return tensor
