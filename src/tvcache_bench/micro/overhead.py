"""`tvcache bench overhead`: the cache's own cost per call, hit and miss, per store.

The tool here does nothing (an echo in a sandbox that costs nothing to create), so the time a call takes is
the cache's own: key and digest, lookup, claim, record, decoding, bookkeeping. A miss is measured in a
rollout that already holds a live sandbox at its state, as in steady state.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tvcache.cache import ToolCache
from tvcache.calls import ToolCall
from tvcache.sandboxes.base import Outcome
from tvcache.sandboxes.reclaim import scratch

__all__ = ["run"]


class _EchoBox:
    async def execute(self, call: ToolCall) -> Outcome:
        text = call.args.get("text", "") if isinstance(call.args, dict) else call.args
        return Outcome(text, changed=call.tool != "read")

    async def snapshot(self) -> str:
        return "echo"

    async def close(self) -> None:
        pass


class EchoSandboxes:
    fingerprint = "echo-v1"

    async def create(self) -> _EchoBox:
        return _EchoBox()

    async def restore(self, snapshot_id: str) -> _EchoBox:
        return _EchoBox()

    async def delete(self, snapshot_id: str) -> None:
        pass


def _percentiles(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)

    def pick(q: float) -> float:
        return samples[min(len(samples) - 1, int(q * len(samples)))] * 1e6

    return {"p50_us": pick(0.50), "p99_us": pick(0.99), "mean_us": statistics.fmean(samples) * 1e6}


async def _measure(url: str | None, calls: int) -> dict[str, dict[str, float]]:
    boxes = EchoSandboxes()
    text = "x" * 200  # a typical short tool output
    async with ToolCache(url) as cache:
        misses: list[float] = []
        hits: list[float] = []
        async with cache.rollout("bench", boxes) as r:
            await r.call("read", {"path": "warm-up"})  # creates the live sandbox
            for i in range(calls):
                t0 = time.perf_counter()
                await r.call("read", {"path": f"/f{i}", "text": text})
                misses.append(time.perf_counter() - t0)
        async with cache.rollout("bench", boxes) as r:
            await r.call("read", {"path": "warm-up"})
            for i in range(calls):
                t0 = time.perf_counter()
                res = await r.call("read", {"path": f"/f{i}", "text": text})
                hits.append(time.perf_counter() - t0)
                assert res.hit
    return {"hit": _percentiles(hits), "miss": _percentiles(misses)}


def run(calls: int = 20000, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    results: dict[str, Any] = {}
    with scratch("bench-overhead", "/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        for name, url in [("memory", None), ("sqlite", f"sqlite:///{tmp}/bench.db")]:
            results[name] = asyncio.run(_measure(url, calls))
    table = Table(title=f"Cache overhead per call ({calls:,} calls each, tool time excluded)")
    for column in ("store", "kind", "p50 µs", "p99 µs", "mean µs"):
        table.add_column(column, justify="right" if "µs" in column else "left")
    for store, kinds in results.items():
        for kind, p in kinds.items():
            table.add_row(store, kind, f"{p['p50_us']:.1f}", f"{p['p99_us']:.1f}", f"{p['mean_us']:.1f}")
    console.print(table)
    return results
