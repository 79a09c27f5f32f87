"""What the labs' checks use to see the mechanism, not only the numbers.

    with recording() as calls:                       # every torch.distributed call, in order
        my_ring_all_reduce(t)
    [c.name for c in calls]                          # ["isend", "irecv", "isend", ...]
    {c.peer for c in calls if c.name == "isend"}     # {right neighbour}

    with unavailable("minidist.communication.comm.ring_all_reduce", "torch.distributed.all_reduce"):
        my_ring_all_reduce(t)                        # calling either raises, saying why

    with messages_sent() as sent:                    # what each point-to-point message carried
        my_ring_all_reduce(t)
    [(m.peer, m.payload) for m in sent]              # [(right neighbour, a chunk's copy), ...]

`recording` sees the calls a function makes into torch.distributed (point-to-point and
collectives alike, with the peer, the bytes and the shape of each), so a check can ask who was
sent what and in which order, where `counting.count_traffic` counts only what left the rank.
`unavailable` makes functions refuse while an exercise is checked: a student's version must not
lean on the library's (or torch's) own version of the very thing it builds. The function objects
themselves refuse, so every name, alias and path that reaches them is caught.
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
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._ops import _OpNamespace

from minidist.core import interposer
from minidist.core._groups import members

__all__ = [
    "Call", "RECORDED", "recording", "unavailable", "LibraryVersionUsed", "Message",
    "messages_sent", "tampered_receives", "Refusals", "Seen", "watching", "MATMULS",
    "FlightRecord", "in_flight", "ran_while_in_flight", "Held", "holding", "PROCESS_STARTERS",
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
    `tensor` is that tensor itself (so a check can ask whether the tensor a function returns
    is the one it reduced) and `before` a copy of what it held when the call began (what this
    rank contributed)."""

    name: str
    peer: int | None
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    op: str | None = None
    sent: tuple[int, ...] | None = None
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
    return Call(name, peer, tensor.nbytes, tuple(tensor.shape), tensor.dtype, op, sent, tensor,
                tensor.detach().clone())


@contextlib.contextmanager
def recording(names: tuple[str, ...] = RECORDED) -> Iterator[list[Call]]:
    """Inside the block every call of torch.distributed's `names` is appended, in order, to
    the list it yields (calls minidist makes on the caller's behalf included)."""
    calls: list[Call] = []

    def watched(name: str) -> Any:
        def call(proceed: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(_describe(name, args, kwargs))
            return proceed(*args, **kwargs)
        return call

    with interposer.subscribed("recording", {f"dist.{name}": watched(name) for name in names
                                             if callable(getattr(dist, name, None))}):
        yield calls


class LibraryVersionUsed(RuntimeError):
    """A checked function called the library's (or torch's) own version of the exercise.
    Each one is announced to the open `unavailable` blocks, so catching it does not hide it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        interposer.announce("minidist.refusal", message)


# What torch runs a torch.distributed collective through below its Python function: the process
# group's own method, the functional collectives and the dispatcher's ops. Refusing the function
# refuses these too, so no Python path reaches the collective unseen.
_BELOW = {
    "all_reduce": ("allreduce", "allreduce_coalesced"),
    "all_gather": ("allgather", "_allgather_base", "allgather_coalesced",
                   "allgather_into_tensor_coalesced", "all_gather_single",
                   "all_gather_single_coalesced"),
    "reduce_scatter": ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                       "reduce_scatter_single", "reduce_scatter_single_coalesced"),
    "all_to_all": ("alltoall", "alltoall_base", "all_to_all_single"),
    "broadcast": ("broadcast",), "reduce": ("reduce",), "gather": ("gather",),
    "scatter": ("scatter",),
}
_FAMILY = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
           "all_to_all_single": "all_to_all", "all_reduce_coalesced": "all_reduce",
           "all_gather_coalesced": "all_gather"}
_FUNCTIONAL = {  # torch.distributed._functional_collectives, and the ops they and c10d run
    "all_reduce": ("all_reduce", "all_reduce_inplace", "all_reduce_coalesced"),
    "all_gather": ("all_gather_tensor", "all_gather_tensor_inplace", "all_gather_inplace",
                   "all_gather_into_tensor_coalesced", "all_gather_tensor_autograd"),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_inplace",
                       "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_autograd"),
    "all_to_all": ("all_to_all_single", "all_to_all_inplace", "all_to_all_single_autograd"),
    "broadcast": ("broadcast",),
}
_OPS = {
    "all_reduce": ("c10d.allreduce_", "c10d.allreduce_coalesced_", "_c10d_functional.all_reduce",
                   "_c10d_functional.all_reduce_", "_c10d_functional.all_reduce_coalesced",
                   "_c10d_functional.all_reduce_coalesced_"),
    "all_gather": ("c10d.allgather_", "c10d._allgather_base_", "c10d.allgather_coalesced_",
                   "c10d.allgather_into_tensor_coalesced_",
                   "_c10d_functional.all_gather_into_tensor",
                   "_c10d_functional.all_gather_into_tensor_out",
                   "_c10d_functional.all_gather_into_tensor_coalesced"),
    "reduce_scatter": ("c10d.reduce_scatter_", "c10d._reduce_scatter_base_",
                       "c10d.reduce_scatter_tensor_coalesced_",
                       "_c10d_functional.reduce_scatter_tensor",
                       "_c10d_functional.reduce_scatter_tensor_coalesced"),
    "all_to_all": ("c10d.alltoall_", "c10d.alltoall_base_", "_c10d_functional.all_to_all_single"),
    "broadcast": ("c10d.broadcast_", "_c10d_functional.broadcast", "_c10d_functional.broadcast_"),
    "reduce": ("c10d.reduce_",), "gather": ("c10d.gather_",), "scatter": ("c10d.scatter_",),
}


def _below(path: str) -> list[str]:
    """The paths below torch.distributed's collective `path` (none for anything else)."""
    prefix, _, name = path.rpartition(".")
    if prefix not in ("torch.distributed", "torch.distributed.distributed_c10d"):
        return []
    family = _FAMILY.get(name, name)
    return ([f"torch.distributed.ProcessGroup.{method}" for method in _BELOW.get(family, ())]
            + [f"torch._C._distributed_c10d.Backend.{method}" for method in _BELOW.get(family, ())]
            + [f"torch.distributed._functional_collectives.{function}"
               for function in _FUNCTIONAL.get(family, ())]
            + [f"torch.ops.{op}" for op in _OPS.get(family, ())])


@contextlib.contextmanager
def unavailable(*paths: str, reason: str = "", allow: Iterable[str] = (),
                processes: bool = False) -> Iterator[Refusals]:
    """Inside the block each function named by its dotted path (e.g.
    "minidist.communication.comm.ring_all_reduce", "torch.distributed.all_reduce", a class's
    method: "minidist.parallel.tensor_parallel.CopyToParallel.apply", or "module.*": every
    function the module defines) raises LibraryVersionUsed when called, however it is reached.
    `allow` names the functions (dotted paths) a "module.*" leaves callable: the scaffolding
    an exercise is given, and the helpers that scaffolding calls.

    The function object itself refuses (its code is swapped for a refusal while the block
    runs), so a name bound by `from ... import`, an alias, a functools.partial and the library's
    own callers all meet the refusal; a C function (torch.chunk) is refused wherever it is
    called from, by identity, through a profile hook. A torch.distributed collective is refused
    with what torch runs it through: its process group's method, the functional collectives and
    the dispatcher's ops. A C method of a class ("torch.Tensor.tensor_split") is refused
    however it is bound (t.tensor_split, torch._C.TensorBase.tensor_split(t, ...)).

    With processes=True, starting a process is refused too (subprocess, os.fork, os.system,
    multiprocessing, minidist's own run): a fresh interpreter would reach the library's
    versions out of the block's sight. The block yields a `Refusals`, whose `exempt` lets the
    check itself call the library inside the block."""
    allowed = set(allow)
    targets = [target for path in paths for target in _expand(path) if target not in allowed]
    targets += [below for path in paths for below in _below(path)
                if _resolvable(below) and below not in targets]
    if processes:
        targets += [path for path in PROCESS_STARTERS if _resolvable(path)]
    targets = list(dict.fromkeys(targets))  # two collectives share what they run below
    undo: list[Callable[[], None]] = []
    refused_builtins: dict[int, str] = {}
    refused_methods: dict[int, str] = {}  # id of the refusal standing in a class for a C method
    refused_code: dict[tuple[str, bytes], str] = {}
    refusals: list[str] = []

    def keep(_: Callable[..., None], message: str) -> None:
        refusals.append(message)

    def refuse() -> None:
        undo.extend(_refuse(path, reason, refused_builtins, refused_code, refused_methods)
                    for path in targets)

    def lift() -> None:
        for restore in reversed(undo):
            restore()
        undo.clear()
        refused_builtins.clear()
        refused_code.clear()
        refused_methods.clear()

    for path in targets:  # import every module first: one may subclass what another refuses
        _owner(path)
    try:
        refuse()
        with interposer.subscribed("recording", {"minidist.refusal": keep}), \
                _refusing_copies(refused_builtins, refused_code, refused_methods, reason):
            yield Refusals(refuse, lift)
    finally:
        lift()
    if refusals:  # refused, and the function caught it and went on: still refused
        raise LibraryVersionUsed(f"{refusals[0]} (your function caught the refusal and went on)")


class Refusals:
    """What `unavailable` yields: `exempt(function)` is `function` run with the refusals lifted
    for that call alone, for the check's own use of the library inside the block (the check
    holds this object; the student's function never sees it)."""

    def __init__(self, refuse: Callable[[], None], lift: Callable[[], None]) -> None:
        self._refuse, self._lift = refuse, lift

    def exempt(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            self._lift()
            try:
                return function(*args, **kwargs)
            finally:
                self._refuse()
        return call


def _expand(path: str) -> list[str]:
    """`path`, or for "module.*" the path of every function the module defines."""
    if not path.endswith(".*"):
        return [path]
    module = importlib.import_module(path[:-2])
    return [f"{path[:-2]}.{name}" for name, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module.__name__]


def _resolvable(path: str) -> bool:
    try:
        _owner(path)
    except (AttributeError, ModuleNotFoundError, RuntimeError):
        return False
    return True


PROCESS_STARTERS = (
    "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.system",
    "_posixsubprocess.fork_exec", "multiprocessing.process.BaseProcess.start",
)
"""Where every new process of this one begins: subprocess (fork_exec or posix_spawn), os.fork
and what calls it (os.spawn*, pty), os.system, and multiprocessing (its fork server too, and so
minidist's run); refused by `unavailable(..., processes=True)`."""


def _refusal(path: str, reason: str) -> str:
    if path in PROCESS_STARTERS:
        return (f"your function started a process ({path}): a check runs your function in this "
                f"process, where the library's versions it is compared with are unavailable; "
                f"compute it here{': ' + reason if reason else ''}")
    return (f"your function called {path}: write your own; the library's version is what your "
            f"function is compared with{': ' + reason if reason else ''}")


def _refuse(path: str, reason: str, refused_builtins: dict[int, str],
            refused_code: dict[tuple[str, bytes], str],
            refused_methods: dict[int, str]) -> Callable[[], None]:
    """Make the function at `path` refuse; returns what undoes it. Its code's fingerprint goes
    into `refused_code`, so a copy of it (a reloaded module, exec of its source) refuses too."""
    owner, attribute = _owner(path)
    if getattr(getattr(owner, attribute), "_minidist_refusal", False):
        return lambda: None  # refused already, by another path to the same function
    # A class's own entry (a staticmethod, a classmethod), or nothing if it inherits one.
    entry = vars(owner).get(attribute, _INHERITED) if not isinstance(owner, _OpNamespace) \
        else getattr(owner, attribute)
    # An inherited method (torch.autograd.Function.apply) is shared with every subclass: it is
    # refused on this class alone, by its attribute, which every alias of the class sees.
    inherited = inspect.isclass(owner) and entry is _INHERITED
    functions = [] if inherited else _python_functions(getattr(owner, attribute))
    if functions:  # swap the code of the function object (and what it wraps): every alias sees it
        saved = [(function, function.__code__) for function in functions]
        # Only the innermost function's code is the library's own: a decorator's wrapper
        # (torch.no_grad's, c10d's logger) shares its code with every function it wraps.
        innermost = functions[-1].__code__
        refused_code[innermost.co_name, innermost.co_code] = path
        for function, code in saved:
            function.__code__ = _refusing_code(code, _refusal(path, reason))

        def restore_code() -> None:
            for function, code in reversed(saved):
                function.__code__ = code
        return restore_code

    value = getattr(owner, attribute)
    if inspect.ismodule(owner) and not isinstance(owner, _OpNamespace):
        refused_builtins[id(value)] = path  # a C function: refused by identity wherever called

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise LibraryVersionUsed(_refusal(path, reason))

    refuse._minidist_refusal = True  # type: ignore[attr-defined]
    setattr(owner, attribute, refuse)
    if inspect.isclass(owner) and inspect.ismethoddescriptor(value):
        # A C method: a bound call of it (through a base class too) finds `refuse` on the type.
        refused_methods[id(refuse)] = path

    def restore_attribute() -> None:
        if entry is _INHERITED:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, entry)
        refused_builtins.pop(id(value), None)
        refused_methods.pop(id(refuse), None)
    return restore_attribute


def _python_functions(value: Any) -> list[Any]:
    """The Python function objects behind `value` (unwrapping methods, staticmethods and
    functools.wraps chains), [] for a C function."""
    functions = []
    value = getattr(value, "__func__", value)
    while inspect.isfunction(value) and value not in functions:
        functions.append(value)
        value = getattr(value, "__wrapped__", None)
    return functions


def _refusing_code(code: types.CodeType, message: str) -> types.CodeType:
    """Code that raises LibraryVersionUsed(message), with as many free variables as `code` has
    (a function's code can only be swapped for code with the same number)."""
    free = [f"_free{i}" for i in range(len(code.co_freevars))]
    source = ("def outer():\n" + "".join(f"    {name} = None\n" for name in free)
              + "    def refused(*args, **kwargs):\n"
              + (f"        ({', '.join(free)},)\n" if free else "")
              # __import__, a builtin, works in whichever module's globals the function runs
              + "        raise __import__('minidist.core.checking', fromlist=['_'])"
              f".LibraryVersionUsed({message!r})\n"
              + "    return refused\n")
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # noqa: S102 - our own text: a refusal with a fixed message
    refused = namespace["outer"]().__code__
    return refused.replace(co_name=code.co_name, co_qualname=code.co_qualname,
                           co_filename=code.co_filename, co_firstlineno=code.co_firstlineno)


@contextlib.contextmanager
def _refusing_copies(builtins: dict[int, str], code: dict[tuple[str, bytes], str],
                     methods: dict[int, str], reason: str) -> Iterator[None]:
    """While the block runs, a call of a refused C function, or of any Python function whose
    code is a refused one's (same name, same bytecode: a module reloaded or loaded again from
    its file, its source exec'd), raises, from any caller, in this thread and in threads it
    starts."""
    if not builtins and not code and not methods:
        yield
        return

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            refused = code.get((frame.f_code.co_name, frame.f_code.co_code))
        elif event == "c_call":
            refused = builtins.get(id(arg))
            if refused is None and methods:
                refused = _refused_method(arg, methods)
        else:
            return
        if refused is not None:
            raise LibraryVersionUsed(_refusal(refused, reason))

    previous, previous_threads = sys.getprofile(), threading.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)


def _refused_method(called: Any, methods: dict[int, str]) -> str | None:
    """The path of a refused C method if `called` is one bound to an object (t.tensor_split,
    torch._C.TensorBase.tensor_split(t, ...)): the entry its object's type has is a refusal."""
    bound_to = getattr(called, "__self__", None)
    if bound_to is None or inspect.ismodule(bound_to):
        return None
    try:
        return methods.get(id(getattr(type(bound_to), called.__name__, None)))
    except Exception:  # noqa: BLE001 - an odd type's attribute lookup: not a refused method
        return None


_INHERITED = object()


def _owner(path: str) -> tuple[Any, str]:
    """The object holding the last name of a dotted path, and that name: the longest prefix
    that imports as a module, then attributes (a class) down to the last."""
    parts = path.split(".")
    if parts[:2] == ["torch", "ops"] and len(parts) == 4:  # a dispatcher op: torch.ops.ns.name
        namespace = getattr(torch.ops, parts[2])
        getattr(namespace, parts[3])  # raises AttributeError for an op this torch lacks
        return namespace, parts[3]
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
            sent.append(Message(peer, tensor.detach().clone()))
        return proceed(group, tensors, dst, *args, **kwargs)

    with interposer.subscribed("messages", {"ProcessGroup.send": send}):
        yield sent


class _Tampered(dist.Work):
    """A receive whose message, once it has arrived, gets `delta` added to every element."""

    def __init__(self, work: dist.Work, tensors: list[torch.Tensor], delta: float) -> None:
        super().__init__()
        self.work, self.tensors, self.delta, self.done = work, tensors, delta, False

    def wait(self, timeout: Any = None) -> bool:
        arrived = self.work.wait() if timeout is None else self.work.wait(timeout)
        if not self.done:
            self.done = True
            for tensor in self.tensors:
                tensor.add_(self.delta if tensor.is_floating_point() else round(self.delta))
        return arrived

    def is_completed(self) -> bool:
        return self.work.is_completed()


@contextlib.contextmanager
def tampered_receives(*, delta: float = 1.0, nth: int | None = None) -> Iterator[list[int]]:
    """Inside the block the `nth` point-to-point message this rank receives (counting from 0;
    every one with nth=None) arrives with `delta` added to each element, however it was
    received (dist.recv, dist.irecv, batch_isend_irecv, minidist's rings). The list it
    yields holds the source (global rank) of each message received, in order.

    A check runs the student's function and the library's under the same tampering: a
    function whose result really comes from what it received changes as the library's does;
    one that computed its result another way (a formula, a side channel, a replay of data
    gathered earlier) does not."""
    from minidist.core._groups import members

    sources: list[int] = []

    def receive(proceed: Any, group: Any, tensors: list, src: int, *args: Any,
                **kwargs: Any) -> Any:
        work = proceed(group, tensors, src, *args, **kwargs)
        index = len(sources)
        sources.append(members(group)[src] if src >= 0 else src)
        return _Tampered(work, tensors, delta) if nth is None or index == nth else work

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
    of call in one order. Like `unavailable`, it swaps the module's attribute: `from ...
    import` copies are not seen."""
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
    (`ran_while_in_flight`)."""
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
            work = proceed(group, tensors, *args)
            numbers[id(work)] = number
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


class Held:
    """What a block left allocated: see `holding`."""

    def __init__(self) -> None:
        self.nbytes = 0  # set when the block ends

    def new_bytes(self, exclude: Iterable[torch.Tensor | None] = ()) -> int:
        """Bytes the block allocated that are still allocated after it, less the storages of
        `exclude`: tensors it was meant to make and keep (the shards' gradients, say)."""
        skip = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in exclude if t is not None}
        return self.nbytes - sum(skip.values())


@contextlib.contextmanager
def holding() -> Iterator[Held]:
    """The memory a block leaves held, whoever holds it: the bytes of CPU tensor storages
    allocated inside the block and not freed by its end, whether a module, an optimizer, a
    closure, a global or autograd keeps them, not only what a check knows to look at.

        with holding() as held:
            zero1_step(params, shards, optimizer, world_size)
        held.new_bytes(exclude=[shard.grad for shard in shards])  # 0 beyond the shards' grads?

    PyTorch's profiler reports each allocation and free of the block's thread (and of
    autograd's, which runs CPU backward on it); the bytes are known when the block ends."""
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints a "USDT: profiler_start" line on stderr for each profile unless its level is
    # above them, which it reads when a process's first profile starts; nbgrader scores a test
    # cell that wrote to stderr 0.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    held = Held()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        yield held
    held.nbytes = sum(event.nbytes() for event in profiler.profiler.kineto_results.events()
                      if event.name() == "[memory]")
