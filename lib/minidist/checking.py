"""What the labs' checks use to see the mechanism, not only the numbers.

    with recording() as calls:                       # every torch.distributed call, in order
        my_ring_all_reduce(t)
    [c.name for c in calls]                          # ["isend", "irecv", "isend", ...]
    {c.peer for c in calls if c.name == "isend"}     # {right neighbour}

    with unavailable("minidist.comm.ring_all_reduce", "torch.distributed.all_reduce"):
        my_ring_all_reduce(t)                        # calling either raises, saying why

    with messages_sent() as sent:                    # what each point-to-point message carried
        my_ring_all_reduce(t)
    [(m.peer, m.payload) for m in sent]              # [(right neighbour, a chunk's copy), ...]

`recording` sees the calls a function makes into torch.distributed (point-to-point and
collectives alike, with the peer, the bytes and the shape of each), so a check can ask who was
sent what and in which order, where `traffic.count_traffic` counts only what left the rank.
`unavailable` swaps functions for ones that raise while an exercise is checked: a student's
version must not lean on the library's (or torch's) own version of the very thing it builds.
`messages_sent` keeps a copy of every message's payload, so a check can ask what travelled in
each step (a partial sum, a finished chunk), not only how many bytes.
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

__all__ = ["Call", "RECORDED", "recording", "unavailable", "LibraryVersionUsed", "Message",
           "messages_sent"]

RECORDED = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce", "all_gather",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
    "all_to_all", "all_to_all_single", "barrier", "reduce", "gather", "scatter",
)
"""The torch.distributed functions `recording` watches."""


@dataclass(frozen=True)
class Call:
    """One call into torch.distributed: its name, the peer (global rank) of a point-to-point
    call, and the bytes, shape and dtype of its first tensor."""

    name: str
    peer: int | None
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None


def _describe(name: str, args: tuple, kwargs: dict) -> Call:
    tensor = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
    if isinstance(tensor, list):  # all_gather's output list, and the like
        tensor = next((t for t in tensor if isinstance(t, torch.Tensor)), None)
    peer = None
    if name in ("send", "isend", "recv", "irecv"):
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
    if not isinstance(tensor, torch.Tensor):
        return Call(name, peer, 0, (), None)
    return Call(name, peer, tensor.numel() * tensor.element_size(), tuple(tensor.shape),
                tensor.dtype)


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
    "minidist.comm.ring_all_reduce", "torch.distributed.all_reduce") raises
    LibraryVersionUsed when called; wherever it was imported from, a module that took the
    name by `from ... import` keeps the original (import the module instead)."""
    swapped = []
    for path in paths:
        module_name, _, attribute = path.rpartition(".")
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)

        def refuse(*args: Any, _path: str = path, **kwargs: Any) -> Any:
            raise LibraryVersionUsed(
                f"your function called {_path}: write your own; the library's version is "
                f"what your function is compared with{': ' + reason if reason else ''}")

        setattr(module, attribute, refuse)
        swapped.append((module, attribute, original))
    try:
        yield
    finally:
        for module, attribute, original in swapped:
            setattr(module, attribute, original)


@dataclass(frozen=True)
class Message:
    """One point-to-point message this rank sent: the global rank it went to and a copy of its
    payload, taken when it was sent."""

    peer: int
    payload: torch.Tensor


@contextlib.contextmanager
def messages_sent() -> Iterator[list[Message]]:
    """Inside the block every point-to-point message this process sends is appended, in order,
    to the list it yields, with a copy of what it carried.

    It watches the one method every send ends in, ProcessGroup.send, as `traffic.count_traffic`
    does, so dist.send, dist.isend, batch_isend_irecv and minidist's algorithms are all seen,
    however they were imported. Blocks nest with each other and with count_traffic's."""
    from minidist.traffic import members

    sent: list[Message] = []
    # From the class dict: pybind keeps methods there as descriptors that bind `self` again.
    original = vars(dist.ProcessGroup)["send"]

    def send(self: Any, tensors: list, dst: int, *args: Any, **kwargs: Any) -> Any:
        peer = members(self)[dst]
        for tensor in tensors:
            sent.append(Message(peer, tensor.detach().clone()))
        return original(self, tensors, dst, *args, **kwargs)

    dist.ProcessGroup.send = send
    try:
        yield sent
    finally:
        dist.ProcessGroup.send = original
