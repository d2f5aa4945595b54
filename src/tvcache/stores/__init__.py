"""Stores hold the tool-call graph. `open_store` picks one from a URL; each module holds one store."""

from __future__ import annotations

from ..extras import require
from .base import Claim, EntryInfo, GraphExport, Lease, SnapshotRecord, Store, StoreError, TaskInfo

__all__ = [
    "Claim",
    "EntryInfo",
    "GraphExport",
    "Lease",
    "SnapshotRecord",
    "Store",
    "StoreError",
    "TaskInfo",
    "open_store",
]


def open_store(url: str | None) -> Store:
    """`None` or "memory://": in memory; "sqlite:///path.db?cache_mb=64": a durable file, at most `cache_mb` of
    its entries also in memory; "http://host:port": a shared `tvcache serve`; "redis://host:port/db": Redis or
    Redis Cluster. Each backend is imported only when used."""
    if url is not None and not isinstance(url, str):
        raise TypeError(f"a store URL is a string such as 'sqlite:///runs/cache.db', got {url!r}")
    if url is None or url == "memory://":
        from .memory import MemoryStore

        return MemoryStore()
    if url.startswith("memory://"):
        raise ValueError(
            f"the memory store takes no options, got {url!r}: it is the whole graph and cannot drop entries;"
            " for bounded memory use sqlite:///path.db?cache_mb=N"
        )
    if url.startswith("sqlite://"):
        from .sqlite import SQLiteStore

        return SQLiteStore.from_url(url)
    if url.startswith(("http://", "https://")):
        require("client", "the http:// store", "aiohttp")
        from .http import HTTPStore

        return HTTPStore(url)
    if url.startswith(("redis://", "rediss://", "redis+cluster://")):
        require("redis", "the redis:// store", "redis")
        from .redis import RedisStore

        return RedisStore(url)
    raise ValueError(
        f"unknown store URL {url!r}: expected memory://, sqlite:///path.db, http://host:port or redis://host:port/db"
    )
