"""A process mesh: the job's ranks arranged along named dimensions, one process group each.

    mesh = Mesh(pp=2, dp=2, tp=2)           # 8 ranks; dimensions slowest-varying first
    mesh.size("tp"), mesh.coord("pp")       # how long a dimension is, where this rank sits
    mesh.ranks("dp")                        # this rank's data-parallel group, global ranks
    collectives.all_reduce(x, group=mesh.group("tp"))

Dimensions are named, and ordered as you list them, slowest first: a rank is the row-major
index of its coordinates, exactly as in PyTorch's `init_device_mesh(device, (2, 2, 2),
mesh_dim_names=("pp", "dp", "tp"))`, so `mesh.to_torch()` is the same layout as a
`DeviceMesh`. The course lists parallel dimensions in Megatron-LM's order, `ORDER`: pp slowest,
then dp, ep, cp, and tp fastest (REFERENCES.md#megatron-lm). A TP group is then t consecutive
ranks, which a launcher puts on one node: the dimension that communicates most stays on the
fastest links. Any names work, for any purpose: `Mesh(node=2, gpu=4)` for a hierarchical
all-reduce, `Mesh(replicate=2, shard=4)` for HSDP.

**Nodes.** `Mesh(dp=2, tp=2, network=TwoTier(ranks_per_node=2))` also says which ranks share a
node: consecutive blocks of `ranks_per_node`, as launchers place them (ranks 0, 1 on node 0).
With Megatron's order the tp group (0, 1) then sits inside a node, while `Mesh(tp=2, dp=2, ...)`
puts it across nodes. The mesh makes two more groups per rank, `node_group()` (the ranks of its
node) and `cross_node_group()` (the ranks with its local rank on every node), which
hierarchical all-reduce runs on, and, for an emulated `TwoTier`, delays every message this
process sends by its link's time (`minidist.communication.network`: an emulation, for laptops).

A dimension the mesh does not have has size 1 and coordinate 0, so code written for
`Mesh(pp=2, dp=2, tp=2)` runs on `Mesh(dp=8)`; asking for its group is an error. Creating
groups is collective: build a mesh on every rank, in the same order. This module is the only
place minidist creates process groups.
"""

from __future__ import annotations

import itertools
import math

import torch.distributed as dist

from minidist.communication import emulation
from minidist.communication.network import TwoTier
from minidist.core._checks import positive_int, require_process_group

__all__ = ["ORDER", "group_ranks", "Mesh"]

ORDER = ("pp", "dp", "ep", "cp", "tp")
"""The course's order of parallel dimensions, slowest-varying first (Megatron-LM's)."""


def group_ranks(sizes: dict[str, int], dim: str) -> list[list[int]]:
    """Every group of dimension `dim` in a mesh of `sizes` (dimension name -> size, slowest
    first), as lists of global ranks. A group holds the ranks whose coordinates agree on
    every other dimension.

        group_ranks({"pp": 2, "dp": 2, "tp": 2}, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
        group_ranks({"pp": 2, "dp": 2, "tp": 2}, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    """
    if dim not in sizes:
        raise ValueError(f"dim={dim!r}: the mesh has dimensions {', '.join(map(repr, sizes))}")
    positive_int(**sizes)
    names = list(sizes)
    # stride of a dimension: how far apart in rank two neighbours along it are
    strides = {name: math.prod(sizes[later] for later in names[i + 1:])
               for i, name in enumerate(names)}
    others = [name for name in names if name != dim]
    groups = []
    for coords in itertools.product(*(range(sizes[name]) for name in others)):
        base = sum(c * strides[name] for c, name in zip(coords, others, strict=True))
        groups.append([base + i * strides[dim] for i in range(sizes[dim])])
    return groups


class Mesh:
    """The job's ranks along named dimensions (see the module doc), with this rank's process
    group along each, and with `network`, the nodes they run on. Build it on every rank of a
    job of exactly prod(sizes) ranks. (One long class, a dozen one-line questions about the
    grid: splitting them up would hide that they all read the one rank table.)"""

    def __init__(self, *, network: TwoTier | None = None, **sizes: int):
        if not sizes:
            raise ValueError("a Mesh needs at least one dimension, e.g. Mesh(dp=4) or "
                             "Mesh(pp=2, dp=2, tp=2)")
        positive_int(**sizes)
        require_process_group("Mesh")
        self.sizes = dict(sizes)
        world, product = dist.get_world_size(), math.prod(sizes.values())
        if product != world:
            shape = "·".join(f"{name}={size}" for name, size in sizes.items())
            raise ValueError(
                f"{shape} makes {product} ranks but the job has {world} ranks: choose sizes "
                f"whose product is {world}, or start {product} ranks")
        if network is not None and not isinstance(network, TwoTier):
            raise ValueError(f"network={network!r}: give a minidist.communication.network.TwoTier, "
                             f"e.g. TwoTier(ranks_per_node=2)")
        if network is not None:
            network.nodes(world)  # raises if the ranks do not fill whole nodes: before any group
        self.tiers = network
        self.network: emulation.Network | None = None  # the nodes, once the groups are made
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._ranks: dict[str, list[int]] = {}
        for dim in self.sizes:
            # every rank creates every group, in the same order (dist.new_group is collective)
            for ranks in group_ranks(self.sizes, dim):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups[dim], self._ranks[dim] = group, ranks
        self._torch_mesh = None
        self._node_groups: dict[str, dist.ProcessGroup] = {}
        if network is not None:
            self._make_node_groups(network, world)

    def _make_node_groups(self, network: TwoTier, world: int) -> None:
        g, count = network.ranks_per_node, network.nodes(world)
        nodes = [list(range(node * g, (node + 1) * g)) for node in range(count)]
        across = [[node * g + local for node in range(count)] for local in range(g)]
        for kind, blocks in (("node", nodes), ("across", across)):
            for ranks in blocks:
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._node_groups[kind] = group
        whole = [dist.group.WORLD, *(self._groups[d] for d in self.sizes if self.sizes[d] == world)]
        self.network = emulation.connect(network, self._node_groups["node"],
                                        self._node_groups["across"], whole)

    def node_of(self, rank: int | None = None) -> int:
        """The node global rank `rank` (default: this one) runs on; 0 without a network."""
        rank = self.rank if rank is None else rank
        return self.tiers.node_of(rank) if self.tiers else 0

    def node_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's node (needs `network`)."""
        return self._group_of("node")

    def cross_node_group(self) -> dist.ProcessGroup:
        """This rank and the ranks with the same local rank on every other node (needs
        `network`): the group hierarchical all-reduce crosses nodes on."""
        return self._group_of("across")

    def _group_of(self, name: str) -> dist.ProcessGroup:
        if self.tiers is None:
            raise ValueError("this Mesh was built without a network, so it does not know which "
                             "ranks share a node: build it with Mesh(..., network="
                             "TwoTier(ranks_per_node=...))")
        return self._node_groups[name]

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank()

    @property
    def dims(self) -> tuple[str, ...]:
        """The dimensions' names, slowest-varying first."""
        return tuple(self.sizes)

    def size(self, dim: str) -> int:
        """How many ranks the dimension has (1 for a dimension the mesh does not have)."""
        return self.sizes.get(dim, 1)

    def ranks(self, dim: str) -> list[int]:
        """This rank's group along `dim`: global ranks, in order of their coordinate."""
        return list(self._ranks[dim]) if dim in self.sizes else [self.rank]

    def coord(self, dim: str) -> int:
        """This rank's coordinate along `dim` (its rank inside that group)."""
        return self.ranks(dim).index(self.rank)

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of this rank's `dim` group, for any collective on it."""
        if dim not in self.sizes:
            raise ValueError(f"dim={dim!r}: this mesh has dimensions "
                             f"{', '.join(map(repr, self.sizes))}; add {dim}=... to the Mesh")
        return self._groups[dim]

    def to_torch(self) -> dist.device_mesh.DeviceMesh:
        """The same layout as PyTorch's DeviceMesh, with the same dimension names, for DTensor's
        parallelize_module, fully_shard and pipelining. Built (collectively) on the first
        call."""
        if self._torch_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            self._torch_mesh = init_device_mesh(device, tuple(self.sizes.values()),
                                                mesh_dim_names=self.dims)
        return self._torch_mesh

    def __repr__(self) -> str:
        coords = ", ".join(f"{d}={self.coord(d)}/{self.sizes[d]}" for d in self.sizes)
        return f"Mesh(rank {self.rank}: {coords})"
