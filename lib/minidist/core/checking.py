"""What the labs' checks use to see the mechanism, not only the numbers.

    with recording() as calls:                       # every torch.distributed call, in order
        my_ring_all_reduce(t)
    [c.name for c in calls]                          # ["isend", "irecv", "isend", ...]
    {c.peer for c in calls if c.name == "isend"}     # {right neighbour}

    with messages_sent() as sent:                    # what each point-to-point message carried
        my_ring_all_reduce(t)
    [(m.peer, m.payload) for m in sent]              # [(right neighbour, a chunk's copy), ...]

`recording` sees the calls a function makes into torch.distributed (point-to-point and
collectives alike, with the peer, the bytes and the shape of each), so a check can ask who was
sent what and in which order, where `counting.count_traffic` counts only what left the rank.
(`minidist.core.refusal.unavailable` makes the library's own answer refuse while a check runs.)
`messages_sent` keeps a copy of every message's payload, so a check can ask what travelled in
each step (a partial sum, a finished chunk), not only how many bytes.

    with recording() as calls, watching("os.replace", into=calls):
        save_shards(shards, path)                    # collectives and renames, in one order
    with in_flight() as steps:
        gather_then_matmul_chunked(x, weight)        # posts, waits and matmuls, in order
    ran_while_in_flight(steps)                       # {request: matmuls while it travelled}

`watching` sees calls of any function (a file renamed, a file loaded); `in_flight` sees when
each point-to-point request was posted and waited on, and the operators (matmuls) that ran
in between: what overlapped what, from the order alone, so no timing can make it flaky.

    with unavailable("minidist.costs.bubbles.*"):
        detached(bubble_of_total, globals())(31, 66)  # its own code, the notebook's imports only

`detached` keeps out what an earlier cell computed (a table of the library's answers, a model
fitted to them), which no refusal during the call can reach.

Why one module of about 810 lines: these are the instruments of one check, used together inside
one `unavailable` block (what was called, what travelled, what a tampered message changed, what
overlapped, what was held, what came back, what the function could reach), and most share the
interposer's layers.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import functools
import importlib
import inspect
import itertools
import random
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from minidist.core import interposer
from minidist.core._groups import members
from minidist.core._supervisor import quiet_profiler
from minidist.core.refusal import _notebooks, unavailable

__all__ = [
    "Call", "RECORDED", "recording", "Message", "messages_sent", "changed_in_place",
    "tampered_receives", "Seen",
    "watching", "MATMULS", "FlightRecord", "in_flight", "ran_while_in_flight",
    "exchanges_posted_together", "Held", "holding", "reached_buffers",
    "plain", "detached",
]

RECORDED = (
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "broadcast", "all_to_all", "all_to_all_single", "barrier", "reduce",
    "gather", "scatter",
)
"""The torch.distributed functions `recording` watches (those this torch has)."""


@dataclass(frozen=True)
class Call:
    """One call into torch.distributed: its name, the peer (global rank) of a point-to-point
    call, and the bytes, shape and dtype of its first tensor; the reduction `op` ("SUM",
    "MAX", ...) of a reducing collective; for an all-to-all, the bytes it `sent` to each rank
    of its group, in group order (its own piece included: it never leaves the rank).
    `ranks` are the global ranks of the group it ran on (whether a reduction spanned the world
    or one rank alone). `tensor` is that tensor itself (so a check can ask whether the tensor a
    function returns is the one it reduced) and `before` a copy of what it held when the call
    began (what this rank contributed)."""

    name: str
    peer: int | None
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    op: str | None = None
    sent: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None
    tensor: torch.Tensor | None = field(default=None, compare=False, repr=False)
    before: torch.Tensor | None = field(default=None, compare=False, repr=False)


_REDUCING = {"all_reduce": 1, "reduce": 2, "reduce_scatter": 2, "reduce_scatter_tensor": 2,
             "reduce_scatter_single": 2}
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
        return tuple(t.nbytes for t in inputs)
    if name != "all_to_all_single":  # (output, input, output_split_sizes, input_split_sizes, group)
        return None
    x = kwargs.get("input", args[1] if len(args) > 1 else None)
    splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
    group = kwargs.get("group", args[4] if len(args) > 4 else None)
    if not isinstance(x, torch.Tensor):
        return None
    row_bytes = x[0].nbytes if x.dim() and len(x) else x.element_size()
    if not splits:  # equal pieces of dim 0
        size = dist.get_world_size(group)
        splits = [x.shape[0] // size if x.dim() else 0] * size
    return tuple(int(rows) * row_bytes for rows in splits)


@functools.cache
def _parameters(name: str) -> inspect.Signature:
    return inspect.signature(getattr(dist, name))


def _group_ranks(name: str, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """The global ranks of the group a call ran on (the world when none was given)."""
    try:
        group = _parameters(name).bind(*args, **kwargs).arguments.get("group")
        return tuple(members(group))
    except (TypeError, ValueError, RuntimeError):  # not bindable, or a group torch does not know
        return None


def _describe(name: str, args: tuple, kwargs: dict) -> Call:
    tensor = args[0] if args else kwargs.get("tensor")
    if isinstance(tensor, list):  # all_gather's output list, and the like
        tensor = next((t for t in tensor if isinstance(t, torch.Tensor)), None)
    peer = None
    if name in ("send", "isend", "recv", "irecv"):
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
    op, sent = _reduction(name, args, kwargs), _sent(name, args, kwargs)
    ranks = _group_ranks(name, args, kwargs)
    if not isinstance(tensor, torch.Tensor):
        return Call(name, peer, 0, (), None, op, sent, ranks)
    return Call(name, peer, tensor.nbytes, tuple(tensor.shape), tensor.dtype, op, sent, ranks,
                tensor, tensor.detach().clone())


@contextlib.contextmanager
def recording(names: tuple[str, ...] = RECORDED) -> Iterator[list[Call]]:
    """Inside the block every call of torch.distributed's `names` is appended, in order, to
    the list it yields (calls minidist makes on the caller's behalf included)."""
    calls: list[Call] = []
    # torch's functions call each other (dist.send runs isend, broadcast_object_list runs
    # broadcast): a recorded call made inside another is torch's own, not the caller's, so only
    # the outermost is recorded (all_gather_object is not recorded: its all_gather is).
    inside = threading.local()

    def watched(name: str) -> Any:
        def call(proceed: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "call", False):
                return proceed(*args, **kwargs)
            calls.append(_describe(name, args, kwargs))
            inside.call = True
            try:
                return proceed(*args, **kwargs)
            finally:
                inside.call = False
        return call

    with interposer.subscribed("recording", {f"dist.{name}": watched(name) for name in names
                                             if callable(getattr(dist, name, None))}):
        yield calls


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

    It watches the one method every send ends in, ProcessGroup.send, as `counting.count_traffic`
    does, so dist.send, dist.isend, batch_isend_irecv and minidist's algorithms are all seen,
    however they were imported. Blocks nest with each other and with count_traffic's."""
    sent: list[Message] = []

    def send(proceed: Any, group: Any, tensors: list, dst: int, *args: Any, **kwargs: Any) -> Any:
        peer = members(group)[dst]
        for tensor in tensors:
            # a plain tensor's copy: a subclass sent as it is would answer the check's comparisons
            with torch._C.DisableTorchFunctionSubclass():
                sent.append(Message(peer, tensor.detach().clone().as_subclass(torch.Tensor)))
        return proceed(group, tensors, dst, *args, **kwargs)

    with interposer.subscribed("messages", {"ProcessGroup.send": send}):
        yield sent


class _Arrival(dist.Work):
    """A receive whose message, once it has arrived (the first wait(), or is_completed() turning
    True), is handed over by `arrive` once: tampered with, or copied to where the caller looks."""

    def __init__(self, work: dist.Work, arrive: Callable[[], None]) -> None:
        super().__init__()
        self.work, self.arrive, self.done = work, arrive, False

    def _arrived(self) -> None:
        if not self.done:
            self.done = True
            self.arrive()

    def wait(self, timeout: Any = None) -> bool:
        arrived = self.work.wait() if timeout is None else self.work.wait(timeout)
        self._arrived()
        return arrived

    def is_completed(self) -> bool:
        completed = self.work.is_completed()
        if completed:
            self._arrived()
        return completed


_MULTIPLY_IN_PLACE, _ADD_IN_PLACE = torch.Tensor.mul_, torch.Tensor.add_  # as imported


def changed_in_place(tensor: torch.Tensor, *, scale: float = 1.0, delta: float = 0.0) -> None:
    """`tensor` becomes scale * tensor + delta in place (whole numbers for an integer tensor),
    out of the checked code's sight: with torch's methods as they were when this module was
    imported (a later patch of torch.Tensor's methods does not see the call) and with every
    torch-function and dispatch mode off (a mode the checked code entered sees neither the call
    nor its numbers), so that the change a check makes stays unknown to the code it checks."""
    from torch.utils._python_dispatch import _disable_current_modes

    if not tensor.is_floating_point():
        scale, delta = round(scale), round(delta)
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        _ADD_IN_PLACE(_MULTIPLY_IN_PLACE(tensor, scale), delta)


@contextlib.contextmanager
def tampered_receives(*, delta: float = 1.0, scale: float = 1.0, nth: int | None = None,
                      secret_offsets: list[float] | None = None) -> Iterator[list[int]]:
    """Inside the block the `nth` point-to-point message this rank receives (counting from 0;
    every one with nth=None) arrives as `scale` * message + `delta`, element by element, however
    it was received (dist.recv, dist.irecv, batch_isend_irecv, minidist's rings). The list it
    yields holds the source (global rank) of each message received, in order. A scale other
    than 1 also moves a result that adds what arrived to a value obtained another way.

    With a list as `secret_offsets`, each message changed also gets a whole number from -1000
    to 1000 added, drawn from the operating system's randomness in this process and appended to
    the list: what no other rank can know or foresee, so a rank whose result depends on others'
    messages gets it right only from what arrived (the check adds the offsets it gathers).

    A check runs the student's function and the library's under the same tampering: a
    function whose result really comes from what it received changes as the library's does;
    one that computed its result another way (a formula, a side channel, a replay of data
    gathered earlier) does not. The change is made out of the checked code's sight
    (`changed_in_place`)."""

    sources: list[int] = []
    draw = random.SystemRandom()

    def receive(proceed: Any, group: Any, tensors: list, src: int, *args: Any,
                **kwargs: Any) -> Any:
        work = proceed(group, tensors, src, *args, **kwargs)
        index = len(sources)
        sources.append(members(group)[src] if src >= 0 else src)
        if nth is not None and index != nth:
            return work
        offset = 0.0
        if secret_offsets is not None:
            offset = float(draw.randint(-1000, 1000))
            secret_offsets.append(offset)

        def tamper() -> None:
            for tensor in tensors:
                changed_in_place(tensor, scale=scale, delta=delta + offset)
        return _Arrival(work, tamper)

    with interposer.subscribed("tampering", {"ProcessGroup.recv": receive}):
        yield sources


# --- What happened, in order: other functions' calls, requests in flight, matmuls --------------


@dataclass(frozen=True)
class Seen:
    """One call `watching` saw: the function's dotted path and the arguments it was given."""

    name: str
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def watching(*paths: str, into: list | None = None,
             observe: Callable[..., Any] | None = None) -> Iterator[list]:
    """Inside the block every call of the functions named by dotted path (e.g. "os.replace",
    "torch.load") is appended, as a `Seen`, to `into` (a new list if None), which it yields,
    and, with `observe`, first calls `observe(*args, **kwargs)` (to see when, and on what, a
    checked function calls it). Pass the list `recording` yields as `into` to see both kinds
    of call in one order. It swaps the module's attribute (where `minidist.core.refusal`
    swaps the function's code), so `from ... import` copies are not seen."""
    seen: list = [] if into is None else into
    swapped = []
    for path in paths:
        module_name, _, attribute = path.rpartition(".")
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)

        def watched(*args: Any, _path: str = path, _original: Any = original,
                    **kwargs: Any) -> Any:
            seen.append(Seen(_path, args, kwargs))
            if observe is not None:
                observe(*args, **kwargs)
            return _original(*args, **kwargs)

        setattr(module, attribute, functools.wraps(original)(watched))
        swapped.append((module, attribute, original))
    try:
        yield seen
    finally:
        for module, attribute, original in swapped:
            setattr(module, attribute, original)


MATMULS = ("mm", "bmm", "addmm", "baddbmm")
"""The aten operators every matrix multiply ends in (@, F.linear, torch.matmul, einsum)."""


@dataclass(frozen=True)
class FlightRecord:
    """One thing `in_flight` saw. `kind` is "post" (a request, `name` "isend" or "irecv", to or
    from global rank `peer` (None: any), `nbytes` long, numbered `request` in posting order),
    "wait" (on request number `request`) or "op" (an aten operator `name` whose output has
    `shape`)."""

    kind: str
    name: str
    peer: int | None = None
    nbytes: int = 0
    shape: tuple[int, ...] = ()
    request: int | None = None


@contextlib.contextmanager
def in_flight(ops: tuple[str, ...] = MATMULS) -> Iterator[list[FlightRecord]]:
    """Inside the block, in the order they happen: every point-to-point request posted (by
    dist.isend, dist.irecv, dist.batch_isend_irecv, or dist.send and dist.recv, which post and
    then wait), every wait on one of them (`Work.wait`), and every call of the aten operators
    `ops`, however the caller spelled them (@, F.linear, torch.matmul, einsum for matmuls). An
    op between a request's post and its wait ran while that request was in flight
    (`ran_while_in_flight`). A received message is handed over at its wait (on CPU): polling
    the receive buffer shows nothing arriving earlier, as on a device where the copy lands
    when the wait says so."""
    from torch.utils._python_dispatch import TorchDispatchMode

    records: list[FlightRecord] = []
    numbers: dict[int, int] = {}  # id(work) -> its request number
    works: list[Any] = []  # keeps each work alive, so that no id is reused inside the block
    original_wait = dist.Work.wait

    def posting(name: str) -> Any:
        def call(proceed: Any, group: Any, tensors: list[torch.Tensor], *args: Any) -> Any:
            peer = None
            if name != "recv_anysource":
                try:
                    peer = members(group)[args[0]]
                except (RuntimeError, ValueError, IndexError):  # a group unknown to torch
                    peer = args[0]
            number = sum(r.kind == "post" for r in records)
            tensor = tensors[0]
            records.append(FlightRecord("post", "isend" if name == "send" else "irecv", peer,
                                        tensor.nbytes,
                                        tuple(tensor.shape), number))
            if name == "send" or tensor.device.type != "cpu":
                work = posted = proceed(group, tensors, *args)
            else:  # the message lands in a buffer of its own, handed over at the wait
                landing = [torch.empty_like(t) for t in tensors]
                posted = proceed(group, landing, *args)
                work = _Arrival(posted, functools.partial(_copy_all, tensors, landing))
            numbers[id(posted)] = number  # the wait the caller makes ends in posted's
            works.append(work)
            return work
        return call

    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_wait(work, *args, **kwargs)
        if id(work) in numbers:
            records.append(FlightRecord("wait", "wait", request=numbers[id(work)]))
        return result

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ops:
                records.append(FlightRecord("op", func.overloadpacket.__name__,
                                            shape=tuple(getattr(out, "shape", ()))))
            return out

    dist.Work.wait = wait
    try:
        with interposer.subscribed("recording", {f"ProcessGroup.{name}": posting(name)
                                                 for name in ("send", "recv", "recv_anysource")}), \
                _Ops():
            yield records
    finally:
        dist.Work.wait = original_wait


def _copy_all(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    for destination, source in zip(destinations, sources, strict=True):
        destination.copy_(source)


def ran_while_in_flight(records: list[FlightRecord]) -> dict[int, int]:
    """{request number: how many ops ran between its post and its first wait} for every request
    `in_flight` saw posted (a request never waited on counts the ops until the end)."""
    counts: dict[int, int] = {}
    open_requests: set[int] = set()
    for record in records:
        if record.kind == "post":
            counts[record.request] = 0
            open_requests.add(record.request)
        elif record.kind == "wait":
            open_requests.discard(record.request)
        elif record.kind == "op":
            for number in open_requests:
                counts[number] += 1
    return counts


def exchanges_posted_together(records: list[FlightRecord]) -> int:
    """How many requests `in_flight` saw posted while one of the other direction (an isend's,
    an irecv's) was in flight: a step that posts its send and its receive before waiting on
    either counts; a blocking send and receive, one after the other, never do."""
    open_requests: dict[int, str] = {}
    together = 0
    for record in records:
        if record.kind == "post":
            together += any(name != record.name for name in open_requests.values())
            open_requests[record.request] = record.name
        elif record.kind == "wait":
            open_requests.pop(record.request, None)
    return together


class Held:
    """What a block left allocated: see `holding`."""

    def __init__(self) -> None:
        self.nbytes = 0  # set when the block ends
        self.peak_bytes = 0  # the most the block held at once above what it started with

    def new_bytes(self, exclude: Iterable[torch.Tensor | None] = ()) -> int:
        """Bytes the block allocated that are still allocated after it, less the bytes of
        `exclude`: tensors it was meant to make and keep (the shards' gradients, say). Only a
        tensor's own elements are left out: the rest of a larger allocation it views counts."""
        skip = {(t.untyped_storage().data_ptr(), t.storage_offset()): t.numel() * t.element_size()
                for t in exclude if t is not None}
        return self.nbytes - sum(skip.values())


@contextlib.contextmanager
def holding() -> Iterator[Held]:
    """The memory a block leaves held, whoever holds it: the bytes of CPU tensor storages
    allocated inside the block and not freed by its end, whether a module, an optimizer, a
    closure, a global or autograd keeps them, not only what a check knows to look at; and the
    most it held at once (`peak_bytes`: a buffer per step where one would do shows there).

        with holding() as held:
            zero1_step(params, shards, optimizer, world_size)
        held.new_bytes(exclude=[shard.grad for shard in shards])  # 0 beyond the shards' grads?

    PyTorch's profiler reports each allocation and free of the block's thread (and of
    autograd's, which runs CPU backward on it), so starting a thread inside the block is
    refused (what it held would go uncounted); the bytes are known when the block ends."""
    from torch.profiler import ProfilerActivity, profile

    quiet_profiler()
    held = Held()
    with unavailable("threading.Thread.start", "_thread.start_new_thread",
                     reason="the memory a block holds is counted on its own thread"), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        yield held
    changes = sorted((event.start_ns(), event.nbytes())
                     for event in profiler.profiler.kineto_results.events()
                     if event.name() == "[memory]")
    held.nbytes = sum(nbytes for _, nbytes in changes)
    held.peak_bytes = max(itertools.accumulate(nbytes for _, nbytes in changes), default=0)


# --- What a checked function returned, as plain data -------------------------------------------


def reached_buffers(*functions: Any, at_least: int = 4096,
                    most_items: int = 256) -> list[tuple[str, int]]:
    """What `functions` keep beside their arguments: (name, size) of each buffer of at least
    `at_least` bytes (a tensor's storage, a NumPy array, a bytearray, a memory map) and each table
    of more than `most_items` entries that their code reaches through module-level names, their
    closures and attributes, their classes' methods and the notebook's functions those name in
    turn, looking inside containers.

    `holding` sees what a function allocates while it runs; a buffer made before (with the cell,
    or as the function reached a rank) is not among it, nor a table of answers worked out then."""
    import mmap

    import numpy as np

    found: dict[str, int] = {}
    seen: set[int] = set()

    def size(value: Any) -> int | None:
        if isinstance(value, torch.Tensor):
            return value.untyped_storage().nbytes()
        if isinstance(value, np.ndarray):
            return value.nbytes
        if isinstance(value, (bytes, bytearray, mmap.mmap)):
            return len(value)
        if isinstance(value, memoryview):
            return value.nbytes
        return None

    def names_in(code: types.CodeType) -> set[str]:
        names = set(code.co_names)
        for constant in code.co_consts:
            if isinstance(constant, types.CodeType):
                names |= names_in(constant)
        return names

    def visit(name: str, value: Any, depth: int) -> None:
        if id(value) in seen or depth > 4:
            return
        seen.add(id(value))
        nbytes = size(value)
        if nbytes is not None:
            if nbytes >= at_least:
                found[name] = nbytes
        elif isinstance(value, (dict, list, tuple, set)):
            if len(value) > most_items:
                found[name] = len(value)
            else:
                items = value.items() if isinstance(value, dict) else enumerate(value)
                for key, item in items:
                    visit(f"{name}[{key!r}]", item, depth + 1)
        elif isinstance(value, types.FunctionType):
            for attribute, item in vars(value).items():  # what it keeps on itself
                visit(f"{value.__name__}.{attribute}", item, depth + 1)
            for inner, cell in zip(value.__code__.co_freevars, value.__closure__ or (),
                                   strict=True):
                if _filled(cell):
                    visit(f"{value.__name__}.{inner}", cell.cell_contents, depth + 1)
            for used in names_in(value.__code__) & value.__globals__.keys():
                item = value.__globals__[used]
                if not isinstance(item, types.ModuleType) and (_notebooks_own(item)
                                                               or not callable(item)):
                    visit(used, item, depth + 1)
        elif isinstance(value, type) and _notebooks_own(value):
            for attribute, item in vars(value).items():
                visit(f"{value.__name__}.{attribute}", getattr(item, "__func__", item), depth + 1)
        elif isinstance(value, types.MethodType):
            visit(name, value.__func__, depth)

    for function in functions:
        visit(getattr(function, "__name__", "function"), function, 0)
    return sorted(found.items())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _notebooks_own(value: Any) -> bool:
    """Whether `value` is a function or class the notebook defined (a cell, or a file it wrote)."""
    code = getattr(value, "__code__", None)
    if code is not None:
        return _notebooks(code.co_filename)
    module = sys.modules.get(getattr(value, "__module__", "") or "")
    return isinstance(value, type) and (module is None or module.__name__ == "__main__"
                                        or _notebooks(getattr(module, "__file__", "") or ""))


def plain(value: Any) -> Any:
    """`value` as plain data, converted now: a number, string or None of its exact built-in
    type, a tuple, list or dict (or a dataclass's fields) of such, a tensor as a plain tensor;
    any other object as it is. A subclass of one of these is converted by its own float(),
    int(), items(), ... here: called inside a check's `unavailable` block, whatever those
    compute runs where the library is refused, not later when the check compares the value."""
    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return value
    for kind in (bool, int, float, complex, str, bytes):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, torch.Tensor):
        return value if type(value) in (torch.Tensor, torch.nn.Parameter) else (
            value.as_subclass(torch.Tensor).clone())
    if isinstance(value, dict):
        return {plain(key): plain(item) for key, item in dict.items(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple keeps its type
        return type(value)(*(plain(item) for item in tuple.__iter__(value)))
    if isinstance(value, (list, tuple)):
        items = [plain(item) for item in (list.__iter__ if isinstance(value, list)
                                          else tuple.__iter__)(value)]
        return items if isinstance(value, list) else tuple(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{field.name: plain(getattr(value, field.name))
                                            for field in dataclasses.fields(value) if field.init})
    return value


# --- A checked function with only its own code and the notebook's imports ---------------------

_BUILTINS = dict(vars(builtins))  # as minidist found them: a name a notebook adds later is state


def _imported(value: Any) -> bool:
    """Whether `value` is something a notebook imports (a module, or a function or class a
    module defines, reachable under its own name there) rather than state it computed."""
    if isinstance(value, types.ModuleType):
        return _installed(value)
    if isinstance(value, types.BuiltinFunctionType):  # a method of a table is state, not code
        return value.__self__ is None or isinstance(value.__self__, types.ModuleType)
    if not isinstance(value, (type, types.FunctionType)):
        return False
    module = sys.modules.get(getattr(value, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return False
    found: Any = module
    for part in value.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is value


def _installed(module: types.ModuleType) -> bool:
    """Whether `module` was loaded from the environment (the standard library, an installed
    package, minidist) rather than made by the notebook: `types.ModuleType(...)`, `__main__`,
    or a file the notebook wrote, any of which can carry a table or a fitted model."""
    if module.__name__ == "__main__":
        return False
    if module.__name__ in sys.builtin_module_names:
        return True
    spec = getattr(module, "__spec__", None)
    places = [spec.origin] if spec is not None and spec.origin else []
    places += list(getattr(spec, "submodule_search_locations", None) or [])
    return bool(places) and all(place in ("built-in", "frozen") or not _notebooks(place)
                                for place in places)


def _notebook_import(name: str, *args: Any, **kwargs: Any) -> Any:
    module = builtins.__import__(name, *args, **kwargs)
    made = [found for found in (module, sys.modules.get(name)) if found is not None
            and not _installed(found)]
    if made:
        raise ImportError(f"a checked function imports what the environment installed, not "
                          f"{made[0].__name__!r}, which the notebook made or wrote: what it "
                          f"holds was computed before the check")
    return module


def detached(function: Callable, namespace: dict[str, Any]) -> Callable:
    """`function` as its own code computes it, rebound to what `namespace` (the notebook's
    globals) imported: its modules and the library's classes and functions, the functions the
    notebook defined (rebound the same way), and builtins as they were. Every value the
    notebook computed is out of reach (a table, a fitted model, a cache an earlier cell filled
    with the library's answers, a default argument): called inside a check's `unavailable`
    block, the result is what the function works out itself, from the check's inputs.

    Literal defaults its `def` writes (`eps=1e-6`) are kept, and the notebook's own classes,
    their methods rebound and the tables kept on them left out.

    Why: refusing the library while a function runs does not stop an earlier cell from asking
    it in advance; a name the function reads from that cell now raises NameError."""
    clean: dict[str, Any] = {"__name__": namespace.get("__name__", "__main__"),
                             "__builtins__": dict(_BUILTINS, __import__=_notebook_import)}
    for name, value in namespace.items():
        if _imported(value):
            clean[name] = value
        elif isinstance(value, types.FunctionType) and value.__globals__ is namespace \
                and value.__closure__ is None:  # the notebook's own code, rebound
            clean[name] = _rebound(value, clean)
        elif isinstance(value, type) and value.__module__ == namespace.get("__name__"):
            with contextlib.suppress(TypeError, ValueError):  # a class it cannot rebuild: left out
                clean[name] = _rebound_class(value, namespace, clean)
    if not (isinstance(function, types.FunctionType) and function.__globals__ is namespace):
        raise AssertionError(f"{getattr(function, '__name__', function)!r} should be a function "
                             f"defined in its cell with def, got {type(function).__name__}")
    if function.__closure__ is not None:
        raise AssertionError(f"{function.__name__} should be defined at the top level of its "
                             "cell, not inside another function that hands it values")
    rebound = clean.get(function.__name__)
    if not (isinstance(rebound, types.FunctionType) and rebound.__code__ is function.__code__):
        rebound = _rebound(function, clean)
    return rebound


_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _rebound(function: types.FunctionType, clean: dict[str, Any],
             closure: tuple[types.CellType, ...] | None = None) -> types.FunctionType:
    """`function`'s code with `clean` as its globals (and `closure`, if given, for its own),
    and only the defaults its `def` line writes as literals (`eps=1e-6`): a default computed
    by an earlier cell is state."""
    rebound = types.FunctionType(function.__code__, clean, function.__name__,
                                 closure=function.__closure__ if closure is None else closure)
    written = _literal_defaults(function)
    defaults = function.__defaults__ or ()
    kept = 0  # defaults fill the last parameters: keep the literal tail
    while kept < len(defaults) and _written(defaults[-1 - kept], written.get(-1 - kept)):
        kept += 1
    rebound.__defaults__ = defaults[len(defaults) - kept:] or None
    rebound.__kwdefaults__ = {name: value for name, value in (function.__kwdefaults__ or {}).items()
                              if _written(value, written.get(name))} or None
    return rebound


def _written(value: Any, literal: Any) -> bool:
    return literal is not None and type(value) in _SCALARS and literal == (value,)


def _literal_defaults(function: types.FunctionType) -> dict[int | str, tuple]:
    """{position from the end, or keyword name: (value,)} of the defaults the source of
    `function`'s `def` writes as literals; none when its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return {}
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {}
    found: dict[int | str, tuple] = {}
    pairs = [(k - len(definition.args.defaults), node)
             for k, node in enumerate(definition.args.defaults)]
    pairs += [(arg.arg, node) for arg, node in zip(definition.args.kwonlyargs,
                                                    definition.args.kw_defaults, strict=True)
              if node]
    for key, node in pairs:
        try:
            found[key] = (ast.literal_eval(node),)
        except ValueError:
            continue
    return found


def _rebound_class(cls: type, namespace: dict[str, Any], clean: dict[str, Any]) -> type:
    """A class the notebook defined, its methods rebound to `clean`, less the tables kept on
    it (a tensor, an array, or a container of more than 16 items)."""
    body: dict[str, Any] = {}
    with_super: dict[str, Any] = {}  # methods whose super() needs the new class in its cell
    for name, value in vars(cls).items():
        if name in ("__dict__", "__weakref__"):
            continue
        function = getattr(value, "__func__", value)
        if isinstance(function, types.FunctionType) and function.__globals__ is namespace:
            if function.__closure__ is not None:
                with_super[name] = value
                continue
            method = _rebound(function, clean)
            body[name] = type(value)(method) if function is not value else method
        elif isinstance(value, property):
            body[name] = property(*(_rebound(f, clean) if isinstance(f, types.FunctionType)
                                    and f.__globals__ is namespace else f
                                    for f in (value.fget, value.fset, value.fdel)))
        elif not _table(value):
            body[name] = value
    rebuilt = type(cls.__name__, cls.__bases__, body)
    for name, value in with_super.items():
        function = getattr(value, "__func__", value)
        cells = tuple(types.CellType(rebuilt) if free == "__class__" else cell for free, cell
                      in zip(function.__code__.co_freevars, function.__closure__, strict=True))
        method = _rebound(function, clean, cells)
        setattr(rebuilt, name, type(value)(method) if function is not value else method)
    return rebuilt


def _table(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or hasattr(value, "__array__"):
        return True
    return isinstance(value, (dict, list, set, tuple, frozenset)) and len(value) > 16
