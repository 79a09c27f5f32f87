"""The checks every minidist module makes on its input, written once so the messages agree.

The arithmetic modules (memory, traffic, flops, pipeline) never need torch; the process-group
checks import torch.distributed only when called, so importing those modules stays fast.
"""

from __future__ import annotations


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


def reduce_op(op: object, tensor: object, allowed: tuple[str, ...], hint: str = "") -> str:
    """The name ("sum", "avg", "max") of the reduction `op`, a name or a
    torch.distributed.ReduceOp, if it is one of `allowed` (else the error ends with `hint`);
    "avg" needs a floating-point `tensor` (an average of integers is not an integer)."""
    import torch.distributed as dist

    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max"}
    name = names.get(op) if isinstance(op, dist.ReduceOp.RedOpType) else op
    if name not in allowed:
        names = [repr(name) for name in allowed]
        choices = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise ValueError(f"op={op!r}: this reduces with {choices}{hint}")
    if name == "avg" and not tensor.is_floating_point():
        raise ValueError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}; use "
                         f"op='sum' and divide by the world size yourself")
    return name


def require_process_group(what: str) -> None:
    """Raise unless torch.distributed has a default process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            f"no process group: {what} needs a process group; call it inside "
            "minidist.core.launch.run, or after torch.distributed.init_process_group"
        )
