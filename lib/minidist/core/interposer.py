"""The one place minidist steps between a program and torch.distributed.

Five things in minidist need to see (or delay) what a rank sends: the launcher's record of each
rank's latest call, the comparison of each collective across its group, the labs' checks, the
byte counter and the emulated network. Each subscribes
here to a *target*, a function of torch.distributed (`"dist.all_reduce"`; a collective is
replaced in `distributed_c10d` too, where torch's own functions and a program reaching past
`torch.distributed` find it) or one of the two
methods every point-to-point message ends in (`"ProcessGroup.send"`, `"ProcessGroup.recv"`,
and `"ProcessGroup.recv_anysource"`),
and this module puts one wrapper in the target's place while anyone is subscribed, torch's own
back when no one is. Two more targets are minidist's own: `"minidist.collective"`, which the
collective layer (minidist.communication.collectives) `announce`s once per collective it runs,
and `"minidist.event"`, each timeline Event noted (minidist.core.timeline).

A subscriber is an *around* function, `around(proceed, *args, **kwargs)`: it sees the call's
arguments, must call `proceed(*args, **kwargs)` once (or hand it to a thread that will, as the
emulated network does) and returns what the call returns. A call meets its subscribers in the
order of LAYERS, outermost first, whatever order they subscribed in; inside one layer, the
earlier subscription is outside the later one (blocks nest as they read):

    calls      minidist.core._calls: each rank's latest call, for launch.run's reports
    agreement  minidist.core.agreement: each collective compared across its group first
    recording  minidist.core.checking.recording: the torch.distributed calls a check watches
    messages   minidist.core.checking.messages_sent: each message's payload, copied
    tampering  minidist.core.checking.tampered_receives: a received message changed on arrival
    counting   minidist.communication.counting: each message's bytes and peer
    route      minidist.communication.network: the emulated links' delays; it sends last

So the counter counts a message when it is posted, before the emulated network delays it, and
the launcher has recorded the call before anything else can block in it. `muted(layer)` makes a
layer's subscribers step aside (they are skipped) inside a block: set-up traffic that a count
should not include.

The launcher's recorder leaves `dist.isend` and `dist.irecv` alone, since `P2POp` checks its op by
identity: it sees them in ProcessGroup.send and ProcessGroup.recv, where they end.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["LAYERS", "ANNOUNCED", "subscribe", "subscribed", "subscribers", "muted", "announce"]

LAYERS = ("calls", "agreement", "recording", "messages", "tampering", "counting", "route")

# minidist's own targets, announced, not replaced: each collective the collective layer runs,
# each timeline Event noted (minidist.core.timeline.note), each refusal of a checked function
# (minidist.core.refusal.LibraryVersionUsed)
ANNOUNCED = ("minidist.collective", "minidist.event", "minidist.refusal")

Around = Callable[..., Any]
_POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")

# The interposer's state, the only module-level state minidist keeps outside per-group caches.
_original: dict[str, Any] = {}  # target -> torch's own function (or method descriptor)
_subscribers: dict[str, list[tuple[int, int, Around]]] = {}  # target -> (layer, order, around)
_muted: dict[str, int] = dict.fromkeys(LAYERS, 0)  # layer -> open muted() blocks
_order = itertools.count()


def _owner(target: str) -> tuple[Any, str]:
    kind, _, name = target.partition(".")
    if target in ANNOUNCED:
        return None, name
    if kind == "ProcessGroup" and name in ("send", "recv", "recv_anysource"):
        return dist.ProcessGroup, name
    if kind == "dist" and callable(getattr(dist, name, None)):
        return dist, name
    raise ValueError(f"target={target!r}: give 'dist.<function>', 'ProcessGroup.send', "
                     f"'ProcessGroup.recv' or one of {', '.join(ANNOUNCED)}")


def _unless_muted(layer: str, around: Around) -> Around:
    def maybe(proceed: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if _muted[layer]:
            return proceed(*args, **kwargs)
        return around(proceed, *args, **kwargs)
    return maybe


def _install(target: str) -> None:
    """Put one wrapper calling `target`'s subscribers in order in its place, or torch's own
    back when it has none."""
    owner, name = _owner(target)
    if owner is None:  # announced, never replaced
        return
    subscribers = sorted(_subscribers.get(target, []), key=lambda entry: entry[:2])
    if not subscribers:
        if target in _original:
            _put(owner, name, _original.pop(target))
        return
    if target not in _original:
        # From the class dict, not getattr: pybind keeps methods there as descriptors, and only
        # the descriptor binds `self` when put back on the class.
        _original[target] = vars(owner)[name] if owner is dist.ProcessGroup else getattr(owner,
                                                                                          name)
    call = _original[target]
    for layer, _, around in reversed(subscribers):
        call = functools.partial(_unless_muted(LAYERS[layer], around), call)

    def interposed(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    if owner is dist:
        functools.update_wrapper(interposed, _original[target])
    _put(owner, name, interposed)


def _put(owner: Any, name: str, value: Any) -> None:
    """Set `owner.name`; a torch.distributed collective also in distributed_c10d, where torch
    defines it and where its own callers (all_gather_object's all_gather, a program's
    `distributed_c10d.all_reduce`) find it. Point-to-point functions stay torch's there:
    batch_isend_irecv runs each P2POp's own function, already seen where it was passed."""
    if owner is dist and name not in _POINT_TO_POINT and name in vars(distributed_c10d) and (
            vars(distributed_c10d)[name] is getattr(dist, name)):
        setattr(distributed_c10d, name, value)
    setattr(owner, name, value)


def subscribe(layer: str, target: str, around: Around, *,
              replace: bool = False) -> Callable[[], None]:
    """Have every call of `target` go through `around` from now on, at `layer`'s place in
    LAYERS (with `replace`, instead of that layer's earlier subscribers); returns the function
    that unsubscribes it."""
    if layer not in LAYERS:
        raise ValueError(f"layer={layer!r}: choose one of {', '.join(LAYERS)}")
    _owner(target)
    entry = (LAYERS.index(layer), next(_order), around)
    if replace:
        _subscribers[target] = [e for e in _subscribers.get(target, []) if e[0] != entry[0]]
    _subscribers.setdefault(target, []).append(entry)
    _install(target)

    def unsubscribe() -> None:
        if entry in _subscribers.get(target, []):
            _subscribers[target].remove(entry)
            _install(target)

    return unsubscribe


@contextlib.contextmanager
def subscribed(layer: str, targets: dict[str, Around]) -> Iterator[None]:
    """`subscribe` each of `targets` ({target: around}) for the block's duration."""
    unsubscribes = []
    try:
        for target, around in targets.items():
            unsubscribes.append(subscribe(layer, target, around))
        yield
    finally:
        for unsubscribe in reversed(unsubscribes):
            unsubscribe()


def subscribers(target: str) -> list[str]:
    """The layers subscribed to `target` now, outermost first (one entry per subscription)."""
    _owner(target)
    return [LAYERS[layer] for layer, _, _ in sorted(_subscribers.get(target, []),
                                                    key=lambda entry: entry[:2])]


def announce(target: str, *args: Any) -> None:
    """Tell `target`'s subscribers (one of ANNOUNCED), in LAYERS order, about `args`."""
    if target not in ANNOUNCED:
        raise ValueError(f"target={target!r}: choose one of {', '.join(ANNOUNCED)}")
    for layer, _, around in sorted(_subscribers.get(target, []), key=lambda entry: entry[:2]):
        if not _muted[LAYERS[layer]]:
            around(_nothing, *args)


def _nothing(*args: Any) -> None:
    """What an announcement proceeds to: nothing runs there."""


@contextlib.contextmanager
def muted(layer: str) -> Iterator[None]:
    """Inside the block, `layer`'s subscribers are skipped (calls go straight on to the next
    layer)."""
    if layer not in LAYERS:
        raise ValueError(f"layer={layer!r}: choose one of {', '.join(LAYERS)}")
    _muted[layer] += 1
    try:
        yield
    finally:
        _muted[layer] -= 1
