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

Each rank starts with the caller's environment as it is when `run` is called, so a variable a
notebook sets (`os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"`) applies to the next `run`.

Under torchrun or `srun` the process already is one rank (RANK/WORLD_SIZE or
SLURM_PROCID/SLURM_NTASKS are set): `run` joins the job's process group and calls the
function in place, so the same lab code runs unchanged on a cluster.

A rank that raises makes `run` raise `RankError` naming it, with its own traceback (notebook
frames as "Cell In[n], line k", the launcher's frames left out); ranks that broke only because
it stopped are named as such, ranks that failed on their own each get their own report. A run
that does not finish within `timeout` raises `RankTimeout` naming the unfinished ranks and
showing where each one was stuck. Either way, and on Ctrl-C (`RunInterrupted`, a
KeyboardInterrupt saying so), every rank is stopped before `run` returns. Starting and
watching the processes is the private `minidist._supervisor`'s job.
"""

from __future__ import annotations

import atexit
import datetime
import linecache
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from minidist._checks import positive_int
from minidist._supervisor import Failure, RanksFailed, RanksStuck, Supervisor, to_cpu

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
    """Ranks did not finish in time; `.ranks` lists them, `.rank` is the first of them."""

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
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return their results.

    The default process group is initialized on every rank before `fn` starts. Results come
    back in rank order (under torchrun/Slurm every rank gets the whole list). `backend` is
    "gloo" or "nccl" (default: `default_backend(world_size)`); `timeout` is in seconds
    (default `DEFAULT_TIMEOUT_S`).
    """
    positive_int(world_size=world_size)
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
    __tracebackhide__ = True  # IPython hides this frame: the error carries the rank's frames
    try:
        return Supervisor(fn, world_size, args, kwargs, backend, timeout).run()
    except RanksFailed as failed:
        error: BaseException = _failure_error(failed, world_size)
    except RanksStuck as stuck:
        error = _timeout_error(stuck, world_size, timeout)
    except KeyboardInterrupt:
        error = RunInterrupted(f"all {world_size} ranks were stopped")
    raise error from None


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
            store=_torchrun_attempt_store(world_size, timeout),
        )
        atexit.register(_leave_group)
    torch.set_num_threads(1)
    try:
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
    dist.destroy_process_group()


# --- What a failure looks like -----------------------------------------------------------------


def _failure_error(failed: RanksFailed, world_size: int) -> RankError:
    """The first rank that failed on its own, with its traceback; every other rank that failed
    on its own, too; then, in one line each, the ranks that broke only because those stopped
    and the ranks that were still running when all were stopped."""
    own = [f for f in failed.failures if not f.peer_error] or failed.failures[:1]
    broken = sorted({f.rank for f in failed.failures} - {f.rank for f in own})
    first = own[0]
    message = f"rank {first.rank} of {world_size} failed: {first.description}"
    first_traceback = _format_traceback(first)
    if first_traceback:
        message += f"\n\nTraceback from rank {first.rank}:\n{first_traceback}"
    for other in own[1:]:
        other_traceback = _format_traceback(other)
        if other_traceback == first_traceback:
            message += (f"\n\nrank {other.rank} of {world_size} failed too, on its own, "
                        "with the same error and traceback.")
        else:
            message += f"\n\nrank {other.rank} of {world_size} failed too: {other.description}"
            if other_traceback:
                message += f"\n\nTraceback from rank {other.rank}:\n{other_traceback}"
    notes = []
    if broken:
        stopped = ", ".join(str(f.rank) for f in own)
        notes.append(f"rank(s) {', '.join(map(str, broken))} failed afterwards, because "
                     f"rank(s) {stopped} stopped")
    if failed.running:
        notes.append(f"rank(s) {', '.join(map(str, failed.running))} were still running")
    if notes:
        message += f"\n\n({'; '.join(notes)}; all ranks were stopped.)"
    return RankError(message, first.rank, first_traceback)


def _timeout_error(stuck: RanksStuck, world_size: int, timeout: float) -> RankTimeout:
    names = ", ".join(map(str, sorted(stuck.stuck)))
    finished = ", ".join(map(str, stuck.finished))
    message = (
        f"rank(s) {names} of {world_size} did not finish within {timeout:g} s"
        + (f" (rank(s) {finished} finished)" if finished else "")
        + ". A rank waiting in a collective or recv that its peers never join hangs "
        "forever; pass timeout= if the work is just slow.\n"
    )
    for rank, frames in sorted(stuck.stuck.items()):
        shown = "\n".join(_format_frame(*frame) for frame in frames)
        message += (f"\nWhere rank {rank} was stuck (most recent call last):\n"
                    f"{shown or '  (no stack was printed)'}\n")
    return RankTimeout(message, sorted(stuck.stuck))


def _format_traceback(failure: Failure) -> str:
    frames = [_format_frame(f.filename, f.lineno, f.name) for f in failure.frames]
    return "\n".join([*frames, failure.exception.rstrip()]).strip("\n")


def _format_frame(filename: str, lineno: int | None, function: str) -> str:
    """One frame as a traceback shows it, with its source line; a notebook cell's frame as
    IPython names it ("Cell In[3], line 2"), not by the temporary file it was compiled as."""
    cell = _notebook_cell(filename)
    where = f"Cell {cell}, line {lineno}" if cell else f'File "{filename}", line {lineno}'
    source = linecache.getline(filename, lineno or 0).strip()
    return f"  {where}, in {function}" + (f"\n    {source}" if source else "")


def _notebook_cell(filename: str) -> str | None:
    """"In[n]" when `filename` is the code of IPython cell n in this process, else None."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    shell = get_ipython()
    label = shell.compile.format_code_name(filename) if shell is not None else None
    return label[1] if label else None
