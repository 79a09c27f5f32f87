"""Start N ranks of one function: from a notebook cell, a script, torchrun or Slurm.

    from minidist.core.launch import run

    def hello(rank, world_size, greeting):
        print(greeting, "from", rank)
        return rank * rank

    run(hello, 4, "hi")        # -> [0, 1, 4, 9]; each rank's prints appear prefixed "[rank2] ..."

In a notebook or a plain script, `run` starts `world_size` processes itself. The function is
shipped to them with cloudpickle, so it may be defined in a notebook cell or in `python -c`
(torch.multiprocessing.spawn can only start importable functions). Processes are forked from
a "fork server" that imported torch once and has never run a torch op, so each `run` costs a
fork and a rendezvous instead of a fresh interpreter, and no rank inherits a thread pool.

Each rank starts with the caller's environment as it is when `run` is called, so a variable a
notebook sets (`os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"`) applies to the next `run`.

Under torchrun or `srun` the process already is one rank (RANK/WORLD_SIZE or
SLURM_PROCID/SLURM_NTASKS are set): `run` joins the job's process group and calls the
function in place, so the same lab code runs unchanged on a cluster.

A rank that raises makes `run` raise `RankError` naming it, with its own traceback (notebook
frames as "Cell In[n], line k", the launcher's frames left out); ranks that broke only because
it stopped are named as such, ranks that failed on their own each get their own report. A rank
that dies natively (a signal: a heap corruption, gloo aborting) is reported with its last
stderr lines, its Python stack as it died and what a known message means. A run that does not
finish within `timeout` raises `RankTimeout` naming the unfinished ranks, what each waits for
(and the cycle, when they wait on each other) and where they were stuck, ranks with the same
stack shown once; torch's and other libraries' frames are hidden unless the environment has
MINIDIST_FULL_STACKS=1. Ranks that call mismatched collectives (different ops, sizes, dtypes or
roots in the same turn) are named with each call and its line: in the error when the mismatch
crashes a rank, and as a `RankTimeout` a few seconds after they stop making progress when it
hangs. In a notebook (`check_calls`) each collective of minidist's collective layer is also
compared across its group before it runs (minidist.core.agreement), so a mismatch there raises
`CallMismatch` at once, on every rank, before a byte moves. While ranks wait without progress
the cell shows one line saying so, replaced by the report. Either way, and on Ctrl-C
(`RunInterrupted`, a KeyboardInterrupt saying so), every rank is stopped before `run` returns.
Starting and watching the processes is the private `minidist.core._supervisor`'s job; recording
each rank's calls, `minidist.core._calls`'.

Why one module of about 530 lines: `run` and the errors a student reads when ranks fail, hang or are
interrupted; each message is kept beside the check that raises it."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import inspect
import linecache
import math
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Imported only once a group exists (torch.optim imports it, through torch._dynamo), its
# functions would keep the default group in their default arguments past
# destroy_process_group; `_leave_group` must be able to free the group.
import torch.distributed.nn.functional  # noqa: F401

from minidist.core._calls import LatestCall
from minidist.core._checks import positive_int
from minidist.core._diagnose import (
    conflicts,
    describe_conflict,
    describe_cycle,
    explain,
    find_cycle,
    rank_list,
    same_stacks,
    shown_frames,
    waits_for,
)
from minidist.core._groups import forget_groups
from minidist.core._supervisor import Failure, RanksFailed, RanksStuck, Supervisor, to_cpu
from minidist.core.agreement import checking_calls

__all__ = [
    "DEFAULT_TIMEOUT_S", "RankError", "RankTimeout", "RunInterrupted", "default_backend",
    "device", "run",
]

DEFAULT_TIMEOUT_S = float(os.environ.get("MINIDIST_TIMEOUT", "30"))
"""Seconds `run` waits for all ranks when no timeout is given; `MINIDIST_TIMEOUT` overrides it
(graders set it below their per-cell limit)."""


class RankError(RuntimeError):
    """A rank failed; `.rank` is the one that failed first, `.traceback` its traceback."""

    def __init__(self, message: str, rank: int, rank_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.traceback = rank_traceback

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the ranks' report alone, which already holds the failing rank's
        own frames; the caller's frames in `run` and the supervisor would only bury it."""
        return f"{type(self).__name__}: {self}".splitlines()


class RankTimeout(RankError):
    """Ranks did not finish: the time ran out, or they were stopped early because they wait in
    mismatched collectives that can never complete. `.ranks` lists them, `.rank` is the first
    of them."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message, ranks[0])
        self.ranks = ranks


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or a notebook's interrupt) during `run`: every rank was stopped first."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: one line, instead of where the interrupt happened to land."""
        return [f"{type(self).__name__}: {self}"]


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
    check_calls: bool | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return their results.

    The default process group is initialized on every rank before `fn` starts. Results come
    back in rank order (under torchrun/Slurm every rank gets the whole list). `backend` is
    "gloo" or "nccl" (default: `default_backend(world_size)`); `timeout` is in seconds
    (default `DEFAULT_TIMEOUT_S`). With `check_calls`, every collective of minidist's
    collective layer is compared across its group before it runs, and a mismatch raises
    `minidist.core.agreement.CallMismatch` on every rank, naming each rank's call; it costs a
    store round trip per collective, so it defaults to on in a notebook (a Jupyter kernel),
    where mistakes are made, and off in scripts and benchmarks.
    """
    positive_int(world_size=world_size)
    _check_function(fn, world_size, args, kwargs)
    timeout = _check_timeout(timeout)
    if check_calls is None:
        check_calls = "ipykernel" in sys.modules
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

    if launched is not None:
        return _run_in_place(fn, world_size, args, kwargs, backend, timeout, check_calls,
                             *launched)
    __tracebackhide__ = True  # IPython hides this frame: the error carries the rank's frames
    try:
        return Supervisor(fn, world_size, args, kwargs, backend, timeout, check_calls).run()
    except RanksFailed as failed:
        error: BaseException = _failure_error(failed, world_size)
    except RanksStuck as stuck:
        error = _timeout_error(stuck, world_size, timeout)
    except KeyboardInterrupt:
        error = RunInterrupted(f"all {world_size} ranks were stopped")
    raise error from None


def _check_function(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict) -> None:
    """`fn` can be called as fn(rank, world_size, *args, **kwargs), or a ValueError says why."""
    if not callable(fn):
        raise ValueError(f"run's first argument must be a function, got {fn!r}; pass the "
                         "function itself: run(my_function, world_size)")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(0, world_size, *args, **kwargs)
    except TypeError as error:
        name = getattr(fn, "__name__", repr(fn))
        extra = "".join(f", {a!r}" for a in args) + "".join(f", {k}={v!r}"
                                                          for k, v in kwargs.items())
        raise ValueError(
            f"{name}{signature} cannot be called as {name}(rank, world_size{extra}): {error}. "
            f"Each rank calls fn(rank, world_size, *args, **kwargs): define it as "
            f"def {name}(rank, world_size, ...), with one parameter per extra argument of run"
        ) from None


def _check_timeout(timeout: float | None) -> float:
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            math.isfinite(timeout) and timeout > 0):
        raise ValueError(
            f"timeout={timeout!r}: must be a positive, finite number of seconds (how long run "
            f"waits for every rank to return), e.g. timeout=30; leave it out for "
            f"{DEFAULT_TIMEOUT_S:g} s"
        )
    return float(timeout)


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


def _run_in_place(fn, world_size, args, kwargs, backend, timeout, check_calls, rank, env_world,
                  local_rank):
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
            store=_torchrun_attempt_store(world_size, timeout),
        )
        atexit.register(_leave_group)
    torch.set_num_threads(1)
    try:
        with checking_calls() if check_calls else contextlib.nullcontext():
            result = to_cpu(fn(rank, world_size, *args, **kwargs))
    except BaseException:
        # The job failed: its peers may be gone or stuck, and a barrier would only add a
        # second error (or wait for them). The launcher restarts or ends every rank.
        atexit.unregister(_leave_group)
        raise
    results: list[Any] = [None] * world_size
    dist.all_gather_object(results, result)
    return results


def _torchrun_attempt_store(world_size: int, timeout: float) -> dist.Store | None:
    """Under torchrun's agent store, a store of this restart attempt's own keys; else None
    (init_process_group then builds its store from MASTER_ADDR/MASTER_PORT).

    The agent keeps one store across `--max-restarts` restarts, so a restarted rank could read
    the address a dead rank of the previous attempt left there, and wait on it until the
    timeout. Each attempt's keys get their own prefix, as torch.distributed.elastic once did."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                          is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(f"minidist/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)


def _leave_group() -> None:
    # Rank 0 hosts the store: leaving before the others are done aborts them mid-teardown.
    dist.barrier()
    # The groups must be freed now, while Python still runs: a gloo worker thread that drops
    # the last reference to a finished collective's tensors during interpreter shutdown
    # cannot take the GIL, and aborts the process ("terminate called without an active
    # exception"). So forget minidist's per-group state and collect cycles (hooks) holding
    # groups; destroying the last reference then joins the group's threads.
    forget_groups()
    gc.collect()
    dist.destroy_process_group()


# --- What a failure looks like -----------------------------------------------------------------


def _full_stacks() -> bool:
    return os.environ.get("MINIDIST_FULL_STACKS", "") not in ("", "0")


HIDDEN_NOTE = ("(torch's and other libraries' frames are hidden; set "
               "os.environ['MINIDIST_FULL_STACKS'] = '1' to see them)")


def _failure_error(failed: RanksFailed, world_size: int) -> RankError:
    """The first rank that failed on its own, with its traceback (or, for a native death, its
    last stderr lines and its stack as it died); every other rank that failed on its own, too;
    mismatched calls between the ranks; then, in one line each, the ranks that broke only
    because those stopped and the ranks that were still running when all were stopped."""
    own = [f for f in failed.failures if not f.peer_error] or failed.failures[:1]
    broken = sorted({f.rank for f in failed.failures} - {f.rank for f in own})
    first = own[0]
    message = f"rank {first.rank} of {world_size} failed: {first.description}"
    message += _failure_report(first)

    def same(failure: Failure) -> tuple:
        return failure.description, _format_traceback(failure), [
            (f.filename, f.lineno, f.name) for f in failure.frames]

    for other in own[1:]:
        if same(other) == same(first):
            message += (f"\n\nrank {other.rank} of {world_size} failed too, on its own, "
                        "with the same error and traceback.")
        else:
            message += (f"\n\nrank {other.rank} of {world_size} failed too: "
                        f"{other.description}{_failure_report(other)}")
    message += _mismatch_report(failed.calls, failed.failures)
    notes = []
    if broken:
        stopped = ", ".join(str(f.rank) for f in own)
        notes.append(f"rank(s) {', '.join(map(str, broken))} failed afterwards, because "
                     f"rank(s) {stopped} stopped")
    if failed.running:
        notes.append(f"rank(s) {', '.join(map(str, failed.running))} were still running")
    if notes:
        message += f"\n\n({'; '.join(notes)}; all ranks were stopped.)"
    return RankError(message, first.rank, _format_traceback(first))


def _failure_report(failure: Failure) -> str:
    """What follows a failed rank's first line: an explanation of a known message, the
    traceback of its exception, or, when it died without one, its last stderr lines and its
    Python stack as it died."""
    text = "\n".join([failure.exception, *failure.stderr_tail])
    meaning = explain(text, failure.signal_name)
    report = f"\n{meaning}" if meaning else ""
    if failure.exception:
        traceback = _format_traceback(failure)
        return report + (f"\n\nTraceback from rank {failure.rank}:\n{traceback}"
                         if traceback else "")
    tail = [line for line in failure.stderr_tail if line.strip()]
    if tail:
        report += (f"\n\nLast lines rank {failure.rank} wrote to stderr:\n"
                   + "\n".join(f"  {line}" for line in tail))
    if failure.signal_name:
        frames = [(f.filename, f.lineno, f.name) for f in failure.frames]
        shown = shown_frames(frames, _full_stacks())
        if shown:
            report += (f"\n\nPython stack of rank {failure.rank} when it died (most recent call "
                       "last):\n" + "\n".join(_format_frame(*frame) for frame in shown))
            if len(shown) < len(frames):
                report += f"\n{HIDDEN_NOTE}"
        else:
            report += (f"\n\n(rank {failure.rank}'s Python stack as it died held no frame of "
                       "its function: it died outside it, e.g. while the function's tensors "
                       "were freed after it returned)")
    return report


def _mismatch_report(calls: dict[int, LatestCall | None], failures: list[Failure]) -> str:
    """Mismatched calls in progress when the ranks failed; when a rank's message says there
    was a collective mismatch but the calls in progress do not show it, every rank's latest
    call."""
    found = conflicts([call for call in calls.values() if call is not None], in_progress=False)
    if found:
        return "\n\nMismatched calls: " + "\n".join(
            describe_conflict(group, _call_location) + "." for group in found)
    texts = "\n".join(f.exception + "\n".join(f.stderr_tail) for f in failures)
    if "collective mismatch" in explain(texts) and any(calls.values()):
        latest = [f"rank {rank}: {call.describe()} at {_call_location(call)}"
                  for rank, call in sorted(calls.items()) if call is not None]
        return "\n\nEach rank's latest call:\n" + "\n".join(f"  {line}" for line in latest)
    return ""


def _timeout_error(stuck: RanksStuck, world_size: int, timeout: float) -> RankTimeout:
    names = ", ".join(map(str, sorted(stuck.stuck)))
    finished = ", ".join(map(str, stuck.finished))
    calls = stuck.calls
    found = conflicts([calls[rank] for rank in stuck.stuck if calls.get(rank) is not None])
    if stuck.mismatch_after is not None:
        message = (
            f"rank(s) {names} of {world_size} are stuck in mismatched collectives: stopped "
            f"after {stuck.mismatch_after:.0f} s without progress (the timeout was {timeout:g} "
            "s). Every rank of a group must make the same collective calls, in the same "
            "order, with the same sizes.\n"
        )
    else:
        message = (
            f"rank(s) {names} of {world_size} did not finish within {timeout:g} s"
            + (f" (rank(s) {finished} finished)" if finished else "")
            + ". A rank waiting in a collective or recv that its peers never join hangs "
            "forever; pass timeout= if the work is just slow.\n"
        )
    if found:
        message += "\nMismatched calls: " + "\n".join(
            describe_conflict(group, _call_location) + "." for group in found) + "\n"
    edges = waits_for(calls, stuck.stuck)
    cycle = find_cycle(edges)
    if cycle and not found:
        message += f"\nDeadlock: {describe_cycle(cycle, calls)}.\n"
    elif not found:
        message += _who_waits(stuck, edges)
    everything = _full_stacks()
    hidden = False
    stacks = {rank: shown_frames(frames, everything) for rank, frames in stuck.stuck.items()}
    for ranks, frames in same_stacks(stacks):
        hidden |= any(len(stacks[r]) < len(stuck.stuck[r]) for r in ranks)
        shown = "\n".join(_format_frame(*frame) for frame in frames)
        if len(ranks) > 1 and frames:
            filename, lineno, _ = frames[-1]
            source = linecache.getline(filename, lineno).strip()
            message += (f"\n{rank_list(ranks)} are all at {_location(filename, lineno)}"
                        + (f": {source}" if source else "") + "\n"
                        f"Where {rank_list(ranks)} were stuck (most recent call last):\n"
                        f"{shown}\n")
        else:
            for rank in ranks:
                message += (f"\nWhere rank {rank} was stuck (most recent call last):\n"
                            f"{shown or '  (no stack was printed)'}\n")
    if hidden:
        message += f"{HIDDEN_NOTE}\n"
    return RankTimeout(message, sorted(stuck.stuck))


def _who_waits(stuck: RanksStuck, edges: dict[int, list[int]]) -> str:
    """One line per stuck rank: its call and the ranks it waits for, and what those do."""
    lines = []
    for rank in sorted(stuck.stuck):
        call = stuck.calls.get(rank)
        if call is None or not call.waiting:
            lines.append(f"rank {rank} is in no collective or send/recv (computing, sleeping "
                         "or waiting on something else)")
            continue
        line = f"rank {rank} is in {call.describe()} at {_call_location(call)}"
        others = edges.get(rank, [])
        gone = [r for r in others if r in stuck.finished]
        busy = [r for r in others if r not in stuck.finished]
        if gone:
            line += f", waiting for {rank_list(gone)}, which already returned"
        if busy:
            doing = []
            for other in busy:
                other_call = stuck.calls.get(other)
                what = (f"in {other_call.describe()}" if other_call is not None
                        and other_call.waiting else "in no collective")
                doing.append(f"{other} ({what})")
            line += (" and" if gone else ",") + f" waiting for {', '.join(doing)}"
        lines.append(line)
    return "\n" + "\n".join(lines) + "\n" if lines else ""


def _format_traceback(failure: Failure) -> str:
    if not failure.exception:
        return ""
    frames = [_format_frame(f.filename, f.lineno, f.name) for f in failure.frames]
    return "\n".join([*frames, failure.exception.rstrip()]).strip("\n")


def _location(filename: str, lineno: int | None) -> str:
    """"Cell In[3], line 2" for a notebook cell's code, else 'File "x.py", line 2'."""
    cell = _notebook_cell(filename)
    return f"Cell {cell}, line {lineno}" if cell else f'File "{filename}", line {lineno}'


def _call_location(call: LatestCall) -> str:
    return f"{_location(call.filename, call.lineno)} (in {call.function})"


def _format_frame(filename: str, lineno: int | None, function: str) -> str:
    """One frame as a traceback shows it, with its source line; a notebook cell's frame as
    IPython names it ("Cell In[3], line 2"), not by the temporary file it was compiled as."""
    source = linecache.getline(filename, lineno or 0).strip()
    return f"  {_location(filename, lineno)}, in {function}" + (
        f"\n    {source}" if source else "")


def _notebook_cell(filename: str) -> str | None:
    """"In[n]" when `filename` is the code of IPython cell n in this process, else None."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    shell = get_ipython()
    label = shell.compile.format_code_name(filename) if shell is not None else None
    return label[1] if label else None
