"""Stores hold the tool-call graph. `open_store` picks one from a URL; each module holds one store."""

from __future__ import annotations

from .base import Claim, Lease, SnapshotRecord, Store, StoreError

__all__ = ["Claim", "Lease", "SnapshotRecord", "Store", "StoreError", "open_store"]


def open_store(url: str | None) -> Store:
    """`None` or "memory://": in memory; "sqlite:///path.db": a durable file. Others come with their modules."""
    if url is None or url == "memory://":
        from .memory import MemoryStore

        return MemoryStore()
    if url.startswith("sqlite://"):
        from .sqlite import SQLiteStore

        path = url.removeprefix("sqlite://")
        if not path.startswith("/") or path == "/":
            raise ValueError(
                f"a sqlite store URL is sqlite:///relative/path.db or sqlite:////abs/path.db, got {url!r}"
            )
        return SQLiteStore(path[1:])
    raise ValueError(f"unknown store URL {url!r}: expected memory://, sqlite:///path.db")
