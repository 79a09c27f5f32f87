"""What went wrong between ranks, from each rank's latest call (minidist.core._calls) and stack:
mismatched collectives, who waits for whom and the cycle among them, stacks that are the same,
and what a native crash's message means. `minidist.core.launch` words the reports with these.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Callable, Iterable

import torch

from minidist.core._calls import FAMILY, SAME_SIZE, LatestCall

Frame = tuple[str, int, str]  # (filename, line, function)

# Known native messages (a rank's last stderr lines, or its error) and what they mean.
EXPLANATIONS = [
    (re.compile(r"Received data size doesn't match expected size"),
     "gloo received a message of a different size than this rank expected: the ranks called "
     "a collective (or send/recv) with different sizes, or called different collectives, in "
     "the same turn (a collective mismatch)."),
    (re.compile(r"malloc\(\)|free\(\)|double free|corrupted (size|double-linked)|"
                r"munmap_chunk|malloc_consolidate|tcache"),
     "glibc found the heap corrupted: something wrote past the end of its memory. In these "
     "labs the usual cause is `tensor.untyped_storage().resize_(n)` given a number of "
     "elements where it takes bytes (use n * tensor.element_size()), so later writes run "
     "past the storage."),
]
SIGNAL_EXPLANATIONS = {
    "SIGSEGV": "The process touched memory it does not own (a native crash, not a Python "
               "error): often a tensor whose storage was resized or freed under it.",
    "SIGABRT": "A C++ library (torch, gloo, glibc) aborted the process: its message is in the "
               "rank's last stderr lines.",
    "SIGKILL": "Something killed the process: on a machine out of memory, the kernel's "
               "out-of-memory killer.",
    "SIGBUS": "The process touched memory that has no backing (a native crash): often shared "
              "memory (/dev/shm) that ran out.",
}


def explain(text: str, signal_name: str = "") -> str:
    """One line on what `text` (stderr lines or an error) means, or "" if nothing known."""
    for pattern, meaning in EXPLANATIONS:
        if pattern.search(text):
            return meaning
    return SIGNAL_EXPLANATIONS.get(signal_name, "")


def rank_list(ranks: Iterable[int]) -> str:
    """"rank 3", "ranks 0–3", "ranks 0, 2, 5"."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}–{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


# --- Mismatched calls ---------------------------------------------------------------------------


def _signature(call: LatestCall) -> tuple:
    """What must agree between ranks that meet in one collective (or one send and its recv)."""
    family = FAMILY.get(call.op, call.op)
    if call.kind != "collective":
        return (call.numel, call.dtype)
    sized = (call.numel, call.dtype) if call.op in SAME_SIZE else ()
    return (family, call.peer, *sized)


def conflicts(calls: list[LatestCall], in_progress: bool = True) -> list[list[LatestCall]]:
    """Groups of calls that should match and do not: the same turn (n-th collective) on one
    process group made as different collectives, sizes, dtypes or roots; or a send and the
    recv waiting for it with different sizes or dtypes. With `in_progress`, only calls that
    have not returned count (a mismatch can complete on one rank and crash the other)."""
    found = []
    turns: dict[tuple[str, int], list[LatestCall]] = {}
    for call in calls:
        if (call.waiting or not in_progress) and call.kind == "collective":
            turns.setdefault((call.group, call.group_seq), []).append(call)
    for same_turn in turns.values():
        if len({_signature(call) for call in same_turn}) > 1:
            found.append(sorted(same_turn, key=lambda call: call.rank))
    by_rank = {call.rank: call for call in calls if call.waiting and call.kind != "collective"}
    for call in by_rank.values():
        if call.op in ("send", "isend") and call.peer in by_rank:
            other = by_rank[call.peer]
            if (other.op in ("recv", "irecv") and other.peer in (call.rank, -1)
                    and _signature(other) != _signature(call)):
                found.append(sorted([call, other], key=lambda c: c.rank))
    return found


def describe_conflict(calls: list[LatestCall], where: Callable[[LatestCall], str]) -> str:
    """"rank 0 called all_gather of 64 float32 at Cell In[12], line 7; rank 1 called ..."."""
    parts: dict[str, list[int]] = {}
    for call in calls:
        parts.setdefault(f"{call.describe()} at {where(call)}", []).append(call.rank)
    return "; ".join(f"{rank_list(ranks)} called {text}" for text, ranks in parts.items())


# --- Who waits for whom --------------------------------------------------------------------------


def waits_for(calls: dict[int, LatestCall | None], stuck: Iterable[int]) -> dict[int, list[int]]:
    """For each stuck rank, the ranks it waits for: the peer of its send or recv, or the
    members of its collective's group that are not in that same collective."""
    stuck = set(stuck)
    edges: dict[int, list[int]] = {}
    for rank in sorted(stuck):
        call = calls.get(rank)
        if call is None or not call.waiting:
            continue
        if call.kind != "collective":
            edges[rank] = [call.peer] if call.peer >= 0 else []
            continue
        absent = []
        for member in call.members:
            other = calls.get(member)
            joined = (other is not None and other.waiting and member in stuck
                      and other.kind == "collective" and other.group == call.group
                      and other.group_seq == call.group_seq)
            if member != rank and not joined:
                absent.append(member)
        edges[rank] = absent
    return edges


def find_cycle(edges: dict[int, list[int]]) -> list[int]:
    """A cycle in the wait-for graph, starting at its lowest rank, or [] if there is none."""
    done: set[int] = set()

    def walk(path: list[int]) -> list[int]:
        for step in edges.get(path[-1], []):
            if step in path:
                return path[path.index(step):]
            if step in edges and step not in done:
                found = walk([*path, step])
                if found:
                    return found
        done.add(path[-1])
        return []

    for start in sorted(edges):
        cycle = walk([start])
        if cycle:
            lowest = cycle.index(min(cycle))
            return cycle[lowest:] + cycle[:lowest]
    return []


def describe_cycle(cycle: list[int], calls: dict[int, LatestCall | None]) -> str:
    """"rank 0 waits for 3, 3 for 2, 2 for 1, 1 for 0: nobody sends first"."""
    pairs = list(zip(cycle, cycle[1:] + cycle[:1], strict=True))
    text = ", ".join(f"{a} for {b}" if i else f"rank {a} waits for {'itself' if a == b else b}"
                     for i, (a, b) in enumerate(pairs))
    ops = {calls[rank].op for rank in cycle if calls.get(rank) is not None}
    if ops <= {"recv", "irecv", "recv_object_list"}:
        return text + ": nobody sends first"
    return text + ": each waits for a call the next one never makes"


# --- Stacks ---------------------------------------------------------------------------------------


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)),
            paths["stdlib"], paths["purelib"], paths["platlib"]}
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs) + tuple(
        os.path.join(d, "") for d in dirs)


LIBRARY_DIRS = _library_dirs()


def is_library(filename: str) -> bool:
    """True for frames of torch, minidist, the standard library and installed packages."""
    return filename.startswith(LIBRARY_DIRS) or filename.startswith("<frozen")


def shown_frames(frames: list[Frame], everything: bool) -> list[Frame]:
    """The frames a report shows: the user's own, unless `everything` (or there are none)."""
    if everything:
        return frames
    own = [frame for frame in frames if not is_library(frame[0])]
    return own or frames


def same_stacks(stacks: dict[int, list[Frame]]) -> list[tuple[list[int], list[Frame]]]:
    """Ranks grouped by identical stacks, in order of their lowest rank."""
    groups: dict[tuple[Frame, ...], list[int]] = {}
    for rank, frames in sorted(stacks.items()):
        groups.setdefault(tuple(frames), []).append(rank)
    return [(ranks, list(frames)) for frames, ranks in groups.items()]
