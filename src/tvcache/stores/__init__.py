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
    """`None` or "memory://": in memory; "sqlite:///path.db": a durable file; "http://host:port": a shared
    `tvcache serve`; "redis://host:port/db": Redis or Redis Cluster. Each backend is imported only when used."""
    if url is None or url == "memory://":
        from .memory import MemoryStore

        return MemoryStore()
    if url.startswith("sqlite://"):
        from .sqlite import SQLiteStore

        path = url.removeprefix("sqlite://")
        if not path.startswith("/") or path == "/":
            raise ValueError(f"a sqlite store URL is sqlite:///relative/path.db or sqlite:////abs/path.db, got {url!r}")
        return SQLiteStore(path[1:])
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
