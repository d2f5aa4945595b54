"""The store interface: the same checks for every store (memory, SQLite, Redis, Redis Cluster); durability of the
SQLite store."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from redis_server import redis_cluster, redis_server  # noqa: F401  (fixtures for the redis stores)
from tvcache.graph import EDGE, MEMO, Entry, Scope, child_id
from tvcache.stores import Claim, open_store
from tvcache.stores.memory import MemoryStore
from tvcache.stores.sqlite import SQLiteStore

SCOPE = Scope("ns", "task", "fp")
ROOT = SCOPE.root
D1, D2 = b"1" * 16, b"2" * 16


@pytest.fixture(params=["memory", "sqlite", "redis", "redis-cluster"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    s: Any
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "sqlite":
        s = SQLiteStore(tmp_path / "c.db")
    else:  # a real server (or 3-node cluster) started once per session, emptied for each test
        pytest.importorskip("redis", reason="the redis package (redis-py) is not installed")
        from tvcache.stores.redis import RedisStore

        server = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
        server.flush()
        s = RedisStore(server.url)
    yield s
    asyncio.run(s.close())


def entry(output: bytes, kind: Any = EDGE) -> Entry:
    return Entry(kind, output, 0.5)


def test_node_ids_are_content_addressed() -> None:
    assert Scope("ns", "task", "fp").root == ROOT
    assert len({ROOT, Scope("ns", "task", "fp2").root, Scope("ns", "task2", "fp").root}) == 3
    assert child_id(ROOT, D1) == child_id(ROOT, D1) != child_id(ROOT, D2)
    assert child_id(child_id(ROOT, D1), D2) != child_id(child_id(ROOT, D2), D1)


def test_first_writer_wins(store: Any) -> None:
    async def main() -> None:
        key = SCOPE.key
        assert await store.lookup(key, ROOT, D1) is None
        assert (await store.record(key, ROOT, D1, entry(b"first"), None)).output == b"first"
        assert (await store.record(key, ROOT, D1, entry(b"second", MEMO), None)).output == b"first"
        assert await store.lookup(key, ROOT, D1) == entry(b"first")

    asyncio.run(main())


def test_claims_single_flight_and_expiry(store: Any) -> None:
    async def main() -> None:
        key = SCOPE.key
        mine = await store.lookup(key, ROOT, D1, claim=0.2)
        assert isinstance(mine, Claim) and mine.token
        assert await store.lookup(key, ROOT, D1, claim=0.2) == Claim(None)  # busy
        waiter = asyncio.create_task(store.wait(key, ROOT, D1, 5.0))
        await asyncio.sleep(0.01)
        await store.record(key, ROOT, D1, entry(b"out"), mine.token)
        assert await waiter == entry(b"out")
        # A released claim wakes its waiters with nothing, so they claim it themselves.
        other = await store.lookup(key, ROOT, D2, claim=5.0)
        waiter = asyncio.create_task(store.wait(key, ROOT, D2, 5.0))
        await asyncio.sleep(0.01)
        await store.release(key, ROOT, D2, other.token)
        assert await waiter is None
        # A claim whose owner vanished expires and is taken over.
        lost = await store.lookup(key, ROOT, D2, claim=0.05)
        assert lost.token
        t0 = time.monotonic()
        assert await store.wait(key, ROOT, D2, 5.0) is None
        assert time.monotonic() - t0 < 1.0
        taken = await store.lookup(key, ROOT, D2, claim=5.0)
        assert taken.token and taken.token != lost.token
        assert not await store.refresh(key, ROOT, D2, lost.token, 5.0)
        assert await store.refresh(key, ROOT, D2, taken.token, 5.0)

    asyncio.run(main())


def test_leases_find_the_deepest_snapshot_and_protect_it(store: Any) -> None:
    async def main() -> None:
        key = SCOPE.key
        n1 = child_id(ROOT, D1)
        n2 = child_id(n1, D2)
        n3 = child_id(n2, D1)
        assert await store.add_snapshot(key, "o", [ROOT, n1], "s1", 2) == []
        assert await store.add_snapshot(key, "o", [ROOT, n1, n2], "s2", 2) == []
        assert await store.add_snapshot(key, "o", [ROOT, n1], "dup", 2) == ["dup"]  # node already has one
        lease = await store.lease(key, "o", [n1, n2, n3], 60.0)
        assert (lease.node, lease.snapshot_id) == (n2, "s2")
        assert await store.lease(key, "o", [n3], 60.0) is None
        # Over budget: s2 is leased, so the inner s1 goes although leaves go first.
        assert await store.add_snapshot(key, "o", [ROOT, n1, n2, n3], "s3", 2) == ["s1"]
        await store.unlease(key, lease.token)
        records = {r.snapshot_id: r for r in await store.snapshots(key)}
        assert set(records) == {"s2", "s3"} and not records["s2"].leased
        assert records["s3"].parent == n2
        # An expired lease no longer protects.
        await store.lease(key, "o", [n2], 0.01)
        await asyncio.sleep(0.05)
        assert not any(r.leased for r in await store.snapshots(key))
        await store.drop_snapshot(key, "o", n3, "s3")
        assert [r.snapshot_id for r in await store.snapshots(key)] == ["s2"]
        # Another origin sees none of these, and its budget is its own.
        assert await store.lease(key, "elsewhere", [n1, n2], 60.0) is None
        assert await store.add_snapshot(key, "elsewhere", [ROOT, n1], "e1", 1) == []
        assert [r.snapshot_id for r in await store.snapshots(key, "o")] == ["s2"]
        assert {r.origin for r in await store.snapshots(key)} == {"o", "elsewhere"}

    asyncio.run(main())


def test_export_names_tasks_and_counts_hits(store: Any) -> None:
    async def main() -> None:
        from tvcache.stores import TaskInfo

        key = SCOPE.key
        await store.register(TaskInfo(key, "ns", "task", "fp"))
        await store.record(key, ROOT, D1, Entry(EDGE, b"out", 0.5, "bash {}"), None)
        await store.record(key, ROOT, D2, Entry(MEMO, b"o2", 0.1, "read {}"), None)
        for _ in range(3):
            await store.lookup(key, ROOT, D1)
        graph = await store.export(key)
        assert graph.task == TaskInfo(key, "ns", "task", "fp")
        assert await store.tasks() == [graph.task]
        by_call = {e.call: e for e in graph.entries}
        assert (by_call["bash {}"].hits, by_call["bash {}"].child) == (3, child_id(ROOT, D1))
        assert (by_call["read {}"].kind, by_call["read {}"].child) == ("memo", None)
        assert (await store.export(key, limit=1)).truncated

    asyncio.run(main())


def test_store_urls() -> None:
    assert isinstance(open_store(None), MemoryStore)
    with pytest.raises(ValueError, match="unknown store URL"):
        open_store("ftp://x")
    with pytest.raises(ValueError, match="sqlite"):
        open_store("sqlite://")


WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from tvcache.graph import Entry
    from tvcache.stores.sqlite import SQLiteStore

    async def main():
        store = SQLiteStore(sys.argv[1])
        for i in range(100000):
            digest = i.to_bytes(16, "big")
            await store.record("s", b"n" * 16, digest, Entry("edge", str(i).encode(), 0.1), None)
            print(i, flush=True)  # acknowledged

    asyncio.run(main())
    """
)


def test_sqlite_store_keeps_every_acknowledged_entry_after_sigkill(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked = -1
    for line in proc.stdout:
        acked = int(line)
        if acked >= 300:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    async def main() -> None:
        store = SQLiteStore(db)
        for i in range(acked + 1):
            found = await store.lookup("s", b"n" * 16, i.to_bytes(16, "big"))
            assert found is not None and found.output == str(i).encode(), i
        await store.close()

    asyncio.run(main())
