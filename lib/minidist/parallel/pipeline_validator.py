"""The validator of pipeline schedules (`minidist.parallel.pipeline`'s notation and rules):
`validate` raises a `ScheduleError` that names the rank and the action at fault and says what
is wrong, before a schedule runs on real ranks (`minidist.parallel.pipeline_exec`).

    from minidist.parallel import pipeline, pipeline_validator

    pipeline_validator.validate(pipeline.schedule("1f1b", ranks=4, microbatches=8))  # passes
    pipeline_validator.validate(pipeline.Schedule.from_text("rank 0: B0 F0"))      # raises

The checks, in order: each action well formed and on its rank; each send and receive matched
on the peer; each action after what it needs on its own rank; every stage running every
microbatch; and no deadlock (the schedule is simulated at zero cost, and
`minidist.parallel.pipeline_simulator` names the ranks that wait for each other).
"""

from __future__ import annotations

from minidist.parallel.pipeline import (
    COMMUNICATION,
    COMPUTE,
    Action,
    Schedule,
    ScheduleError,
    matching,
    peer,
    position,
)
from minidist.parallel.pipeline_simulator import Costs, simulate

__all__ = ["validate"]


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` unless `schedule` is legal: every action well formed and on the
    rank that holds its stage, every stage running F and B (and W, when split) of every
    microbatch exactly once, each after what it needs (its forward, its input or gradient),
    every send matched by one receive, and no deadlock. The error names the rank and the
    action at fault (by position in `schedule.actions[rank]`)."""
    _check_actions(schedule)
    _check_matching(schedule)
    _check_order(schedule)
    _check_complete(schedule)
    simulate(schedule, Costs(F=0.0, B=0.0, W=0.0))  # raises ScheduleError on a deadlock


def _fault(schedule: Schedule, rank: int, index: int, problem: str, fix: str = "") -> ScheduleError:
    action = schedule.actions[rank][index]
    message = (f"rank {rank}, {position(schedule, rank, index)}, "
               f"{action.describe(schedule)}: {problem}" + (f". {fix}" if fix else ""))
    return ScheduleError(message, rank, index, action)


def _check_actions(schedule: Schedule) -> None:
    if len(schedule.actions) != schedule.ranks:
        raise ScheduleError(f"the schedule has {len(schedule.actions)} action lists for "
                            f"{schedule.ranks} ranks: give one list per rank")
    last = schedule.num_stages - 1
    for rank, ops in enumerate(schedule.actions):
        first_seen: dict[Action, int] = {}
        for index, action in enumerate(ops):
            if not isinstance(action, Action) or action.kind not in COMPUTE + COMMUNICATION:
                raise ScheduleError(f"rank {rank}, entry {index} of its actions: {action!r} is "
                                    f"not an Action of kind {', '.join(COMPUTE + COMMUNICATION)}",
                                    rank, index)
            where = f"rank {rank}, {position(schedule, rank, index)}"
            if not 0 <= action.microbatch < schedule.microbatches:
                raise ScheduleError(
                    f"{where}: microbatch {action.microbatch} does not exist; microbatches are "
                    f"0..{schedule.microbatches - 1}", rank, index, action)
            if not 0 <= action.stage <= last:
                raise ScheduleError(f"{where}: stage {action.stage} does not exist; stages are "
                                    f"0..{last}", rank, index, action)
            if schedule.rank_of(action.stage) != rank:
                raise ScheduleError(
                    f"{where}: stage {action.stage} lives on rank "
                    f"{schedule.rank_of(action.stage)}, not on rank {rank}", rank, index, action)
            if action.kind == "W" and not schedule.split_backward:
                raise ScheduleError(f"{where}: a W in a schedule whose backward is not split",
                                    rank, index, action)
            if not action.is_compute:
                to_next = action.kind in ("SEND_F", "RECV_B")
                neighbour = action.stage + (1 if to_next else -1)
                if not 0 <= neighbour <= last:
                    raise ScheduleError(
                        f"{where}: stage {action.stage} has no "
                        f"{'next' if to_next else 'previous'} stage to talk to",
                        rank, index, action)
                if schedule.rank_of(neighbour) == rank:
                    raise ScheduleError(
                        f"{where}: stages {action.stage} and {neighbour} are both on rank "
                        f"{rank}, so nothing is sent: remove it", rank, index, action)
            if action in first_seen:
                raise _fault(schedule, rank, index, "appears twice (first as "
                             f"{position(schedule, rank, first_seen[action])})")
            first_seen[action] = index


def _needs(schedule: Schedule, action: Action) -> list[Action]:
    """What must come before `action` on its own rank."""
    k, j, last = action.stage, action.microbatch, schedule.num_stages - 1
    local = schedule.rank_of
    if action.kind == "F":
        if k == 0:
            return []
        return [Action("F", k - 1, j) if local(k - 1) == local(k) else Action("RECV_F", k, j)]
    if action.kind == "B":
        needs = [Action("F", k, j)]
        if k < last:
            same = local(k + 1) == local(k)
            needs.append(Action("B", k + 1, j) if same else Action("RECV_B", k, j))
        return needs
    if action.kind == "W":
        return [Action("B", k, j)]
    if action.kind == "SEND_F":
        return [Action("F", k, j)]
    if action.kind == "SEND_B":
        return [Action("B", k, j)]
    return []


def _check_order(schedule: Schedule) -> None:
    for rank, ops in enumerate(schedule.actions):
        done: set[Action] = set()
        for index, action in enumerate(ops):
            for needed in _needs(schedule, action):
                if needed in done:
                    continue
                what = needed.label(schedule, schedule.chunks > 1)
                when = "comes later" if needed in ops else "is missing"
                if action.kind == "B" and needed.kind == "F":
                    problem = f"runs before its forward ({what} {when})"
                elif needed.kind.startswith("RECV"):
                    problem = (f"runs before its input arrives ({what}: "
                               f"{needed.describe(schedule)}, {when})")
                else:
                    problem = f"needs {what} ({needed.describe(schedule)}) first, which {when}"
                raise _fault(schedule, rank, index, problem)
            done.add(action)


def _check_complete(schedule: Schedule) -> None:
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    for stage in range(schedule.num_stages):
        rank = schedule.rank_of(stage)
        present = set(schedule.actions[rank])
        for j in range(schedule.microbatches):
            for kind in kinds:
                action = Action(kind, stage, j)
                if action not in present:
                    raise ScheduleError(
                        f"rank {rank} never runs {action.label(schedule, schedule.chunks > 1)} "
                        f"({action.describe(schedule)}): every stage must run every microbatch",
                        rank, None, action)


def _check_matching(schedule: Schedule) -> None:
    held = [set(ops) for ops in schedule.actions]
    for rank, ops in enumerate(schedule.actions):
        for index, action in enumerate(ops):
            if action.is_compute:
                continue
            other = peer(schedule, action)
            if matching(action) not in held[other]:
                wanted = matching(action).label(schedule, schedule.chunks > 1)
                if action.kind.startswith("SEND"):
                    problem = f"rank {other} never receives it (no {wanted} on rank {other})"
                else:
                    problem = f"rank {other} never sends it (no {wanted} on rank {other})"
                raise _fault(schedule, rank, index, problem)
