"""Pipeline-parallel schedules as plain data, and the generators of the named ones. Beside this
module: a validator that explains what is wrong (`pipeline_validator`), and a simulator that
turns a schedule into a timeline with its bubble and memory (`pipeline_simulator`).

    from minidist.parallel import pipeline, pipeline_simulator, pipeline_validator

    s = pipeline.schedule("1f1b", ranks=4, microbatches=8)
    print(s)                            # each rank's actions, in order
    pipeline_validator.validate(s)      # raises ScheduleError naming the rank and action at fault
    t = pipeline_simulator.simulate(s)  # uniform costs: F = 1, B = 1, W = 1 (backward = 2F)
    print(t.table())                    # the same, placed in time (one column per time unit)
    t.makespan, t.bubble_fraction, t.peak_inflight   # the step, its idle share, memory per rank

A stage is always a piece of the model: it is cut into `num_stages` = p·v consecutive stages
over p pipeline ranks, v chunks per rank, and stage k lives on rank k mod p (Narayanan et al.
2021's placement: rank r holds stages r, r+p, ...). Without interleaving v = 1, so rank r holds
stage r alone.
A schedule is, for each rank, the ordered list of what it does:

    F3     forward of microbatch 3 through this rank's stage
    B3     backward of microbatch 3: the gradient for the stage's input (and, unless the
           schedule splits the backward, also for its weights)
    W3     weight gradient of microbatch 3, when the backward is split (zero-bubble schedules)
    F3>1   send microbatch 3's activation (this stage's output) to rank 1
    F3<0   receive microbatch 3's activation (this stage's input) from rank 0
    B3>0   send the gradient of this stage's input to rank 0
    B3<2   receive the gradient of this stage's output from rank 2
    F3@5   the same with the stage named, when a rank holds several (interleaved schedules)

Sends are asynchronous (isend): a send never waits. A receive waits until the matching send
has been posted. Error messages number a rank's compute actions from 0, as `print(schedule)`
lists them ("compute action 5 (B1)"), and place a send or receive next to one ("F3<0, before
compute action 4"): the numbering the reader sees, whether or not sends are shown.
The validator and the executor (`minidist.parallel.pipeline_exec`) both follow these rules, so a
schedule the validator accepts cannot deadlock on real ranks.

The simulator reproduces the published bubbles and memory of every schedule (uniform costs, no
communication latency; tests/test_pipeline.py checks them for every p <= 8, m <= 32): GPipe
(Huang et al. 2019), 1F1B and interleaved (Narayanan et al. 2021 §2.2, §2.2.1, §2.2.2) and ZB-H1
(Qi et al. 2023 §2, given m >= p and T_W <= T_F). Lab 06 has students derive them from the
timelines, so they are not restated here; `minidist.costs.bubbles` computes them
directly, also for ZB-H2 (Qi et al. §2.2), which has a formula there but no generator here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from minidist.core._checks import one_of, positive_int
from minidist.costs.bubbles import SCHEDULES

__all__ = [
    "SCHEDULES", "COMPUTE", "COMMUNICATION", "ScheduleError", "Action", "peer", "matching",
    "position", "Schedule", "schedule",
]

COMPUTE = ("F", "B", "W")
COMMUNICATION = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ScheduleError(ValueError):
    """An illegal schedule. `.rank` and `.index` locate the action at fault in
    `schedule.actions[rank]` and `.action` is that action (for a missing action: the rank that
    should run it, index None, and the missing action); for a deadlock `.blocked` maps every
    stuck rank to the (index, action) it waits at."""

    def __init__(self, message: str, rank: int | None = None, index: int | None = None,
                 action: Action | None = None,
                 blocked: dict[int, tuple[int, Action]] | None = None):
        super().__init__(message)
        self.rank = rank
        self.index = index
        self.action = action
        self.blocked = blocked or {}


# --- Actions and schedules ---------------------------------------------------------------------


class Action(NamedTuple):
    """One step of one rank: `kind` is F, B or W (compute) or SEND_F, RECV_F, SEND_B, RECV_B;
    `stage` is the stage on this rank that the action belongs to; `microbatch` counts from 0.
    (A named tuple: schedules hash and compare many of them.)"""

    kind: str
    stage: int
    microbatch: int

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def label(self, schedule: Schedule | None = None, show_stage: bool = True) -> str:
        """Compact form, e.g. "F3", "F3@5", "F3>1"; peers are shown when `schedule` is given."""
        text = f"{self.kind[-1]}{self.microbatch}" + (f"@{self.stage}" if show_stage else "")
        if self.is_compute:
            return text
        arrow = ">" if self.kind.startswith("SEND") else "<"
        return text + arrow + (str(peer(schedule, self)) if schedule else "?")

    def describe(self, schedule: Schedule) -> str:
        """In words, for error messages: "receive the activation of microbatch 3 from rank 1"."""
        of = f"of microbatch {self.microbatch}"
        on = f" on stage {self.stage}" if schedule.chunks > 1 else ""
        if self.kind == "F":
            return f"forward {of}{on}"
        if self.kind == "B":
            what = "input gradient" if schedule.split_backward else "backward"
            return f"{what} {of}{on}"
        if self.kind == "W":
            return f"weight gradient {of}{on}"
        what = "activation" if self.kind.endswith("F") else "gradient"
        if self.kind.startswith("SEND"):
            return f"send the {what} {of} to rank {peer(schedule, self)}"
        return f"receive the {what} {of} from rank {peer(schedule, self)}"

    def __str__(self) -> str:
        if self.is_compute:
            return self.label()
        return f"{self.kind}{self.microbatch}@{self.stage}"


def peer(schedule: Schedule, action: Action) -> int:
    """The rank a communication action talks to: activations go to the next stage's rank,
    gradients to the previous stage's."""
    step = 1 if action.kind in ("SEND_F", "RECV_B") else -1
    return schedule.rank_of(action.stage + step)


def matching(action: Action) -> Action:
    """The action on the peer rank that completes a send or receive."""
    step = 1 if action.kind in ("SEND_F", "RECV_B") else -1
    flipped = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}
    return Action(flipped[action.kind], action.stage + step, action.microbatch)


def position(schedule: Schedule, rank: int, index: int) -> str:
    """Where `schedule.actions[rank][index]` is, in the numbering `print(schedule)` shows:
    "compute action 5 (B1)", counting F, B and W from 0; a send or receive by its label and the
    compute action next to it, "F3<0, before compute action 4" (a receive precedes the compute
    that needs it, a send follows the one that produced it)."""
    ops = schedule.actions[rank]
    action = ops[index]
    label = action.label(schedule, schedule.chunks > 1 or action.stage != rank)
    before = sum(a.is_compute for a in ops[:index])
    if action.is_compute:
        return f"compute action {before} ({label})"
    follows = any(a.is_compute for a in ops[index + 1:])
    if before and (action.kind.startswith("SEND") or not follows):
        return f"{label}, after compute action {before - 1}"
    return f"{label}, before compute action {before}" if follows else label


@dataclass(frozen=True)
class Schedule:
    """Per rank, the ordered actions it runs. `ranks` = p pipeline ranks, `chunks` = v stages
    per rank, so the model is cut into `num_stages` = p*v stages; stage k lives on rank k % p.
    `split_backward` is True when backward is split into B (input gradient) and W (weights).
    (About 120 lines, most of them `from_text`, which reads the `text()` it prints back.)"""

    name: str
    ranks: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    chunks: int = 1
    split_backward: bool = False

    @property
    def num_stages(self) -> int:
        return self.ranks * self.chunks

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.ranks))

    @classmethod
    def from_compute(cls, name: str, compute: Sequence[Sequence[Action]], microbatches: int,
                     chunks: int = 1) -> Schedule:
        """A schedule from each rank's compute actions (F, B, W) in order, with the sends and
        receives added: a receive just before the action that needs it, a send just after
        the action that produces it."""
        ranks = len(compute)
        if ranks < 1:
            raise ValueError("a schedule needs at least one rank: got an empty list")
        num_stages = ranks * chunks
        actions = []
        for rank, ops in enumerate(compute):
            ordered: list[Action] = []
            for op in ops:
                if not isinstance(op, Action):
                    raise ScheduleError(f"rank {rank}: {op!r} is not an Action", rank)
                k, j = op.stage, op.microbatch
                remote_prev = k > 0 and (k - 1) % ranks != rank
                remote_next = k < num_stages - 1 and (k + 1) % ranks != rank
                if op.kind == "F" and remote_prev:
                    ordered.append(Action("RECV_F", k, j))
                if op.kind == "B" and remote_next:
                    ordered.append(Action("RECV_B", k, j))
                ordered.append(op)
                if op.kind == "F" and remote_next:
                    ordered.append(Action("SEND_F", k, j))
                if op.kind == "B" and remote_prev:
                    ordered.append(Action("SEND_B", k, j))
            actions.append(tuple(ordered))
        split = any(op.kind == "W" for ops in compute for op in ops)
        return cls(name, ranks, microbatches, tuple(actions), chunks, split)

    @classmethod
    def from_text(cls, text: str, microbatches: int | None = None, chunks: int = 1,
                  name: str = "custom") -> Schedule:
        """Parse the compact form: one line "rank r: F0 F0>1 ..." per rank, in rank order
        (other lines, such as the header `text()` prints, are skipped). Without "@stage" an
        action is on the rank's only stage. `microbatches` defaults to one more than the
        largest microbatch named. `Schedule.from_text(s.text(comm=True), chunks=s.chunks)`
        rebuilds `s`."""
        rows = re.findall(r"^\s*rank\s*(\d+)\s*:(.*)$", text, re.MULTILINE)
        if not rows:
            raise ScheduleError("no line of the form 'rank 0: F0 F0>1 ...' in the text")
        token = re.compile(r"^([FBW])(\d+)(?:@(\d+))?(?:([<>])(\d+))?$")
        actions, named_peers = [], []
        for rank, (number, line) in enumerate(rows):
            if int(number) != rank:
                raise ScheduleError(f"line {rank + 1} is for rank {number}: give the ranks in "
                                    f"order 0, 1, 2, ...", rank)
            ops = []
            for word in line.split():
                match = token.match(word)
                if not match:
                    raise ScheduleError(f"rank {rank}: cannot read {word!r}; write e.g. F3, B3, "
                                        "W3, F3@5, F3>1 (send) or F3<0 (receive)", rank)
                kind, microbatch, stage, arrow, other = match.groups()
                if stage is None and chunks > 1:
                    raise ScheduleError(f"rank {rank}: {word!r} must name its stage (e.g. "
                                        f"{word[0]}{microbatch}@{rank}) when ranks hold "
                                        f"{chunks} chunks", rank)
                if arrow and kind == "W":
                    raise ScheduleError(f"rank {rank}: {word!r}: weight gradients are never "
                                        "sent", rank)
                if arrow:
                    kind = ("SEND_" if arrow == ">" else "RECV_") + kind
                    named_peers.append((rank, len(ops), int(other)))
                ops.append(Action(kind, rank if stage is None else int(stage), int(microbatch)))
            actions.append(tuple(ops))
        if microbatches is None:
            microbatches = 1 + max((a.microbatch for ops in actions for a in ops), default=-1)
        split = any(a.kind == "W" for ops in actions for a in ops)
        schedule = cls(name, len(actions), microbatches, tuple(actions), chunks, split)
        for rank, index, named in named_peers:
            action = actions[rank][index]
            if 0 <= action.stage < schedule.num_stages and named != peer(schedule, action):
                raise ScheduleError(
                    f"rank {rank}, {position(schedule, rank, index)} (written with rank "
                    f"{named}): that message goes to or comes from rank "
                    f"{peer(schedule, action)}", rank, index, action)
        return schedule

    def compute(self, rank: int) -> list[Action]:
        """Rank `rank`'s compute actions (F, B, W) in order."""
        return [a for a in self.actions[rank] if a.is_compute]

    def text(self, comm: bool = False) -> str:
        """One line per rank; with `comm=True` the sends and receives too."""
        lines = [f"{self.name}: {self.ranks} ranks, {self.microbatches} microbatches"
                 + (f", {self.chunks} chunks per rank" if self.chunks > 1 else "")]
        for rank, ops in enumerate(self.actions):
            shown = [a.label(self, self.chunks > 1) for a in ops if comm or a.is_compute]
            lines.append(f"rank {rank}: " + " ".join(shown))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


# --- Generators ----------------------------------------------------------------------------------


def schedule(name: str, ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    """A named schedule on `ranks` = p pipeline ranks, for `microbatches` = m.

    name: "gpipe" (all forwards, then all backwards; Huang et al. 2019), "1f1b" (PipeDream-Flush:
    a warm-up of forwards, then one forward, one backward in turn; Narayanan et al. 2021),
    "interleaved" (1F1B over `chunks` = v stages per rank, so p*v stages in all; needs m a
    multiple of p; Narayanan et al. 2021 §2.2.2), "zb-h1" (1F1B with each backward split
    into input gradient B and weight gradient W, rank r holding back r of its W's to fill the
    cool-down; Qi et al. 2023). Every rank has one stage except with "interleaved".
    """
    positive_int(ranks=ranks, microbatches=microbatches, chunks=chunks)
    if name == "zb-h2":
        raise ValueError("schedule 'zb-h2' has bubble and memory formulas here "
                         "(bubble_fraction, inflight_microbatches) but no generator: choose one "
                         f"of {', '.join(SCHEDULES[:-1])}")
    one_of("schedule", name, SCHEDULES)
    if chunks != 1 and name != "interleaved":
        raise ValueError(f"chunks={chunks} applies to 'interleaved' only; {name!r} has one stage "
                         "per rank (leave chunks=1)")
    p, m = ranks, microbatches
    if name == "interleaved":
        if m % p:
            raise ValueError(
                f"interleaved needs microbatches to be a multiple of ranks: m={m}, p={p}; use "
                f"m={max(p, m // p * p)} or m={(m // p + 1) * p}")
        compute = [_interleaved(rank, p, m, chunks) for rank in range(p)]
        return Schedule.from_compute(name, compute, m, chunks)
    generator = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb-h1": _zb_h1}[name]
    return Schedule.from_compute(name, [generator(rank, p, m) for rank in range(p)], m)


def _gpipe(rank: int, p: int, m: int) -> list[Action]:
    return [Action("F", rank, j) for j in range(m)] + [Action("B", rank, j) for j in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    warmup = min(p - 1 - rank, m)
    ops = [Action("F", rank, j) for j in range(warmup)]
    for j in range(m - warmup):
        ops += [Action("F", rank, warmup + j), Action("B", rank, j)]
    return ops + [Action("B", rank, j) for j in range(m - warmup, m)]


def _zb_h1(rank: int, p: int, m: int) -> list[Action]:
    # 1F1B's order with B = input gradient only. Rank r keeps its first r weight gradients for
    # later: W's fill the cool-down, where 1F1B idles waiting for gradients, while at most
    # p microbatches are in flight on every rank (Qi et al. 2023, Figure 3).
    warmup = min(p - 1 - rank, m)
    ops = [Action("F", rank, j) for j in range(warmup)]
    for j in range(m):
        if warmup + j < m:
            ops.append(Action("F", rank, warmup + j))
        ops.append(Action("B", rank, j))
        if j >= rank:
            ops.append(Action("W", rank, j - rank))
    return ops + [Action("W", rank, j) for j in range(max(m - rank, 0), m)]


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    # Microbatches go through in groups of p: the group's forwards on chunk 0, then on chunk 1,
    # ...; backwards the other way round. A warm-up of forwards before the first backward
    # (Megatron-LM's schedule), then one of each in turn.
    def forward(i: int) -> Action:
        group, within = divmod(i, p * v)
        chunk, offset = divmod(within, p)
        return Action("F", chunk * p + rank, group * p + offset)

    def backward(i: int) -> Action:
        group, within = divmod(i, p * v)
        chunk, offset = divmod(within, p)
        return Action("B", (v - 1 - chunk) * p + rank, group * p + offset)

    total = m * v
    warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
    ops = [forward(i) for i in range(warmup)]
    for i in range(total - warmup):
        ops += [forward(warmup + i), backward(i)]
    return ops + [backward(i) for i in range(total - warmup, total)]
