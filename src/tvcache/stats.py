"""Counters a cache keeps about its own work, for `ToolCache.stats()` and the reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Stats"]


@dataclass
class Stats:
    calls: int = 0  # every r.call()
    hits: int = 0  # answered from an entry, including after waiting for another rollout
    executions: int = 0  # tool executions on behalf of callers (misses, uncacheable, direct)
    waits: int = 0  # misses that waited for a concurrent execution of the same call (single flight)
    replays: int = 0  # calls re-executed to rebuild a state
    creates: int = 0  # fresh sandboxes made on the critical path
    restores: int = 0  # snapshots restored on the critical path
    warm: int = 0  # misses that took a sandbox prefetched ahead of need
    snapshots: int = 0
    evictions: int = 0
    mismatches: int = 0  # replays whose output differed from the recorded one: a nondeterministic tool
    detached: int = 0  # rollouts whose state could no longer be reproduced from the cache
    store_errors: int = 0  # store operations that failed; the call went on without the cache
    failures: int = 0  # executions that raised or returned error=True (never cached)
    uncached: int = 0  # results returned but not recorded (detached, store down, too large, uncacheable)
    seconds_executing: float = 0.0  # tool time of `executions`
    seconds_replaying: float = 0.0
    seconds_saved: float = 0.0  # recorded execution time of every hit

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
