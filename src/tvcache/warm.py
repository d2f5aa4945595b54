"""Sandboxes made ahead of need: fresh ones per task and restored forks of snapshots.

A rollout that misses takes a warm sandbox instead of paying for `create` or `restore` on the critical path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict

from .sandboxes.base import Sandbox, Sandboxes

__all__ = ["WarmPool"]


class WarmPool:
    def __init__(self) -> None:
        # (factory id, scope key) -> fresh sandboxes; (factory id, snapshot id) -> forks of that snapshot.
        self._fresh: defaultdict[tuple[int, str], list[Sandbox]] = defaultdict(list)
        self._forks: defaultdict[tuple[int, str], list[Sandbox]] = defaultdict(list)

    def fresh_count(self, factory: Sandboxes, scope: str) -> int:
        return len(self._fresh.get((id(factory), scope), ()))

    def fork_count(self, factory: Sandboxes, snapshot_id: str) -> int:
        return len(self._forks.get((id(factory), snapshot_id), ()))

    def put_fresh(self, factory: Sandboxes, scope: str, box: Sandbox) -> None:
        self._fresh[(id(factory), scope)].append(box)

    def put_fork(self, factory: Sandboxes, snapshot_id: str, box: Sandbox) -> None:
        self._forks[(id(factory), snapshot_id)].append(box)

    def take_fresh(self, factory: Sandboxes, scope: str) -> Sandbox | None:
        boxes = self._fresh.get((id(factory), scope))
        return boxes.pop() if boxes else None

    def take_fork(self, factory: Sandboxes, snapshot_id: str) -> Sandbox | None:
        boxes = self._forks.get((id(factory), snapshot_id))
        return boxes.pop() if boxes else None

    async def forget(self, factory: Sandboxes, snapshot_id: str) -> None:
        """Close the forks of a snapshot that was evicted: nobody will ask for them again."""
        for box in self._forks.pop((id(factory), snapshot_id), []):
            with contextlib.suppress(Exception):
                await box.close()

    async def close(self) -> None:
        boxes = [b for pool in (self._fresh, self._forks) for bs in pool.values() for b in bs]
        self._fresh.clear()
        self._forks.clear()
        await asyncio.gather(*(b.close() for b in boxes), return_exceptions=True)
