"""FSDP as people first meet it: FSDP1's options in FSDP2's terms, and what each keeps.

PyTorch's first FSDP, `torch.distributed.fsdp.FullyShardedDataParallel` ("FSDP1"), wraps the
model once and is configured by options; FSDP2, `fully_shard`, is called on each block and
then the root, with parameters as DTensors (PyTorch FSDP and FSDP2 docs;
REFERENCES.md#pytorch-fsdp1, #pytorch-fsdp2):

    FSDP1                                          FSDP2
    ShardingStrategy.FULL_SHARD                    fully_shard(..., reshard_after_forward=True)
    ShardingStrategy.SHARD_GRAD_OP                 fully_shard(..., reshard_after_forward=False)
    ShardingStrategy.NO_SHARD                      DistributedDataParallel (nothing sharded)
    ShardingStrategy.HYBRID_SHARD                  fully_shard(..., mesh=2-D (replicate, shard))
    auto_wrap_policy=ModuleWrapPolicy({Block})     fully_shard(block) for each block, then root
    backward_prefetch=BackwardPrefetch.BACKWARD_PRE  prefetching by default
    mixed_precision=MixedPrecision(...)            mp_policy=MixedPrecisionPolicy(...)
    cpu_offload=CPUOffload(offload_params=True)    offload_policy=CPUOffloadPolicy()

SHARD_GRAD_OP is not an out-of-memory fix: it keeps every unit's parameters gathered from its
forward to its backward, trading memory for one all-gather less (2Ψ of traffic, not 3Ψ).
Both FSDPs keep the root unit (the parameters in no wrapped block) gathered from forward to
backward whatever the strategy. On CPU (gloo) torch 2.13 runs every strategy and
MixedPrecision; CPUOffload and CPUOffloadPolicy need a GPU.

Pure arithmetic, no torch: a strategy is its name or the ShardingStrategy member itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from minidist.core._checks import positive_int

__all__ = ["STRATEGIES", "strategy_name", "parameter_bytes_after_forward"]

STRATEGIES = {
    "FULL_SHARD": "fully_shard(each block, then the root), reshard_after_forward=True",
    "SHARD_GRAD_OP": "fully_shard(each block, then the root), reshard_after_forward=False",
    "NO_SHARD": "DistributedDataParallel: every rank keeps everything",
    "HYBRID_SHARD": "fully_shard(..., mesh=init_device_mesh(device, (nodes, gpus_per_node), "
                    "mesh_dim_names=('replicate', 'shard')))",
}
"""FSDP1's ShardingStrategy names and their FSDP2 equivalents."""


def strategy_name(strategy: object) -> str:
    """The name of an FSDP1 sharding strategy given as a ShardingStrategy member or a string;
    ValueError for anything else."""
    name = getattr(strategy, "name", strategy)
    if name not in STRATEGIES:
        raise ValueError(f"sharding strategy {strategy!r}: choose one of "
                         f"{', '.join(STRATEGIES)} (torch.distributed.fsdp.ShardingStrategy); "
                         f"FSDP2 replaces them with reshard_after_forward and the mesh")
    return name


def parameter_bytes_after_forward(strategy: object, unit_numels: Sequence[int], root_numel: int,
                                  world_size: int, *, shard_size: int | None = None,
                                  bytes_per_element: int = 4) -> float:
    """Bytes of parameters a rank holds between the end of forward and the start of
    backward: its shards of every unit (Ψ/N) plus what is gathered.

        FULL_SHARD     shards + the root unit, gathered  e·(Ψ/N + Ψ_root)
        SHARD_GRAD_OP  shards + every unit, gathered     e·(Ψ/N + Ψ)
        NO_SHARD       the whole model                   e·Ψ
        HYBRID_SHARD   like FULL_SHARD over the `shard_size` ranks of a node: e·(Ψ/g + Ψ_root)

    `unit_numels` are the wrapped blocks' parameter counts, `root_numel` the rest's, e the
    bytes per element. Shards are Ψ/N exactly (FSDP1 pads each to a multiple of N)."""
    name = strategy_name(strategy)
    positive_int(world_size=world_size, bytes_per_element=bytes_per_element)
    total = sum(unit_numels) + root_numel
    if name == "NO_SHARD":
        return bytes_per_element * total
    group = world_size
    if name == "HYBRID_SHARD":
        if shard_size is None:
            raise ValueError("HYBRID_SHARD shards over the ranks of one node: pass shard_size, "
                             "the GPUs per node")
        positive_int(shard_size=shard_size)
        if world_size % shard_size:
            raise ValueError(f"shard_size={shard_size} does not divide world_size={world_size}: "
                             f"the mesh is (world_size / shard_size, shard_size)")
        group = shard_size
    gathered = total if name == "SHARD_GRAD_OP" else root_numel
    return bytes_per_element * (total / group + gathered)
