"""Per-group state, and one call that forgets it all when the job's groups end (so that
nothing in minidist keeps a destroyed group, and its threads, alive)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["forget_groups", "on_forget_groups", "per_group_cache"]

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
