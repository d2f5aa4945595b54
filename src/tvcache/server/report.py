"""`tvcache stats URL`: a running server's counters as tables."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
from rich.console import Console
from rich.table import Table

from ..stores.base import TaskInfo
from .wire import StatsReply

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


def print_stats(url: str, token: str | None = None, console: Console | None = None) -> StatsReply:
    """Print the stats of the server at `url` (token: argument, URL userinfo or TVCACHE_TOKEN)."""
    console = console or Console()
    stats, tasks = fetch_stats(url, token)
    t = stats.totals
    answered = t.hits + t.waited_hits
    table = Table(title=f"tvcache server {urlsplit(url).netloc.rpartition('@')[2]} · {stats.store}", show_header=False)
    table.add_column("counter")
    table.add_column("value", justify="right")
    rows = [
        ("uptime", f"{stats.uptime:,.0f} s"),
        ("lookups", f"{t.lookups:,}"),
        ("hits", f"{t.hits:,}"),
        ("waited hits (single flight)", f"{t.waited_hits:,}"),
        ("hit rate", f"{answered / t.lookups:.1%}" if t.lookups else "-"),
        ("misses", f"{t.misses:,}"),
        ("records (executions)", f"{t.records:,}"),
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
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if stats.tasks:
        names = {info.key: info for info in tasks}
        per_task = Table(title="per task")
        for column in ("namespace", "task", "lookups", "hit rate", "records", "tool time saved"):
            per_task.add_column(column, justify="left" if column in ("namespace", "task") else "right")
        for key, c in sorted(stats.tasks.items(), key=lambda kv: -kv[1].lookups):
            info = names.get(key)
            per_task.add_row(
                info.namespace if info else "?",
                info.task if info else key[:12],
                f"{c.lookups:,}",
                f"{c.hits / c.lookups:.1%}" if c.lookups else "-",
                f"{c.records:,}",
                f"{c.seconds_saved:,.1f} s",
            )
        console.print(per_task)
    return stats
