"""Refusing the library's own answer while an exercise is checked, by identity.

    with unavailable("minidist.communication.comm.ring_all_reduce", "torch.distributed.all_reduce"):
        my_ring_all_reduce(t)                        # calling either raises, saying why

A student's version must not lean on the library's (or torch's) own version of the very thing it
builds. `unavailable` makes the function objects themselves refuse, so every name, alias, copy
and path that reaches them is caught: a Python function's code is swapped for a refusal, a copy
of that code is refused by its fingerprint (its instructions, whatever its locals are named)
when it is long, has no line table, or keeps the original's name, docstring, place in the
library's file or the layout of its source, and an edited copy by the columns it keeps; a class
by every method it defines; a C function or method by its identity; and a torch.distributed
collective together with what torch runs it through below. A refusal the checked function
catches is raised again when the block ends. What would work out of the block's sight is
refused with it: switching its watch off, a thread or a process the notebook left running
beside it, and (when asked) files, pipes and sockets.

Why one module of about 1130 lines: the refusal of each kind of callable (Python function, class
method, C function, dispatcher op, a copy's code) is one mechanism, swapped in and out together,
and what it watches (this thread, and what runs beside it, and where it may look away: torch's
loader of tensors) is what makes it hold.
"""

from __future__ import annotations
import __future__

import contextlib
import difflib
import dis
import functools
import importlib
import importlib.util
import inspect
import itertools
import linecache
import operator
import os
import re
import socket
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch._ops import _OpNamespace

from minidist.core import interposer

__all__ = ["unavailable", "prepare", "Refusals", "LibraryVersionUsed", "PROCESS_STARTERS",
           "TORCH_COLLECTIVES", "TORCH_STORE", "FILES", "FOREIGN_MEMORY", "MODES", "PEEKING",
           "FORGING", "watched_as_here"]


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


TORCH_COLLECTIVES = tuple(f"torch.distributed.{name}" for name in (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather",
    "scatter", "all_reduce_coalesced", "all_gather_coalesced", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list", "barrier",
    "monitored_barrier"))
"""Every collective of torch.distributed, to pass to `unavailable` where an exercise builds its
communication from point-to-point sends: each is refused with what torch runs it through below,
so no result can come from a collective while right-sized sends are made for show."""


TORCH_STORE = tuple(f"torch.distributed.Store.{method}" for method in (
    "set", "get", "add", "append", "check", "compare_set", "delete_key", "multi_get", "multi_set",
    "num_keys", "list_keys", "wait", "queue_push", "queue_pop", "queue_len"))
"""Every method of torch.distributed's key-value store, the rendezvous store every process group
holds: a side channel no traffic count sees, to pass to `unavailable` where an exercise must
communicate through its collectives. minidist's comparison of each collective across its group
(`minidist.core.agreement`) uses the store too: refuse it inside `agreement.unchecked()`."""


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
    versions out of the block's sight. A function or class of a minidist module rebound inside
    the block (the check's reference swapped for a stand-in) is put back, and refused. The block
    yields a `Refusals`, whose `exempt` lets the check itself call the library inside it."""
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
    refused_code: dict[int, list[_Original]] = {}  # bytecode size -> the refused code that size
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
    beside = _started_beside(processes)
    if beside:
        raise LibraryVersionUsed(
            f"{beside[0]} is still running beside the check: a checked function runs alone, in "
            f"this thread, where the library's versions it is compared with are unavailable; "
            f"finish it (join it, shut the pool down) before the check")
    # What the check compares with: a name the checked function rebinds is put back (a
    # check's own spy, bound before the block, stays). A block inside another leaves that to
    # the outer one, which still refuses it as it ends (Lab 14's pieces open one at each call).
    library = {} if sys.getprofile() in _HOOKS else _library_names()
    try:
        refuse()
        with interposer.subscribed("recording", {"minidist.refusal": keep}), \
                _refusing_copies(refused_builtins, refused_code, refused_methods, reason):
            yield Refusals(refuse, lift)
    finally:
        lift()
        rebound = _put_back(library)
    if refusals:  # refused, and the function caught it and went on: still refused
        raise LibraryVersionUsed(f"{refusals[0]} (your function caught the refusal and went on)")
    if rebound:
        raise LibraryVersionUsed(
            f"{rebound[0]} was rebound inside the check: a checked function leaves the library "
            f"as it found it (the check compares with it); it is put back")


def prepare(modules: Iterable[types.ModuleType]) -> None:
    """Work out now what a check compares copies of the functions `modules` define with (their
    code compiled both ways, identity and columns), so that the processes forked from this one
    after it start with it done: minidist's fork server does so for the library once (0.25 s
    on a laptop), not every rank that refuses much of it (26 ms of each of Lab 14's)."""
    for module in modules:
        for value in list(vars(module).values()):
            if getattr(value, "__module__", None) != module.__name__:
                continue
            members = vars(value).values() if inspect.isclass(value) else (value,)
            for function in (f for member in members for f in _python_functions(member)):
                for code in _compiled_both_ways(function.__code__):
                    _identity(code)
                    _columns(code)


def _library_names() -> dict[str, dict[str, Any]]:
    """What a check compares the student's function with: a copy of every loaded minidist
    module's namespace, by module name (copied whole, in C; what it holds is sorted out only
    where something was rebound, as the block ends)."""
    modules = sys.modules
    names = list(modules)  # ~1200 with torch's: picked out in C
    return {name: dict(vars(module)) for name in itertools.compress(
                names, map(str.startswith, names, itertools.repeat("minidist.")))
            if (module := modules.get(name)) is not None}


def _unchanged(before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the namespace `now` holds the very names and values `before` did, in order
    (compared by identity, in C: an object's own __eq__ has no say)."""
    return (len(before) == len(now) and all(map(operator.is_, before, now))
            and all(map(operator.is_, before.values(), now.values())))


def _put_back(library: dict[str, dict[str, Any]]) -> list[str]:
    """The functions and classes of `library` (dotted) bound to something else now, each put
    back."""
    rebound = []
    for module_name, before in library.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        now = vars(module)
        if _unchanged(before, now):
            continue
        for attribute in [name for name, value in before.items()
                          if now.get(name, value) is not value]:
            value = before[attribute]
            if isinstance(value, (types.FunctionType, type, functools.partial)):
                setattr(module, attribute, value)
                rebound.append(f"{module_name}.{attribute}")
    return rebound


def _started_beside(processes: bool) -> list[str]:
    """What the notebook started that still runs beside this thread: a thread running the
    notebook's code (or a pool's worker, which runs whatever it is handed), and with `processes`
    a child process other than multiprocessing's own servers. Code running there would be out
    of the block's sight (a profile hook watches only its own thread)."""
    found = []
    stacks = sys._current_frames()
    for thread in threading.enumerate():
        if (thread is threading.current_thread() or not thread.is_alive()
                or _idle_library_pool(thread)):
            continue
        # what it was given to run (a Timer's function too), and what it runs now
        runs = [getattr(thread, "_target", None), getattr(thread, "function", None),
                type(thread).run]
        frame, codes = stacks.get(thread.ident), []
        while frame is not None:
            codes.append(frame.f_code)
            frame = frame.f_back
        for callable_ in filter(None, runs):
            callable_ = getattr(callable_, "func", callable_)  # a functools.partial
            callable_ = getattr(callable_, "__func__", callable_)  # a bound method
            codes.append(getattr(callable_, "__code__", None))
            if (getattr(callable_, "__module__", "") or "").startswith(
                    ("concurrent.futures", "multiprocessing.pool")):
                codes.append(None)  # a pool's worker runs whatever it is handed
        if any(code is None or _notebooks(code.co_filename) for code in codes):
            found.append(f"a thread your notebook started ({thread.name!r})")
    if processes:
        found += [f"a process your notebook started (pid {pid})" for pid in _children()]
    if not torch.distributed.is_initialized():  # the notebook's process, not one of its ranks
        found += [f"a process (pid {pid}) that shares a pipe or memory with your notebook but "
                  f"is none of its own" for pid in _strangers()]
    return found


def _strangers() -> list[int]:
    """The pids of processes that share a pipe or a shared memory mapping with this one but are
    neither its ancestors, its descendants nor multiprocessing's servers and their ranks: a
    helper forked before a check and detached from it (Linux; elsewhere none are found).

    Only the processes that may descend from this one are read (`_may_descend`). The scan
    runs as every check starts (a lab's run starts about 300); reading every process's
    descriptors and memory map took 4 ms on a quiet laptop and 80 ms beside this course's own
    test suite, whose other notebooks' processes are now left unread."""
    processes = {}  # pid -> (parent's pid, start time in clock ticks since boot)
    for entry in os.listdir("/proc") if os.path.isdir("/proc/self/fd") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    fields = file.read().rpartition(")")[2].split()  # from field 3, the state
                processes[int(entry)] = int(fields[1]), int(fields[19])
            except (OSError, IndexError, ValueError):
                continue
    me = os.getpid()
    if me not in processes:
        return []
    known, pid = set(), me
    while pid > 1 and pid not in known:  # this process and its ancestors
        known.add(pid)
        pid = processes.get(pid, (0, 0))[0]
    lineage = set(known)
    # What an ancestor holds too was inherited (a terminal's or a job's output pipe, which
    # unrelated processes share): only what this process opened itself can reach a helper.
    mine = _shared_with("self")
    for ancestor in known - {me}:
        mine -= _shared_with(str(ancestor))
    if not mine:
        return []
    children: dict[int, list[int]] = {}
    for child, (parent, _) in processes.items():
        children.setdefault(parent, []).append(child)
    stack = [root for root in {me, *_servers()} if root]
    while stack:  # their descendants
        pid = stack.pop()
        known.add(pid)
        stack += [child for child in children.get(pid, []) if child not in known]
    return [pid for pid in processes if pid not in known
            and _may_descend(pid, processes, lineage, processes[me][1])
            and _shared_with(str(pid)) & mine]


def _may_descend(pid: int, processes: dict[int, tuple[int, int]], lineage: set[int],
                 born: int) -> bool:
    """Whether `pid` may descend from the process born at `born` whose ancestors (and itself)
    are `lineage`, from `processes` ({pid: (parent's pid, start time)}): it started no earlier,
    and none of its ancestors is older without being of that lineage (an orphan is adopted by
    init, or by the nearest of its ancestors that adopts orphans)."""
    if processes[pid][1] < born:
        return False
    seen = set()
    while pid not in seen:
        seen.add(pid)
        pid = processes[pid][0]  # its parent
        if pid <= 1 or pid in lineage or pid not in processes:
            return True  # adopted by init or by the lineage, or gone: it may
        if processes[pid][1] < born:
            return False  # an older process of another lineage started it
    return True


def _shared_with(pid: str) -> set[str]:
    """The pipes ("pipe:[inode]") a process holds open and the shared mappings (device and
    inode) it has; empty when they cannot be read."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("pipe:"):
                    found.add(link)
        with open(f"/proc/{pid}/maps") as file:  # a torch process maps ~2000 regions
            found.update(f"{device}:{inode}" for device, inode in _SHARED.findall(file.read()))
    except OSError:
        return set()
    return found


# A line of /proc/PID/maps whose permissions end in "s" (shared) and that maps a file (inode
# not 0): its device and inode.
_SHARED = re.compile(r"^\S+ \S{3}s \S+ (\S+) ([1-9]\d*)", re.MULTILINE)


def watched_as_here(function: Callable[[], Any]) -> Callable[[], Any]:
    """`function`, to be run on another thread (a pool's, started before a check) under the
    watch this thread has now: what a check refuses here it refuses there too."""
    hook = sys.getprofile()

    def watched() -> Any:
        previous = sys.getprofile()
        sys.setprofile(hook)
        try:
            return function()
        finally:
            sys.setprofile(previous)
    return watched


def _idle_library_pool(thread: threading.Thread) -> bool:
    """Whether `thread` is minidist's own communication thread
    (minidist.communication.collectives), with nothing queued on it: it runs only what the
    library hands it, and it outlives the collective that started it (a check that follows
    one would otherwise be refused for it). Looked up, not imported: it sits above core."""
    collectives = sys.modules.get("minidist.communication.collectives")
    pool = getattr(collectives, "_worker", None)
    return (pool is not None and thread in getattr(pool, "_threads", ())
            and all(future.done() for future in getattr(collectives, "_queued", ())))


def _notebooks(filename: str) -> bool:
    """Whether code from `filename` is the notebook's (a cell, or a file it wrote) rather than
    an installed package's, the standard library's or minidist's."""
    libraries = (sys.prefix, sys.base_prefix, sys.exec_prefix, _MINIDIST, "<frozen ")
    return not filename.startswith(libraries)


_MINIDIST = __file__.rsplit("/core/", 1)[0]


def _servers() -> set[int | None]:
    """The pids of multiprocessing's fork server and resource tracker (None: not started)."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    return {getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
            getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)}


def _children() -> list[int]:
    """The pids of this process's live children, less multiprocessing's fork server and
    resource tracker (Linux; elsewhere none are found)."""
    servers = _servers()
    pids = []
    for listing in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{listing}/children") as file:
                pids += [int(pid) for pid in file.read().split()]
        except OSError:
            continue
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as file:
                state = file.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if pid not in servers and state not in ("Z", "X"):
            alive.append(pid)
    return alive


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


@functools.lru_cache(maxsize=4096)  # a check refuses the same paths block after block
def _expand(path: str) -> tuple[str, ...]:
    """`path`, or for "module.*" the path of every function the module defines; a Python class
    refuses by every function it defines (its methods, static and class methods, properties),
    then by its name: an alias of the class taken before the block, or an instance made before
    it, meets the refusal in whichever method it calls."""
    if path.endswith(".*"):
        module = importlib.import_module(path[:-2])
        return tuple(f"{path[:-2]}.{name}" for name, value in vars(module).items()
                     if inspect.isfunction(value) and value.__module__ == module.__name__)
    try:
        owner, attribute = _owner(path)
    except (AttributeError, ModuleNotFoundError, RuntimeError):
        return (path,)
    value = getattr(owner, attribute)
    if not inspect.isclass(value) or not hasattr(sys.modules.get(value.__module__), "__file__"):
        return (path,)
    methods = [f"{path}.{name}" for name, member in vars(value).items()
               if _python_functions(member)]
    return (*methods, path)


def _resolvable(path: str) -> bool:
    try:
        _owner(path)
    except (AttributeError, ModuleNotFoundError, RuntimeError):
        return False
    return True


FILES = tuple(path for path in (
    "io.open", "os.open", "os.pipe", "os.mkfifo", "os.memfd_create", "socket.socket",
    "socket.socketpair", "mmap.mmap", "_posixshmem.shm_open")
    if importlib.util.find_spec(path.partition(".")[0])
    and hasattr(importlib.import_module(path.partition(".")[0]), path.partition(".")[2])) + (
    "torch.from_file", "torch.UntypedStorage.from_file",
    *(f"torch._C._distributed_c10d.Backend.{method}"
      for method in ("send", "recv", "recv_anysource")),
    "torch._C._distributed_c10d.ProcessGroup.boxed")
"""What opens a file, a pipe, a socket or shared memory, and the backend's own send and receive
below the process group (`group._get_backend(device).send(...)`, or the dispatcher's c10d ops,
which take `group.boxed()`: torch calls neither from Python): the side channels beside the
collectives, which no count, tamper or emulation sees, to pass to `unavailable` where an
exercise has no business with files (a verdict, a norm or a state shared through /tmp, /dev/shm
or gloo's backend would pass every count of its collectives). Reading a source file to show a
traceback or a warning stays allowed."""

FOREIGN_MEMORY = (
    "torch.from_numpy", "torch.frombuffer", "torch.asarray", "torch.as_tensor", "torch.from_dlpack",
    "torch.utils.dlpack.from_dlpack", "torch.UntypedStorage.from_buffer")
"""What puts a tensor on memory that torch's allocator did not give (NumPy's, a buffer's):
`minidist.core.checking.holding` counts what torch allocates, so a check of the memory a function
holds refuses these while it runs, with FILES (a memory map among them)."""


MODES = ("torch._C._push_on_torch_dispatch_stack", "torch._C._push_on_torch_function_stack")
"""Entering a torch-function or dispatch mode (TorchFunctionMode, TorchDispatchMode): a mode sees,
and may answer, every torch operation a function runs, so it can record what a computation made
and hand it back later (a recompute that replays forward's values) or model what autograd keeps
instead of measuring it; refused where an exercise is to compute that itself."""


PROCESS_STARTERS = (
    "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.system",
    "_posixsubprocess.fork_exec", "multiprocessing.process.BaseProcess.start",
)
"""Where every new process of this one begins: subprocess (fork_exec or posix_spawn), os.fork
and what calls it (os.spawn*, pty), os.system, and multiprocessing (its fork server too, and so
minidist's run); refused by `unavailable(..., processes=True)`."""


PEEKING = tuple(path for path in (
    "sys._getframe", "sys._current_frames", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "inspect.currentframe", "inspect.stack", "inspect.getouterframes",
    "inspect.trace", "traceback.extract_stack", "traceback.walk_stack", "traceback.format_stack",
    "traceback.print_stack", "os.read", "os.write", "os.readv", "os.writev", "os.pread",
    "os.pwrite", "os.sendfile", "os.fdopen")
    if hasattr(importlib.import_module(path.partition(".")[0]), path.partition(".")[2]))
"""What reads the check's own state (its frames, the garbage collector's lists of live objects:
the inputs of every rank, the expected payloads) or talks through a descriptor opened before the
check (a pipe to a helper process that still has the library); refused in every `unavailable`
block when the notebook's own code calls it (a cell, or a file it wrote), so the library,
torch and the check keep their use of them."""

FORGING = ("minidist.core.timeline.note", "minidist.core.interposer.announce")
"""What records an event, a collective or a refusal for the check to see: the library's own
functions (an attention block, the collective layer) call them; refused in every `unavailable`
block when the notebook's own code calls them, so what a check counts is what ran."""

_SOURCE_READERS = ("linecache", "tokenize")  # they open .py files to show a line of a traceback

_WATCH_SWITCHES = (sys.setprofile, sys.settrace)
"""What would switch the copy detection off in this thread (a profile hook is per thread)."""


def _refusal(path: str, reason: str) -> str:
    if path in ("sys.setprofile", "sys.settrace", "threading.setprofile", "threading.settrace",
                "minidist.core.interposer.muted"):
        return (f"your function called {path}: it would switch off the check's watch for the "
                f"library's versions (a profile hook); a checked function leaves it alone")
    if path in ("threading.Thread.start", "_thread.start_new_thread"):
        return (f"your function started a thread ({path}): a checked function runs in the "
                f"check's thread{': ' + reason if reason else ''}")
    if path in FILES:
        return (f"your function called {path}: this exercise shares nothing through files, "
                f"pipes, sockets or the backend's own sends; what the ranks need travels by the "
                f"collectives it names"
                f"{': ' + reason if reason else ''}")
    if path in FORGING:
        return (f"your function called {path}: the events and collectives a check counts are "
                f"recorded by the library's own functions as they run (an attention block, the "
                f"collective layer), not noted by the function checked"
                f"{': ' + reason if reason else ''}")
    if path in PEEKING or path.startswith("socket.socket."):
        return (f"your function called {path}: a checked function works from its arguments and "
                f"what the collectives deliver, not from the check's frames, the live objects "
                f"the garbage collector lists, or a descriptor opened before the check"
                f"{': ' + reason if reason else ''}")
    if path == "minidist.communication.counting.uncounted":
        return (f"your function called {path}: it would hide its messages from the count; every "
                f"byte an exercise sends is sent where it is counted"
                f"{': ' + reason if reason else ''}")
    if path in FOREIGN_MEMORY:
        return (f"your function called {path}: it puts a tensor on memory torch's allocator did "
                f"not give, which the check's count of memory held cannot see; allocate tensors "
                f"with torch{': ' + reason if reason else ''}")
    if path in MODES:
        return (f"your function entered a torch mode ({path}): a mode sees every operation and "
                f"can record one computation's results to hand them back later; compute it "
                f"here{': ' + reason if reason else ''}")
    if path in PROCESS_STARTERS:
        return (f"your function started a process ({path}): a check runs your function in this "
                f"process, where the library's versions it is compared with are unavailable; "
                f"compute it here{': ' + reason if reason else ''}")
    return (f"your function called {path}: write your own; the library's version is what your "
            f"function is compared with{': ' + reason if reason else ''}")


def _refuse(path: str, reason: str, refused_builtins: dict[int, str],
            refused_code: dict[int, list[_Original]],
            refused_methods: dict[int, str]) -> Callable[[], None]:
    """Make the function at `path` refuse; returns what undoes it. Its code goes into
    `refused_code`, so a copy of it (a reloaded module, exec of its source) refuses too."""
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
        for compiled in _compiled_both_ways(innermost):
            refused_code.setdefault(len(compiled.co_code), []).append(
                _Original(path, compiled, innermost))
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
    """The Python function objects behind `value` (unwrapping methods, staticmethods,
    properties' getters and functools.wraps chains), [] for a C function."""
    functions = []
    value = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    while inspect.isfunction(value) and value not in functions:
        functions.append(value)
        value = getattr(value, "__wrapped__", None)
    return functions


def _refusing_code(code: types.CodeType, message: str) -> types.CodeType:
    """Code that raises LibraryVersionUsed(message), with as many free variables as `code` has
    (a function's code can only be swapped for code with the same number)."""
    return _refusing_code_at(code, code.co_filename, message)


@functools.lru_cache(maxsize=4096)  # keyed by the file too: equal code compares equal across files
def _refusing_code_at(code: types.CodeType, filename: str, message: str) -> types.CodeType:
    refused = _refusing_template(len(code.co_freevars))
    return refused.replace(co_name=code.co_name, co_qualname=code.co_qualname,
                           co_filename=filename, co_firstlineno=code.co_firstlineno,
                           co_consts=tuple(message if constant == _MESSAGE else constant
                                           for constant in refused.co_consts))


_MESSAGE = "\x00the refusal's message\x00"  # a placeholder, swapped for each refusal's own


@functools.cache  # one per number of free variables: a rank refuses hundreds of functions
def _refusing_template(free_variables: int) -> types.CodeType:
    free = [f"_free{i}" for i in range(free_variables)]
    source = ("def outer():\n" + "".join(f"    {name} = None\n" for name in free)
              + "    def refused(*args, **kwargs):\n"
              + (f"        ({', '.join(free)},)\n" if free else "")
              # __import__, a builtin, works in whichever module's globals the function runs
              + "        raise __import__('minidist.core.refusal', fromlist=['_'])"
              f".LibraryVersionUsed({_MESSAGE!r})\n"
              + "    return refused\n")
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # noqa: S102 - our own text: a refusal with a placeholder message
    return namespace["outer"]().__code__


_LOCAL_SLOTS = frozenset(("LOAD_FAST", "STORE_FAST", "DELETE_FAST", "LOAD_FAST_CHECK",
                          "LOAD_FAST_AND_CLEAR", "LOAD_DEREF", "STORE_DEREF", "DELETE_DEREF",
                          "LOAD_CLOSURE", "MAKE_CELL", "LOAD_CLASSDEREF"))


_FUTURE_ANNOTATIONS = __future__.annotations.compiler_flag


@functools.lru_cache(maxsize=4096)
def _compiled_both_ways(code: types.CodeType) -> tuple[types.CodeType, ...]:
    """`code`, and its source compiled with the other reading of annotations: a copy pasted
    into a notebook (or exec'd) without its module's `from __future__ import annotations`
    builds its annotations with other instructions, so its fingerprint differs. Only what it
    defines inside itself (a nested function, a class) evaluates annotations in its code: code
    with nothing nested is the same either way."""
    if not any(isinstance(constant, types.CodeType) for constant in code.co_consts):
        return (code,)
    other = code.co_flags & _FUTURE_ANNOTATIONS ^ _FUTURE_ANNOTATIONS
    try:
        try:
            module = compile(_source(code), code.co_filename, "exec", flags=other,
                             dont_inherit=True)
        except SyntaxError:  # a bracket closed on a line with no instruction of its own
            module = compile(textwrap.dedent(inspect.getsource(code)), code.co_filename, "exec",
                             flags=other, dont_inherit=True)
    except (OSError, TypeError, SyntaxError):  # no source to read: its own code only
        return (code,)
    again = [c for c in module.co_consts
             if isinstance(c, types.CodeType) and c.co_name == code.co_name]
    return (code, *again[:1])


def _source(code: types.CodeType) -> str:
    """The source of `code`'s function, dedented: its lines from the first (a decorator's) to
    the last any of its instructions, or those of the code nested in it, ends on. Read from
    linecache, as inspect.getsource does, without tokenizing the file to find the end (which
    is most of a refusal's cost in a rank that starts with nothing cached)."""
    lines = linecache.getlines(code.co_filename)
    ends, nested = [], [code]
    while nested:
        inner = nested.pop()
        ends += [end for _, end, _, _ in inner.co_positions() if end is not None]
        nested += [constant for constant in inner.co_consts if isinstance(constant, types.CodeType)]
    if not lines or not ends:
        raise OSError(f"no source for {code.co_name} in {code.co_filename}")
    return textwrap.dedent("".join(lines[code.co_firstlineno - 1:max(ends)]))


@functools.lru_cache(maxsize=4096)  # a check refuses the same functions again and again
def _fingerprint(code: types.CodeType) -> tuple:
    """What every copy of `code` keeps, however it and its locals are renamed and whatever its
    line numbers: its instructions, each with the constant, global or attribute name it uses
    (a local by its slot), nested functions' code by their own fingerprints."""
    instructions = []
    for instruction in dis.get_instructions(code):
        argument = instruction.argval
        if instruction.opname in _LOCAL_SLOTS:
            argument = instruction.arg
        elif isinstance(argument, types.CodeType):
            argument = _fingerprint(argument)
        elif instruction.opname == "LOAD_CONST":
            argument = repr(argument)  # a list or dict constant is not hashable
        instructions.append((instruction.opname, argument))
    return tuple(instructions)


class _Original(NamedTuple):
    """A refused function's code, as a copy of it may still show it. What a copy is compared on
    is worked out when a call's code is the same size, not when the block opens: a block refuses
    hundreds of functions, and a rank process starts with none of it cached."""

    path: str
    code: types.CodeType  # its code, or its source compiled with the other annotations
    innermost: types.CodeType  # the function's own code: its name, docstring, place, layout

    @property
    def fingerprint(self) -> tuple:
        return _fingerprint(self.code)

    @property
    def name(self) -> str:
        return _identity(self.innermost)[0]

    @property
    def docstring(self) -> str | None:
        return _identity(self.innermost)[1]

    @property
    def place(self) -> tuple[str, int]:  # its file and first line
        return _identity(self.innermost)[2]

    @property
    def layout(self) -> tuple[tuple[int | None, ...], ...]:
        return _identity(self.innermost)[3]

    @property
    def columns(self) -> tuple[tuple[int, int, int], ...]:  # `_columns`: what an edited copy keeps
        return _columns(self.innermost)


def _identity(code: types.CodeType) -> tuple[str, str | None, tuple[str, int],
                                             tuple[tuple[int | None, ...], ...]]:
    """The name, docstring, place and layout of `code`: a copy that kept one of them is the
    library's code; instructions alone are not enough, since short code written independently
    (an honest student's union of intervals) can be instruction for instruction the library's."""
    return _identity_at(code, code.co_filename)


@functools.lru_cache(maxsize=4096)  # keyed by the file too: equal code compares equal across files
def _identity_at(code: types.CodeType, filename: str) -> tuple[
        str, str | None, tuple[str, int], tuple[tuple[int | None, ...], ...]]:
    first = code.co_consts[0] if code.co_consts else None
    return (code.co_name, first if isinstance(first, str) and first else None,
            (filename, code.co_firstlineno), _layout(code))


def _layout(code: types.CodeType) -> tuple[tuple[int | None, ...], ...]:
    """Where each instruction of the body stands in its source: line (from the body's first),
    column, end line and end column. Code written anew puts its tokens elsewhere; a copy keeps
    them, however it was renamed (a cloned code object, a paste whose docstring was dropped or
    whose function was renamed on its `def` line)."""
    body = [position for position in code.co_positions()
            if position[0] is not None and position[0] > code.co_firstlineno]
    if not body:
        return ()
    first = min(line for line, *_ in body)
    return tuple((line - first, column, end - first, end_column)
                 for line, end, column, end_column in body)


@functools.lru_cache(maxsize=4096)
def _columns(code: types.CodeType) -> tuple[tuple[int, int, int], ...]:
    """Where each instruction of the body stands on its line: its first and last column (from
    the body's least indented) and how many lines it spans. A copy whose lines were edited,
    added or removed keeps nearly all of them in order; code written anew, even to the same
    instructions, puts its tokens elsewhere. Only code compiled from a string is compared
    (`_made_from_text`): a cell may hold scaffolding the lab shares with the library."""
    body = [position for position in code.co_positions()
            if position[0] is not None and position[0] > code.co_firstlineno
            and position[2] is not None and position[3] is not None]
    if not body:
        return ()
    base = min(column for _, _, column, _ in body)
    return tuple((column - base, end_column - base, end - line)
                 for line, end, column, end_column in body)


_RESEMBLING, _EDITED = 40, 0.7  # instructions, and how much of their columns a copy keeps


def _made_from_text(filename: str) -> bool:
    """Whether code from `filename` was compiled from a string at run time (exec, compile):
    neither a notebook cell's (IPython names each after the cell), nor a file's, nor the
    library's. A cell may hold scaffolding the lab shares with the library; a string built
    from the library's source is a copy."""
    return (_notebooks(filename) and not _CELL.search(filename)
            and not os.path.isfile(filename))


_CELL = re.compile(r"/ipykernel_\d+/\d+\.py$|^<ipython-input-")


@functools.lru_cache(maxsize=4096)  # difflib on columns: met again in block after block
def _resembles(called: types.CodeType, originals: tuple[_Original, ...]) -> str | None:
    """The path of the refused function `called` is an edited copy of (a line added, removed
    or changed, then compiled from the library's source): most of its columns, in order."""
    columns = _columns(called)
    if len(columns) < _RESEMBLING:
        return None
    matcher = difflib.SequenceMatcher(None, (), columns, autojunk=False)  # indexed once
    for original in originals:
        if not 0.75 * len(original.columns) <= len(columns) <= 1.33 * len(original.columns):
            continue
        matcher.set_seq1(original.columns)
        if (matcher.real_quick_ratio() >= _EDITED and matcher.quick_ratio() >= _EDITED
                and matcher.ratio() >= _EDITED):
            return original.path
    return None


# Instructions: code this short (`return self.module(*args)`) is the library's only when it comes
# from the library's file; code this long is not written anew instruction for instruction (the
# solutions' longest coincidence with the library is 10 instructions; an interval merge of 53
# written independently has been seen).
_SHORT, _ALONE = 16, 60


def _copied(called: types.CodeType, originals: list[_Original], length: int) -> str | None:
    """The path of the refused function `called` is a copy of, if it kept its identity: its
    place; or no line table (compiled source always has one: this code was made from another
    code object); or, unless it is short, its name, docstring or layout; or, if it is long,
    nothing more: its instructions are enough."""
    name, docstring, place, layout = _identity(called)
    forged = all(line is None for line, *_ in called.co_positions())
    for original in originals:
        if (place == original.place or forged or length >= _ALONE
                or length >= _SHORT and (name == original.name or docstring is not None
                                         and docstring == original.docstring
                                         or layout and layout == original.layout)):
            return original.path
    return None


@contextlib.contextmanager
def _refusing_copies(builtins: dict[int, str], code: dict[int, list[_Original]],
                     methods: dict[int, str], reason: str) -> Iterator[None]:
    """While the block runs, a call of a refused C function, or of any Python function whose
    code is a copy of a refused one's (`_fingerprint`: a module reloaded or loaded again from
    its file, its source exec'd, the function copied under another name), raises, from any
    caller, in this thread and in threads it starts."""
    seen: dict[int, tuple[types.CodeType, str | None]] = {}  # id(code) -> (code, refused path)
    every = tuple(original for originals in code.values() for original in originals)

    def refused_copy(called: types.CodeType) -> str | None:  # once per code object
        path = None
        sized = code.get(len(called.co_code))
        if sized:  # most code is no refused code's size: no disassembly needed
            # nor for code whose opcodes differ (an equal fingerprint has the same opcodes)
            opcodes = called.co_code[::2]
            sized = [original for original in sized if original.code.co_code[::2] == opcodes]
        if sized:
            fingerprint = _fingerprint(called)
            originals = [original for original in sized if original.fingerprint == fingerprint]
            path = originals and _copied(called, originals, len(fingerprint))
        if not path and _made_from_text(called.co_filename):
            path = _resembles(called, every)
        seen[id(called)] = (called, path or None)
        return path or None

    # The hook runs at every call in the block: identity tests and dict lookups only.
    set_profile, set_trace = _THREAD_SWITCHES
    switches = {id(switch): f"sys.{switch.__name__}" for switch in _WATCH_SWITCHES}
    method_names = {path.rpartition(".")[2] for path in methods.values()}
    peeking_builtins, peeking_code = _peeking()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            called = frame.f_code
            found = seen.get(id(called))
            if found is not None and found[0] is called:
                refused = found[1]
            else:
                refused = refused_copy(called)
            if (called is set_profile or called is set_trace) and not _ours(frame.f_back):
                refused = f"threading.{called.co_name}"
            elif called is _MUTING and frame.f_locals.get("layer") != "counting":
                refused = "minidist.core.interposer.muted"  # the check's own watching layers
            elif refused is None and id(called) in peeking_code and _notebooks_call(frame.f_back):
                refused = peeking_code[id(called)]
        elif event == "c_call":
            key = id(arg)
            refused = builtins.get(key)
            if refused is None:
                if key in switches:
                    refused = None if _ours(frame) else switches[key]
                elif method_names and getattr(arg, "__name__", None) in method_names:
                    refused = _refused_method(arg, methods)
            elif refused in FILES and (frame.f_globals.get("__name__") in _SOURCE_READERS
                                       or _ours(frame)):  # a nested block reading /proc
                refused = None
            if refused is None:  # lookups first: the caller's file only for what peeks
                peeked = peeking_builtins.get(key)
                if peeked is None and isinstance(getattr(arg, "__self__", None), _SOCKET):
                    peeked = f"socket.socket.{arg.__name__}"
                if peeked is not None and _notebooks_call(frame):
                    refused = peeked
        else:
            return
        if refused is not None:
            raised.append(refused)  # Python unsets a profile hook that raises
            raise LibraryVersionUsed(_refusal(refused, reason))

    raised: list[str] = []
    previous, previous_threads = sys.getprofile(), threading.getprofile()
    loader = _torch_loader(watched=any(path in FILES for path in builtins.values()))
    _HOOKS.add(profile)
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        with loader:
            yield
        if sys.getprofile() is not profile and not raised:  # switched off, unseen by the hook
            raise LibraryVersionUsed(_refusal("sys.setprofile", reason))
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)
        _HOOKS.discard(profile)


_HOOKS: set[Callable[..., None]] = set()  # the open blocks' hooks: a block inside one finds it


_TORCH_LOAD = torch.serialization.load
_LOAD_PARAMETERS = inspect.signature(_TORCH_LOAD)
_TORCH_PACKAGES = len(torch.serialization._package_registry)  # where storages go: cpu, cuda, ...


@functools.wraps(_TORCH_LOAD)
def _unwatched_load(*args: Any, **kwargs: Any) -> Any:
    """torch.load inside a block that does not refuse files: with the hook off when it can run
    only torch's code (see `_torch_loader`)."""
    try:
        given = _LOAD_PARAMETERS.bind(*args, **kwargs).arguments
    except TypeError:  # torch says what is wrong
        return _TORCH_LOAD(*args, **kwargs)
    only_torch = (isinstance(given.get("f"), (str, os.PathLike))
                  and given.get("pickle_module") is None
                  and not callable(given.get("map_location"))
                  and (given.get("weights_only") is True
                       or given.get("weights_only") is None
                       and "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in os.environ)
                  and all(map(_torchs_own, torch.serialization.get_safe_globals()))
                  and len(torch.serialization._package_registry) == _TORCH_PACKAGES)
    if not only_torch:
        return _TORCH_LOAD(*args, **kwargs)
    hook = sys.getprofile()
    sys.setprofile(None)
    try:
        return _TORCH_LOAD(*args, **kwargs)
    finally:
        sys.setprofile(hook)


@contextlib.contextmanager
def _torch_loader(watched: bool) -> Iterator[None]:
    """torch.load while the block runs: watched, as any call is, where the block refuses files
    (the loader opens one); elsewhere `_unwatched_load`, which turns the hook off when the load
    can run only torch's code: from a path, tensors only (weights_only, and no class of the
    caller's allowed in), no callable map_location, no storage location of the caller's
    registered. Its unpickler is Python, every opcode a call the hook would see: a rank's
    restore from a checkpoint of 200 tensors took four times as long watched. Set by each block
    and put back as it ends, since only the innermost block's hook watches; left alone when
    torch.load is someone else's."""
    before = torch.load, torch.serialization.load
    if not all(load in (_TORCH_LOAD, _unwatched_load) for load in before):
        yield
        return
    torch.load = torch.serialization.load = _TORCH_LOAD if watched else _unwatched_load
    try:
        yield
    finally:
        torch.load, torch.serialization.load = before


def _torchs_own(allowed: Any) -> bool:
    """Whether a class or function torch.load may build (a safe global) is torch's own, as its
    module holds it: torch registers a few; one of the caller's would run its code in the load."""
    allowed = allowed[0] if isinstance(allowed, tuple) else allowed  # (class, name it goes by)
    module = sys.modules.get(getattr(allowed, "__module__", None) or "")
    return (module is not None and module.__name__.partition(".")[0] == "torch"
            and getattr(module, getattr(allowed, "__name__", ""), None) is allowed)


@functools.cache  # the same functions in every block: looked up once
def _peeking() -> tuple[dict[int, str], dict[int, str]]:
    """{id of a C function: its path}, {id of a Python function's code: its path} of PEEKING
    and FORGING (the code objects live as long as their modules, so their ids stay theirs)."""
    builtins, code = {}, {}
    for path in PEEKING + FORGING:
        owner, attribute = _owner(path)
        value = getattr(owner, attribute)
        if isinstance(value, types.FunctionType):
            code[id(value.__code__)] = path
        else:
            builtins[id(value)] = path
    return builtins, code


_SOCKET = socket.socket  # the class, kept: FILES refuses the name while a block runs


def _notebooks_call(caller: Any) -> bool:
    """Whether `caller` (a frame) runs the notebook's own code."""
    return caller is not None and _notebooks(caller.f_code.co_filename)


_THREAD_SWITCHES = (threading.setprofile.__code__, threading.settrace.__code__)
_MUTING = interposer.muted.__wrapped__.__code__
"""Muting a layer of the interposer: the library's scaffolding mutes traffic counting alone;
muting a check's recording, tampering or messages would blind it."""


def _ours(frame: Any) -> bool:
    """Whether `frame` runs this module's code (its own switching of the hook)."""
    return frame is not None and frame.f_code.co_filename == __file__


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
    split = _module_prefix(path)
    if split is None:
        raise ModuleNotFoundError(f"{path}: no module to import in it")
    module = ".".join(parts[:split])
    owner = sys.modules.get(module) or importlib.import_module(module)  # loaded: no importlib
    for name in parts[split:-1]:
        owner = getattr(owner, name)
    if not hasattr(owner, parts[-1]):
        raise AttributeError(f"{path}: {owner!r} has no attribute {parts[-1]!r}")
    return owner, parts[-1]


@functools.lru_cache(maxsize=4096)  # each failed import of a longer prefix searches the disk
def _module_prefix(path: str) -> int | None:
    """How many of `path`'s dotted names the longest prefix that imports as a module has."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        return split
    return None
