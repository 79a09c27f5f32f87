"""Per-group state, and one call that forgets it all when the job's groups end (so that
nothing in minidist keeps a destroyed group, and its threads, alive); a group's global ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["forget_groups", "members", "on_forget_groups", "per_group_cache"]

_forgetters: list[Callable[[], None]] = []


def per_group_cache() -> dict[Any, Any]:
    """A new dict keyed by process group, emptied by `forget_groups`."""
    cache: dict[Any, Any] = {}
    _forgetters.append(cache.clear)
    return cache


def on_forget_groups(forget: Callable[[], None]) -> None:
    """Have `forget_groups` call `forget`: for state holding groups that is not a cache."""
    _forgetters.append(forget)


def forget_groups() -> None:
    """Forget every group minidist holds: empty each cache, run each `on_forget_groups`."""
    for forget in _forgetters:
        forget()


_members: dict[Any, tuple[int, ...]] = per_group_cache()  # process group -> its global ranks


def members(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of `group` (None: the default group), in group-rank order."""
    import torch.distributed as dist

    key = group or dist.group.WORLD
    if key not in _members:
        _members[key] = tuple(dist.get_process_group_ranks(key))
    return _members[key]
