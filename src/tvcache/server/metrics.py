"""`/metrics`: a server's counters in the Prometheus text format, read only when scraped."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .counters import BUCKETS, Counters, RequestCounters

__all__ = ["CONTENT_TYPE", "Metrics", "cache_metrics", "request_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TOTALS = {
    "lookups": "Lookups served.",
    "hits": "Lookups answered with an entry.",
    "misses": "Lookups that found no entry.",
    "claims": "Misses that were claimed for execution.",
    "records": "Entries recorded (executions that finished).",
    "releases": "Claims given up without an entry (executions that failed).",
    "waits": "Waits for a concurrent execution of the same call (single flight).",
    "waited_hits": "Waits that ended with the entry.",
    "evictions": "Snapshots evicted to keep within budget.",
    "errors": "Requests answered with a 4xx or 5xx status.",
}


def request_metrics(prefix: str, counters: RequestCounters) -> Iterator[Metric]:
    """Requests by path and status, and their latency histogram: what every server reports."""
    requests = CounterMetricFamily(f"{prefix}_requests", "Requests by endpoint and status.", labels=["path", "code"])
    latency = HistogramMetricFamily(f"{prefix}_request_duration_seconds", "Time to answer a request.", labels=["path"])
    for path, hist in sorted(counters.latency.items()):
        for status, count in sorted(hist.statuses.items()):
            requests.add_metric([path, str(status)], count)
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), hist.counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        latency.add_metric([path], buckets, hist.total)
    yield requests
    yield latency


def cache_metrics(c: Counters) -> Iterator[Metric]:
    for name, text in _TOTALS.items():
        yield CounterMetricFamily(f"tvcache_{name}", text, value=getattr(c, name))
    saved = "Recorded tool seconds of every hit."
    yield CounterMetricFamily("tvcache_tool_seconds_saved", saved, value=c.seconds_saved)
    yield GaugeMetricFamily("tvcache_tasks", "Tasks seen since the server started.", value=len(c.tasks))
    yield from request_metrics("tvcache", c)


class _Collector(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]):
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


class Metrics:
    """A registry of the process's own metrics plus whatever `collect` yields when scraped."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(collect))
        ProcessCollector(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
