"""What the server counts: totals, per-task totals, a once-a-second time series, request latencies.

Plain integers bumped on the hot path (a few tens of nanoseconds each); `/metrics` and `/v1/stats` read them
when asked, so a request pays nothing for Prometheus or the dashboard.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from ..stores.wire import Series, StatsReply, TaskTotals, Totals

__all__ = ["BUCKETS", "Counters", "Latency", "RequestCounters"]

# Upper bounds, seconds, of the request latency histogram: a hit over loopback is ~0.1-1 ms, a wait can block.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0, 300.0)
SERIES_POINTS = 900  # 15 minutes at one sample a second
MAX_TASKS = 10_000  # tasks counted one by one; later ones share one row, so counters stay bounded


@dataclass
class Latency:
    """A cumulative-bucket histogram as Prometheus wants it: counts per bucket (the last one is +Inf)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)

    def add(self, seconds: float, status: int) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds
        self.statuses[status] = self.statuses.get(status, 0) + 1


@dataclass
class _Task:
    lookups: int = 0
    hits: int = 0
    records: int = 0
    seconds_saved: float = 0.0


class RequestCounters:
    """What every server counts of its requests: refusals and failures, and latency per path."""

    def __init__(self) -> None:
        self.started = time.time()
        self.errors = 0  # requests answered 4xx or 5xx
        self.latency: dict[str, Latency] = {}


class Counters(RequestCounters):
    """The cache server's counts."""

    def __init__(self, store: str) -> None:
        super().__init__()
        self.store = store
        self.lookups = 0
        self.hits = 0
        self.misses = 0
        self.claims = 0  # misses that got a claim: executions under way
        self.records = 0
        self.releases = 0
        self.waits = 0
        self.waited_hits = 0  # waits that ended with the entry
        self.read_set_hits = 0  # misses answered by a result recorded in another state that read the same
        self.evictions = 0
        self.seconds_saved = 0.0  # recorded tool seconds of every hit and waited hit
        self.tasks: dict[str, _Task] = {}
        self._samples: deque[tuple[float, int, int, int, int, int, float]] = deque(maxlen=SERIES_POINTS)

    def task(self, scope_key: str) -> _Task:
        task = self.tasks.get(scope_key)
        if task is None:
            if len(self.tasks) >= MAX_TASKS:
                scope_key = "other"
                task = self.tasks.get(scope_key)
            if task is None:
                task = self.tasks[scope_key] = _Task()
        return task

    def waited_hit(self, scope_key: str, seconds: float) -> None:
        """A wait that ended with the entry: a call answered without executing, like a hit."""
        task = self.task(scope_key)
        self.waited_hits += 1
        task.hits += 1
        self.seconds_saved += seconds
        task.seconds_saved += seconds

    def read_set_hit(self, scope_key: str, seconds: float) -> None:
        """A miss answered by what the call read (recorded by its client): a hit too."""
        task = self.task(scope_key)
        self.read_set_hits += 1
        self.hits += 1
        task.hits += 1
        self.seconds_saved += seconds
        task.seconds_saved += seconds

    def sample(self) -> None:
        hits = self.hits + self.waited_hits
        self._samples.append(
            (time.time(), self.lookups, hits, self.records, self.waits, self.evictions, self.seconds_saved)
        )

    def totals(self) -> Totals:
        return Totals(
            self.lookups,
            self.hits,
            self.misses,
            self.claims,
            self.records,
            self.releases,
            self.waits,
            self.waited_hits,
            self.evictions,
            self.seconds_saved,
            self.errors,
            self.read_set_hits,
        )

    def reply(self) -> StatsReply:
        columns = list(zip(*self._samples, strict=True)) or [()] * 7
        t, lookups, hits, records, waits, evictions, saved = (list(c) for c in columns)
        return StatsReply(
            started=self.started,
            uptime=time.time() - self.started,
            store=self.store,
            totals=self.totals(),
            tasks={k: TaskTotals(v.lookups, v.hits, v.records, v.seconds_saved) for k, v in self.tasks.items()},
            series=Series(t, lookups, hits, records, waits, evictions, saved),
        )
