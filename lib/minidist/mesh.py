"""A process mesh: dp·pp·tp ranks arranged so that each parallelism has its own groups.

    mesh = Mesh(dp=2, pp=2, tp=2)           # inside a process group of 8 ranks
    mesh.coord("tp"), mesh.size("pp")       # where this rank sits, how long each dimension is
    mesh.ranks("dp")                        # this rank's data-parallel group, global ranks
    dist.all_reduce(x, group=mesh.group("tp"))

Rank order is Megatron-LM's: TP varies fastest, then DP, then PP (REFERENCE.md, "mesh rank
order"). A TP group is therefore t consecutive ranks, which a launcher puts on one node: the
dimension that communicates most stays on the fastest links. With dimensions listed slowest
first, ("pp", "dp", "tp"), the rank is the row-major index of its coordinates, as in PyTorch's
`init_device_mesh`, so `mesh.to_torch()` is the same layout as a `DeviceMesh`.
"""

from __future__ import annotations

import itertools
import math

import torch.distributed as dist

from minidist._checks import positive_int, require_process_group

DIMS = ("pp", "dp", "tp")
"""The mesh's dimensions, slowest-varying first."""


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
    """dp·pp·tp ranks with one process group per dimension per rank (see the module doc).

    Build it on every rank of a process group of exactly dp·pp·tp ranks: creating the groups
    is collective. A dimension of size 1 still has groups (of one rank each)."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1):
        positive_int(dp=dp, pp=pp, tp=tp)
        require_process_group("Mesh")
        self.sizes = {"pp": pp, "dp": dp, "tp": tp}
        world = dist.get_world_size()
        if dp * pp * tp != world:
            raise ValueError(
                f"dp·pp·tp = {dp}·{pp}·{tp} = {dp * pp * tp} but the process group has "
                f"{world} ranks: choose sizes whose product is {world}, or start "
                f"{dp * pp * tp} ranks")
        self.rank = dist.get_rank()
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._ranks: dict[str, list[int]] = {}
        for dim in DIMS:
            # every rank creates every group, in the same order (dist.new_group is collective)
            for ranks in group_ranks(self.sizes, dim):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups[dim], self._ranks[dim] = group, ranks
        self._torch_mesh = None

    def _check(self, dim: str) -> None:
        if dim not in DIMS:
            raise ValueError(f"dim={dim!r}: choose one of {', '.join(map(repr, DIMS))}")

    def size(self, dim: str) -> int:
        """How many ranks the dimension has."""
        self._check(dim)
        return self.sizes[dim]

    def ranks(self, dim: str) -> list[int]:
        """This rank's group along `dim`: global ranks, in order of their coordinate."""
        self._check(dim)
        return list(self._ranks[dim])

    def coord(self, dim: str) -> int:
        """This rank's coordinate along `dim` (its rank inside that group)."""
        return self.ranks(dim).index(self.rank)

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of this rank's `dim` group, for any collective on it."""
        self._check(dim)
        return self._groups[dim]

    def rank_at(self, pp: int, dp: int, tp: int) -> int:
        """The global rank at coordinates (pp, dp, tp)."""
        for dim, coord in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= coord < self.sizes[dim]:
                raise ValueError(f"{dim}={coord}: must be in 0..{self.sizes[dim] - 1}")
        return (pp * self.sizes["dp"] + dp) * self.sizes["tp"] + tp

    def to_torch(self) -> dist.device_mesh.DeviceMesh:
        """The same layout as PyTorch's DeviceMesh, dimensions named ("pp", "dp", "tp"), for
        DTensor's parallelize_module, fully_shard and pipelining. Built (collectively) on the
        first call."""
        if self._torch_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            self._torch_mesh = init_device_mesh(device, tuple(self.sizes[d] for d in DIMS),
                                                mesh_dim_names=DIMS)
        return self._torch_mesh

    def __repr__(self) -> str:
        coords = ", ".join(f"{d}={self.coord(d)}/{self.sizes[d]}" for d in DIMS)
        return f"Mesh(rank {self.rank}: {coords})"

