"""Sandboxes made ahead of need: fresh ones per task and restored forks of snapshots.

A rollout that misses takes a warm sandbox instead of paying for `create` or `restore` on the critical path.
The pool is bounded: a warm sandbox nobody took (its task's rollouts all hit, or never came) is closed once
`limit` newer ones are waiting, so a long training run does not accumulate them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict

from .sandboxes.base import Sandbox, Sandboxes

__all__ = ["WarmPool"]

# ("fresh", factory id, scope key) or ("fork", factory id, snapshot id)
_Key = tuple[str, int, str]


class WarmPool:
    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        # id(box) -> (key, box), oldest first; by id because the protocol does not promise hashable sandboxes
        self._boxes: OrderedDict[int, tuple[_Key, Sandbox]] = OrderedDict()

    def _count(self, key: _Key) -> int:
        return sum(1 for k, _ in self._boxes.values() if k == key)

    def _take(self, key: _Key) -> Sandbox | None:
        for ident, (k, box) in reversed(self._boxes.items()):  # the newest: least likely to be stale
            if k == key:
                del self._boxes[ident]
                return box
        return None

    async def _put(self, key: _Key, box: Sandbox) -> None:
        self._boxes[id(box)] = (key, box)
        while len(self._boxes) > self.limit:
            _, (_, oldest) = self._boxes.popitem(last=False)
            with contextlib.suppress(Exception):
                await oldest.close()

    def fresh_count(self, factory: Sandboxes, scope_key: str) -> int:
        return self._count(("fresh", id(factory), scope_key))

    def fork_count(self, factory: Sandboxes, snapshot_id: str) -> int:
        return self._count(("fork", id(factory), snapshot_id))

    async def put_fresh(self, factory: Sandboxes, scope_key: str, box: Sandbox) -> None:
        await self._put(("fresh", id(factory), scope_key), box)

    async def put_fork(self, factory: Sandboxes, snapshot_id: str, box: Sandbox) -> None:
        await self._put(("fork", id(factory), snapshot_id), box)

    def take_fresh(self, factory: Sandboxes, scope_key: str) -> Sandbox | None:
        return self._take(("fresh", id(factory), scope_key))

    def take_fork(self, factory: Sandboxes, snapshot_id: str) -> Sandbox | None:
        return self._take(("fork", id(factory), snapshot_id))

    async def forget(self, factory: Sandboxes, snapshot_id: str) -> None:
        """Close the forks of a snapshot that was evicted: nobody will ask for them again."""
        while (box := self.take_fork(factory, snapshot_id)) is not None:
            with contextlib.suppress(Exception):
                await box.close()

    def __len__(self) -> int:
        return len(self._boxes)

    async def close(self) -> None:
        boxes = [box for _, box in self._boxes.values()]
        self._boxes.clear()
        await asyncio.gather(*(b.close() for b in boxes), return_exceptions=True)
