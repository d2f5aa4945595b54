"""`tvcache bench synthetic`: a parametric GRPO workload over an in-process world, for scale.

The world is a small key-value store in `PythonSandboxes`: `read {"key"}` returns a key's value (annotated
read-only), `append {"key", "value"}` appends to it, so every state depends on the order of all earlier
writes. Each call carries `cost_ms`, and executing it sleeps that long: a stand-in for a tool that waits on
a remote sandbox, so a 2-core machine can simulate hundreds of concurrent rollouts.

How rollouts are generated (`generate`): at each position of a rollout, the agent picks one of `branching`
candidate calls of that task and position, candidate k with probability proportional to 1/(k+1)^`skew`
(GRPO samples of one prompt mostly agree and now and then diverge; with `branching` 1 all rollouts are the
same). A candidate is a read with probability `read_fraction`, else an append; keys come from a small set.
Costs are log-normal with median `cost_ms` and shape `cost_sigma`, fixed per candidate. At most `capacity`
calls execute at once (the machine's cores), so work a cache duplicates delays other rollouts.

Two measurements:

- `compare`: the four strategies on the replay engine (outputs checked against no cache), moderate size.
- `scale`: tvcache alone on the memory store with zero-cost tools, thousands of rollouts growing the graph
  past 10^5 nodes; at checkpoints it reports the graph's size, the process's resident memory growth per
  entry, and the cost of a hit (re-running earlier rollouts, which then only hit) as the graph grows.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from tvcache.cache import ToolCache
from tvcache.calls import ToolCall, Tools
from tvcache.graph import EDGE
from tvcache.sandboxes.python import PythonSandboxes

from ..replay import ReplayOptions, percentile, replay_strategies, resident_kb
from ..report import format_bytes, print_table, wide_console, write_charts
from ..strategies import STRATEGIES
from ..traces import Trace, TraceCall
from ..workload import Workload

__all__ = ["KEYS", "TOOLS", "Params", "build_workload", "generate", "make_sandboxes", "run", "run_tool", "scale"]

KEYS = tuple("abcdefgh")
TOOLS = Tools(read_only={"read"})


async def run_tool(state: dict[str, str], call: ToolCall) -> str:
    args = call.args
    if not isinstance(args, dict):
        raise ValueError(f"{call.tool} takes a JSON object of arguments")
    cost = float(args.get("cost_ms", 0)) / 1000
    if cost > 0:
        await asyncio.sleep(cost)
    key = args["key"]
    if call.tool == "read":
        return f"{key}={state.get(key, '')}"
    if call.tool == "append":
        state[key] = state.get(key, "") + args["value"]
        return f"{key} has {len(state[key])} chars"
    return f"Error: unknown tool {call.tool!r}"


def make_sandboxes(capacity: int = 0) -> PythonSandboxes[dict[str, str]]:
    """The world's sandboxes. `capacity` > 0 lets at most that many calls execute at once across all of
    them, like a machine with that many cores running the tools: duplicated work then slows others down."""
    if capacity <= 0:
        return PythonSandboxes(make=dict, run=run_tool, fingerprint="synthetic-kv-v1")
    slots = asyncio.Semaphore(capacity)

    async def limited(state: dict[str, str], call: ToolCall) -> str:
        async with slots:
            return await run_tool(state, call)

    return PythonSandboxes(make=dict, run=limited, fingerprint="synthetic-kv-v1")


@dataclass(frozen=True)
class Params:
    tasks: int = 8
    rollouts: int = 8  # per task
    calls: int = 12  # per rollout
    branching: int = 3  # candidate calls per position
    skew: float = 1.5  # how strongly rollouts agree on the first candidate
    read_fraction: float = 0.5
    cost_ms: float = 20.0  # median cost of a call
    cost_sigma: float = 1.0  # log-normal shape
    capacity: int = 4  # calls the simulated machine runs at once (0: unlimited)
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.tasks, self.rollouts, self.calls, self.branching) < 1:
            raise ValueError("tasks, rollouts, calls and branching must be at least 1")
        if not 0 <= self.read_fraction <= 1 or self.cost_ms < 0 or self.cost_sigma < 0:
            raise ValueError("read_fraction must be in [0, 1], cost_ms and cost_sigma >= 0")


def _candidate(task: int, position: int, k: int, p: Params) -> TraceCall:
    # Seeded by (seed, task, position, k): the same candidate is the same call in every rollout.
    rng = random.Random(hashlib.blake2b(f"{p.seed}/{task}/{position}/{k}".encode(), digest_size=8).digest())
    cost = round(p.cost_ms * math.exp(rng.gauss(0, p.cost_sigma)), 3) if p.cost_ms else 0
    key = rng.choice(KEYS)
    if rng.random() < p.read_fraction:
        return TraceCall("read", {"key": key, "cost_ms": cost})
    return TraceCall("append", {"key": key, "value": rng.choice("xyz"), "cost_ms": cost})


def generate(p: Params) -> list[Trace]:
    rng = random.Random(p.seed)
    weights = [1 / (k + 1) ** p.skew for k in range(p.branching)]
    traces = []
    for task in range(p.tasks):
        for rollout in range(p.rollouts):
            picks = rng.choices(range(p.branching), weights, k=p.calls)
            calls = [_candidate(task, i, k, p) for i, k in enumerate(picks)]
            traces.append(Trace(f"synthetic-{task}", f"r{rollout}", "tvcache_bench.workloads.synthetic", calls))
    return traces


def build_workload(p: Params) -> Workload:
    factory = make_sandboxes(p.capacity)
    return Workload(
        name="synthetic",
        traces=generate(p),
        sandboxes=lambda task: factory,
        tools=TOOLS,
        close=factory.close,
        notes=f"generated GRPO rollouts ({', '.join(f'{k}={v}' for k, v in asdict(p).items())})",
    )


async def compare(p: Params, options: ReplayOptions) -> Any:
    workload = build_workload(p)
    try:
        return await replay_strategies(workload, STRATEGIES, options)
    finally:
        await workload.close()


# -- scale -------------------------------------------------------------------------------------------------


async def _replay_one(cache: ToolCache, factory: PythonSandboxes[dict[str, str]], trace: Trace) -> list[float]:
    seconds = []
    async with cache.rollout(trace.task, factory, TOOLS) as r:
        for c in trace.calls:
            t0 = time.perf_counter()
            await r.call(c.tool, c.args)
            seconds.append(time.perf_counter() - t0)
    return seconds


async def _graph_size(cache: ToolCache) -> tuple[int, int]:
    """(entries, edges) of every task in the cache's store."""
    entries = edges = 0
    for info in await cache.store.tasks():
        export = await cache.store.export(info.scope_key, limit=10**9)
        entries += len(export.entries)
        edges += sum(1 for e in export.entries if e.kind == EDGE)
    return entries, edges


async def scale(
    tasks: int = 120,
    rollouts: int = 32,
    calls: int = 40,
    branching: int = 8,
    checkpoints: int = 5,
    probes: int = 20,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Grow one memory-store cache with `tasks * rollouts` rollouts of zero-cost calls; after each
    `1/checkpoints` of the tasks, measure its size, memory and hit cost. Returns one row per checkpoint."""
    p = Params(tasks, rollouts, calls, branching, skew=0.5, read_fraction=0.25, cost_ms=0, capacity=0, seed=seed)
    traces = generate(p)
    factory = make_sandboxes()
    cache = ToolCache()
    gc.collect()
    rss0 = resident_kb("VmRSS") or 0
    rows = []
    done = 0
    started = time.perf_counter()
    try:
        per_checkpoint = max(1, math.ceil(tasks / checkpoints))
        for first in range(0, tasks, per_checkpoint):
            chunk = [t for t in traces[first * rollouts : (first + per_checkpoint) * rollouts]]
            t0 = time.perf_counter()
            for i in range(0, len(chunk), rollouts):  # one task at a time, its rollouts concurrent
                await asyncio.gather(*(_replay_one(cache, factory, t) for t in chunk[i : i + rollouts]))
            grow_seconds = time.perf_counter() - t0
            await cache.flush()  # the snapshots still being taken count in the figures below
            done += len(chunk)
            entries, edges = await _graph_size(cache)
            gc.collect()
            rss = (resident_kb("VmRSS") or 0) - rss0
            # Hit cost at this size: earlier rollouts again, which now only hit (no sandbox is made).
            rng = random.Random(done)
            hits: list[float] = []
            before = cache.stats()["hits"]
            for trace in rng.sample(traces[:done], min(probes, done)):
                hits += await _replay_one(cache, factory, trace)
            assert cache.stats()["hits"] - before == len(hits), "probe rollouts must only hit"
            ordered = sorted(hits)
            rows.append(
                {
                    "rollouts": done,
                    "calls": done * calls,
                    "entries": entries,
                    "nodes": edges + len(await cache.store.tasks()),
                    "rss_growth_bytes": rss * 1024,
                    "bytes_per_entry": rss * 1024 / entries if entries else 0.0,
                    "miss_path_us_per_call": grow_seconds / (len(chunk) * calls) * 1e6,
                    "hit_p50_us": percentile(ordered, 0.5) * 1e6,
                    "hit_p99_us": percentile(ordered, 0.99) * 1e6,
                    "snapshots": int(cache.stats()["snapshots"]),
                    "seconds": time.perf_counter() - started,
                }
            )
    finally:
        await cache.close()
        await factory.close()
    return rows


def print_scale(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="synthetic scale: tvcache, memory store, zero-cost tools", title_justify="left")
    for name in ("rollouts", "entries", "nodes", "RSS growth", "bytes/entry", "µs/call growing", "hit p50", "hit p99"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            f"{r['rollouts']:,}",
            f"{r['entries']:,}",
            f"{r['nodes']:,}",
            format_bytes(r["rss_growth_bytes"]),
            f"{r['bytes_per_entry']:.0f}",
            f"{r['miss_path_us_per_call']:.0f}",
            f"{r['hit_p50_us']:.1f} µs",
            f"{r['hit_p99_us']:.1f} µs",
        )
    console.print(table)


def run(charts: str | None = None, *, small: bool = False, progress: bool = True) -> dict[str, Any]:
    """Both measurements with default sizes (`small`: a few seconds, for tests); prints the tables."""
    console = wide_console()
    p = Params(tasks=4, rollouts=4, calls=6, cost_ms=2) if small else Params()
    options = ReplayOptions(batch=4, epochs=2, concurrency=16, progress=progress and not small)
    result = asyncio.run(compare(p, options))
    print_table(result, console)
    if charts:
        for path in write_charts(result, charts):
            console.print(f"chart: {path}")
    sizes: dict[str, Any] = {"tasks": 6, "rollouts": 8, "calls": 10, "checkpoints": 2} if small else {}
    rows = asyncio.run(scale(**sizes))
    print_scale(rows, console)
    return {"compare": result.summary(), "scale": rows}
