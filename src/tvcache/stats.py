"""Counters a cache keeps about its own work, for `ToolCache.stats()` and the reports."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["Part", "Stats"]

#: Where a call's time goes besides executing and replaying: the `seconds_<part>` counters `Stats.timing` adds to.
Part = Literal["waiting", "creating", "restoring", "snapshotting", "store", "background"]


@dataclass
class Stats:
    calls: int = 0  # every r.call()
    hits: int = 0  # answered from an entry, including after waiting for another rollout
    read_set_hits: int = 0  # of `hits`: answered by a result recorded in another state that read the same
    read_set_edges: int = 0  # of `read_set_hits`: state-changing calls, whose recorded writes moved the rollout
    executions: int = 0  # tool executions on behalf of callers (misses, uncacheable, direct)
    waits: int = 0  # misses that waited for a concurrent execution of the same call (single flight)
    replays: int = 0  # calls re-executed to rebuild a state
    creates: int = 0  # fresh sandboxes made on the critical path
    restores: int = 0  # snapshots restored on the critical path
    warm: int = 0  # misses that took a sandbox prefetched ahead of need
    snapshots: int = 0  # taken (restores and warm: used)
    snapshots_skipped: int = 0  # states worth saving for one more rollout, not saved: few came back (`policy.Reuse`)
    evictions: int = 0
    mismatches: int = 0  # replays whose output differed from the recorded one: a nondeterministic tool
    detached: int = 0  # rollouts whose state could no longer be reproduced from the cache
    store_errors: int = 0  # store operations that failed; the call went on without the cache
    failures: int = 0  # executions that raised or returned error=True (never cached)
    uncached: int = 0  # results returned but not recorded (detached, store down, too large, uncacheable)
    seconds_executing: float = 0.0  # tool time of `executions`
    seconds_replaying: float = 0.0
    seconds_saved: float = 0.0  # recorded execution time of every hit
    # Where the rest of the calls' time went, on their critical path (prefetching is not counted): what a
    # report subtracts from the calls' time to find the cache's own overhead.
    seconds_waiting: float = 0.0  # for another rollout's identical call (single flight)
    seconds_creating: float = 0.0  # fresh sandboxes
    seconds_restoring: float = 0.0  # snapshots restored, also attempts that failed
    seconds_snapshotting: float = 0.0  # snapshots under way that a miss had to wait for (its sandbox held still)
    seconds_store: float = 0.0  # store round trips: lookups, records, claims, leases
    # Off the critical path: snapshots taken and recorded, and read sets digested, after their call answered.
    seconds_background: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def timing(self, part: Part) -> _Timer:
        """Add the wall time of the block (also one that raises or is cancelled) to `seconds_<part>`."""
        return _Timer(self, f"seconds_{part}")


class _Timer:
    """`Stats.timing`'s block: a plain class, since it wraps every store round trip, hits included (a generator
    context manager costs about a microsecond more per hit)."""

    __slots__ = ("_name", "_stats", "_t0")

    def __init__(self, stats: Stats, name: str) -> None:
        self._stats, self._name, self._t0 = stats, name, 0.0

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        setattr(self._stats, self._name, getattr(self._stats, self._name) + time.perf_counter() - self._t0)
