"""Sandboxes made ahead of need: fresh ones per task and restored forks of snapshots.

A rollout that misses takes a warm sandbox instead of paying for `create` or `restore` on the critical path.
The pool is bounded: a warm sandbox nobody took (its task's rollouts all hit, or never came) is closed once
`limit` newer ones are waiting, so a long training run does not accumulate them.

Sandboxes are filed by their factory's origin (unique per factory instance, see `context.Factories`), so a
factory that was garbage-collected can never hand its warm sandboxes to a new one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from .sandboxes.base import Sandbox
from .tasks import TaskGroup

__all__ = ["WarmPool"]

# ("fresh", origin, scope key) or ("fork", origin, snapshot id)
_Key = tuple[Literal["fresh", "fork"], str, str]


class WarmPool:
    def __init__(self, tasks: TaskGroup, limit: int = 64) -> None:
        self.limit = limit
        self._tasks = tasks  # closes the sandboxes the pool lets go, in the cache's task group
        # id(box) -> (key, box), oldest first; by id because the protocol does not promise hashable sandboxes
        self._boxes: OrderedDict[int, tuple[_Key, Sandbox]] = OrderedDict()

    def count(self, key: _Key) -> int:
        return sum(1 for k, _ in self._boxes.values() if k == key)

    def take(self, key: _Key) -> Sandbox | None:
        for ident, (k, box) in reversed(self._boxes.items()):  # the newest: least likely to be stale
            if k == key:
                del self._boxes[ident]
                return box
        return None

    def put(self, key: _Key, box: Sandbox) -> None:
        """File `box` (the pool owns it from now on), closing the oldest beyond the limit."""
        self._boxes[id(box)] = (key, box)
        while len(self._boxes) > self.limit:
            _, (_, oldest) = self._boxes.popitem(last=False)
            self._close(oldest)

    def forget(self, origin: str, snapshot_id: str) -> None:
        """Close the forks of a snapshot that was evicted: nobody will ask for them again."""
        while (box := self.take(("fork", origin, snapshot_id))) is not None:
            self._close(box)

    def __len__(self) -> int:
        return len(self._boxes)

    def close(self) -> None:
        """Close every sandbox in the pool (in the cache's task group: `TaskGroup.join` waits for them)."""
        boxes = [box for _, box in self._boxes.values()]
        self._boxes.clear()
        for box in boxes:
            self._close(box)

    def _close(self, box: Sandbox) -> None:
        self._tasks.cleanup_soon(box.close())
