"""The pipeline simulator: a schedule (`minidist.parallel.pipeline`) run on paper, as a
`Timeline` with its makespan, bubble and microbatches in flight per rank.

    from minidist.parallel import pipeline, pipeline_simulator

    t = pipeline_simulator.simulate(pipeline.schedule("1f1b", ranks=4, microbatches=8))
    print(t.table())                    # one column per time unit, "." where a rank idles
    t.makespan, t.bubble_fraction, t.peak_inflight

Each rank runs its actions in order; a compute action takes its `Costs`, a send never waits,
a receive waits for its send (plus `Costs.latency`). A schedule in which no rank can move
raises a `ScheduleError` naming every stuck rank and the cycle of ranks waiting for each
other. `minidist.parallel.pipeline_exec` measures the same `Timeline` on real ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from minidist.core.timeline import Event
from minidist.parallel.pipeline import Action, Schedule, ScheduleError, matching, peer, position

__all__ = ["Costs", "action_event", "Timeline", "simulate"]


@dataclass(frozen=True)
class Costs:
    """Time of each compute action, in any unit: F forward, B input gradient, W weight
    gradient, for one microbatch through one stage. A schedule that does not split the
    backward runs B and W as one action costing B + W, so the default Costs() is the usual
    assumption backward = 2 x forward. Each may be one number or a list with one entry per
    stage. `latency` is the time from a send until its receive can complete."""

    F: float | Sequence[float] = 1.0
    B: float | Sequence[float] = 1.0
    W: float | Sequence[float] = 1.0
    latency: float = 0.0

    def of(self, action: Action, split_backward: bool) -> float:
        """Duration of a compute action."""
        def at(value: float | Sequence[float]) -> float:
            return value[action.stage] if isinstance(value, Sequence) else value

        if action.kind == "F":
            return at(self.F)
        if action.kind == "B":
            return at(self.B) if split_backward else at(self.B) + at(self.W)
        return at(self.W)

    def check(self, num_stages: int) -> None:
        for name in ("F", "B", "W"):
            value = getattr(self, name)
            values = list(value) if isinstance(value, Sequence) else [value]
            if isinstance(value, Sequence) and len(values) != num_stages:
                raise ValueError(f"Costs.{name} has {len(values)} entries for {num_stages} "
                                 "stages: give one per stage, or a single number")
            if any(not isinstance(x, (int, float)) or x < 0 for x in values):
                raise ValueError(f"Costs.{name}={value!r}: costs must be numbers >= 0")
        if self.latency < 0:
            raise ValueError(f"Costs.latency={self.latency!r}: must be >= 0")


def action_event(rank: int, action: Action, start: float, end: float) -> Event:
    """The `timeline.Event` of a compute action that ran on `rank` from `start` to `end`:
    kind F, B or W, named by its label ("F3@1"), the action itself as `detail`."""
    return Event(rank, action.kind, action.label(), start, end, action)


@dataclass
class Timeline:
    """What each rank computed and when: simulated by `simulate`, or measured by
    `minidist.parallel.pipeline_exec`. `events[rank]` lists the rank's compute actions in order,
    as `timeline.Event`s whose `detail` is the `Action`. `table()` lays it out in time."""

    schedule: Schedule
    events: list[list[Event]]
    measured: bool = False

    @property
    def start(self) -> float:
        return min((e.start for events in self.events for e in events), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first action's start to the last action's end, over all ranks."""
        return max((e.end for events in self.events for e in events), default=0.0) - self.start

    @property
    def busy(self) -> list[float]:
        """Per rank, the time spent computing."""
        return [sum(e.duration for e in events) for events in self.events]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of total rank-time: 1 - (total busy time) / (ranks x makespan)."""
        total = self.schedule.ranks * self.makespan
        return 1 - sum(self.busy) / total if total else 0.0

    @property
    def peak_inflight(self) -> list[int]:
        """Per rank (pipeline stage), the most microbatches whose activations it holds at
        once: counted from a forward until the backward that frees them (W when split).
        With several chunks per rank it counts chunk-microbatches."""
        frees = "W" if self.schedule.split_backward else "B"
        peaks = []
        for events in self.events:
            held = peak = 0
            for event in events:
                held += (event.kind == "F") - (event.kind == frees)
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def table(self, unit: float | None = None) -> str:
        """One row per rank, one column per `unit` of time (default: the shortest action);
        an action fills the columns it covers, "." marks idle time."""
        durations = [e.duration for events in self.events for e in events if e.duration > 0]
        unit = unit or min(durations, default=1.0)
        columns = max(1, round(self.makespan / unit))
        show_stage = self.schedule.chunks > 1
        grid = [["."] * columns for _ in self.events]
        for rank, events in enumerate(self.events):
            for event in events:
                first = round((event.start - self.start) / unit)
                last = max(first + 1, round((event.end - self.start) / unit))
                for column in range(first, min(last, columns)):
                    grid[rank][column] = event.detail.label(show_stage=show_stage)
        width = max(len(cell) for row in grid for cell in row)
        header = "time  " + " ".join(str(c % 10).rjust(width) for c in range(columns))
        rows = [f"rank {r} " + " ".join(cell.rjust(width) for cell in row)
                for r, row in enumerate(grid)]
        summary = (f"makespan {self.makespan:.4g}, bubble {self.bubble_fraction:.1%}, "
                   f"peak in flight {self.peak_inflight}")
        return "\n".join([header, *rows, summary])

    def __repr__(self) -> str:
        kind = "measured" if self.measured else "simulated"
        return (f"Timeline({kind} {self.schedule.name}, p={self.schedule.ranks}, "
                f"m={self.schedule.microbatches}: makespan={self.makespan:.4g}, "
                f"bubble_fraction={self.bubble_fraction:.4f}, "
                f"peak_inflight={self.peak_inflight})")


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Run `schedule` on paper: every action starts as soon as its rank is free and, for an
    action after a receive, its message has arrived (send time + `costs.latency`).
    `costs=None` means Costs(): F = B = W = 1, so a full backward costs 2 forwards, and no
    latency. Raises ScheduleError if the schedule deadlocks (call
    `pipeline_validator.validate` first for the other checks)."""
    costs = costs or Costs()
    costs.check(schedule.num_stages)
    events = _run(schedule, lambda rank, action: costs.of(action, schedule.split_backward),
                  costs.latency)
    return Timeline(schedule, events)


def _run(schedule: Schedule, duration: Callable[[int, Action], float],
         latency: float) -> list[list[Event]]:
    """Each rank executes its actions in order; a receive waits for its send. Returns the
    compute events, or raises ScheduleError naming every rank that can no longer move."""
    clock = [0.0] * schedule.ranks
    position = [0] * schedule.ranks
    arrival: dict[Action, float] = {}  # receive action -> when its message is available
    events: list[list[Event]] = [[] for _ in range(schedule.ranks)]
    moved = True
    while moved:
        moved = False
        for rank, ops in enumerate(schedule.actions):
            while position[rank] < len(ops):
                action = ops[position[rank]]
                if action.kind.startswith("RECV"):
                    if action not in arrival:
                        break  # blocked until the sender gets there
                    clock[rank] = max(clock[rank], arrival.pop(action))
                elif action.kind.startswith("SEND"):
                    arrival[matching(action)] = clock[rank] + latency
                else:
                    end = clock[rank] + duration(rank, action)
                    events[rank].append(action_event(rank, action, clock[rank], end))
                    clock[rank] = end
                position[rank] += 1
                moved = True
    stuck = {rank: position[rank] for rank, ops in enumerate(schedule.actions)
             if position[rank] < len(ops)}
    if stuck:
        raise _deadlock(schedule, stuck)
    return events


def _deadlock(schedule: Schedule, stuck: dict[int, int]) -> ScheduleError:
    lines, waits_for = [], {}
    for rank, index in stuck.items():
        action = schedule.actions[rank][index]
        sender = peer(schedule, action)
        waits_for[rank] = sender
        send = matching(action)
        at = schedule.actions[sender].index(send) if send in schedule.actions[sender] else None
        later = (f"rank {sender} sends it only at {position(schedule, sender, at)}"
                 if at is not None else f"rank {sender} never sends it")
        lines.append(f"rank {rank} is stuck at {position(schedule, rank, index)}: waiting to "
                     f"{action.describe(schedule)}; {later}")
    cycle = _cycle(waits_for)
    summary = "deadlock: no rank can move"
    if cycle:
        summary += ": " + " -> ".join(f"rank {r}" for r in cycle) + " wait for each other"
    first = next(iter(stuck))
    blocked = {rank: (index, schedule.actions[rank][index]) for rank, index in stuck.items()}
    return ScheduleError("\n".join([summary, *lines]), first, stuck[first],
                         schedule.actions[first][stuck[first]], blocked)


def _cycle(waits_for: dict[int, int]) -> list[int]:
    """A cycle in the waits-for graph, as [a, b, ..., a], or [] if there is none."""
    for start in waits_for:
        path, rank = [], start
        while rank in waits_for and rank not in path:
            path.append(rank)
            rank = waits_for[rank]
        if rank in path:
            return path[path.index(rank):] + [rank]
    return []
