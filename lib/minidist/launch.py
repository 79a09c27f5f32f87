"""Start N ranks of one function: from a notebook cell, a script, torchrun or Slurm.

    from minidist.launch import run

    def hello(rank, world_size, greeting):
        print(greeting, "from", rank)
        return rank * rank

    run(hello, 4, "hi")        # -> [0, 1, 4, 9]; each rank's prints appear prefixed "[rank2] ..."

In a notebook or a plain script, `run` starts `world_size` processes itself. The function is
shipped to them with cloudpickle, so it may be defined in a notebook cell or in `python -c`
(torch.multiprocessing.spawn can only start importable functions). Processes are forked from
a "fork server" that imported torch once and has never run a torch op, so each `run` costs a
fork and a rendezvous instead of a fresh interpreter, and no rank inherits a thread pool.

Under torchrun or `srun` the process already is one rank (RANK/WORLD_SIZE or
SLURM_PROCID/SLURM_NTASKS are set): `run` joins the job's process group and calls the
function in place, so the same lab code runs unchanged on a cluster.

A rank that raises makes `run` raise `RankError` naming it, with its traceback; a run that
does not finish within `timeout` raises `RankTimeout` naming the unfinished ranks and showing
where each one was stuck. Either way, and on Ctrl-C, every rank is killed before `run` returns.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import linecache
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("MINIDIST_TIMEOUT", "30"))
"""Seconds `run` waits for all ranks when no timeout is given; `MINIDIST_TIMEOUT` overrides it
(graders set it below their per-cell limit)."""

_FAILURE_GRACE_S = 0.5  # after the first failure, how long to collect the others before killing
_STACK_DUMP_WAIT_S = 0.5  # how long stuck ranks get to print their stacks after SIGUSR1
_EXIT_WAIT_S = 5.0  # how long finished ranks get to leave their process group and exit


class RankError(RuntimeError):
    """A rank failed; `.rank` is the one that failed first, `.traceback` its traceback."""

    def __init__(self, message: str, rank: int, rank_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.traceback = rank_traceback


class RankTimeout(RankError):
    """Ranks did not finish in time; `.ranks` lists them, `.rank` is the first of them."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message, ranks[0])
        self.ranks = ranks


def default_backend(world_size: int) -> str:
    """`MINIDIST_BACKEND` when set (the cluster's job scripts set it from BACKEND); otherwise
    nccl with one GPU per rank when this machine has enough GPUs, else gloo on CPU."""
    chosen = os.environ.get("MINIDIST_BACKEND")
    if chosen:
        if chosen not in ("gloo", "nccl"):
            raise ValueError(f"MINIDIST_BACKEND={chosen!r}: use 'gloo' or 'nccl', or unset it")
        return chosen
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def device() -> torch.device:
    """The device this rank computes on: its own GPU under nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return their results.

    The default process group is initialized on every rank before `fn` starts. Results come
    back in rank order (under torchrun/Slurm every rank gets the whole list). `backend` is
    "gloo" or "nccl" (default: `default_backend(world_size)`); `timeout` is in seconds
    (default `DEFAULT_TIMEOUT_S`).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    backend = backend or default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    launched = _rank_from_launcher_env()
    # Under a launcher the ranks may span nodes: each needs a GPU on its own node only.
    if backend == "nccl" and launched is None and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but this machine "
            f"has {torch.cuda.device_count()} GPU(s); use backend='gloo' or fewer ranks"
        )
    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")

    if launched is not None:
        return _run_in_place(fn, world_size, args, kwargs, backend, timeout, *launched)
    return _Supervisor(fn, world_size, args, kwargs, backend, timeout).run()


# --- Under torchrun or srun: this process is one rank already ---------------------------------


def _rank_from_launcher_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) set by torchrun, srun or our own launcher, else None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    # Only a multi-task srun step makes this process one rank of many: a notebook kernel
    # running inside a one-task Slurm job (JupyterHub's SlurmSpawner) starts its own ranks.
    if "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"])
    return None


def _slurm_master_addr_and_port() -> tuple[str, str]:
    """Rank 0's host (the step's first node) and a port derived from the job id."""
    addr = os.environ.get("MASTER_ADDR")
    if addr is None:
        nodes = os.environ["SLURM_STEP_NODELIST"]
        try:
            hostnames = subprocess.run(
                ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=True
            ).stdout.split()
        except (OSError, subprocess.CalledProcessError) as error:
            raise RuntimeError(
                f"cannot find rank 0's host: MASTER_ADDR is unset and `scontrol show hostnames "
                f"{nodes}` failed ({error}); export MASTER_ADDR in the job script"
            ) from error
        addr = hostnames[0]
    port = os.environ.get("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 40000))
    return addr, port


def _run_in_place(fn, world_size, args, kwargs, backend, timeout, rank, env_world, local_rank):
    if world_size != env_world:
        raise ValueError(
            f"run(..., world_size={world_size}) but this job has {env_world} processes; start "
            f"{world_size} (torchrun --nproc-per-node={world_size}, or srun -n {world_size}) "
            f"or call run with world_size={env_world}"
        )
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = _slurm_master_addr_and_port()
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        atexit.register(_leave_group)
    torch.set_num_threads(1)
    result = _to_cpu(fn(rank, world_size, *args, **kwargs))
    results: list[Any] = [None] * world_size
    dist.all_gather_object(results, result)
    return results


def _leave_group() -> None:
    # Rank 0 hosts the store: leaving before the others are done aborts them mid-teardown.
    dist.barrier()
    dist.destroy_process_group()


# --- In a notebook or plain script: start the ranks ourselves ---------------------------------


def _fork_server() -> multiprocessing.context.ForkServerContext:
    """A process that imported torch once and forks ranks on demand; started on first use.

    It exits once the process that started it and all ranks are gone.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle", __name__])
    return context


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
    result: bytes | None = None
    reported_error: bool = False
    finished: bool = False


@dataclass(order=True)
class _Failure:
    peer_error: bool  # broke because another rank went away: reported only if nothing else did
    when: float
    rank: int
    description: str = field(compare=False)
    rank_traceback: str = field(compare=False, default="")


class _Supervisor:
    """Starts the ranks, forwards their output, collects results, and kills them at the end."""

    def __init__(self, fn, world_size, args, kwargs, backend, timeout):
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as error:
            raise ValueError(
                f"cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
                f"{error}. Pass plain data (tensors, numbers, lists) as arguments."
            ) from error
        self.world_size = world_size
        self.timeout = timeout
        # The store is the rendezvous point: binding port 0 lets the OS pick a free port, so
        # runs in a row or at the same time never collide.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        context = _fork_server()
        self.ranks: list[_RankProcess] = []
        for rank in range(world_size):
            spec = _RankSpec(
                rank, world_size, backend, self.store.port, timeout, payload, list(sys.path),
                os.getcwd(),
            )
            stdout_r, stdout_w = context.Pipe(duplex=False)
            stderr_r, stderr_w = context.Pipe(duplex=False)
            control, child_control = context.Pipe()
            child_lifeline, lifeline = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_main,
                args=(spec, stdout_w, stderr_w, child_control, child_lifeline),
                name=f"minidist-rank{rank}",
                daemon=True,
            )
            self.ranks.append(_RankProcess(rank, process, stdout_r, stderr_r, control, lifeline))
            with _main_module_hidden():
                process.start()
            for child_end in (stdout_w, stderr_w, child_control, child_lifeline):
                child_end.close()

    def run(self) -> list[Any]:
        try:
            self._wait_for_results()
            for rank in self.ranks:
                rank.control.send("release")
            self._wait_for_exit()
            return [cloudpickle.loads(rank.result) for rank in self.ranks]
        finally:
            self._kill_all()
            del self.store

    # The parent's only loop: everything it waits on (pipes, process exits) goes through one
    # `wait`, in the caller's thread, so output lands in the notebook cell that called `run`.
    def _poll(self, timeout: float) -> list[_Failure]:
        sources = {}
        for rank in self.ranks:
            for pipe in (rank.stdout, rank.stderr, rank.control):
                if not pipe.closed:
                    sources[pipe] = rank
            if not rank.finished:
                sources[rank.process.sentinel] = rank
        failures = []
        for source in multiprocessing.connection.wait(list(sources), max(timeout, 0)):
            rank = sources[source]
            if source is rank.control:
                failures += self._on_control(rank)
            elif source in (rank.stdout, rank.stderr):
                self._forward_output(rank, source)
            elif not rank.finished:
                failures += self._on_exit(rank)
        return failures

    def _wait_for_results(self) -> None:
        deadline = time.monotonic() + self.timeout
        failures: list[_Failure] = []
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
            failures += self._poll(remaining)

    def _wait_for_exit(self) -> None:
        deadline = time.monotonic() + _EXIT_WAIT_S
        while any(not rank.finished for rank in self.ranks) and time.monotonic() < deadline:
            self._poll(deadline - time.monotonic())
        for rank in self.ranks:
            self._drain_output(rank)

    def _on_control(self, rank: _RankProcess) -> list[_Failure]:
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
        # Formatted here, not in the rank: only the caller's linecache holds notebook cells.
        rank_traceback = "".join(traceback.format_list(frames)) + exception_text
        return [_Failure(peer_error, when, rank.rank, description, rank_traceback)]

    def _on_exit(self, rank: _RankProcess) -> list[_Failure]:
        rank.finished = True
        # Read what the rank said before it died: its error report may still be in the pipe.
        self._drain_output(rank)
        unread = not rank.control.closed and rank.control.poll(0)
        failures = self._on_control(rank) if unread else []
        if rank.result is not None or rank.reported_error:
            return failures
        code = rank.process.exitcode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return [_Failure(False, time.time(), rank.rank, f"the process {how} before returning")]

    def _forward_output(self, rank: _RankProcess, pipe) -> None:
        try:
            data = os.read(pipe.fileno(), 1 << 16)
        except OSError:
            data = b""
        if not data:
            self._flush_partial(rank, pipe)
            pipe.close()
            return
        *lines, rank.partial_lines[pipe.fileno()] = (
            rank.partial_lines.get(pipe.fileno(), b"") + data
        ).split(b"\n")
        self._emit(rank, pipe, lines)

    def _flush_partial(self, rank: _RankProcess, pipe) -> None:
        rest = rank.partial_lines.pop(pipe.fileno(), b"")
        if rest:
            self._emit(rank, pipe, [rest])

    def _emit(self, rank: _RankProcess, pipe, lines: list[bytes]) -> None:
        text = [line.decode(errors="replace") for line in lines]
        if pipe is rank.stderr and rank.captured_stderr is not None:
            rank.captured_stderr += text
            return
        stream = sys.stderr if pipe is rank.stderr else sys.stdout
        stream.write("".join(f"[rank{rank.rank}] {line}\n" for line in text))
        stream.flush()

    def _drain_output(self, rank: _RankProcess) -> None:
        for pipe in (rank.stdout, rank.stderr):
            while not pipe.closed and pipe.poll(0):
                self._forward_output(rank, pipe)

    def _failure_error(self, failures: list[_Failure]) -> RankError:
        self._kill_all()
        first = min(failures)
        others = sorted({f.rank for f in failures} - {first.rank})
        message = f"rank {first.rank} of {self.world_size} failed: {first.description}"
        if first.rank_traceback:
            message += f"\n\nTraceback from rank {first.rank}:\n{first.rank_traceback.rstrip()}"
        if others:
            message += (
                f"\n\n(rank(s) {', '.join(map(str, others))} failed afterwards, "
                f"because rank {first.rank} stopped; all ranks were stopped.)"
            )
        return RankError(message, first.rank, first.rank_traceback)

    def _timeout_error(self) -> RankTimeout:
        stuck = [rank for rank in self.ranks if rank.result is None]
        for rank in stuck:
            rank.captured_stderr = []
            _signal(rank.process.pid, signal.SIGUSR1)  # faulthandler prints the rank's stack
        deadline = time.monotonic() + _STACK_DUMP_WAIT_S
        while time.monotonic() < deadline:
            self._poll(deadline - time.monotonic())
        self._kill_all()
        names = ", ".join(str(rank.rank) for rank in stuck)
        done = [rank.rank for rank in self.ranks if rank.result is not None]
        message = (
            f"rank(s) {names} of {self.world_size} did not finish within {self.timeout:g} s"
            + (f" (rank(s) {', '.join(map(str, done))} finished)" if done else "")
            + ". A rank waiting in a collective or recv that its peers never join hangs "
            "forever; pass timeout= if the work is just slow.\n"
        )
        for rank in stuck:
            stack = _user_frames(rank.captured_stderr)
            message += f"\nWhere rank {rank.rank} was stuck (most recent call last):\n{stack}\n"
        return RankTimeout(message, [rank.rank for rank in stuck])

    def _kill_all(self) -> None:
        for rank in self.ranks:
            if rank.process.exitcode is None and rank.process.pid is not None:
                _signal(rank.process.pid, signal.SIGKILL, whole_group=True)
        for rank in self.ranks:
            rank.process.join(timeout=_EXIT_WAIT_S)
            rank.finished = True
            for pipe in (rank.stdout, rank.stderr):
                if not pipe.closed:
                    self._drain_output(rank)
            for pipe in (rank.stdout, rank.stderr, rank.control, rank.lifeline):
                pipe.close()


def _signal(pid: int, signum: int, whole_group: bool = False) -> None:
    try:
        if whole_group:
            os.killpg(pid, signum)  # each rank leads its own process group
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _user_frames(dump: list[str]) -> str:
    """faulthandler's dump without the launcher's frames, each with its source line."""
    launcher_frames = ("multiprocessing", "minidist/launch.py", '"<string>"')
    frames = []
    for line in dump:
        frame = re.match(r'\s*File "(.+)", line (\d+) in (.+)', line)
        if frame and not any(skip in line for skip in launcher_frames):
            filename, lineno, function = frame.groups()
            source = linecache.getline(filename, int(lineno)).strip()
            frames.append(f'  File "{filename}", line {lineno}, in {function}\n    {source}')
    return "\n".join(reversed(frames)) or "  (no stack was printed)"


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
    faulthandler.register(signal.SIGUSR1, all_threads=False)
    sys.path[:] = spec.sys_path
    os.chdir(spec.cwd)
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
    torch.set_num_threads(1)
    try:
        fn, args, kwargs = cloudpickle.loads(spec.payload)
        if spec.backend == "nccl":
            torch.cuda.set_device(spec.rank)
        store = dist.TCPStore(
            "127.0.0.1", spec.store_port, is_master=False,
            timeout=datetime.timedelta(seconds=spec.timeout),
        )
        # The process group's own timeout is longer than the parent's, so a hang is reported by
        # the parent (naming the stuck ranks) rather than by gloo/nccl on some random rank.
        dist.init_process_group(
            spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.timeout + 60),
        )
        result = fn(spec.rank, spec.world_size, *args, **kwargs)
        payload = cloudpickle.dumps(_to_cpu(result))
    except BaseException as error:
        sys.stdout.flush()
        control.send((
            "error", time.time(), _is_peer_error(error),
            f"{type(error).__name__}: {error}".splitlines()[0], *_rank_traceback(error),
        ))
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
    frames = [frame for frame in stack if not frame.filename.endswith("minidist/launch.py")]
    return frames, "".join(traceback.format_exception_only(error))


def _to_cpu(value: Any) -> Any:
    """Move tensors in a (nested) result to the CPU, so the caller never touches a rank's GPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    return value
