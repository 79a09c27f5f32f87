"""Every rank of a group making the same collective call, compared before any byte moves.

A collective is a meeting: each rank of its group calls the same one, on a tensor of the same
size and dtype, with the same options. When one rank does not, gloo aborts on a size mismatch
without naming the other rank's call, an all-reduce of a smaller tensor returns a partial sum on
one rank while the other waits, and minidist's own algorithms mismatch their messages halfway.
While `checking_calls()` is open, each collective that minidist's collective layer
(minidist.communication.collectives) runs first compares its call with the other ranks' through
the group's store, and every rank raises the same `CallMismatch`, naming the calls that differ
and which ranks made each:

    collective mismatch, the 3rd collective on ranks [0, 1]: rank 0 called
    all_reduce(8 float32, op='sum', impl='ring'), rank 1 called all_reduce(6 float32, ...)

The comparison meets in the store, not on the group's links, so no count of messages or bytes
sees it. It costs a store round trip per collective (a fraction of a millisecond on one machine),
which is why `minidist.core.launch.run(..., check_calls=...)` opens it in notebooks, where the
mistakes are made, and not in scripts or benchmarks; `unchecked()` mutes it where minidist times
collectives. It subscribes to the collective layer's announcements at the interposer's
"agreement" layer (minidist.core.interposer).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from minidist.core import interposer
from minidist.core._groups import members, per_group_cache

__all__ = ["CallMismatch", "exchange", "checking_calls", "unchecked"]


class CallMismatch(ValueError):
    """The ranks of a group called different collectives, or one with different arguments."""


_calls_made = per_group_cache()  # (group, what) -> calls exchanged so far: the store's key


def exchange(group: dist.ProcessGroup | None, what: str, mine: Any) -> list[Any]:
    """Every rank's `mine` (JSON-able) for the next `what` on `group`, in group-rank order,
    through the group's store; every rank of the group must call it, in the same order."""
    key = group or dist.group.WORLD
    call = _calls_made[key, what] = _calls_made.get((key, what), 0) + 1
    rank, size = dist.get_rank(key), dist.get_world_size(key)
    store = dist.distributed_c10d._get_process_group_store(key)
    store.set(f"minidist/{what}/{call}/{rank}", json.dumps(mine))
    # multi_get waits for every key: one round trip to the store less than wait, then get
    everyone = [json.loads(value) for value in
                store.multi_get([f"minidist/{what}/{call}/{peer}" for peer in range(size)])]
    if call > 1:  # every rank has read the previous call's values: it has written this call's
        store.delete_key(f"minidist/{what}/{call - 1}/{rank}")
    return everyone


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _compare(_: Callable[..., None], op: str, nbytes: int, group: dist.ProcessGroup | None,
             when: str, call: str) -> None:
    """The collective layer's announcement of `op(call)` on `group`: raise `CallMismatch` on
    every rank unless every rank of the group announced the same. Only the main thread's calls
    are compared: calls made on other threads (a compression hook on minidist's communication
    thread, autograd's device threads) may interleave with the main thread's differently on
    each rank, and the comparison pairs each rank's n-th call with the others' n-th."""
    ranks = members(group)
    if len(ranks) == 1 or threading.current_thread() is not threading.main_thread():
        return
    everyone = exchange(group, "calls", f"{op}({call})")
    if len(set(everyone)) == 1:
        return
    made = _calls_made[group or dist.group.WORLD, "calls"]
    by_call: dict[str, list[int]] = {}
    for rank, theirs in zip(ranks, everyone, strict=True):
        by_call.setdefault(theirs, []).append(rank)
    said = ", ".join(f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))} called "
                     f"{theirs}" for theirs, who in by_call.items())
    raise CallMismatch(
        f"collective mismatch, the {_ordinal(made)} collective on ranks {list(ranks)}: {said}. "
        f"Every rank of a group must make the same collective call, on a tensor of the same "
        f"size and dtype, with the same options")


@contextlib.contextmanager
def checking_calls() -> Iterator[None]:
    """Inside the block, every collective of minidist's collective layer is compared across
    its group before it runs (`CallMismatch` if they differ)."""
    with interposer.subscribed("agreement", {"minidist.collective": _compare}):
        yield


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Inside the block, collectives run without the comparison: where minidist times them."""
    with interposer.muted("agreement"):
        yield
