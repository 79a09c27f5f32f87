"""Run a pipeline schedule on real ranks, time every action, and say where a deadlock is stuck.

    trace = pipeline_exec.execute(schedule, {rank: stage}, inputs, targets, loss_fn)

on every rank of the pipeline group (from a notebook,
`minidist.parallel.pipeline_harness.run_pipeline` starts the ranks and gathers what they
measured). Three parts: the shapes each stage will
receive, exchanged before the first microbatch (`exchange_shapes`); the interpreter that runs
this rank's action list (`_Executor`); and the report of a deadlock (`_Reporter`).

Rank r runs the stages `schedule.stages_of(r)` and nothing else. It follows its action list
literally: a receive waits at its place for its `irecv` (posted a little ahead, while the
compute before it runs), a send posts `isend` and moves on (sends are waited for at the end);
every message is tagged with its stage and microbatch, so messages match by identity, never by
arrival order. F runs the stage (and, on the last stage, the loss divided by m,
so the summed gradients are those of the mean loss over the whole batch, as in single-process
training and in torch.distributed.pipelining with scale_grads=True), B backpropagates,
W accumulates weight gradients. When the backward is split, B computes the input gradient
with `torch.autograd.grad(..., retain_graph=True)` and W walks the graph again for the
weights: correct, but W repeats part of B's work. Real zero-bubble implementations split the
graph instead (PyTorch's `stage_backward_input` / `stage_backward_weight`). A stage that has
`set_requires_gradient_sync` (minidist's DDP, as FSDP2 in PyTorch) syncs its gradients only in
its last backward of the step.

Emulated compute. A 2-core laptop cannot show a 4-rank bubble with real math: the ranks fight
for the cores. With `time_unit` > 0 every compute action lasts at least its cost in
`pipeline_simulator.Costs` times `time_unit` seconds: the real (tiny) math runs, then the rank
sleeps for the rest. Sleeping takes no CPU, so the measured timeline is the schedule's, and its
bubble matches `pipeline_simulator.simulate` within a few points.

Deadlocks. Every wait has a time limit (`timeout`, seconds; gloo). A rank that runs out of
time publishes what it is stuck on in the job's key-value store, collects the other ranks'
reports, and raises `PipelineDeadlock` with one line per rank, e.g. "rank 2 is stuck at
F3<1, before compute action 3: waiting to receive the activation of microbatch 3 from rank 1".

Why one module of about 520 lines: running a schedule, timing each action and naming where a
deadlock is stuck read the same state: the action under way and what it waits on."""

from __future__ import annotations

import datetime
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from minidist.communication import collectives
from minidist.communication.comm import chunk_bounds
from minidist.communication.counting import uncounted
from minidist.core._checks import positive_int
from minidist.core._groups import members
from minidist.core.timeline import Event, clock
from minidist.parallel.pipeline import Action, Schedule, peer, position
from minidist.parallel.pipeline_simulator import Costs, action_event

__all__ = [
    "DEFAULT_TIMEOUT_S", "PipelineDeadlock", "split_layers", "split_microbatches",
    "check_stages", "exchange_shapes", "RankTrace", "execute", "wait_limit",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DEFAULT_TIMEOUT_S = 5.0
"""How long a wait may last, on top of the step's emulated compute, before it is a deadlock."""
_STORE_PREFIX = "minidist.parallel.pipeline_exec"
_calls = itertools.count()  # execute() calls so far, the same count on every rank


class PipelineDeadlock(RuntimeError):
    """Ranks waited longer than the timeout; `.reports` maps each rank to what it was doing."""

    def __init__(self, message: str, reports: dict[int, str] | None = None):
        super().__init__(message)
        self.reports = reports or {}


# --- Cutting a model into stages ---------------------------------------------------------------


def split_layers(layers: Sequence[nn.Module], num_stages: int) -> list[nn.Sequential]:
    """Cut a list of layers into `num_stages` consecutive stages of (nearly) equal length."""
    layers = list(layers)
    positive_int(num_stages=num_stages)
    if num_stages > len(layers):
        raise ValueError(
            f"{num_stages} stages but the model has only {len(layers)} layers: every stage "
            f"needs at least one layer; use at most {len(layers)} stages or a deeper model")
    return [nn.Sequential(*layers[start:end]) for start, end in chunk_bounds(len(layers),
                                                                             num_stages)]


def split_microbatches(batch: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """The batch cut along dim 0 into equal microbatches (equal, so that the mean of the
    microbatch losses is the loss of the batch)."""
    if batch.shape[0] % microbatches:
        raise ValueError(
            f"a batch of {batch.shape[0]} samples does not split into microbatches={microbatches} "
            f"equal parts; use a batch size divisible by {microbatches}")
    return list(batch.chunk(microbatches))


def _stage_output(stage: nn.Module, index: int, x: torch.Tensor) -> torch.Tensor:
    """`stage(x)`, with a shape mismatch at a stage boundary explained."""
    try:
        return stage(x)
    except RuntimeError as error:
        if index == 0:
            raise ValueError(f"stage 0 cannot take the input, of shape {tuple(x.shape)}: "
                             f"{error}") from None
        raise ValueError(
            f"stage {index} cannot take the output of stage {index - 1}, of shape "
            f"{tuple(x.shape)}: {error}. Adjacent stages must fit: stage {index - 1}'s last "
            f"layer must produce what stage {index}'s first layer takes") from None


def check_stages(stages: Sequence[nn.Module], example: torch.Tensor) -> list[torch.Size]:
    """Run one microbatch through the stages in order (no gradients) and return each stage's
    output shape; raise a clear ValueError at the first boundary where the shapes disagree."""
    shapes = []
    with torch.no_grad():
        x = example
        for index, stage in enumerate(stages):
            x = _stage_output(stage, index, x)
            shapes.append(x.shape)
    return shapes


# --- Before the first microbatch: the shapes each stage will receive ---------------------------

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
_Shape = tuple[torch.Size, torch.dtype]


def exchange_shapes(schedule: Schedule, stages: dict[int, nn.Module],
                    first_input: torch.Tensor | None, first_target: torch.Tensor | None,
                    loss_fn: LossFn, group: dist.ProcessGroup | None
                    ) -> tuple[dict[int, _Shape], dict[int, _Shape]]:
    """Walk the pipeline once: stage k's owner runs one microbatch's forward and backward
    (warming it up: the first backward in a process imports sympy, ~0.3 s, and would otherwise
    be timed) and tells stage k+1's owner the shape of what it will send. Returns (shape and
    dtype of each local stage's output, of each local stage's input that comes from another
    rank). Uncounted: set-up, not the step."""
    shape = first_input.shape if first_input is not None else None
    dtype = first_input.dtype if first_input is not None else torch.float32
    meta = torch.zeros(2 + 8, dtype=torch.int64)  # dtype code, ndim, up to 8 sizes
    outputs: dict[int, _Shape] = {}
    incoming: dict[int, _Shape] = {}
    last = schedule.num_stages - 1
    with uncounted():
        for k in sorted(stages):
            if k > 0 and k - 1 not in stages:
                dist.recv(meta, members(group)[schedule.rank_of(k - 1)], group=group)
                shape = torch.Size(meta[2:2 + int(meta[1])].tolist())
                dtype = _DTYPES[int(meta[0])]
                incoming[k] = (shape, dtype)
            out = _warm_up(stages[k], k, torch.zeros(shape, dtype=dtype),
                           first_target if k == last else None, loss_fn)
            shape, dtype = out.shape, out.dtype
            outputs[k] = (shape, dtype)
            if k < last and k + 1 not in stages:
                if len(shape) > 8 or dtype not in _DTYPES:
                    raise ValueError(f"stage {k} outputs {dtype} of shape {tuple(shape)}: the "
                                     "executor sends float tensors of at most 8 dimensions")
                meta.zero_()
                meta[0], meta[1] = _DTYPES.index(dtype), len(shape)
                meta[2:2 + len(shape)] = torch.tensor(shape)
                dist.send(meta, members(group)[schedule.rank_of(k + 1)], group=group)
    return outputs, incoming


def _warm_up(stage: nn.Module, k: int, x: torch.Tensor, target: torch.Tensor | None,
             loss_fn: LossFn) -> torch.Tensor:
    """Forward and backward of stage k on `x`, leaving no gradient behind."""
    if x.is_floating_point():
        x.requires_grad_()
    out = _stage_output(stage, k, x)
    result = loss_fn(out, target) if target is not None else out
    wrt = [p for p in stage.parameters() if p.requires_grad] + [x] * x.requires_grad
    if result.requires_grad and wrt:
        torch.autograd.grad(result, wrt, torch.ones_like(result), allow_unused=True)
    return out.detach()


# --- When a wait never ends: the deadlock report -------------------------------------------------


class _Reporter:
    """Each rank's last words in the job's key-value store: what it finished, or what it is
    stuck on; a rank that runs out of time collects everyone's into one PipelineDeadlock."""

    def __init__(self, pipeline_rank: int, ranks: int, group: dist.ProcessGroup | None,
                 timeout: float):
        self.pipeline_rank, self.ranks, self.timeout = pipeline_rank, ranks, timeout
        # one key per call and pipeline group: several pipelines may run side by side
        self.key = f"{_STORE_PREFIX}/{next(_calls)}/{members(group)[0]}"

    def publish(self, status: str) -> None:
        _store().set(f"{self.key}/{self.pipeline_rank}", f"rank {self.pipeline_rank} {status}")

    def deadlock(self) -> PipelineDeadlock:
        """Collect every rank's report (waiting at most one more timeout) into one error."""
        store, keys = _store(), [f"{self.key}/{rank}" for rank in range(self.ranks)]
        deadline = time.monotonic() + self.timeout
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        reports = {
            rank: store.get(key).decode() if store.check([key])
            else f"rank {rank} sent no report (still computing, or stuck outside a send/receive)"
            for rank, key in enumerate(keys)
        }
        stuck = sorted(rank for rank, text in reports.items() if "stuck" in text)
        message = (f"pipeline deadlock: rank(s) {', '.join(map(str, stuck))} stuck (time limit "
                   f"{self.timeout:g} s per wait)\n" + "\n".join(reports.values()))
        return PipelineDeadlock(message, reports)


_stores: dict[tuple[str, int], dist.TCPStore] = {}


def _store() -> dist.TCPStore:
    """A client of the job's key-value store (the rendezvous store at MASTER_ADDR:PORT)."""
    address = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if address not in _stores:
        _stores[address] = dist.TCPStore(*address, is_master=False,
                                         timeout=datetime.timedelta(seconds=30))
    return _stores[address]


# --- The interpreter: one rank's action list -----------------------------------------------------


@dataclass
class RankTrace:
    """What one rank did: its compute actions as `timeline.Event`s (whose `rank` is the
    global rank) and, on the last stage, each microbatch's loss (not divided by m)."""

    pipeline_rank: int  # this rank's place in the pipeline group
    events: list[Event]
    losses: list[float]


class _Mailbox:
    """One rank's point-to-point messages: sends posted and kept until the end, receives posted
    ahead of their place, and every wait bounded, ending in the deadlock report."""

    def __init__(self, schedule: Schedule, pipeline_rank: int,
                 group: dist.ProcessGroup | None, timeout: float):
        self.schedule, self.pipeline_rank, self.group = schedule, pipeline_rank, group
        self.actions = schedule.actions[pipeline_rank]
        self.timeout = datetime.timedelta(seconds=timeout)
        self.reporter = _Reporter(pipeline_rank, schedule.ranks, group, timeout)
        self.sends: list[tuple[int, Action, dist.Work, torch.Tensor]] = []
        self.receives: dict[Action, tuple[dist.Work, torch.Tensor]] = {}  # posted, not waited

    def send(self, index: int, action: Action, tensor: torch.Tensor) -> None:
        # send and receive address the global rank of the peer's pipeline rank
        to = members(self.group)[peer(self.schedule, action)]
        request = dist.isend(tensor.contiguous(), to, group=self.group,
                             tag=_tag(self.schedule, action))
        self.sends.append((index, action, request, tensor))  # keep it alive until sent

    # A receive is posted (irecv) ahead of its place in the list: when the rank starts the
    # compute action before it, so that the transfer overlaps that computation. It is waited
    # for at its place. Posting early never blocks, so this cannot add a deadlock.
    def post_receives(self, start: int, shape_of: Callable[[Action], _Shape]) -> None:
        """Post the receives from `start` up to the next compute action."""
        for action in itertools.takewhile(lambda a: not a.is_compute, self.actions[start:]):
            if action.kind.startswith("RECV") and action not in self.receives:
                shape, dtype = shape_of(action)
                buffer = torch.empty(shape, dtype=dtype)
                source = members(self.group)[peer(self.schedule, action)]
                request = dist.irecv(buffer, source, group=self.group,
                                     tag=_tag(self.schedule, action))
                self.receives[action] = (request, buffer)

    def receive(self, index: int, action: Action) -> torch.Tensor:
        request, buffer = self.receives.pop(action)
        self.wait(index, request, action.describe(self.schedule))
        return buffer

    def finish(self) -> None:
        """Wait until every send has been received."""
        for index, action, request, _ in self.sends:
            self.wait(index, request, f"wait until rank {peer(self.schedule, action)} receives "
                                      f"what it sent ({action.describe(self.schedule)})")
        self.reporter.publish("finished all its actions")

    def wait(self, index: int, request: dist.Work, doing: str) -> None:
        """Wait for a send or receive of the schedule; past the time limit, report a deadlock.
        A rank that gives up waiting closes its connections, so a peer still waiting on it
        sees "connection closed" rather than a timeout: that rank is stuck as well."""
        try:
            request.wait(self.timeout)
        except RuntimeError as error:
            text = str(error).lower()
            if "timed out" in text:
                why = ""
            elif "connection closed" in text or "connection reset" in text:
                why = " (until a peer gave up waiting and closed its connection)"
            else:
                raise
            where = position(self.schedule, self.pipeline_rank, index)
            self.reporter.publish(f"is stuck at {where}: waiting to {doing}{why}")
            raise self.reporter.deadlock() from None


class _Executor:
    """The state of one rank while it runs its action list: what each action computes, and
    the activations and gradients it keeps per (stage, microbatch) until the backward that
    frees them.

    Why one unit of about 140 lines: one short method per kind of action, in one place with the
    table that dispatches them; the messages are `_Mailbox`'s."""

    def __init__(self, schedule: Schedule, stages: dict[int, nn.Module],
                 inputs: torch.Tensor | None, targets: torch.Tensor | None, loss_fn: LossFn,
                 costs: Costs, time_unit: float, timeout: float,
                 group: dist.ProcessGroup | None):
        self.schedule, self.group, self.stages = schedule, group, stages
        self.pipeline_rank = dist.get_rank(group)  # this rank's place in the group
        self.actions = schedule.actions[self.pipeline_rank]
        self.loss_fn, self.costs, self.time_unit = loss_fn, costs, time_unit
        self.last = schedule.num_stages - 1
        m = schedule.microbatches
        self.inputs = split_microbatches(inputs, m) if 0 in stages else []
        self.targets = split_microbatches(targets, m) if self.last in stages else []
        self.mailbox = _Mailbox(schedule, self.pipeline_rank, group, timeout)
        # Per (stage, microbatch): the stage's input (a leaf that collects its gradient), its
        # output (the loss on the last stage), the gradient of its output, of its input.
        self.stage_input: dict[tuple[int, int], torch.Tensor] = {}
        self.stage_output: dict[tuple[int, int], torch.Tensor] = {}
        self.output_grad: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grad: dict[tuple[int, int], torch.Tensor] = {}
        self.events: list[Event] = []
        self.losses: list[float] = []
        # the last action of each stage that accumulates weight gradients: sync happens there
        accumulates = "W" if schedule.split_backward else "B"
        self.syncs = {k: max(i for i, a in enumerate(self.actions)
                             if a.kind == accumulates and a.stage == k) for k in stages}
        self.outputs: dict[int, _Shape] = {}
        self.incoming: dict[int, _Shape] = {}
        self.index = 0  # position in this rank's action list

    def run(self) -> RankTrace:
        self.outputs, self.incoming = exchange_shapes(
            self.schedule, self.stages, self.inputs[0] if self.inputs else None,
            self.targets[0] if self.targets else None, self.loss_fn, self.group)
        with uncounted():
            collectives.barrier(group=self.group, when="start the clock together")
        self.mailbox.post_receives(0, self.shape_of)
        for index, action in enumerate(self.actions):
            self.index = index
            if action.is_compute:
                self.mailbox.post_receives(index + 1, self.shape_of)
            self.ACTIONS[action.kind](self, action)
        self.mailbox.finish()
        return RankTrace(self.pipeline_rank, self.events, self.losses)

    def shape_of(self, receive: Action) -> _Shape:
        """What a receive brings: the previous stage's output, or this stage's output grad."""
        return (self.incoming if receive.kind == "RECV_F" else self.outputs)[receive.stage]

    # --- Communication ---

    def send_activation(self, action: Action) -> None:
        output = self.stage_output[action.stage, action.microbatch].detach()
        self.mailbox.send(self.index, action, output)

    def send_gradient(self, action: Action) -> None:
        grad = self.input_grad.pop((action.stage, action.microbatch))
        self.mailbox.send(self.index, action, grad)

    def receive_activation(self, action: Action) -> None:
        buffer = self.mailbox.receive(self.index, action)
        self.stage_input[action.stage, action.microbatch] = buffer.requires_grad_()

    def receive_gradient(self, action: Action) -> None:
        grad = self.mailbox.receive(self.index, action)
        self.output_grad[action.stage, action.microbatch] = grad

    # --- Compute ---

    def forward(self, action: Action) -> None:
        k, j = action.stage, action.microbatch
        with self.timed(action):
            x = self.inputs[j] if k == 0 else self.stage_input[k, j]
            out = self.stages[k](x)
            if k == self.last:
                loss = self.loss_fn(out, self.targets[j])
                self.losses.append(loss.item())
                out = loss / self.schedule.microbatches
            elif k + 1 in self.stages:
                self.stage_input[k + 1, j] = out.detach().requires_grad_()
            self.stage_output[k, j] = out

    def backward(self, action: Action) -> None:
        k, j = action.stage, action.microbatch
        with self.timed(action):
            grad = self.grad_of_output(k, j)
            out, x = self.stage_output[k, j], self.stage_input.get((k, j))
            if self.schedule.split_backward:
                if x is not None:
                    (self.input_grad[k, j],) = torch.autograd.grad(out, x, grad, retain_graph=True)
                return
            self.sync_if_last(k)
            torch.autograd.backward(out, grad)
            if x is not None:
                self.input_grad[k, j] = x.grad
            self.release(k, j)

    def weight_gradient(self, action: Action) -> None:
        k, j = action.stage, action.microbatch
        with self.timed(action):
            weights = [p for p in self.stages[k].parameters() if p.requires_grad]
            self.sync_if_last(k)
            torch.autograd.backward(self.stage_output[k, j], self.grad_of_output(k, j),
                                    inputs=weights)
            self.release(k, j)

    # What each kind of action runs (the kinds of minidist.parallel.pipeline.Action).
    ACTIONS: dict[str, Callable[[_Executor, Action], None]] = {
        "F": forward, "B": backward, "W": weight_gradient,
        "SEND_F": send_activation, "RECV_F": receive_activation,
        "SEND_B": send_gradient, "RECV_B": receive_gradient,
    }

    def sync_if_last(self, k: int) -> None:
        """Let a data-parallel stage all-reduce its gradients in its last backward only."""
        stage = self.stages[k]
        if hasattr(stage, "set_requires_gradient_sync"):
            stage.set_requires_gradient_sync(self.index == self.syncs[k])

    def grad_of_output(self, k: int, j: int) -> torch.Tensor | None:
        if k == self.last:
            return None  # the output is the loss
        if k + 1 in self.stages:
            return self.input_grad[k + 1, j]
        return self.output_grad[k, j]

    def release(self, k: int, j: int) -> None:
        """Free microbatch j's activations on stage k: its backward is complete."""
        for store in (self.stage_output, self.output_grad, self.stage_input):
            store.pop((k, j), None)
        self.input_grad.pop((k + 1, j), None)

    def timed(self, action: Action) -> _Timed:
        seconds = self.costs.of(action, self.schedule.split_backward) * self.time_unit
        return _Timed(self, action, seconds)


def _tag(schedule: Schedule, action: Action) -> int:
    """The message's own tag, the same on both sides: messages between two ranks are then
    matched by what they are, not by the order in which they were posted (tag 0 is left for
    the shape exchange)."""
    gradient = action.kind.endswith("B")
    boundary = action.stage - (action.kind in ("RECV_F", "SEND_B"))  # the lower stage's index
    return 1 + 2 * (boundary * schedule.microbatches + action.microbatch) + gradient


class _Timed:
    """Times a compute action; with emulated compute, makes it last at least `seconds`."""

    def __init__(self, executor: _Executor, action: Action, seconds: float):
        self.executor, self.action, self.seconds = executor, action, seconds

    def __enter__(self) -> None:
        self.start = clock()

    def __exit__(self, *exc: object) -> None:
        left = self.start + self.seconds - clock()
        if left > 0:
            time.sleep(left)
        executor = self.executor
        # the event's rank is the global rank, as every Event's is
        executor.events.append(action_event(dist.get_rank(), self.action, self.start, clock()))


def wait_limit(schedule: Schedule, costs: Costs, time_unit: float) -> float:
    """The default time limit of a wait: DEFAULT_TIMEOUT_S plus all emulated compute."""
    emulated = sum(costs.of(a, schedule.split_backward) for ops in schedule.actions
                   for a in ops if a.is_compute)
    return DEFAULT_TIMEOUT_S + emulated * time_unit


def execute(schedule: Schedule, stages: dict[int, nn.Module], inputs: torch.Tensor | None,
            targets: torch.Tensor | None, loss_fn: LossFn, *, costs: Costs | None = None,
            time_unit: float = 0.0, timeout: float | None = None,
            group: dist.ProcessGroup | None = None) -> RankTrace:
    """Run this rank's part of `schedule`; call it on every rank of the process group, or of
    `group` (e.g. a mesh's "pp" group), whose ranks are then the schedule's pipeline ranks.

    `stages` maps each stage this rank holds (`schedule.stages_of(r)`, r its rank in the
    pipeline group) to its module. `inputs` (the whole batch) is needed on the rank holding
    stage 0, `targets` on the rank holding the last stage; both are cut into
    `schedule.microbatches` equal microbatches. Gradients accumulate in the stages'
    parameters. With `time_unit` > 0 each compute action lasts at least its cost in `costs`
    (default `Costs()`) times `time_unit` seconds. A wait longer than `timeout` seconds raises
    `PipelineDeadlock`, with what every rank waits on; the default, `DEFAULT_TIMEOUT_S` plus
    the emulated compute of the whole step, is longer than any wait of a schedule that can
    finish.
    """
    pipeline_rank = dist.get_rank(group)
    if dist.get_world_size(group) != schedule.ranks:
        raise ValueError(f"the schedule has {schedule.ranks} ranks but the process group has "
                         f"{dist.get_world_size(group)}: start {schedule.ranks} ranks")
    if sorted(stages) != schedule.stages_of(pipeline_rank):
        raise ValueError(f"pipeline rank {pipeline_rank} holds stages "
                         f"{schedule.stages_of(pipeline_rank)} in this schedule, but got "
                         f"modules for stages {sorted(stages)}")
    if 0 in stages and inputs is None:
        raise ValueError(f"pipeline rank {pipeline_rank} holds stage 0 and needs the inputs")
    if schedule.num_stages - 1 in stages and targets is None:
        raise ValueError(f"pipeline rank {pipeline_rank} holds the last stage and needs the "
                         f"targets")
    costs = costs or Costs()
    costs.check(schedule.num_stages)
    timeout = wait_limit(schedule, costs, time_unit) if timeout is None else timeout
    return _Executor(schedule, stages, inputs, targets, loss_fn, costs, time_unit, timeout,
                     group).run()


