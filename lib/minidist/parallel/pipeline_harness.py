"""A pipeline from a notebook: start the ranks, run one step, and compare with PyTorch's own.

    from minidist.parallel import pipeline, pipeline_harness

    def build_stages():                     # the same model on every rank: seed it
        torch.manual_seed(0)
        return pipeline_exec.split_layers([nn.Linear(16, 16) for _ in range(8)], 4)

    s = pipeline.schedule("1f1b", ranks=4, microbatches=8)
    result = pipeline_harness.run_pipeline(s, build_stages, x, y, F.mse_loss, time_unit=0.02)
    result.grads            # {"0.0.weight": ..., ...}, named like nn.Sequential(*stages)
    result.timeline         # measured: .bubble_fraction, .peak_inflight, as simulated by
                            # pipeline_simulator.simulate

`reference_grads` runs the same step in one process; `run_torch_pipeline` runs it with
`torch.distributed.pipelining`, the schedule's PyTorch counterpart (`TORCH_SCHEDULES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from minidist.core import launch
from minidist.parallel.pipeline import Schedule
from minidist.parallel.pipeline_exec import (
    LossFn,
    PipelineDeadlock,
    check_stages,
    execute,
    split_microbatches,
    wait_limit,
)
from minidist.parallel.pipeline_simulator import Costs, Timeline
from minidist.parallel.pipeline_validator import validate

__all__ = ["PipelineRun", "run_pipeline", "reference_grads", "TORCH_SCHEDULES", "torch_step",
           "run_torch_pipeline"]


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
    trace = execute(schedule, mine, inputs, targets, loss_fn, costs=costs, time_unit=time_unit,
                    timeout=timeout)
    return _named_grads(mine), trace


def run_pipeline(schedule: Schedule, build_stages: Callable[[], Sequence[nn.Module]],
                 inputs: torch.Tensor, targets: torch.Tensor, loss_fn: LossFn,
                 *, costs: Costs | None = None, time_unit: float = 0.0,
                 timeout: float | None = None, check: bool = True) -> PipelineRun:
    """Start `schedule.ranks` ranks with `minidist.core.launch.run` and run one training step.

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
        timeout = wait_limit(schedule, costs or Costs(), time_unit)
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
    timeline = Timeline(schedule, [trace.events for trace in traces], measured=True)
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
