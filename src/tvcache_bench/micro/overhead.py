"""`tvcache bench overhead`: the cache's own cost per call, hit and miss, per store.

The tool here does nothing (an echo in a sandbox that costs nothing to create), so the time a call takes is
the cache's own: key and digest, lookup, claim, record, decoding, bookkeeping. A miss is measured in a
rollout that already holds a live sandbox at its state, as in steady state.

Reuse by what a call read adds two kinds: a read-only miss that also keeps its read set as a candidate, and a
read-set hit (an exact miss answered by a candidate whose reads all match: the second lookup phase, its checks
and the memo it records). Their sandbox reports reads of `READ_KEYS` keys per call, as a SQLite query of a
few tables or a short shell command does.
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


READ_KEYS = 8


class _ReadingBox(_EchoBox):
    """Reports what a read read (its path and a few shared ones) and what a write wrote, like SQLite or a traced
    workspace."""

    async def execute(self, call: ToolCall) -> Outcome:
        path = str(call.args.get("path", "")) if isinstance(call.args, dict) else ""
        text = call.args.get("text", "") if isinstance(call.args, dict) else call.args
        if call.tool == "read":
            reads = {f"path:{path}": "base", **{f"path:/lib/{k}": "base" for k in range(READ_KEYS - 1)}}
            return Outcome(text, changed=False, reads=reads)
        return Outcome(text, changed=True, writes={f"path:{path}": path})


class ReadingEchoSandboxes(EchoSandboxes):
    fingerprint = "echo-reads-v1"

    async def create(self) -> _ReadingBox:
        return _ReadingBox()

    async def restore(self, snapshot_id: str) -> _ReadingBox:
        return _ReadingBox()

    async def base_digests(self, keys: Any) -> dict[str, str]:
        return dict.fromkeys(keys, "base")


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
        reads = await _measure_reads(cache, calls, text)
    return {"hit": _percentiles(hits), "miss": _percentiles(misses), **reads}


async def _measure_reads(cache: ToolCache, calls: int, text: str) -> dict[str, dict[str, float]]:
    """Rollout A writes one file, then reads `calls` others (misses that keep their read sets); rollout B writes
    another file, then reads the same ones: each an exact miss answered by A's candidate."""
    boxes = ReadingEchoSandboxes()
    samples: dict[str, list[float]] = {"miss + candidate": [], "read-set hit": []}
    for written, kind in (("/a", "miss + candidate"), ("/b", "read-set hit")):
        async with cache.rollout("bench-reads", boxes) as r:
            await r.call("write", {"path": written})  # creates the live sandbox; a new state for each rollout
            for i in range(calls):
                t0 = time.perf_counter()
                res = await r.call("read", {"path": f"/f{i}", "text": text})
                samples[kind].append(time.perf_counter() - t0)
                assert res.source == ("reads" if kind == "read-set hit" else "executed"), res.source
    return {kind: _percentiles(s) for kind, s in samples.items()}


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
