"""A training job that survives crashes: TinyGPT on synthetic tokens, sharded, checkpointed.

    torchrun --nproc-per-node=2 --max-restarts=2 -m minidist.jobs.train --steps 12 \\
        --checkpoint-dir run1 --checkpoint-every 5 --fail-at-step 3 7 --fail-rank 1

or, from a notebook, `run(train, 2, TrainConfig(...))` (minidist.core.launch). Every
`checkpoint_every` steps the job saves a sharded checkpoint (minidist.jobs.checkpoint) of all that
the next step depends on: the model and optimizer shards (FSDP, or ZeRO-2), every random
generator (torch CPU and CUDA, Python, NumPy), the sampler's position in the data and the
gradient-norm history. On start it loads the newest complete checkpoint, skipping a torn one,
so a job restarted after a crash (torchrun --max-restarts restarts all ranks; nothing in
torchrun resumes training state) prints the same losses, bit for bit, as one that never failed.
Rank 0 prints one line per step: `step <i> loss <float.hex()>`.

Guards, each with a message naming the rank and the step:
- a NaN or Inf in any rank's loss or gradients is seen by every rank in the same all-reduce,
  and all of them skip the step (the batch is consumed, the weights and optimizer untouched);
- a gradient norm above `spike_factor` times the mean of the recent norms is reported and
  clipped to that limit;
- a collective that waits longer than `collective_timeout` seconds (a peer died or hangs)
  ends the job with an error instead of waiting forever. Under torchrun that is the process
  group's timeout; inside `run(train, ...)` the launcher's `timeout` bounds the whole job and
  reports where each rank was stuck.

Lab 09 has students write the capture of the random generators and the sampler, and the NaN
guard; `train(..., capture_state=, restore_state=, all_finite=)` runs the job with theirs in
place of the library's own (`checkpoint.RNGState` with the sampler, and the flags above).

Failures can be injected: `--fail-at-step` kills a rank abruptly (os._exit, as a crashed
process would vanish), `--nan-at-step` turns a rank's loss into NaN, `--hang-at-step` stops a
rank in its tracks. Each injected crash fires once: a marker file in the checkpoint directory
remembers it, so the restarted job runs through.

With `--fail-scope node` the failing rank takes its whole node down instead: its torchrun
agent and every worker that agent started are killed (SIGKILL), as a machine losing power
would. Started elastically, with one agent on each node and a rendezvous server at HOST:PORT
that outlives them (a `torch.distributed.TCPStore(HOST, PORT, is_master=True)` kept by
the job's launcher; a node that hosted the rendezvous would take it down with it),

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc-per-node=1 \\
        --max-restarts=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=run1 \\
        --rdzv-conf=is_host=0 -m minidist.jobs.train --steps 12 --checkpoint-dir run1 \\
        --checkpoint-every 5 --fail-at-step 7 --fail-rank 1 --fail-scope node

the job goes on without the lost node: the survivors' collectives fail as soon as its sockets
close, their agents restart them, the next rendezvous round closes with the nodes that are
left (at least the minimum of `--nnodes`) once the lost one has missed its heartbeats, and the
job resumes from the newest complete checkpoint, resharded onto the smaller world. Rank 0 says
so: `resumed from <dir> at step 5 on 1 rank(s) (saved by 2)`. A node that joins later (up
to the maximum of `--nnodes`) makes the agents restart the workers on the larger world the
same way. (Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, torch 2.13's agents keep the first
round's worker store, and a node that joins a later round waits for the store's address,
which nobody publishes again, until its rendezvous times out.)
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minidist.communication import collectives
from minidist.core._checks import one_of, positive, positive_int
from minidist.core.launch import run
from minidist.jobs import checkpoint
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.models import TinyGPT
from minidist.parallel.zero import ZeroOptimizer

__all__ = [
    "TrainConfig", "SyntheticTokens", "ResumableSampler", "GradientGuard", "CollectiveTimeout",
    "CapturedState", "train", "parse_args", "main",
]


@dataclass
class TrainConfig:
    """Everything a run depends on; the command line's options, one field each."""

    steps: int
    checkpoint_dir: str
    checkpoint_every: int
    fail_at_step: list[int] = field(default_factory=list)
    fail_rank: int = 0
    fail_scope: str = "rank"
    nan_at_step: int | None = None
    nan_rank: int = 0
    hang_at_step: int | None = None
    hang_rank: int = 0
    sharding: str = "fsdp"
    collective_timeout: float = 60.0
    spike_factor: float = 5.0
    token_noise: float = 0.1
    global_batch: int = 8
    seq_len: int = 16
    vocab: int = 64
    hidden: int = 32
    layers: int = 2
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        positive_int(steps=self.steps, checkpoint_every=self.checkpoint_every,
                     global_batch=self.global_batch, seq_len=self.seq_len, vocab=self.vocab,
                     hidden=self.hidden, layers=self.layers)
        positive(collective_timeout=self.collective_timeout, spike_factor=self.spike_factor,
                 lr=self.lr)
        one_of("sharding", self.sharding, ("fsdp", "zero"))
        one_of("fail_scope", self.fail_scope, ("rank", "node"))
        if not 0 <= self.token_noise < 1:
            raise ValueError(f"token_noise={self.token_noise!r}: a fraction in [0, 1)")


class SyntheticTokens:
    """`size` sequences following a rule the model can learn (each token is the previous one
    plus a per-sequence stride, mod vocab), fixed by `seed`."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab, (size, 1), generator=generator)
        strides = torch.randint(1, 4, (size, 1), generator=generator)
        self.tokens = (starts + strides * torch.arange(seq_len + 1)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.tokens[indices]
        return rows[:, :-1], rows[:, 1:]


class ResumableSampler:
    """Global batches of dataset indices, reshuffled each epoch from (seed, epoch); its
    state is (epoch, position), so a resumed job continues with the very next batch."""

    def __init__(self, size: int, global_batch: int, seed: int):
        if global_batch > size:
            raise ValueError(f"global_batch={global_batch} exceeds the dataset's {size} items")
        self.size, self.global_batch, self.seed = size, global_batch, seed
        self.epoch, self.position = 0, 0

    def next_batch(self) -> list[int]:
        if self.position + self.global_batch > self.size:  # the incomplete tail is dropped
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(self.size,
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        batch = order[self.position: self.position + self.global_batch].tolist()
        self.position += self.global_batch
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class GradientGuard:
    """Reports and clips gradient-norm spikes: a norm above `factor` times the mean of the
    last `window` accepted norms (after `warmup` of them) is scaled down to that limit."""

    def __init__(self, factor: float, window: int = 20, warmup: int = 3):
        self.factor, self.window, self.warmup = factor, window, warmup
        self.history: list[float] = []

    def clip_factor(self, norm: float) -> tuple[float, str | None]:
        """(what to multiply the gradients by, a report or None); records the norm kept."""
        scale, report = 1.0, None
        if len(self.history) >= self.warmup:
            mean = sum(self.history) / len(self.history)
            limit = self.factor * mean
            if norm > limit:
                scale = limit / norm
                report = (f"gradient norm {norm:.4g} is {norm / mean:.1f}x the mean of the "
                          f"last {len(self.history)} steps; clipped to {limit:.4g}")
        self.history = (self.history + [norm * scale])[-self.window:]
        return scale, report

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = list(state["history"])


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the job's timeout: a peer died or hangs."""


class CapturedState:
    """A checkpoint leaf made of two functions: `capture(sampler)` returns everything the next
    steps draw from (the random generators and the sampler's position), and `restore(state,
    sampler)` puts it back. What `capture` returns is pickled into a per-rank tensor, so it is
    restored only on the same world size, as `checkpoint.RNGState` is."""

    def __init__(self, capture: Callable[[Any], Any], restore: Callable[[Any, Any], None],
                 sampler: ResumableSampler):
        self.capture, self.restore, self.sampler = capture, restore, sampler

    def state_dict(self) -> dict[str, Any]:
        pickled = pickle.dumps(self.capture(self.sampler))
        return {"captured": checkpoint.PerRank(torch.frombuffer(bytearray(pickled),
                                                                dtype=torch.uint8))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restore(pickle.loads(state["captured"].value.numpy().tobytes()), self.sampler)


def train(rank: int, world_size: int, config: TrainConfig, *,
          capture_state: Callable[[Any], Any] | None = None,
          restore_state: Callable[[Any, Any], None] | None = None,
          all_finite: Callable[[torch.Tensor, list], bool] | None = None) -> dict[int, float]:
    """Run (or resume) the job on this rank; returns {step: global mean loss} of the steps
    this attempt ran (skipped steps left out).

    `capture_state(sampler)` and `restore_state(state, sampler)` (both or neither) replace the
    library's record of the generators and the sampler; `all_finite(loss, grads)`, which must
    give every rank the same answer, replaces its NaN guard."""
    if (capture_state is None) != (restore_state is None):
        raise ValueError("give capture_state and restore_state together: a resume needs both")
    if config.global_batch % world_size:
        raise ValueError(f"global_batch={config.global_batch} must be a multiple of the "
                         f"world size {world_size}")
    if config.fail_at_step and config.fail_scope == "node" and "TORCHELASTIC_RUN_ID" not in \
            os.environ:
        raise ValueError("fail_scope='node' kills the torchrun agent that started this rank; "
                         "start the job with torchrun, or use fail_scope='rank'")
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    model: torch.nn.Module = TinyGPT(vocab=config.vocab, hidden=config.hidden, heads=2,
                                     layers=config.layers, max_seq=config.seq_len)
    if config.sharding == "fsdp":
        model = FullyShardedDataParallel(model)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        grads = lambda: [p.grad for p in model.parameters()]  # noqa: E731 (this rank's shards)
    else:
        optimizer = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=config.lr)
        grads = lambda: [s.grad for s in optimizer.shards]  # noqa: E731
    # Each rank draws its own token noise: the per-rank generators a resume must restore.
    torch.manual_seed(config.seed + 1 + rank)
    random.seed(config.seed + 1 + rank)
    np.random.seed(config.seed + 1 + rank)
    data = SyntheticTokens(16 * config.global_batch, config.seq_len, config.vocab, config.seed)
    sampler = ResumableSampler(len(data), config.global_batch, config.seed)
    guard = GradientGuard(config.spike_factor)
    state = {"model": checkpoint.ModelState(model),
             "optimizer": checkpoint.OptimizerState(model, optimizer),
             "rng": checkpoint.RNGState(), "sampler": sampler, "gradient_guard": guard,
             "step": 0}
    if capture_state is not None:  # the sampler stays a leaf too: restored on any world size
        state["rng"] = CapturedState(capture_state, restore_state, sampler)
    say = print if rank == 0 else (lambda *args, **kwargs: None)

    latest = checkpoint.latest_checkpoint(config.checkpoint_dir)
    if latest is not None:
        saved_by = checkpoint.read_metadata(latest)["world_size"]
        not_restored = checkpoint.load(state, latest)
        say(f"resumed from {latest} at step {state['step']} on {world_size} rank(s) (saved by "
            f"{saved_by})", flush=True)
        if not_restored:
            say(f"the world size changed: {', '.join(not_restored)} start afresh from the "
                f"seed on each rank", flush=True)
    losses = {}
    for step in range(state["step"] + 1, config.steps + 1):
        try:
            loss = _step(rank, world_size, step, config, model, optimizer, grads, data,
                         sampler, guard, say, all_finite)
        except RuntimeError as error:
            if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
                raise
            raise CollectiveTimeout(
                f"rank {rank}, step {step}: a collective waited more than "
                f"{config.collective_timeout:g} s; a peer died or hangs. Ending the job; a "
                f"restart resumes from the newest complete checkpoint "
                f"({checkpoint.latest_checkpoint(config.checkpoint_dir)})") from error
        if loss is not None:
            losses[step] = loss
            say(f"step {step} loss {loss.hex()}", flush=True)
        state["step"] = step
        if step % config.checkpoint_every == 0:
            path = checkpoint.save(state, checkpoint.checkpoint_path(config.checkpoint_dir,
                                                                     step))
            say(f"saved {path}", flush=True)
    return losses


def _step(rank, world_size, step, config, model, optimizer, grads, data, sampler, guard,
          say, all_finite=None) -> float | None:
    """One training step; the global mean loss, or None if a guard skipped it."""
    indices = sampler.next_batch()[rank::world_size]
    ids, targets = data.batch(indices)
    noisy = torch.rand(ids.shape) < config.token_noise
    ids = torch.where(noisy, torch.randint_like(ids, config.vocab), ids)
    loss = model.loss(ids, targets)
    if step == config.nan_at_step and rank == config.nan_rank:
        loss = loss * float("nan")
    _maybe_fail(rank, step, config)
    loss.backward()
    if step == config.hang_at_step and rank == config.hang_rank:
        time.sleep(config.collective_timeout * 10)  # stuck: never joins the next collective
    local = [g for g in grads() if g is not None]
    squares = sum((g.double().pow(2).sum() for g in local), torch.zeros((), dtype=torch.float64))
    if all_finite is not None:  # the caller's guard, then the loss and the norm
        finite = all_finite(loss, local)
        summary = torch.stack([loss.detach().double() / world_size, squares])
        collectives.all_reduce(summary, when="loss and gradient norm")
        if not finite:
            say(f"step {step}: a non-finite loss or gradient on some rank (all_finite): step "
                f"skipped on all ranks", flush=True)
            optimizer.zero_grad()
            return None
        return _apply(step, optimizer, guard, local, summary[1], summary[0], say)
    # One all-reduce tells every rank which ranks saw a non-finite loss or gradient, the
    # global loss and the global squared gradient norm.
    flags = torch.zeros(2 * world_size + 2, dtype=torch.float64)
    flags[rank] = float(not torch.isfinite(loss).item())
    flags[world_size + rank] = float(not all(torch.isfinite(g).all().item() for g in local))
    flags[-2], flags[-1] = loss.detach().double() / world_size, squares
    collectives.all_reduce(flags, when="flags, loss and gradient norm")
    bad_loss = [r for r in range(world_size) if flags[r] > 0]
    bad_grads = [r for r in range(world_size) if flags[world_size + r] > 0]
    if bad_loss or bad_grads:
        say(f"step {step}: non-finite loss on rank(s) {bad_loss or 'none'}, non-finite "
            f"gradients on rank(s) {bad_grads or 'none'}: step skipped on all ranks",
            flush=True)
        optimizer.zero_grad()
        return None
    return _apply(step, optimizer, guard, local, flags[-1], flags[-2], say)


def _apply(step, optimizer, guard, local, squares, loss, say) -> float:
    """Clip a gradient-norm spike, step the optimizer; the global mean loss."""
    scale, report = guard.clip_factor(math.sqrt(squares.item()))
    if report is not None:
        say(f"step {step}: {report}", flush=True)
        for g in local:
            g.mul_(scale)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _maybe_fail(rank: int, step: int, config: TrainConfig) -> None:
    """Die abruptly, once per injected step, as a crashed process (or, with fail_scope "node",
    a crashed machine) would: no cleanup at all."""
    if step not in config.fail_at_step or rank != config.fail_rank:
        return
    marker = Path(config.checkpoint_dir) / f"injected_failure_step_{step}_rank_{rank}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    if config.fail_scope == "node":
        print(f"rank {rank}: injected failure of its node (torchrun agent {os.getppid()} and "
              f"its workers) at step {step}", file=sys.stderr, flush=True)
        _kill_node()
    else:
        print(f"rank {rank}: injected failure at step {step}", file=sys.stderr, flush=True)
        os._exit(1)


def _kill_node() -> None:
    """SIGKILL this worker's torchrun agent, then every worker it started, this one last.

    Killing the agent alone is not a node failure: the agent starts each worker in a session
    of its own, so its workers would train on, orphaned, and no survivor would notice."""
    agent = os.getppid()
    siblings = _children(agent) - {os.getpid()}  # listed first: the agent's death orphans them
    os.kill(agent, signal.SIGKILL)
    for sibling in siblings:
        os.kill(sibling, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _children(parent: int) -> set[int]:
    """The ids of the processes whose parent is `parent` (Linux: read from /proc)."""
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # the process ended meanwhile
                continue
            # Fields after the command name, which is in parentheses and may hold spaces.
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                children.add(int(entry.name))
    return children


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="python -m minidist.jobs.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainConfig(steps=1, checkpoint_dir="", checkpoint_every=1)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--checkpoint-every", type=int, required=True)
    parser.add_argument("--fail-at-step", type=int, nargs="+", default=[])
    parser.add_argument("--fail-scope", choices=("rank", "node"), default=defaults.fail_scope)
    parser.add_argument("--sharding", choices=("fsdp", "zero"), default=defaults.sharding)
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if name in ("steps", "checkpoint_dir", "checkpoint_every", "fail_at_step", "fail_scope",
                    "sharding"):
            continue
        kind = float if isinstance(value, float) else int
        parser.add_argument(flag, type=kind, default=value)
    return TrainConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    # Under torchrun each process is one rank already: run joins the job's process group with
    # `timeout` as the group's timeout. Started with plain python the job runs on one rank,
    # and `timeout` bounds the whole run: one collective timeout per step.
    launched = "WORLD_SIZE" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    timeout = config.collective_timeout * (1 if launched else config.steps + 1)
    try:
        run(train, world_size, config, timeout=timeout)
    except CollectiveTimeout as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        os._exit(1)  # a clean exit would wait in a barrier for the peer that hangs


if __name__ == "__main__":
    main()
