"""Process supervision for `minidist.core.launch.run` in a notebook or a plain script: start the
ranks, forward their output, collect their results or failures, and kill them at the end.

Nothing here is course material: `minidist.core.launch` is what a rank is and what `run` does.
This module only reports what happened (`RanksFailed`, `RanksStuck`, or the results);
`minidist.core.launch` turns that into the errors a student reads.

Why one module of about 750 lines: starting, watching and reaping the ranks share one process table,
its pipes and its clock; split, each part would need the others' state."""

from __future__ import annotations

import collections
import contextlib
import datetime
import faulthandler
import functools
import multiprocessing
import multiprocessing.connection
import os
import pkgutil
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

import minidist
from minidist.core import _calls, agreement
from minidist.core._calls import LatestCall
from minidist.core._diagnose import conflicts, rank_list

_FAILURE_GRACE_S = 0.5  # after the first failure, how long to collect the others before killing
_STACK_DUMP_WAIT_S = 0.5  # how long stuck ranks get to print their stacks after SIGUSR1
_EXIT_WAIT_S = 5.0  # how long finished ranks get to leave their process group and exit
_TICK_S = 0.5  # how often the caller looks at the ranks' latest calls while it waits
_LIVE_AFTER_S = 5.0  # no progress this long: a line in the cell says who waits in what
_MISMATCH_AFTER_S = 2.0  # no progress this long with mismatched collectives: stop the ranks
_STDERR_TAIL = 12  # a failed rank's last stderr lines that its report shows


@dataclass(order=True)
class Failure:
    """One rank's failure, as the rank reported it (or as its exit showed it)."""

    peer_error: bool  # broke because another rank went away, not on its own
    when: float
    rank: int
    description: str = field(compare=False)
    # The rank's own frames (source lines left for the caller to look up: only the caller's
    # linecache holds notebook cells) and its exception, formatted.
    frames: list[traceback.FrameSummary] = field(compare=False, default_factory=list)
    exception: str = field(compare=False, default="")
    # A rank that died by a signal: its last stderr lines, and whether its Python stack
    # (`frames`) could be read from the dump faulthandler printed.
    stderr_tail: list[str] = field(compare=False, default_factory=list)
    signal_name: str = field(compare=False, default="")


class RanksFailed(Exception):
    """Ranks failed; `.failures` lists every failure seen before they were all killed, earliest
    own failure first; `.running` the ranks that were still running then; `.calls` each
    rank's latest collective or point-to-point call (None before its first)."""

    def __init__(self, failures: list[Failure], running: list[int],
                 calls: dict[int, LatestCall | None]):
        super().__init__(f"{len(failures)} rank(s) failed")
        self.failures = failures
        self.running = running
        self.calls = calls


class RanksStuck(Exception):
    """Ranks did not finish. `.stuck` maps each to its stack, innermost frame last, as
    (filename, line number, function) without the launcher's frames; `.finished` lists the
    ranks that did finish; `.calls` each rank's latest call. `.mismatch_after` is None when
    the time ran out, else the seconds without progress after which ranks waiting in
    mismatched collectives were stopped early."""

    def __init__(self, stuck: dict[int, list[tuple[str, int, str]]], finished: list[int],
                 calls: dict[int, LatestCall | None], mismatch_after: float | None = None):
        super().__init__(f"rank(s) {sorted(stuck)} did not finish")
        self.stuck = stuck
        self.finished = finished
        self.calls = calls
        self.mismatch_after = mismatch_after


def quiet_profiler() -> None:
    """Keep Kineto (torch.profiler's engine) from printing a "USDT: ... profiler_start" line on
    stderr for every profile it starts and stops: into a rank's output, or into a notebook
    cell, where nbgrader scores a test cell that wrote to stderr 0. Level 6 is the first above
    those lines; Kineto reads it when the process's first profile starts, so call this before."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def _fork_server() -> multiprocessing.context.ForkServerContext:
    """A process that imported torch once and forks ranks on demand; started on first use.

    It also imports torch._dynamo, which torch.optim's optimizers import on first use: a few
    seconds of CPU that every rank building an optimizer would otherwise pay again. So does
    torch.distributed.optim, which compiles TorchScript when imported (a check that refuses
    torch's ZeroRedundancyOptimizer imports it in every rank), and minidist's modules, which a
    rank imports as it unpickles its function (a tenth of a second, in each of Lab 14's many
    ranks). Not the pictures, which the notebook draws, nor minidist.core.checking (checks
    import it in the rank): with it preloaded, launches waited 5 s for their ranks more often.
    Such a wait happens without it too: a rank's `TCPStore` client, connected, gets the reply
    to its ping 5 s late (seen with torch alone, in about one 4-rank launch in ten).
    It exits once the process that started it and all ranks are gone.
    """
    _stop_servers_with_the_kernel()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed",
                                    "torch.distributed.optim", "cloudpickle", __name__,
                                    *_library_modules(), "minidist.core._fork_server_ready"])
    return context


@functools.cache  # once per kernel
def _stop_servers_with_the_kernel() -> None:
    """In a Jupyter kernel, stop the fork server and multiprocessing's resource tracker when
    the kernel shuts down or restarts, before ipykernel ends its children: the tracker ignores
    SIGTERM and lives as long as the kernel does, so ipykernel would wait on it until the
    client gave up and killed the kernel, 2.5 s at every shutdown and restart."""
    if _in_notebook():
        from IPython import get_ipython

        get_ipython().observe(_stop_servers, names="exit_now")  # set as shutdown begins


def _stop_servers(change: dict) -> None:
    if not change["new"]:
        return
    from multiprocessing import forkserver, resource_tracker

    # Private, but stable since Python 3.8 (CPython's own tests stop both this way). The
    # server leaves at once; the tracker once every copy of its pipe is closed, the ranks'
    # too, so it is waited for on a thread of its own.
    with contextlib.suppress(AttributeError, OSError):
        forkserver._forkserver._stop()
    with contextlib.suppress(AttributeError):
        threading.Thread(target=resource_tracker._resource_tracker._stop, daemon=True).start()


@functools.cache  # a walk of the package's folders: once, not for every rank started
def _library_modules() -> tuple[str, ...]:
    return tuple(module.name for module in pkgutil.walk_packages(minidist.__path__, "minidist.")
                 if not module.name.startswith(("minidist.pictures", "minidist.core.checking",
                                                "minidist.core._fork_server_ready")))


@contextlib.contextmanager
def _main_module_hidden():
    """Stop multiprocessing from re-running the caller's script in each rank.

    It does so to find functions defined there, which is why scripts normally need an
    `if __name__ == "__main__":` guard; cloudpickle already ships such functions by value.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _rendezvous_store() -> dist.TCPStore:
    """The launch's rendezvous point, on a port the OS picks (runs in a row or at the same time
    never collide), listening on IPv4 only.

    Why not torch's own listener: it is dual-stack IPv6, so each rank it accepts has the address
    ::ffff:127.0.0.1, which no hosts file names. torch asks DNS for that name as it accepts (for
    its logs), and about one query in a hundred waits 5 s for an answer that never comes: a
    launch stalled 5 s in about one in ten. An IPv4 peer, 127.0.0.1, is named by /etc/hosts."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(socket.SOMAXCONN)
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         master_listen_fd=listener.detach())  # the store closes it


@dataclass
class _RankSpec:
    """What a rank process needs to start; pickled across the fork server."""

    rank: int
    world_size: int
    backend: str
    store_port: int
    timeout: float
    payload: bytes  # cloudpickle of (fn, args, kwargs)
    sys_path: list[str]
    cwd: str
    calls_path: str  # where the rank records its latest call (minidist.core._calls)
    check_calls: bool  # compare each collective across its group (minidist.core.agreement)
    # The caller's environment now: the fork server's is the one it had when it started, so a
    # variable set since (TORCH_DISTRIBUTED_DEBUG=DETAIL in a notebook) would not reach the ranks.
    environ: dict[str, str]


@dataclass
class _RankProcess:
    """The parent's handle on one rank: its process, pipes and what it reported."""

    rank: int
    process: multiprocessing.process.BaseProcess
    stdout: multiprocessing.connection.Connection
    stderr: multiprocessing.connection.Connection
    control: multiprocessing.connection.Connection
    lifeline: multiprocessing.connection.Connection  # closing it kills the rank
    partial_lines: dict[int, bytes] = field(default_factory=dict)
    captured_stderr: list[str] | None = None  # set while collecting a stack dump
    fatal_dump: list[str] | None = None  # what faulthandler printed as the rank died
    stderr_tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=_STDERR_TAIL))
    result: bytes | None = None
    reported_error: bool = False
    finished: bool = False


def _death(rank: _RankProcess) -> Failure:
    """The failure of a rank that exited without a result or a report of its own."""
    code = rank.process.exitcode
    if code is not None and code < 0:
        # A native crash: faulthandler printed the Python stack into stderr as it died.
        name = signal.Signals(-code).name
        frames = [traceback.FrameSummary(*frame, lookup_line=False)
                  for frame in _dumped_frames(rank.fatal_dump or [])]
        return Failure(False, time.time(), rank.rank,
                       f"the process was killed by {name} before returning", frames,
                       stderr_tail=list(rank.stderr_tail), signal_name=name)
    return Failure(False, time.time(), rank.rank,
                   f"the process exited with code {code} before returning",
                   stderr_tail=list(rank.stderr_tail))


def _waiting_line(waiting: dict[int, LatestCall], running: list[int], idle: float) -> str:
    """The live line while nothing moves: which ranks wait in which call, which still run."""
    by_op: dict[str, list[int]] = {}
    for rank, call in waiting.items():
        by_op.setdefault(call.op, []).append(rank)
    where = "; ".join(f"{rank_list(ranks)} in {op}" for op, ranks in by_op.items())
    others = sorted(set(running) - set(waiting))
    if others:
        where += f"; {rank_list(others)} running"
    seconds = int(idle // _LIVE_AFTER_S * _LIVE_AFTER_S)  # redrawn every few seconds
    return f"still waiting after {seconds} s: {where}"


def _start(spec: _RankSpec) -> _RankProcess:
    """Fork one rank from the fork server, with its pipes: stdout, stderr, control, lifeline."""
    context = _fork_server()
    stdout_r, stdout_w = context.Pipe(duplex=False)
    stderr_r, stderr_w = context.Pipe(duplex=False)
    control, child_control = context.Pipe()
    child_lifeline, lifeline = context.Pipe(duplex=False)
    process = context.Process(target=_rank_main,
                              args=(spec, stdout_w, stderr_w, child_control, child_lifeline),
                              name=f"minidist-rank{spec.rank}", daemon=True)
    with _main_module_hidden():
        process.start()
    for child_end in (stdout_w, stderr_w, child_control, child_lifeline):
        child_end.close()
    return _RankProcess(spec.rank, process, stdout_r, stderr_r, control, lifeline)


def _pickles(value: Any) -> Exception | None:
    try:
        cloudpickle.dumps(value)
    except Exception as error:  # noqa: BLE001 (any failure is the answer)
        return error
    return None


def _code_names(fn: Any) -> set[str]:
    """The global names `fn`'s code refers to (nested functions, lambdas and comprehensions
    included), and those of the methods of classes it refers to that live in its module."""
    names, seen, todo = set(), set(), [fn]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, type):
            todo += [v for v in vars(item).values() if isinstance(v, (types.FunctionType,
                                                                      staticmethod, classmethod))]
            continue
        item = getattr(item, "__func__", item)
        codes = [getattr(item, "__code__", None)]
        while codes:
            code = codes.pop()
            if code is None:
                continue
            names.update(code.co_names)
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        scope = getattr(item, "__globals__", {})
        todo += [scope[n] for n in list(names)
                 if isinstance(scope.get(n), (type, types.FunctionType))
                 and getattr(scope[n], "__module__", None) == getattr(fn, "__module__", None)]
    return names


def _unpicklable(fn: Any, args: tuple, kwargs: dict, error: Exception) -> str:
    """Why `run` cannot send `fn` and its arguments: the argument, or the global `fn` refers
    to, that cannot be pickled, and the way round it."""
    name = getattr(fn, "__name__", repr(fn))
    for where, value in [*((f"argument {k + 1} ({type(v).__name__})", v)
                           for k, v in enumerate(args)),
                         *((f"argument {k}= ({type(v).__name__})", v) for k, v in kwargs.items())]:
        if (failed := _pickles(value)) is not None:
            return (f"cannot send {name!r}'s {where} to the ranks: {failed}. Pass plain data "
                    f"(tensors, numbers, lists, dataclasses of them) as arguments.")
    module = getattr(fn, "__module__", "?")
    scope = getattr(fn, "__globals__", {})
    names = _code_names(fn)
    culprits = []
    for global_name in sorted(names & scope.keys()):
        value = scope[global_name]
        if isinstance(value, types.ModuleType):
            # cloudpickle sends along a module's submodules whose names the code uses
            # (`dist.config` is torch.distributed.config whenever the code says `.config`)
            for attr in sorted(names):
                sub = sys.modules.get(f"{value.__name__}.{attr}")
                if sub is not None and (failed := _pickles(sub)) is not None:
                    culprits.append(f"the module {sub.__name__} ({failed}), which cloudpickle "
                                    f"sends because the code uses the global {global_name!r} "
                                    f"({value.__name__}) and the name {attr!r}")
        elif getattr(value, "__module__", None) == module and isinstance(
                value, (type, types.FunctionType)):
            continue  # sent by value too: its own globals are searched above
        elif (failed := _pickles(value)) is not None:
            culprits.append(f"the global {global_name!r} ({type(value).__name__}: {failed})")
    found = "; ".join(culprits) if culprits else str(error)
    script = Path(getattr(sys.modules.get("__main__"), "__file__", None) or "my_module").stem
    fix = (f"define it in a module the ranks can import and call it from there (a script run "
           f"as `python {script}.py` can end with `if __name__ == \"__main__\": from {script} "
           f"import main; main()`: `run` then gets {script}.{name}, sent by name)"
           if module == "__main__" else "pass what it needs as arguments instead")
    return (f"cannot send {name!r} to the ranks: {found}. {name!r} is defined in {module}, so "
            f"cloudpickle sends it by value with the globals its code refers to; {fix}.")


class Supervisor:
    """Starts the ranks, watches them (results, failures, progress), kills them at the end.

    Why one unit of about 190 lines: its one loop and what it does on each kind of event belong
    together; a rank's output is forwarded by the functions below it, its start by `_start`."""

    def __init__(self, fn, world_size, args, kwargs, backend, timeout, check_calls):
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as error:
            raise ValueError(_unpicklable(fn, args, kwargs, error)) from error
        self.world_size = world_size
        self.timeout = timeout
        # torch's own check (TORCH_DISTRIBUTED_DEBUG=DETAIL) names mismatched collectives in
        # an error of its own: wait for that rather than stop the ranks first.
        self.stop_mismatches = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() != "DETAIL"
        self.live = _LiveLine()
        self.store = _rendezvous_store()
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        handle, self.calls_path = tempfile.mkstemp(prefix="minidist-calls-", dir=shm)
        os.close(handle)
        self.slots, self.ranks = None, []
        try:  # a start refused (inside a check) or interrupted leaves no file and no rank behind
            self.slots = _calls.create(self.calls_path, world_size)
            for rank in range(world_size):
                self.ranks.append(_start(_RankSpec(
                    rank, world_size, backend, self.store.port, timeout, payload, list(sys.path),
                    os.getcwd(), self.calls_path, check_calls, dict(os.environ))))
        except BaseException:
            self._release()
            raise

    def run(self) -> list[Any]:
        try:
            self._wait_for_results()
            for rank in self.ranks:
                rank.control.send("release")
            self._wait_for_exit()
            return [cloudpickle.loads(rank.result) for rank in self.ranks]
        finally:
            self._release()

    def _release(self) -> None:
        """Stop the ranks and free what the launch holds: its calls file, its store."""
        self.live.clear()
        self._kill_all()
        if self.slots is not None:
            self.slots.close()
        with contextlib.suppress(OSError):
            os.unlink(self.calls_path)
        del self.store

    def calls(self) -> dict[int, LatestCall | None]:
        """Each rank's latest recorded call."""
        return {rank: _calls.read(self.slots, rank) for rank in range(self.world_size)}

    # The parent's only loop: everything it waits on (pipes, process exits) goes through one
    # `wait`, in the caller's thread, so output lands in the notebook cell that called `run`.
    def _poll(self, timeout: float) -> list[Failure]:
        sources = {}
        for rank in self.ranks:
            for pipe in (rank.stdout, rank.stderr, rank.control):
                if not pipe.closed:
                    sources[pipe] = rank
            if not rank.finished:
                sources[rank.process.sentinel] = rank
        failures = []
        ready = multiprocessing.connection.wait(list(sources), max(timeout, 0))
        for source in ready:
            rank = sources[source]
            if source is rank.control:
                failures += self._on_control(rank)
            elif source in (rank.stdout, rank.stderr):
                _forward_output(rank, source, self.live)
            elif not rank.finished:
                failures += self._on_exit(rank)
        if ready:
            self.last_progress = time.monotonic()
        return failures

    def _wait_for_results(self) -> None:
        start = self.last_progress = time.monotonic()
        deadline = start + self.timeout
        failures: list[Failure] = []
        seqs: dict[int, int] = {}
        while any(rank.result is None for rank in self.ranks):
            remaining = deadline - time.monotonic()
            if failures:
                # Keep listening briefly: the rank that failed first may report a moment later
                # than the peers whose connections broke because of it.
                grace_left = min(f.when for f in failures) + _FAILURE_GRACE_S - time.time()
                if grace_left <= 0:
                    raise self._failure_error(failures)
                remaining = min(remaining, grace_left)
            elif remaining <= 0:
                raise self._timeout_error()
            failures += self._poll(min(remaining, _TICK_S))
            if not failures:
                self._watch(seqs)

    def _watch(self, seqs: dict[int, int]) -> None:
        """Between polls: note progress (a rank made a new call), stop ranks stuck in
        mismatched collectives, and keep a line in the cell while nothing moves."""
        calls = self.calls()
        now = time.monotonic()
        current = {rank: call.seq for rank, call in calls.items() if call is not None}
        if current != seqs:
            seqs.clear()
            seqs.update(current)
            self.last_progress = now
        idle = now - self.last_progress
        running = [rank.rank for rank in self.ranks if rank.result is None]
        waiting = {rank: calls[rank] for rank in running
                   if calls[rank] is not None and calls[rank].waiting}
        if (self.stop_mismatches and idle >= _MISMATCH_AFTER_S
                and conflicts(list(waiting.values()))):
            raise self._timeout_error(mismatch_after=idle)
        if idle >= _LIVE_AFTER_S and waiting:
            self.live.show(_waiting_line(waiting, running, idle))
        else:
            self.live.clear()

    def _wait_for_exit(self) -> None:
        deadline = time.monotonic() + _EXIT_WAIT_S
        while any(not rank.finished for rank in self.ranks) and time.monotonic() < deadline:
            self._poll(deadline - time.monotonic())
        for rank in self.ranks:
            _drain_output(rank, self.live)

    def _on_control(self, rank: _RankProcess) -> list[Failure]:
        try:
            message = rank.control.recv()
        except (EOFError, OSError):
            rank.control.close()
            return []
        if message[0] == "result":
            rank.result = message[1]
            return []
        _, when, peer_error, description, frames, exception_text = message
        rank.reported_error = True
        return [Failure(peer_error, when, rank.rank, description, frames, exception_text,
                        list(rank.stderr_tail))]

    def _on_exit(self, rank: _RankProcess) -> list[Failure]:
        rank.finished = True
        # Read what the rank said before it died: its error report may still be in the pipe.
        _drain_output(rank, self.live)
        unread = not rank.control.closed and rank.control.poll(0)
        failures = self._on_control(rank) if unread else []
        if rank.result is not None or rank.reported_error:
            return failures
        return [_death(rank)]

    def _failure_error(self, failures: list[Failure]) -> RanksFailed:
        failed = {failure.rank for failure in failures}
        running = [rank.rank for rank in self.ranks
                   if rank.result is None and rank.rank not in failed]
        calls = self.calls()
        self._kill_all()
        return RanksFailed(sorted(failures), running, calls)

    def _timeout_error(self, mismatch_after: float | None = None) -> RanksStuck:
        self.live.clear()
        stuck = [rank for rank in self.ranks if rank.result is None]
        for rank in stuck:
            rank.captured_stderr = []
            _signal(rank.process.pid, signal.SIGUSR1)  # faulthandler prints the rank's stack
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        while time.monotonic() < deadline:
            self._poll(deadline - time.monotonic())
        calls = self.calls()
        self._kill_all()
        return RanksStuck({rank.rank: _dumped_frames(rank.captured_stderr or [])
                           for rank in stuck},
                          [rank.rank for rank in self.ranks if rank.result is not None],
                          calls, mismatch_after)

    def _kill_all(self) -> None:
        for rank in self.ranks:
            if rank.process.exitcode is None and rank.process.pid is not None:
                _signal(rank.process.pid, signal.SIGKILL, whole_group=True)
        for rank in self.ranks:
            rank.process.join(timeout=_EXIT_WAIT_S)
            rank.finished = True
            for pipe in (rank.stdout, rank.stderr):
                if not pipe.closed:
                    _drain_output(rank, self.live)
            for pipe in (rank.stdout, rank.stderr, rank.control, rank.lifeline):
                pipe.close()


# --- A rank's output: forwarded line by line, its stderr's tail kept for the report -------------


def _forward_output(rank: _RankProcess, pipe, live: _LiveLine) -> None:
    try:
        data = os.read(pipe.fileno(), 1 << 16)
    except OSError:
        data = b""
    if not data:
        rest = rank.partial_lines.pop(pipe.fileno(), b"")
        if rest:
            _emit(rank, pipe, [rest], live)
        pipe.close()
        return
    *lines, rank.partial_lines[pipe.fileno()] = (
        rank.partial_lines.get(pipe.fileno(), b"") + data
    ).split(b"\n")
    _emit(rank, pipe, lines, live)


# What torch's store client prints when that lookup fails (both tries lost): harmless, and in a
# notebook cell any stderr line would fail the cell for nbgrader.
_LOOKUP_WARNING = "[c10d] The hostname of the client socket cannot be retrieved"


def _emit(rank: _RankProcess, pipe, lines: list[bytes], live: _LiveLine) -> None:
    text = [line.decode(errors="replace") for line in lines]
    if pipe is rank.stderr:
        text = [line for line in text if _LOOKUP_WARNING not in line]
        if rank.captured_stderr is not None:
            rank.captured_stderr += text
            return
        for number, line in enumerate(text):
            if rank.fatal_dump is None and line.startswith("Fatal Python error:"):
                rank.fatal_dump = []
            if rank.fatal_dump is not None:  # the report shows it, with cells named
                rank.fatal_dump += text[number:]
                text = text[:number]
                break
        rank.stderr_tail.extend(text)
    if not text:
        return
    live.clear()
    stream = sys.stderr if pipe is rank.stderr else sys.stdout
    stream.write("".join(f"[rank{rank.rank}] {line}\n" for line in text))
    stream.flush()


def _drain_output(rank: _RankProcess, live: _LiveLine) -> None:
    for pipe in (rank.stdout, rank.stderr):
        while not pipe.closed and pipe.poll(0):
            _forward_output(rank, pipe, live)


class _LiveLine:
    """One line in the cell (or terminal) that is rewritten in place, then removed: in a
    notebook a display that is updated, elsewhere a line on stderr redrawn after a carriage
    return."""

    def __init__(self):
        self.handle = None
        self.shown = ""

    def show(self, text: str) -> None:
        if text == self.shown:
            return
        if _in_notebook():
            from IPython.display import display

            if self.handle is None:
                self.handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self.handle.update({"text/plain": text}, raw=True)
        else:
            sys.stderr.write("\r" + text.ljust(len(self.shown)))
            sys.stderr.flush()
        self.shown = text

    def clear(self) -> None:
        if not self.shown:
            return
        if self.handle is not None:
            self.handle.update({"text/plain": ""}, raw=True)
        else:
            sys.stderr.write("\r" + " " * len(self.shown) + "\r")
            sys.stderr.flush()
        self.shown = ""


def _in_notebook() -> bool:
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


def _signal(pid: int, signum: int, whole_group: bool = False) -> None:
    try:
        if whole_group:
            os.killpg(pid, signum)  # each rank leads its own process group
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _dumped_frames(dump: list[str]) -> list[tuple[str, int, str]]:
    """The rank's main thread in faulthandler's dump (innermost frame first), as (filename,
    line, function), outermost first, without the launcher's frames.

    The dump holds one block per thread; the one running the user's function is the block
    that passes through `_rank_main` (a crash in a C++ thread, as gloo's aborts are, makes
    that thread "current" and leaves it without Python frames)."""
    blocks: list[list[str]] = [[]]
    for line in dump:
        if re.match(r"(Current thread|Thread) 0x", line):
            blocks.append([])
        blocks[-1].append(line)
    main = next((block for block in blocks if any("in _rank_main" in line for line in block)),
                blocks[-1])
    frames = []
    for line in main:
        frame = re.match(r'\s*File "(.+)", line (\d+) in (.+)', line)
        if frame:
            filename, lineno, function = frame.groups()
            if function == "_rank_main" and filename.endswith("minidist/core/_supervisor.py"):
                break  # it and what called it are the launcher's
            if "/multiprocessing/" in filename or (filename, function) == ("<string>", "<module>"):
                continue  # the fork server's own frames, when the rank died outside _rank_main
            frames.append((filename, int(lineno), function))
    return frames[::-1]


# --- Inside a rank process ---------------------------------------------------------------------


def _die_with_caller(lifeline: multiprocessing.connection.Connection) -> None:
    """Kill this rank, and anything it started, once the caller's end of `lifeline` closes.

    The caller never writes to it; its end closes when the caller exits, however it exits
    (even SIGKILL), so no rank outlives the notebook kernel that started it.
    """
    try:
        lifeline.recv_bytes()
    except EOFError:
        pass
    os.killpg(0, signal.SIGKILL)


def _is_peer_error(error: BaseException) -> bool:
    """True for errors that mean "another rank went away", not a bug on this rank."""
    text = str(error).lower()
    phrases = ("connection closed by peer", "connection reset", "broken pipe")
    return isinstance(error, dist.DistError) or any(phrase in text for phrase in phrases)


def _rank_main(spec: _RankSpec, stdout_w, stderr_w, control, lifeline) -> None:
    os.setsid()  # own process group, so the parent can kill anything this rank starts
    threading.Thread(target=_die_with_caller, args=(lifeline,), daemon=True).start()
    os.dup2(stdout_w.fileno(), 1)
    os.dup2(stderr_w.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)
    sys.path[:] = spec.sys_path
    os.chdir(spec.cwd)
    os.environ.clear()
    os.environ.update(spec.environ)
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec.store_port),
        OMP_NUM_THREADS="1",
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform.startswith("linux") else "lo0")
    # A store client asks DNS for the name of the address it connects to (torch formats it for
    # its logs; ::ffff:127.0.0.1 is in no hosts file). glibc waits 5 s for an answer lost on
    # the way; one second, asked twice, is plenty on loopback. Read at the rank's first lookup.
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")
    quiet_profiler()
    # glibc reports heap corruption on the terminal unless told to use stderr, where the
    # caller reads it.
    os.environ.setdefault("LIBC_FATAL_STDERR_", "1")
    torch.set_num_threads(1)
    # Before the payload is unpickled: modules it imports (minidist.communication.comm) may keep
    # references to the torch.distributed functions they call.
    _calls.install(spec.calls_path, spec.rank)
    try:
        fn, args, kwargs = cloudpickle.loads(spec.payload)
        if spec.backend == "nccl":
            torch.cuda.set_device(spec.rank)
        store = dist.TCPStore(
            "127.0.0.1", spec.store_port, is_master=False,
            timeout=datetime.timedelta(seconds=spec.timeout),
        )
        dist.set_debug_level_from_env()  # torch read TORCH_DISTRIBUTED_DEBUG when imported
        # The process group's own timeout is longer than the parent's, so a hang is reported by
        # the parent (naming the stuck ranks) rather than by gloo/nccl on some random rank.
        dist.init_process_group(
            spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.timeout + 60),
        )
        with agreement.checking_calls() if spec.check_calls else contextlib.nullcontext():
            result = fn(spec.rank, spec.world_size, *args, **kwargs)
        payload = cloudpickle.dumps(to_cpu(result))
    except BaseException as error:
        sys.stdout.flush()
        control.send((
            "error", time.time(), _is_peer_error(error),
            f"{type(error).__name__}: {error}".splitlines()[0], *_rank_traceback(error),
        ))
        # Stay, connections open, until the caller stops every rank: the peers then fail on
        # their own or not at all, never merely because this rank vanished under them.
        with contextlib.suppress(EOFError, OSError):
            control.recv()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    control.send(("result", payload))
    control.recv()  # "release": stay in the group until every rank is done
    dist.destroy_process_group()
    os._exit(0)


def _rank_traceback(error: BaseException) -> tuple[list[traceback.FrameSummary], str]:
    """The user's frames (source lines left for the caller to look up) and the exception."""
    stack = traceback.StackSummary.extract(traceback.walk_tb(error.__traceback__),
                                           lookup_lines=False)
    frames = [frame for frame in stack
              if not frame.filename.endswith("minidist/core/_supervisor.py")]
    return frames, "".join(traceback.format_exception_only(error))


def to_cpu(value: Any) -> Any:
    """Move tensors in a (nested) result to the CPU, so the caller never touches a rank's GPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) in (list, tuple):
        return type(value)(to_cpu(item) for item in value)
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    return value
