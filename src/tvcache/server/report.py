"""`tvcache stats URL`: a running server's counters as tables."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from ..stores.base import TaskInfo
from ..stores.wire import StatsReply

__all__ = ["fetch_stats", "print_stats"]


def _get(url: str, path: str, token: str | None, kind: Any) -> Any:
    parts = urlsplit(url)
    token = token or parts.password or parts.username or os.environ.get("TVCACHE_TOKEN") or None
    netloc = parts.netloc.rpartition("@")[2]
    base = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    request = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return msgspec.json.decode(response.read(), type=kind)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{base}{path} answered {exc.code}: {exc.read()[:200].decode(errors='replace')}") from None
    except OSError as exc:
        raise RuntimeError(f"cannot reach {base}: {exc}") from None


def fetch_stats(url: str, token: str | None = None) -> tuple[StatsReply, list[TaskInfo]]:
    return _get(url, "/v1/stats", token, StatsReply), _get(url, "/v1/tasks", token, list[TaskInfo])


def format_table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...] | None = None) -> str:
    """Plain text columns: the first left-aligned, the others right-aligned (figures)."""
    lines = [header, *rows] if header else list(rows)
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    out = []
    for n, row in enumerate(lines):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True)]
        out.append("  ".join(cells).rstrip())
        if header and n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def print_stats(url: str, token: str | None = None) -> StatsReply:
    """Print the stats of the server at `url` (token: argument, URL userinfo or TVCACHE_TOKEN)."""
    stats, tasks = fetch_stats(url, token)
    t = stats.totals
    # One count of hits everywhere: answered from an entry, whether at once, after waiting for a concurrent
    # execution of the same call, or by what the call read; the hit rate is those over all lookups.
    hits = t.hits + t.waited_hits
    rows = [
        ("uptime", f"{stats.uptime:,.0f} s"),
        ("lookups", f"{t.lookups:,}"),
        ("hits", f"{hits:,}"),
        ("  of which after waiting (single flight)", f"{t.waited_hits:,}"),
        ("  of which by what the call read (read sets)", f"{t.read_set_hits:,}"),
        ("hit rate (hits / lookups)", f"{hits / t.lookups:.1%}" if t.lookups else "-"),
        ("misses (lookups - hits)", f"{t.lookups - hits:,}"),
        ("records (executions)", f"{t.records - t.read_set_hits:,}"),
        ("released claims (failed executions)", f"{t.releases:,}"),
        ("waits", f"{t.waits:,}"),
        ("evictions", f"{t.evictions:,}"),
        ("tool time saved", f"{t.seconds_saved:,.1f} s"),
        ("refused or failed requests", f"{t.errors:,}"),
    ]
    series = stats.series
    if len(series.t) >= 2:
        window = min(len(series.t) - 1, 60)
        span = series.t[-1] - series.t[-1 - window]
        if span > 0:
            rows.append(
                (f"lookups/s (last {span:.0f} s)", f"{(series.lookups[-1] - series.lookups[-1 - window]) / span:,.1f}")
            )
    print(f"tvcache server {urlsplit(url).netloc.rpartition('@')[2]} · {stats.store}")
    print(format_table(rows))
    if stats.tasks:
        names = {info.scope_key: info for info in tasks}
        per_task = []
        for key, c in sorted(stats.tasks.items(), key=lambda kv: -kv[1].lookups):
            info = names.get(key)
            per_task.append(
                (
                    f"{info.namespace}/{info.task}" if info else key[:12],
                    f"{c.lookups:,}",
                    f"{c.hits:,}",
                    f"{c.hits / c.lookups:.1%}" if c.lookups else "-",
                    f"{c.records:,}",
                    f"{c.seconds_saved:,.1f} s",
                )
            )
        print("\nper task")
        print(format_table(per_task, ("namespace/task", "lookups", "hits", "hit rate", "records", "tool time saved")))
    return stats
