"""`tvcache bench redis`: hits per second through `RedisStore.lookup`, at 1 and 32 concurrent clients.

A client is an asyncio task issuing lookups one after another for entries that exist, as rollouts replaying a
cached prefix do; all clients of a process share one store (one connection each, from its pool). Each lookup
is one Lua script on the server (HGET the entry, HINCRBY its hit count). With `processes` > 1 as many
processes run the same side by side, and their rates add up: that shows what one server takes from many
trainers, where one process is bound by its own CPU (redis-py spends far more per command than Redis does).

Without a URL a throwaway `redis-server` (AOF on, fsync every second) is started on a free port, in /dev/shm when it
exists. With one, the benchmark writes under its own key prefix and deletes what it wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tvcache.graph import EDGE, Entry, Scope, encode_output
from tvcache.sandboxes.reclaim import scratch
from tvcache.stores.redis import RedisStore

from .procs import free_port

__all__ = ["run", "throwaway_server"]

PREFIX = "tvcache-bench"
ENTRIES = 1000


@contextlib.contextmanager
def throwaway_server() -> Iterator[str]:
    """A `redis-server` on a free port for the duration, and its URL."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server), or pass a Redis URL")
    port = free_port()
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with scratch("bench-redis", shm) as workdir:
        proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                # As the README says to run Redis for tvcache: every acknowledged entry in the AOF (on tmpfs here).
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                str(workdir),
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {port}")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


async def _measure(url: str, clients: int, lookups: int) -> dict[str, float]:
    store = RedisStore(url, prefix=PREFIX)
    scope = Scope("bench", f"redis-store-{os.getpid()}-{clients}", "v1")  # one per process
    key, node = scope.key, scope.root
    digests = [i.to_bytes(16, "big") for i in range(ENTRIES)]
    entry = Entry(EDGE, encode_output("x" * 200), 0.5, "bench {}")  # a typical short tool output
    try:
        for digest in digests:
            await store.record(key, node, digest, entry, None)
        per_client = max(1, lookups // clients)
        latencies: list[float] = []

        async def client(k: int, n: int) -> None:
            for i in range(n):
                digest = digests[(k * 7919 + i) % ENTRIES]
                t0 = time.perf_counter()
                found = await store.lookup(key, node, digest, claim=30.0)  # as a rollout asks: claim on a miss
                latencies.append(time.perf_counter() - t0)
                if not isinstance(found, Entry):
                    raise RuntimeError(f"a lookup of a recorded entry returned {found!r}")

        await asyncio.gather(*(client(k, 1) for k in range(clients)))  # open every client's connection
        latencies.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(k, per_client) for k in range(clients)))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        done = len(latencies)
        latencies.sort()
        return {
            "lookups_per_s": done / wall,
            "p50_us": latencies[done // 2] * 1e6,
            "p99_us": latencies[min(done - 1, int(done * 0.99))] * 1e6,
            "mean_us": statistics.fmean(latencies) * 1e6,
            "client_cpu_us_per_lookup": cpu / done * 1e6,
        }
    finally:
        with contextlib.suppress(Exception):
            await store.forget(key)
        await store.close()


def _measure_in_process(args: tuple[str, int, int, bool]) -> dict[str, float]:
    url, clients, lookups, uvloop = args
    if uvloop:
        import uvloop as loop  # type: ignore[import-not-found, unused-ignore]

        result: dict[str, float] = loop.run(_measure(url, clients, lookups))
        return result
    return asyncio.run(_measure(url, clients, lookups))


def measure(
    url: str, clients: int, lookups: int = 20_000, processes: int = 1, uvloop: bool = False
) -> dict[str, float]:
    """Lookups per second of `processes` processes with `clients` concurrent clients each."""
    if processes == 1:
        return _measure_in_process((url, clients, lookups, uvloop))
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.map(_measure_in_process, [(url, clients, lookups, uvloop)] * processes)
    return {
        "lookups_per_s": sum(p["lookups_per_s"] for p in parts),
        **{k: statistics.fmean(p[k] for p in parts) for k in ("p50_us", "p99_us", "mean_us")},
        "client_cpu_us_per_lookup": statistics.fmean(p["client_cpu_us_per_lookup"] for p in parts),
    }


def run(
    url: str | None = None,
    lookups: int = 20_000,
    concurrency: Sequence[int] = (1, 32),
    processes: Sequence[int] = (1,),
    uvloop: bool = False,
    console: Console | None = None,
) -> dict[str, Any]:
    """Measure hits through `RedisStore` at each concurrency and process count; print a table and return the
    figures, keyed "<processes>x<clients>"."""
    console = console or Console()
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        target = url or stack.enter_context(throwaway_server())
        for procs in processes:
            for clients in concurrency:
                results[f"{procs}x{clients}"] = measure(target, clients, lookups, procs, uvloop)
    where = url or "a throwaway local redis-server"
    table = Table(title=f"Hits through RedisStore.lookup on {where} ({lookups:,} lookups per process)")
    for column in ("processes", "clients each", "lookups/s", "p50 µs", "p99 µs", "client CPU µs/lookup"):
        table.add_column(column, justify="right")
    for name, r in results.items():
        procs_, clients_ = name.split("x")
        table.add_row(
            procs_,
            clients_,
            f"{r['lookups_per_s']:,.0f}",
            f"{r['p50_us']:.0f}",
            f"{r['p99_us']:.0f}",
            f"{r['client_cpu_us_per_lookup']:.0f}",
        )
    console.print(table)
    return results


if __name__ == "__main__":
    run(processes=(1, 2))
