"""The cache and the sandbox factories of this process, for frameworks that build environments in workers.

SkyRL, verifiers and veRL construct environments (or tools) themselves, often in worker processes, from
configuration alone: no cache object can be handed in. These functions give every environment of a process the
same cache and the same sandbox factories, made on first use. The cache's store comes from the `TVCACHE_URL`
environment variable (a `tvcache serve` URL or a Redis URL lets all workers share one graph; unset, each process
keeps its own in memory).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from ..cache import ToolCache
from ..sync import SyncToolCache

__all__ = ["URL_VARIABLE", "process_cache", "process_sandboxes", "process_sync_cache"]

URL_VARIABLE = "TVCACHE_URL"

T = TypeVar("T")

_lock = threading.RLock()  # make() may itself ask for a cache
_caches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str | None, ToolCache]] = weakref.WeakKeyDictionary()
_sync_caches: dict[str | None, SyncToolCache] = {}
_sandboxes: dict[Hashable, Any] = {}


def _url(url: str | None) -> str | None:
    return url if url is not None else (os.environ.get(URL_VARIABLE) or None)


def process_cache(url: str | None = None) -> ToolCache:
    """The `ToolCache` of this process and the running event loop for `url` (default `$TVCACHE_URL`, else
    memory), made on first use. Call it from async code: a cache belongs to one event loop."""
    loop = asyncio.get_running_loop()
    url = _url(url)
    with _lock:
        per_loop = _caches.setdefault(loop, {})
        if url not in per_loop:
            per_loop[url] = ToolCache(url)
        return per_loop[url]


def process_sync_cache(url: str | None = None) -> SyncToolCache:
    """The `SyncToolCache` of this process for `url` (default `$TVCACHE_URL`, else memory), made on first use,
    for blocking environments (a thread-pool `step`); closed when the interpreter exits."""
    url = _url(url)
    with _lock:
        cache = _sync_caches.get(url)
        if cache is None:
            if not _sync_caches:
                atexit.register(_close_sync_caches)
            cache = _sync_caches[url] = SyncToolCache(url)
        return cache


def process_sandboxes(key: Hashable, make: Callable[[], T]) -> T:
    """The sandbox factory of this process for `key` (e.g. a database path), made by `make()` on first use.

    Rollouts of a task must use one factory object: its snapshots can be restored only by it, and its
    fingerprint (a content hash of the base) is computed once instead of in every environment."""
    with _lock:
        if key not in _sandboxes:
            _sandboxes[key] = make()
        return _sandboxes[key]  # type: ignore[no-any-return]


def _forget_after_fork() -> None:
    # A worker forked from a process that already had them inherits copies of its caches and factories, whose
    # threads, event loops and sandboxes stay the parent's: it makes its own on first use instead.
    global _lock
    _lock = threading.RLock()
    _caches.clear()
    _sync_caches.clear()
    _sandboxes.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _close_sync_caches() -> None:
    with _lock:
        caches = list(_sync_caches.values())
        _sync_caches.clear()
    for cache in caches:
        cache.close()
