"""Run a pipeline schedule on real ranks, time every action, and say where a deadlock is stuck.

    from minidist import pipeline, pipeline_exec

    def build_stages():                     # the same model on every rank: seed it
        torch.manual_seed(0)
        return pipeline_exec.split_layers([nn.Linear(16, 16) for _ in range(8)], 4)

    s = pipeline.schedule("1f1b", ranks=4, microbatches=8)
    result = pipeline_exec.run_pipeline(s, build_stages, x, y, F.mse_loss, time_unit=0.02)
    result.grads            # {"0.0.weight": ..., ...}, named like nn.Sequential(*stages)
    result.timeline         # measured: .bubble_fraction, .peak_inflight, like pipeline.simulate

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
graph instead (PyTorch's `stage_backward_input` / `stage_backward_weight`).

Emulated compute. A 2-core laptop cannot show a 4-rank bubble with real math: the ranks fight
for the cores. With `time_unit` > 0 every compute action lasts at least its cost in
`pipeline.Costs` times `time_unit` seconds: the real (tiny) math runs, then the rank sleeps for
the rest. Sleeping takes no CPU, so the measured timeline is the schedule's, and its bubble
matches `pipeline.simulate` within a few points.

Deadlocks. Every wait has a time limit (`timeout`, seconds; gloo). A rank that runs out of
time publishes what it is stuck on in the job's key-value store, collects the other ranks'
reports, and raises `PipelineDeadlock` with one line per rank, e.g. "rank 2 is stuck at
action 4 (F3<1): waiting to receive the activation of microbatch 3 from rank 1".
"""

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

from minidist import comm, launch
from minidist._checks import first_rank, positive_int
from minidist.comm import chunk_bounds
from minidist.pipeline import Action, Costs, Schedule, Span, Timeline, peer, validate

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
DEFAULT_TIMEOUT_S = 5.0
"""How long a wait may last, on top of the step's emulated compute, before it is a deadlock."""
_STORE_PREFIX = "minidist.pipeline_exec"
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


# --- One rank ------------------------------------------------------------------------------------


@dataclass
class RankTrace:
    """What one rank did: its compute spans (wall-clock seconds, `time.time()`) and, on the
    last stage, each microbatch's loss (not divided by m)."""

    rank: int
    spans: list[Span]
    losses: list[float]


class _Executor:
    """The state of one rank while it runs its action list."""

    def __init__(self, schedule: Schedule, stages: dict[int, nn.Module],
                 inputs: torch.Tensor | None, targets: torch.Tensor | None, loss_fn: LossFn,
                 costs: Costs, time_unit: float, timeout: float,
                 group: dist.ProcessGroup | None):
        self.schedule = schedule
        self.group = group
        self.rank = dist.get_rank(group)  # the pipeline rank: this rank's place in the group
        self.stages = stages
        self.loss_fn = loss_fn
        self.costs = costs
        self.time_unit = time_unit
        self.timeout = datetime.timedelta(seconds=timeout)
        self.last = schedule.num_stages - 1
        m = schedule.microbatches
        self.inputs = split_microbatches(inputs, m) if 0 in stages else []
        self.targets = split_microbatches(targets, m) if self.last in stages else []
        # one key per call and pipeline group: several pipelines may run side by side
        self.key = f"{_STORE_PREFIX}/{next(_calls)}/{first_rank(group)}"
        # Per (stage, microbatch): the stage's input (a leaf that collects its gradient), its
        # output (the loss on the last stage), the gradient of its output, of its input.
        self.stage_input: dict[tuple[int, int], torch.Tensor] = {}
        self.stage_output: dict[tuple[int, int], torch.Tensor] = {}
        self.output_grad: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grad: dict[tuple[int, int], torch.Tensor] = {}
        self.sends: list[tuple[int, Action, dist.Work, torch.Tensor]] = []
        self.receives: dict[Action, tuple[dist.Work, torch.Tensor]] = {}  # posted, not waited
        self.spans: list[Span] = []
        self.losses: list[float] = []
        # Shape and dtype of each local stage's output, and of each local stage's input that
        # comes from another rank.
        self.boundary: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self.incoming: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self.index = 0  # position in this rank's action list

    def local(self, stage: int) -> bool:
        return stage in self.stages

    def global_rank(self, pipeline_rank: int) -> int:
        """The process group's rank of the pipeline rank, which send and receive take."""
        return pipeline_rank if self.group is None else dist.get_global_rank(self.group,
                                                                             pipeline_rank)

    # Shapes: before the first microbatch, stage k's owner tells stage k+1's owner the shape
    # of what it will send, walking the pipeline once. It also checks that stages fit.
    def exchange_shapes(self) -> None:
        shape: torch.Size | None = self.inputs[0].shape if self.inputs else None
        dtype = self.inputs[0].dtype if self.inputs else torch.float32
        meta = torch.zeros(2 + 8, dtype=torch.int64)  # dtype code, ndim, up to 8 sizes
        dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
        for k in range(self.schedule.num_stages):
            if not self.local(k):
                continue
            if k > 0 and not self.local(k - 1):
                request = dist.irecv(meta, self.global_rank(self.schedule.rank_of(k - 1)),
                                     group=self.group)
                request.wait()  # setup, not the schedule: the process group's time limit
                ndim = int(meta[1])
                shape, dtype = torch.Size(meta[2:2 + ndim].tolist()), dtypes[int(meta[0])]
                self.incoming[k] = (shape, dtype)
            out = self.warm_up(k, torch.zeros(shape, dtype=dtype))
            shape, dtype = out.shape, out.dtype
            self.boundary[k] = (shape, dtype)
            if k < self.last and not self.local(k + 1):
                if len(shape) > 8 or dtype not in dtypes:
                    raise ValueError(f"stage {k} outputs {dtype} of shape {tuple(shape)}: the "
                                     "executor sends float tensors of at most 8 dimensions")
                meta.zero_()
                meta[0], meta[1] = dtypes.index(dtype), len(shape)
                meta[2:2 + len(shape)] = torch.tensor(shape)
                request = dist.isend(meta.clone(),
                                     self.global_rank(self.schedule.rank_of(k + 1)),
                                     group=self.group)
                request.wait()

    def warm_up(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Forward and backward of stage k on `x`, leaving no gradient behind: the first
        backward in a process is slow (it imports sympy, ~0.3 s), and would otherwise be
        timed."""
        if x.is_floating_point():
            x.requires_grad_()
        out = _stage_output(self.stages[k], k, x)
        result = self.loss_fn(out, self.targets[0]) if k == self.last else out
        wrt = [p for p in self.stages[k].parameters() if p.requires_grad] + [x] * x.requires_grad
        if result.requires_grad and wrt:
            torch.autograd.grad(result, wrt, torch.ones_like(result), allow_unused=True)
        return out.detach()

    def run(self) -> RankTrace:
        with comm.uncounted():  # set-up, not the step: count_traffic sees only the schedule
            self.exchange_shapes()
        dist.barrier(group=self.group)  # start the clock together
        actions = self.schedule.actions[self.rank]
        self.post_receives(0)
        for index, action in enumerate(actions):
            self.index = index
            if action.is_compute:
                self.post_receives(index + 1)
            self.ACTIONS[action.kind](self, action)
        for index, action, request, _ in self.sends:
            self.index = index
            self.wait(request, f"wait until rank {peer(self.schedule, action)} receives what "
                               f"action {index} sent ({action.describe(self.schedule)})")
        self.publish("finished all its actions")
        return RankTrace(self.rank, self.spans, self.losses)

    # --- Communication ---

    def send_activation(self, action: Action) -> None:
        self.send(action, self.stage_output[action.stage, action.microbatch].detach())

    def send_gradient(self, action: Action) -> None:
        self.send(action, self.input_grad.pop((action.stage, action.microbatch)))

    def send(self, action: Action, tensor: torch.Tensor) -> None:
        request = dist.isend(tensor.contiguous(), self.global_rank(peer(self.schedule, action)),
                             group=self.group, tag=_tag(self.schedule, action))
        self.sends.append((self.index, action, request, tensor))  # keep it alive until sent

    # A receive is posted (irecv) ahead of its place in the list: when the rank starts the
    # compute action before it, so that the transfer overlaps that computation. It is waited
    # for at its place. Posting early never blocks, so this cannot add a deadlock.
    def post_receives(self, start: int) -> None:
        """Post the receives from `start` up to the next compute action."""
        for action in itertools.takewhile(lambda a: not a.is_compute,
                                          self.schedule.actions[self.rank][start:]):
            if action.kind.startswith("RECV") and action not in self.receives:
                shape, dtype = (self.incoming[action.stage] if action.kind == "RECV_F"
                                else self.boundary[action.stage])
                buffer = torch.empty(shape, dtype=dtype)
                request = dist.irecv(buffer, self.global_rank(peer(self.schedule, action)),
                                     group=self.group, tag=_tag(self.schedule, action))
                self.receives[action] = (request, buffer)

    def receive(self, action: Action) -> torch.Tensor:
        request, buffer = self.receives.pop(action)
        self.wait(request, action.describe(self.schedule))
        return buffer

    def receive_activation(self, action: Action) -> None:
        buffer = self.receive(action)
        self.stage_input[action.stage, action.microbatch] = buffer.requires_grad_()

    def receive_gradient(self, action: Action) -> None:
        self.output_grad[action.stage, action.microbatch] = self.receive(action)

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
            elif self.local(k + 1):
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
            torch.autograd.backward(out, grad)
            if x is not None:
                self.input_grad[k, j] = x.grad
            self.release(k, j)

    def weight_gradient(self, action: Action) -> None:
        k, j = action.stage, action.microbatch
        with self.timed(action):
            weights = [p for p in self.stages[k].parameters() if p.requires_grad]
            torch.autograd.backward(self.stage_output[k, j], self.grad_of_output(k, j),
                                    inputs=weights)
            self.release(k, j)

    # What each kind of action runs (the kinds of minidist.pipeline.Action).
    ACTIONS: dict[str, Callable[[_Executor, Action], None]] = {
        "F": forward, "B": backward, "W": weight_gradient,
        "SEND_F": send_activation, "RECV_F": receive_activation,
        "SEND_B": send_gradient, "RECV_B": receive_gradient,
    }

    def grad_of_output(self, k: int, j: int) -> torch.Tensor | None:
        if k == self.last:
            return None  # the output is the loss
        if self.local(k + 1):
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

    # --- Waiting, and what to say when a wait never ends ---

    def wait(self, request: dist.Work, doing: str) -> None:
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
            action = self.schedule.actions[self.rank][self.index]
            label = action.label(self.schedule, self.schedule.chunks > 1)
            self.publish(f"is stuck at action {self.index} ({label}): waiting to {doing}{why}")
            raise self.deadlock() from None

    def publish(self, status: str) -> None:
        _store().set(f"{self.key}/{self.rank}", f"rank {self.rank} {status}")

    def deadlock(self) -> PipelineDeadlock:
        """Collect every rank's report (waiting at most one more timeout) into one error."""
        store, ranks = _store(), range(self.schedule.ranks)
        keys = [f"{self.key}/{rank}" for rank in ranks]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        reports = {
            rank: store.get(key).decode() if store.check([key])
            else f"rank {rank} sent no report (still computing, or stuck outside a send/receive)"
            for rank, key in zip(ranks, keys, strict=True)
        }
        stuck = sorted(rank for rank, text in reports.items() if "stuck" in text)
        message = (f"pipeline deadlock: rank(s) {', '.join(map(str, stuck))} stuck (time limit "
                   f"{self.timeout.total_seconds():g} s per wait)\n" + "\n".join(reports.values()))
        return PipelineDeadlock(message, reports)


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
        self.start = time.time()

    def __exit__(self, *exc: object) -> None:
        left = self.start + self.seconds - time.time()
        if left > 0:
            time.sleep(left)
        executor = self.executor
        executor.spans.append(Span(executor.rank, self.action, self.start, time.time()))


_stores: dict[tuple[str, int], dist.TCPStore] = {}


def _store() -> dist.TCPStore:
    """A client of the job's key-value store (the rendezvous store at MASTER_ADDR:PORT)."""
    address = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if address not in _stores:
        _stores[address] = dist.TCPStore(*address, is_master=False,
                                         timeout=datetime.timedelta(seconds=30))
    return _stores[address]


def _wait_limit(schedule: Schedule, costs: Costs, time_unit: float) -> float:
    """The default time limit of a wait: DEFAULT_TIMEOUT_S plus all emulated compute."""
    emulated = sum(costs.of(a, schedule.split_backward) for ops in schedule.actions
                   for a in ops if a.is_compute)
    return DEFAULT_TIMEOUT_S + emulated * time_unit


def execute(schedule: Schedule, stages: dict[int, nn.Module], inputs: torch.Tensor | None,
            targets: torch.Tensor | None, loss_fn: LossFn, costs: Costs | None = None,
            time_unit: float = 0.0, timeout: float | None = None,
            group: dist.ProcessGroup | None = None) -> RankTrace:
    """Run this rank's part of `schedule`; call it on every rank of the process group, or of
    `group` (e.g. a mesh's "pp" group), whose ranks are then the schedule's pipeline ranks.

    `stages` maps each stage this rank holds (`schedule.stages_of(rank)`) to its module.
    `inputs` (the whole batch) is needed on the rank holding stage 0, `targets` on the rank
    holding the last stage; both are cut into `schedule.microbatches` equal microbatches.
    Gradients accumulate in the stages' parameters. With `time_unit` > 0 each compute action
    lasts at least its cost in `costs` (default `Costs()`) times `time_unit` seconds. A wait
    longer than `timeout` seconds raises `PipelineDeadlock`, with what every rank waits on;
    the default, `DEFAULT_TIMEOUT_S` plus the emulated compute of the whole step, is longer
    than any wait of a schedule that can finish.
    """
    rank = dist.get_rank(group)
    if dist.get_world_size(group) != schedule.ranks:
        raise ValueError(f"the schedule has {schedule.ranks} ranks but the process group has "
                         f"{dist.get_world_size(group)}: start {schedule.ranks} ranks")
    if sorted(stages) != schedule.stages_of(rank):
        raise ValueError(f"rank {rank} holds stages {schedule.stages_of(rank)} in this schedule, "
                         f"but got modules for stages {sorted(stages)}")
    if 0 in stages and inputs is None:
        raise ValueError(f"rank {rank} holds stage 0 and needs the inputs")
    if schedule.num_stages - 1 in stages and targets is None:
        raise ValueError(f"rank {rank} holds the last stage and needs the targets")
    costs = costs or Costs()
    costs.check(schedule.num_stages)
    timeout = _wait_limit(schedule, costs, time_unit) if timeout is None else timeout
    return _Executor(schedule, stages, inputs, targets, loss_fn, costs, time_unit, timeout,
                     group).run()


# --- From a notebook: start the ranks, run, compare ----------------------------------------------


@dataclass
class PipelineRun:
    """One training step run by `run_pipeline`: the measured timeline, the gradient of every
    parameter (named like `nn.Sequential(*stages).named_parameters()`) and the batch loss."""

    timeline: Timeline
    grads: dict[str, torch.Tensor]
    loss: float


def _named_grads(stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{k}.{name}": param.grad.clone() for k, stage in stages.items()
            for name, param in stage.named_parameters() if param.grad is not None}


def _build(build_stages: Callable[[], Sequence[nn.Module]], num_stages: int) -> list[nn.Module]:
    stages = list(build_stages())
    if len(stages) != num_stages:
        raise ValueError(f"build_stages() returned {len(stages)} stages but the schedule has "
                         f"{num_stages} (ranks x chunks)")
    return stages


def _pipeline_rank(rank: int, world_size: int, schedule: Schedule, build_stages, inputs, targets,
                   loss_fn, costs, time_unit, timeout):
    stages = _build(build_stages, schedule.num_stages)
    mine = {k: stages[k] for k in schedule.stages_of(rank)}
    trace = execute(schedule, mine, inputs, targets, loss_fn, costs, time_unit, timeout)
    return _named_grads(mine), trace


def run_pipeline(schedule: Schedule, build_stages: Callable[[], Sequence[nn.Module]],
                 inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn,
                 costs: Costs | None = None, time_unit: float = 0.0,
                 timeout: float | None = None, check: bool = True) -> PipelineRun:
    """Start `schedule.ranks` ranks with `minidist.launch.run` and run one training step.

    `build_stages()` must return the same `schedule.num_stages` modules on every call (seed
    it); each rank builds them and keeps its own. With `check=True` the schedule is validated
    and the stages are checked to fit together before any rank starts. `costs`, `time_unit` and
    `timeout` are as in `execute`. A deadlock raises `PipelineDeadlock` here, with one line per
    rank saying what it waits for.
    """
    if check:
        validate(schedule)
        check_stages(_build(build_stages, schedule.num_stages),
                     split_microbatches(inputs, schedule.microbatches)[0])
    if timeout is None:
        timeout = _wait_limit(schedule, costs or Costs(), time_unit)
    # A deadlocked rank waits one timeout, then up to one more for the others' reports.
    limit = max(launch.DEFAULT_TIMEOUT_S, 2 * timeout + 10)
    try:
        results = launch.run(_pipeline_rank, schedule.ranks, schedule, build_stages, inputs,
                             targets, loss_fn, costs, time_unit, timeout, timeout=limit)
    except launch.RankError as error:
        marker = f"{PipelineDeadlock.__name__}: "
        if marker in error.traceback:
            report = error.traceback.split(marker, 1)[1].strip()
            raise PipelineDeadlock(report) from None
        raise
    grads = {name: grad for rank_grads, _ in results for name, grad in rank_grads.items()}
    traces = [trace for _, trace in results]
    losses = [loss for trace in traces for loss in trace.losses]
    timeline = Timeline(schedule, [trace.spans for trace in traces], measured=True)
    return PipelineRun(timeline, grads, sum(losses) / len(losses))


def reference_grads(build_stages: Callable[[], Sequence[nn.Module]], inputs: torch.Tensor,
                    targets: torch.Tensor, loss_fn: LossFn
                    ) -> tuple[dict[str, torch.Tensor], float]:
    """Gradients and loss of one step on the whole batch in this process, no pipeline."""
    model = nn.Sequential(*build_stages())
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, loss.item()


TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                   "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble"}
"""The torch.distributed.pipelining class that runs each named schedule; PyTorch implements
ZB-H1 as its interleaved zero-bubble schedule (ZB1P) with one stage per rank."""


def torch_step(schedule: Schedule, stages: dict[int, nn.Module], inputs: torch.Tensor | None,
               targets: torch.Tensor | None, loss_fn: LossFn) -> list[str] | None:
    """This rank's part of the same step run by PyTorch's `torch.distributed.pipelining`,
    with the class `TORCH_SCHEDULES[schedule.name]`; arguments as for `execute`. Gradients
    accumulate in the stages' parameters. Returns, for the schedules PyTorch runs from an
    action list (interleaved, zb-h1), this rank's compute actions in its order, labelled as
    ours ("F3@5"; PyTorch's I, the input gradient, is our split B); None for the others."""
    from torch.distributed import pipelining

    if schedule.name not in TORCH_SCHEDULES:
        raise ValueError(f"PyTorch has no counterpart for schedule {schedule.name!r}; "
                         f"choose one of {', '.join(TORCH_SCHEDULES)}")
    rank = dist.get_rank()
    pipeline_stages = [pipelining.PipelineStage(stages[k], k, schedule.num_stages,
                                                torch.device("cpu"))
                       for k in schedule.stages_of(rank)]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule.name])
    single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
    runner = cls(pipeline_stages[0] if single else pipeline_stages, schedule.microbatches,
                 loss_fn=loss_fn)
    last = schedule.num_stages - 1 in stages
    runner.step(*([inputs] if 0 in stages else []),
                **({"target": targets, "losses": []} if last else {}))
    if single:
        return None
    letters = {"F": "F", "B": "B", "I": "B", "W": "W"}
    return [f"{letters[a.computation_type.value]}{a.microbatch_index}@{a.stage_index}"
            for a in runner.pipeline_order[rank]
            if a is not None and a.computation_type.value in letters]


def _torch_rank(rank: int, world_size: int, schedule: Schedule, build_stages, inputs, targets,
                loss_fn):
    stages = _build(build_stages, schedule.num_stages)
    mine = {k: stages[k] for k in schedule.stages_of(rank)}
    order = torch_step(schedule, mine, inputs, targets, loss_fn)
    return _named_grads(mine), order


def run_torch_pipeline(schedule: Schedule, build_stages: Callable[[], Sequence[nn.Module]],
                       inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn
                       ) -> tuple[dict[str, torch.Tensor], list[list[str]] | None]:
    """The same step with PyTorch's own pipelining (`TORCH_SCHEDULES[schedule.name]`).

    Returns the gradients, named as by `run_pipeline`, and, for the schedules PyTorch runs
    from an action list (interleaved, zb-h1), each rank's compute actions in its order
    (labels like "F3@5"); None for the others.
    """
    if schedule.name not in TORCH_SCHEDULES:
        raise ValueError(f"PyTorch has no counterpart for schedule {schedule.name!r}; "
                         f"choose one of {', '.join(TORCH_SCHEDULES)}")
    results = launch.run(_torch_rank, schedule.ranks, schedule, build_stages, inputs, targets,
                         loss_fn)
    grads = {name: grad for rank_grads, _ in results for name, grad in rank_grads.items()}
    orders = [order for _, order in results]
    return grads, None if orders[0] is None else orders
