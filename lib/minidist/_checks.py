"""The checks every minidist module makes on its input, written once so the messages agree.

The arithmetic modules (memory, traffic, flops, pipeline) never need torch; the process-group
checks import torch.distributed only when called, so importing those modules stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import nn


def positive(**values: float) -> None:
    """Each value is a number > 0 (not a bool)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r}: must be a positive number")


def positive_int(**values: int) -> None:
    """Each value is an int >= 1 (not a bool)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")


def one_of(name: str, value: object, valid: tuple) -> None:
    """`value` is one of `valid`."""
    if value not in valid:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(map(repr, valid))}")


def require_process_group(what: str) -> None:
    """Raise unless torch.distributed has a default process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            f"no process group: {what} needs a process group; call it inside "
            "minidist.launch.run, or after torch.distributed.init_process_group"
        )


def first_rank(group: dist.ProcessGroup | None) -> int:
    """The global rank of `group`'s first member: the rank whose values are copied to all."""
    import torch.distributed as dist

    return dist.get_global_rank(group, 0) if group is not None else 0


def check_same_model(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if the ranks' models differ in names, shapes, dtypes or which
    parameters are trainable: flat buffers and shards would not line up, and collectives
    would mix unrelated tensors or hang."""
    import torch.distributed as dist

    mine = [(f"parameter {name}", tuple(p.shape), str(p.dtype), p.requires_grad)
            for name, p in module.named_parameters()]
    mine += [(f"buffer {name}", tuple(b.shape), str(b.dtype), False)
             for name, b in module.named_buffers()]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for ours, other in zip(reference, theirs, strict=False):  # lengths may differ
            if ours != other:
                raise ValueError(
                    f"the ranks' models differ: rank 0 has {_describe(ours)} where rank {rank} "
                    f"has {_describe(other)}. Build the same model on every rank (the values "
                    f"may differ: rank 0's are copied to all)"
                )
        raise ValueError(
            f"the ranks' models differ: rank 0 has {len(reference)} parameters and buffers, "
            f"rank {rank} has {len(theirs)}. Build the same model on every rank"
        )


def _describe(entry: tuple) -> str:
    name, shape, dtype, requires_grad = entry
    frozen = "" if requires_grad or name.startswith("buffer") else ", frozen"
    return f"{name} of shape {list(shape)}, {dtype}{frozen}"
