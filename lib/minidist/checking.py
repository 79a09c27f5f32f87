"""What the labs' checks use to see the mechanism, not only the numbers.

    with recording() as calls:                       # every torch.distributed call, in order
        my_ring_all_reduce(t)
    [c.name for c in calls]                          # ["isend", "irecv", "isend", ...]
    {c.peer for c in calls if c.name == "isend"}     # {right neighbour}

    with unavailable("minidist.comm.ring_all_reduce", "torch.distributed.all_reduce"):
        my_ring_all_reduce(t)                        # calling either raises, saying why

`recording` sees the calls a function makes into torch.distributed (point-to-point and
collectives alike, with the peer, the bytes and the shape of each), so a check can ask who was
sent what and in which order, where `traffic.count_traffic` counts only what left the rank.
`unavailable` swaps functions for ones that raise while an exercise is checked: a student's
version must not lean on the library's (or torch's) own version of the very thing it builds.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Call", "RECORDED", "recording", "unavailable", "LibraryVersionUsed"]

RECORDED = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce", "all_gather",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "all_to_all", "all_to_all_single", "barrier", "reduce", "gather", "scatter",
)
"""The torch.distributed functions `recording` watches."""


@dataclass(frozen=True)
class Call:
    """One call into torch.distributed: its name, the peer (global rank) of a point-to-point
    call, and the bytes, shape and dtype of its first tensor; the reduction `op` ("SUM",
    "MAX", ...) of a reducing collective; for an all-to-all, the bytes it `sent` to each rank
    of its group, in group order (its own piece included: it never leaves the rank)."""

    name: str
    peer: int | None
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    op: str | None = None
    sent: tuple[int, ...] | None = None


_REDUCING = {"all_reduce": 1, "reduce": 2, "reduce_scatter": 2, "reduce_scatter_tensor": 2}
"""The reducing collectives, with the position of their `op` argument."""


def _reduction(name: str, args: tuple, kwargs: dict) -> str | None:
    if name not in _REDUCING:
        return None
    position = _REDUCING[name]
    op = kwargs.get("op", args[position] if len(args) > position else dist.ReduceOp.SUM)
    return getattr(op, "name", str(op))


def _sent(name: str, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    if name == "all_to_all":  # (output_tensor_list, input_tensor_list, ...)
        inputs = kwargs.get("input_tensor_list", args[1] if len(args) > 1 else [])
        return tuple(t.numel() * t.element_size() for t in inputs)
    if name != "all_to_all_single":  # (output, input, output_split_sizes, input_split_sizes, group)
        return None
    x = kwargs.get("input", args[1] if len(args) > 1 else None)
    splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
    group = kwargs.get("group", args[4] if len(args) > 4 else None)
    if not isinstance(x, torch.Tensor):
        return None
    row_bytes = x[0].numel() * x.element_size() if x.dim() and len(x) else x.element_size()
    if not splits:  # equal pieces of dim 0
        size = dist.get_world_size(group)
        splits = [x.shape[0] // size if x.dim() else 0] * size
    return tuple(int(rows) * row_bytes for rows in splits)


def _describe(name: str, args: tuple, kwargs: dict) -> Call:
    tensor = args[0] if args else kwargs.get("tensor")
    if isinstance(tensor, list):  # all_gather's output list, and the like
        tensor = next((t for t in tensor if isinstance(t, torch.Tensor)), None)
    peer = None
    if name in ("send", "isend", "recv", "irecv"):
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
    op, sent = _reduction(name, args, kwargs), _sent(name, args, kwargs)
    if not isinstance(tensor, torch.Tensor):
        return Call(name, peer, 0, (), None, op, sent)
    return Call(name, peer, tensor.numel() * tensor.element_size(), tuple(tensor.shape),
                tensor.dtype, op, sent)


@contextlib.contextmanager
def recording(names: tuple[str, ...] = RECORDED) -> Iterator[list[Call]]:
    """Inside the block every call of torch.distributed's `names` is appended, in order, to
    the list it yields (calls minidist makes on the caller's behalf included)."""
    calls: list[Call] = []
    originals = {name: getattr(dist, name) for name in names}

    def watched(name: str, function: Any) -> Any:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(_describe(name, args, kwargs))
            return function(*args, **kwargs)
        return call

    for name, function in originals.items():
        setattr(dist, name, watched(name, function))
    try:
        yield calls
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


class LibraryVersionUsed(RuntimeError):
    """A checked function called the library's (or torch's) own version of the exercise."""


@contextlib.contextmanager
def unavailable(*paths: str, reason: str = "") -> Iterator[None]:
    """Inside the block each function named by its dotted path (e.g.
    "minidist.comm.ring_all_reduce", "torch.distributed.all_reduce", or a class's method:
    "minidist.tensor_parallel.CopyToParallel.apply") raises LibraryVersionUsed when called;
    wherever it was imported from, a module that took the name by `from ... import` keeps the
    original (import the module instead)."""
    swapped = []
    for path in paths:
        module, attribute = _owner(path)
        # A class's own entry (a staticmethod, a classmethod), or nothing if it inherits one.
        original = vars(module).get(attribute, _INHERITED)

        def refuse(*args: Any, _path: str = path, **kwargs: Any) -> Any:
            raise LibraryVersionUsed(
                f"your function called {_path}: write your own; the library's version is "
                f"what your function is compared with{': ' + reason if reason else ''}")

        setattr(module, attribute, refuse)
        swapped.append((module, attribute, original))
    try:
        yield
    finally:
        for module, attribute, original in reversed(swapped):
            if original is _INHERITED:
                delattr(module, attribute)
            else:
                setattr(module, attribute, original)


_INHERITED = object()


def _owner(path: str) -> tuple[Any, str]:
    """The object holding the last name of a dotted path, and that name: the longest prefix
    that imports as a module, then attributes (a class) down to the last."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:-1]:
            owner = getattr(owner, name)
        if not hasattr(owner, parts[-1]):
            raise AttributeError(f"{path}: {owner!r} has no attribute {parts[-1]!r}")
        return owner, parts[-1]
    raise ModuleNotFoundError(f"{path}: no module to import in it")
