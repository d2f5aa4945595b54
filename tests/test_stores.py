"""The store interface: the same checks for every store (memory, SQLite, Redis, Redis Cluster); the SQLite store's
durability, bounded memory and work off the event loop; every failure of the SQLite and HTTP stores surfacing as
`StoreError` (the Redis store's are in test_redis_store.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import pidns
from redis_server import free_port, redis_cluster, redis_server  # noqa: F401  (fixtures for the redis stores)
from tvcache.graph import EDGE, MEMO, Entry, Scope, child_id
from tvcache.stores import Claim, StoreError, TaskInfo, open_store
from tvcache.stores.memory import MemoryStore
from tvcache.stores.sqlite import SQLiteStore

SCOPE = Scope("ns", "task", "fp")
ROOT = SCOPE.root
D1, D2 = b"1" * 16, b"2" * 16


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A store of `kind`: memory, sqlite, redis or redis-cluster (a real server, or 3-node cluster, started once per
    session and emptied here)."""
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "c.db")
    pytest.importorskip("redis", reason="the redis package (redis-py) is not installed")
    from tvcache.stores.redis import RedisStore

    server = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster")
    server.flush()
    return RedisStore(server.url)


@pytest.fixture(params=["memory", "sqlite", "redis", "redis-cluster"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    s = make_store(request.param, request, tmp_path)
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


def test_ping_answers(store: Any) -> None:
    asyncio.run(store.ping())


def test_big_values_pass_through(store: Any) -> None:
    """Numbers past 64 bits and large outputs: every store takes them as they are or clamps them, never raises."""
    huge = 2**64 + 1

    async def main() -> None:
        key = SCOPE.key
        big = Entry(EDGE, os.urandom(1 << 20), 1e300, f"calc {{'n': {2**200}}}")
        assert await store.record(key, ROOT, D1, big, None) == big
        assert await store.lookup(key, ROOT, D1) == big
        mine = await store.lookup(key, ROOT, D2, claim=huge)
        assert isinstance(mine, Claim) and mine.token
        assert await store.lookup(key, ROOT, D2, claim=1.0) == Claim(None)  # the huge claim holds
        assert await store.refresh(key, ROOT, D2, mine.token, huge)
        await store.release(key, ROOT, D2, mine.token)
        assert await store.add_snapshot(key, "o", [ROOT], "s", huge) == []
        lease = await store.lease(key, "o", [ROOT], huge)
        assert lease is not None and lease.snapshot_id == "s"
        assert [r.leased for r in await store.snapshots(key)] == [True]
        graph = await store.export(key, limit=huge)
        assert not graph.truncated and [e.size for e in graph.entries] == [1 << 20]

    asyncio.run(main())


def test_store_urls(tmp_path: Path) -> None:
    assert isinstance(open_store(None), MemoryStore)
    with pytest.raises(ValueError, match="unknown store URL"):
        open_store("ftp://x")
    with pytest.raises(ValueError, match="sqlite"):
        open_store("sqlite://")
    with pytest.raises(ValueError, match="cannot drop entries"):
        open_store("memory://?cache_mb=8")
    store = open_store(f"sqlite:///{tmp_path}/a.db?cache_mb=1.5&timeout=0.5")
    assert isinstance(store, SQLiteStore) and store.cache.max_bytes == 1.5 * 2**20
    asyncio.run(store.close())
    assert open_store(f"sqlite:///{tmp_path}/a.db").cache.max_bytes == 64 * 2**20  # type: ignore[attr-defined]
    for bad, message in [
        ("?cache_mb=lots", "cache_mb .* is a number"),
        ("?cache=8", "unknown option 'cache'"),
        ("?cache_mb=-1", "cache_mb is >= 0"),
        ("?timeout=0", "timeout is a number of seconds > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            open_store(f"sqlite:///{tmp_path}/b.db{bad}")
    assert not (tmp_path / "b.db").exists()  # refused before anything was made


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


# -- the SQLite store: bounded memory, off the event loop, failures as StoreError -------------------------------

SWEEPER = textwrap.dedent(
    """
    import asyncio, json, os, sys
    from tvcache.stores.sqlite import SQLiteStore

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    async def main(path, count, size, cache_mb):
        store = SQLiteStore(path, cache_mb=cache_mb)
        await store.lookup("s", b"n" * 16, bytes(16))  # threads, connections and code paths exist from here
        before, peak = rss(), 0
        for sweep in range(2):
            for i in range(count):
                found = await store.lookup("s", b"n" * 16, i.to_bytes(16, "big"))
                assert found is not None and found.output[:8] == i.to_bytes(8, "big") and len(found.output) == size
                peak = max(peak, store.cache.bytes)
        print(json.dumps({"growth": rss() - before, "peak": peak, "bound": store.cache.max_bytes}))
        await store.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
    """
)


def test_sqlite_store_memory_stays_bounded_over_a_database_larger_than_its_cache(tmp_path: Path) -> None:
    """A sweep of lookups over a 96 MiB database, twice, in a fresh process with an 8 MiB cache: the bytes the
    cache holds never pass the bound, and the process grows by well under the database's size."""
    db, count, size = tmp_path / "big.db", 1536, 64 << 10

    async def fill() -> None:
        store = SQLiteStore(db, cache_mb=0)
        for i in range(count):
            output = i.to_bytes(8, "big") + os.urandom(size - 8)
            await store.record("s", b"n" * 16, i.to_bytes(16, "big"), Entry(EDGE, output, 0.1, "read"), None)
        await store.close()

    asyncio.run(fill())
    out = subprocess.run(
        [sys.executable, "-c", SWEEPER, str(db), str(count), str(size), "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    print(figures)
    assert 0 < figures["peak"] <= figures["bound"] == 8 << 20
    assert figures["growth"] < count * size / 4  # the old unbounded dict grew by the whole database


LOCKER = textwrap.dedent(
    """
    import sqlite3, sys
    db = sqlite3.connect(sys.argv[1], isolation_level=None)
    db.execute("BEGIN IMMEDIATE")  # the write lock, until a line arrives on stdin
    print("locked", flush=True)
    sys.stdin.readline()
    db.execute("COMMIT")
    """
)


@asynccontextmanager
async def write_locked(db: Path) -> AsyncIterator[None]:
    """Another process holds `db`'s write lock for the duration."""
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", LOCKER, str(db), stdin=pipe, stdout=pipe)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert await proc.stdout.readline() == b"locked\n"
        yield
    finally:
        proc.stdin.write(b"\n")
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 10) == 0


def test_sqlite_store_waits_for_a_lock_off_the_event_loop(tmp_path: Path) -> None:
    """While a write waits for a lock another process holds, the event loop keeps running (a heartbeat ticks),
    hits are served from memory and lookups from the file; the write lands once the lock is released."""
    db = tmp_path / "c.db"

    async def main() -> None:
        key = SCOPE.key
        elsewhere = SQLiteStore(db, cache_mb=0)  # another process's entry: in the file, not in our memory
        await elsewhere.record(key, ROOT, D2, entry(b"from the file"), None)
        await elsewhere.close()
        store = SQLiteStore(db)
        await store.record(key, ROOT, D1, entry(b"in memory"), None)

        async def heartbeat() -> None:
            for _ in range(20):
                await asyncio.sleep(0.005)

        async with write_locked(db):
            writing = asyncio.create_task(store.record(key, ROOT, D3, entry(b"late"), None))
            await heartbeat()  # 20 ticks of the event loop, while the write waits
            assert not writing.done()  # still waiting for the lock (for up to the 10 s busy timeout)
            assert await store.lookup(key, ROOT, D1) == entry(b"in memory")
            assert await store.lookup(key, ROOT, D2) == entry(b"from the file")  # the reader is not held up
            assert not writing.done()
        assert await writing == entry(b"late")
        assert await store.lookup(key, ROOT, D3) == entry(b"late")
        await store.close()

    asyncio.run(main())


D3 = b"3" * 16


def test_sqlite_store_failures_are_store_errors_and_lose_nothing(tmp_path: Path) -> None:
    db = tmp_path / "c.db"

    async def main() -> None:
        key = SCOPE.key
        store = SQLiteStore(db, timeout=0.2)
        await store.record(key, ROOT, D1, entry(b"kept"), None)
        await store.add_snapshot(key, "o", [ROOT], "s1", 4)
        async with write_locked(db):
            # Past the busy timeout: "database is locked", for every kind of write, and for ping.
            with pytest.raises(StoreError, match="locked"):
                await store.record(key, ROOT, D2, entry(b"refused"), None)
            with pytest.raises(StoreError, match="locked"):
                await store.lease(key, "o", [ROOT], 60.0)
            with pytest.raises(StoreError, match="locked"):
                await store.register(TaskInfo(key, "ns", "task", "fp"))
            with pytest.raises(StoreError, match="locked"):
                await store.ping()
            assert await store.lookup(key, ROOT, D1) == entry(b"kept")
        await store.ping()
        assert await store.lookup(key, ROOT, D2) is None
        assert await store.record(key, ROOT, D2, entry(b"now"), None) == entry(b"now")
        await store.close()
        with pytest.raises(StoreError, match="closed"):
            await store.ping()

        reopened = SQLiteStore(db)
        assert await reopened.lookup(key, ROOT, D1) == entry(b"kept")
        assert await reopened.lookup(key, ROOT, D2) == entry(b"now")
        assert [r.snapshot_id for r in await reopened.snapshots(key)] == ["s1"]
        await reopened.close()

    asyncio.run(main())


def test_sqlite_rows_that_do_not_decode_are_store_errors(tmp_path: Path) -> None:
    """Rows another program wrote badly (an unknown kind, text for the output) raise StoreError, not a crash."""
    db = tmp_path / "c.db"
    key = SCOPE.key
    asyncio.run(SQLiteStore(db).close())  # the schema
    with sqlite3.connect(db) as raw:
        raw.execute(
            "INSERT INTO entries (node, digest, scope, kind, output, seconds, call)"
            " VALUES (?, ?, ?, 'bogus', x'00', 0.1, '')",
            (ROOT, D1, key),
        )
        raw.execute(
            "INSERT INTO entries (node, digest, scope, kind, output, seconds, call)"
            " VALUES (?, ?, ?, 'edge', 'text', 0.1, '')",
            (ROOT, D2, key),
        )
    raw.close()

    async def main() -> None:
        store = SQLiteStore(db)
        for digest in (D1, D2):
            with pytest.raises(StoreError, match="corrupt entry"):
                await store.lookup(key, ROOT, digest, claim=5.0)
        with pytest.raises(StoreError, match="corrupt entry"):
            await store.export(key)
        await store.close()

    asyncio.run(main())
    (tmp_path / "not.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match=r"not\.db"):
        SQLiteStore(tmp_path / "not.db")


# -- the HTTP store: every failure is a StoreError ---------------------------------------------------------------


@asynccontextmanager
async def misbehaving_server() -> AsyncIterator[str]:
    """A real HTTP server on loopback whose first path segment says how it fails: `/<mode>/v1/<op>`."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        if mode == "slow":
            await asyncio.sleep(30)
        if mode == "hangup":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        status, body, kind = {
            "html500": (500, "<html>Internal Server Error</html>", "text/html"),
            "storedown": (503, '{"error": "store failed: redis store at 10.0.0.5:6379: ConnectionError"}', None),
            "token": (401, '{"error": "missing or wrong bearer token"}', None),
            "forbidden": (403, "forbidden", "text/plain"),
            "garbage": (200, "this is not JSON", "text/plain"),
            "badentry": (200, '{"entry": {"kind": "bogus", "output": "AA==", "seconds": 1}}', None),
            "badlist": (200, '{"not": "a list"}', None),
        }[mode]
        return web.Response(status=status, text=body, content_type=kind or "application/json")

    app = web.Application()
    app.router.add_route("*", "/{mode}/v1/{op}", answer)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # the slow handler is not waited for
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_http_store_failures_are_store_errors() -> None:
    pytest.importorskip("aiohttp", reason="the HTTP store needs aiohttp (pip install 'tvcache[client]')")
    from tvcache.stores.http import HTTPStore

    async def main() -> None:
        key = SCOPE.key
        async with misbehaving_server() as url:
            modes = {
                "html500": "500",
                "storedown": "503: store failed",
                "token": "401: missing or wrong bearer token",
                "forbidden": "403",
                "garbage": "invalid",
                "badentry": "invalid",
                "badlist": "invalid",
                "slow": "TimeoutError",
                "hangup": "ServerDisconnectedError",
            }
            for mode, message in modes.items():
                store = HTTPStore(f"{url}/{mode}", timeout=0.5)
                with pytest.raises(StoreError, match=message):
                    await store.lookup(key, ROOT, D1, claim=5.0)
                with pytest.raises(StoreError, match=message):
                    await store.ping()
                await store.close()
        refused = HTTPStore(f"http://127.0.0.1:{free_port()}")
        with pytest.raises(StoreError, match="Connect"):
            await refused.ping()
        await refused.close()

    asyncio.run(main())


def test_http_store_ping_checks_the_server_its_token_and_its_store(tmp_path: Path) -> None:
    """Against a real `tvcache serve` over SQLite: a wrong or missing token, an entry the server's store cannot
    decode (a 503) and a stopped server are each a StoreError; the right token pings fine."""
    pytest.importorskip("uvicorn", reason="the server needs pip install 'tvcache[server]'")
    from server_helpers import Server
    from tvcache.stores.http import HTTPStore

    db = tmp_path / "served.db"
    asyncio.run(SQLiteStore(db).close())
    with sqlite3.connect(db) as raw:
        raw.execute(
            "INSERT INTO entries (node, digest, scope, kind, output, seconds, call)"
            " VALUES (?, ?, ?, 'bogus', x'00', 0.1, '')",
            (ROOT, D1, SCOPE.key),
        )
    raw.close()
    server = Server(tmp_path, f"sqlite:///{db}", "s3cret").start()

    async def main() -> None:
        right, wrong, none = HTTPStore(server.url, "s3cret"), HTTPStore(server.url, "guess"), HTTPStore(server.url)
        await right.ping()
        for store in (wrong, none):
            with pytest.raises(StoreError, match="401"):
                await store.ping()
        with pytest.raises(StoreError, match=r"503: .*corrupt entry"):
            await right.lookup(SCOPE.key, ROOT, D1)
        server.stop()
        with pytest.raises(StoreError, match="failed on a ping"):  # a pooled connection: "disconnected"
            await right.ping()
        for store in (right, wrong, none):
            await store.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()


@pytest.mark.parametrize("namespace", [False, True], ids=["fork", "fork-into-a-pid-namespace"])
def test_sqlite_store_carries_over_fork(namespace: bool, tmp_path: Path) -> None:
    """A store opened before a fork (a trainer forking rollout workers) works in the child, on a connection and
    threads of the child's own, instead of waiting forever for a thread that does not exist there. With
    `namespace`, the parent is a container's first process (pid 1) and forks its child into a PID namespace of its
    own, whose pid is 1 too: a pid cannot tell the child from its parent (the child waited forever then)."""
    if namespace:
        script = "import json, sys, test_stores as t; print(json.dumps(t.store_over_fork(sys.argv[1], True)))"
        found = pidns.run_python(script, str(tmp_path / "c.db"), namespace=True)
        assert found["parent"] == found["child"] == 1, "the test did not set up what it is about"
    else:
        found = store_over_fork(str(tmp_path / "c.db"), False)
        assert found["child"] != found["parent"]


def store_over_fork(path: str, namespace: bool) -> dict[str, int]:
    """test_sqlite_store_carries_over_fork in this process: the parent's and child's pids, after checking both sides."""
    store = SQLiteStore(path, cache_mb=0)
    asyncio.run(store.record(SCOPE.key, ROOT, D1, entry(b"parent"), None))
    readable, writable = os.pipe()
    child = pidns.fork(new_namespace=namespace, alarm=30)
    if child == 0:  # never back into the caller (pytest)
        code = 1
        try:
            os.write(writable, str(os.getpid()).encode())
            assert asyncio.run(store.lookup(SCOPE.key, ROOT, D1)) == entry(b"parent")
            asyncio.run(store.record(SCOPE.key, ROOT, D2, entry(b"child"), None))
            code = 0
        finally:
            os._exit(code)
    os.close(writable)
    _, status = os.waitpid(child, 0)
    pid = int(os.read(readable, 100))
    os.close(readable)
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed (status 3: it waited past its alarm)"

    async def main() -> None:
        assert await store.lookup(SCOPE.key, ROOT, D2) == entry(b"child")
        await store.close()

    asyncio.run(main())
    return {"parent": os.getpid(), "child": pid}
