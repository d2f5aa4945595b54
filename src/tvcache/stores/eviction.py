"""Which snapshots to evict when a scope's origin holds more than its budget. Pure: every store applies it inside
its own atomic step (the Redis store in Lua, mirroring this function line for line)."""

from __future__ import annotations

from collections.abc import Iterable

from .base import SnapshotRecord

__all__ = ["choose_evictions"]


def choose_evictions(records: Iterable[SnapshotRecord], budget: int, added: bytes) -> list[SnapshotRecord]:
    """The snapshots to evict so at most `budget` remain after adding the one at node `added`: never a
    leased one; leaves before inner snapshots (an inner one serves every rollout passing through it), least
    recently used first. The one just added goes last: it was paid for a moment ago, and at the end of a
    chain it would otherwise be the only leaf."""
    records = list(records)
    excess = len(records) - budget
    if excess <= 0:
        return []
    parents = {r.parent for r in records if r.parent is not None}
    candidates = sorted(
        (r for r in records if not r.leased), key=lambda r: (r.node == added, r.node in parents, r.last_used)
    )
    return candidates[:excess]
