"""Caches kept per process group, and one call that forgets them all when the job's groups end
(so that nothing in minidist keeps a destroyed group, and its threads, alive)."""

from __future__ import annotations

from typing import Any

__all__ = ["forget_groups", "per_group_cache"]

_caches: list[dict[Any, Any]] = []


def per_group_cache() -> dict[Any, Any]:
    """A new dict keyed by process group, emptied by `forget_groups`."""
    cache: dict[Any, Any] = {}
    _caches.append(cache)
    return cache


def forget_groups() -> None:
    """Empty every per-group cache."""
    for cache in _caches:
        cache.clear()
