"""The Redis store beyond the shared conformance checks (test_stores.py runs those on a server and a cluster):
processes single-flighting through one server, a server that dies or freezes, and whole workloads checked
against the uncached oracle on a server and on a 3-node cluster."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("redis", reason="the redis package (redis-py) is not installed")

import redis.asyncio as aioredis

import kv

# redis_server and redis_cluster are fixtures (session-wide servers), asked for by name below.
from redis_server import RedisServer, free_port, redis_cluster, redis_server, start_cluster, start_server  # noqa: F401
from test_oracle import check_against_oracle, kv_plan
from tvcache import ToolCache
from tvcache.graph import EDGE, Entry, Scope
from tvcache.stores import Claim, StoreError, open_store
from tvcache.stores.redis import RedisStore

SCOPE = Scope("ns", "task", "fp").key
NODE, DIGEST = b"n" * 16, b"d" * 16


@pytest.fixture
def server(request: pytest.FixtureRequest) -> RedisServer:
    """The session's server, emptied."""
    shared: RedisServer = request.getfixturevalue("redis_server")
    shared.flush()
    return shared


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> RedisServer:
    """The session's 3-node cluster, emptied."""
    shared: RedisServer = request.getfixturevalue("redis_cluster")
    shared.flush()
    return shared


@pytest.fixture
def doomed_server() -> Iterator[RedisServer]:
    """A server of its own, for tests that kill or freeze it."""
    server = start_server()
    yield server
    server.stop()


# A claimant in another process: claims the call, says so, then records after `delay` or dies.
CLAIMANT = textwrap.dedent(
    """
    import asyncio, sys
    from tvcache.graph import Entry
    from tvcache.stores.redis import RedisStore

    async def main(url, ttl, delay):
        store = RedisStore(url)
        claim = await store.lookup(SCOPE, NODE, DIGEST, claim=ttl)
        assert claim.token, claim
        print("claimed", flush=True)
        await asyncio.sleep(delay)
        await store.record(SCOPE, NODE, DIGEST, Entry("edge", b"from the other process", 0.3), claim.token)
        print("recorded", flush=True)
        await store.close()

    asyncio.run(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3])))
    """
).replace("SCOPE, NODE, DIGEST", f"{SCOPE!r}, {NODE!r}, {DIGEST!r}")


def claimant(url: str, ttl: float, delay: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMANT, url, str(ttl), str(delay)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "claimed\n"
    return proc


def test_a_waiter_in_another_process_wakes_when_the_entry_is_recorded(server: RedisServer) -> None:
    proc = claimant(server.url, ttl=30.0, delay=0.3)

    async def main() -> tuple[Any, float]:
        store = RedisStore(server.url)
        t0 = time.monotonic()
        assert await store.lookup(SCOPE, NODE, DIGEST, claim=30.0) == Claim(None)  # busy in the other process
        entry = await store.wait(SCOPE, NODE, DIGEST, timeout=10.0)
        waited = time.monotonic() - t0
        await store.close()
        return entry, waited

    entry, waited = asyncio.run(main())
    assert proc.communicate(timeout=10)[0] == "recorded\n" and proc.returncode == 0
    assert entry == Entry(EDGE, b"from the other process", 0.3)
    # Recorded at about 0.3 s; neither the claim (30 s) nor the wait (10 s) ran out, so the record woke us.
    assert waited < 2.0, waited


def test_a_waiter_takes_over_from_a_claimant_that_died(server: RedisServer) -> None:
    proc = claimant(server.url, ttl=1.0, delay=60.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()

    async def main() -> None:
        store = RedisStore(server.url)
        assert await store.lookup(SCOPE, NODE, DIGEST, claim=30.0) == Claim(None)
        t0 = time.monotonic()
        assert await store.wait(SCOPE, NODE, DIGEST, timeout=30.0) is None  # at the claim's expiry, not 30 s
        assert time.monotonic() - t0 < 5.0
        mine = await store.lookup(SCOPE, NODE, DIGEST, claim=30.0)
        assert isinstance(mine, Claim) and mine.token
        await store.close()

    asyncio.run(main())


ADDER = textwrap.dedent(
    """
    import asyncio, json, sys
    from tvcache.stores.redis import RedisStore

    async def main(url, name):
        store = RedisStore(url)
        doomed = []
        for i in range(40):
            path = [b"r" * 16, f"{name}-{i}".encode().ljust(16, b".")]
            doomed += await store.add_snapshot(SCOPE, "shared", path, f"{name}-{i}", 5)
        print(json.dumps(doomed))
        await store.close()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
).replace("SCOPE", repr(SCOPE))


def test_concurrent_evictions_hand_every_snapshot_to_exactly_one_deleter(server: RedisServer) -> None:
    """Three processes add snapshots of one origin under one budget: atomic eviction keeps the budget and
    never loses a snapshot nor hands one to two callers to delete."""
    procs = [
        subprocess.Popen([sys.executable, "-c", ADDER, server.url, name], stdout=subprocess.PIPE, text=True)
        for name in "abc"
    ]
    doomed = [sid for p in procs for sid in json.loads(p.communicate(timeout=60)[0])]

    async def main() -> list[str]:
        store = RedisStore(server.url)
        kept = [r.snapshot_id for r in await store.snapshots(SCOPE, "shared")]
        await store.close()
        return kept

    kept = asyncio.run(main())
    assert len(kept) == 5
    assert len(doomed) == len(set(doomed)) == 3 * 40 - 5
    assert set(doomed) | set(kept) == {f"{n}-{i}" for n in "abc" for i in range(40)}


def test_a_server_that_dies_raises_store_error_and_the_cache_executes_directly(doomed_server: RedisServer) -> None:
    async def main() -> None:
        store = RedisStore(doomed_server.url)
        await store.record(SCOPE, NODE, DIGEST, Entry(EDGE, b"x", 0.1), None)
        assert isinstance(await store.lookup(SCOPE, NODE, DIGEST), Entry)
        busy = await store.lookup(SCOPE, NODE, b"f" * 16, claim=30.0)
        assert isinstance(busy, Claim) and busy.token
        waiter = asyncio.create_task(store.wait(SCOPE, NODE, b"f" * 16, timeout=30.0))
        await asyncio.sleep(0.2)  # blocked in BLPOP now
        doomed_server.stop()
        t0 = time.monotonic()
        with pytest.raises(StoreError):
            await waiter
        with pytest.raises(StoreError):
            await store.lookup(SCOPE, NODE, DIGEST)
        assert time.monotonic() - t0 < 3.0
        await store.close()

        # The cache goes on without its store: right answers, executed directly, the outage counted.
        async with ToolCache(doomed_server.url) as cache:
            plan = kv_plan(7, 3, 5)
            assert await check_against_oracle(cache, kv.sandboxes(), plan, kv.TOOLS) == 0
            assert cache.stats()["store_errors"] > 0 and cache.stats()["hits"] == 0

    asyncio.run(main())


def test_a_frozen_server_raises_store_error_after_the_socket_timeout(doomed_server: RedisServer) -> None:
    url = doomed_server.url + "?socket_timeout=0.5"

    async def main() -> None:
        store = RedisStore(url)
        busy = await store.lookup(SCOPE, NODE, DIGEST, claim=30.0)
        assert isinstance(busy, Claim) and busy.token
        waiter = asyncio.create_task(store.wait(SCOPE, NODE, DIGEST, timeout=1.0))
        await asyncio.sleep(0.2)
        doomed_server.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreError):
                await store.lookup(SCOPE, NODE, DIGEST)
            with pytest.raises(StoreError):  # blocked for its 1 s, then no answer within the grace
                await waiter
            assert time.monotonic() - t0 < 5.0
        finally:
            doomed_server.resume()
        await store.close()

    asyncio.run(main())


# A script that keeps the server busy for a second (a stand-in for any slow command another client sends).
SPIN = (
    "local t = redis.call('TIME'); local e = t[1] * 1e6 + t[2] + 1e6; "
    "repeat t = redis.call('TIME') until t[1] * 1e6 + t[2] >= e"
)


@pytest.mark.parametrize("how", ["timed out", "cancelled"])
def test_a_claim_taken_by_a_lookup_whose_answer_was_lost_is_given_back(doomed_server: RedisServer, how: str) -> None:
    """A claiming lookup runs on the server, and then its answer waits behind another client's slow command: the
    caller times out, or is cancelled, and the claim stays taken. Nobody would release it: everyone else making the
    call waited out the claim's ttl (30 s) before executing it. The store now gives such a claim back, after a round
    trip on its key. (The server is paused while both commands are sent, so that it runs them in that order.)"""
    url = doomed_server.url + "?socket_timeout=0.5"

    async def main() -> Claim | Any:
        store, other = RedisStore(url), RedisStore(url)
        spinner = aioredis.Redis.from_url(doomed_server.url)
        for connected in (store, other):  # before the pause
            await connected.lookup(SCOPE, NODE, DIGEST)
        await spinner.ping()
        doomed_server.pause()
        try:
            lookup = asyncio.create_task(store.lookup(SCOPE, NODE, DIGEST, claim=30.0))
            await asyncio.sleep(0.1)
            spin = asyncio.create_task(spinner.eval(SPIN, 0))
            await asyncio.sleep(0.1)
        finally:
            doomed_server.resume()
        if how == "cancelled":
            await asyncio.sleep(0.1)  # the lookup has run; its answer waits behind the script
            lookup.cancel()
        with pytest.raises(asyncio.CancelledError if how == "cancelled" else StoreError):
            await lookup
        await spin
        for _ in range(50):  # given back within a few round trips, far within the claim's 30 s
            found = await other.lookup(SCOPE, NODE, DIGEST, claim=30.0)
            if not (isinstance(found, Claim) and found.token is None):
                break
            await asyncio.sleep(0.1)
        for closing in (store, other, spinner):
            await closing.aclose() if closing is spinner else await closing.close()
        return found

    found = asyncio.run(main())
    assert isinstance(found, Claim) and found.token is not None


def test_bad_urls_and_scopes_are_refused(server: RedisServer) -> None:
    assert isinstance(open_store(server.url), RedisStore)
    with pytest.raises(ValueError, match="Redis store URL"):
        RedisStore("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="only database 0"):
        RedisStore("redis+cluster://127.0.0.1:1/3")
    with pytest.raises(ValueError, match="braces"):
        asyncio.run(RedisStore(server.url).lookup("a}b", NODE, DIGEST))


def test_unreachable_server_fails_fast() -> None:
    async def main() -> float:
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0")
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=r"127\.0\.0\.1"):
            await store.lookup(SCOPE, NODE, DIGEST, claim=1.0)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 2.0


async def oracle_runs(url: str, seeds: range) -> tuple[int, dict[str, float]]:
    wrong = 0
    totals: dict[str, float] = {}
    for seed in seeds:
        async with ToolCache(url, namespace=f"run{seed % 3}", snapshot_budget=seed % 4) as cache:
            wrong += await check_against_oracle(cache, kv.sandboxes(), kv_plan(seed, 6, 8), kv.TOOLS)
            for k, v in cache.stats().items():
                totals[k] = totals.get(k, 0) + v
    return wrong, totals


def test_kv_oracle_holds_on_the_redis_store(server: RedisServer) -> None:
    wrong, stats = asyncio.run(oracle_runs(server.url, range(12)))
    assert wrong == 0
    assert stats["store_errors"] == 0 and stats["hits"] > 0 and stats["snapshots"] > 0  # the store was used


def test_kv_oracle_holds_on_a_cluster_and_each_scope_lives_on_one_node(cluster: RedisServer) -> None:
    wrong, stats = asyncio.run(oracle_runs(cluster.url, range(6)))
    assert wrong == 0
    assert stats["store_errors"] == 0 and stats["hits"] > 0

    async def spread() -> None:  # more scopes, so they land on several nodes
        store = RedisStore(cluster.url)
        for i in range(30):
            scope = Scope("ns", f"task-{i}", "fp").key
            await store.record(scope, NODE, DIGEST, Entry(EDGE, b"x", 0.1), None)
            await store.add_snapshot(scope, "o", [NODE], f"s{i}", 2)
        await store.close()

    asyncio.run(spread())
    homes: dict[str, set[int]] = {}
    for port in cluster.ports:
        for key in cluster.cli("--scan", port=port).split():
            if "{" in key:
                homes.setdefault(key[key.index("{") + 1 : key.index("}")], set()).add(port)
    assert len(homes) > 30
    assert all(len(ports) == 1 for ports in homes.values())
    assert len({port for ports in homes.values() for port in ports}) == 3  # and scopes spread over the nodes


def test_forget_deletes_every_key_of_a_scope(server: RedisServer) -> None:
    from tvcache.stores import TaskInfo

    other = Scope("ns", "other", "fp").key

    async def main() -> None:
        store = RedisStore(server.url)
        for scope in (SCOPE, other):
            await store.register(TaskInfo(scope, "ns", scope[:6], "fp"))
            await store.record(scope, NODE, DIGEST, Entry(EDGE, b"x", 0.1), None)
            await store.lookup(scope, NODE, DIGEST)
            await store.add_snapshot(scope, "o1", [NODE], "s1", 4)
            await store.add_snapshot(scope, "o2", [NODE], "s2", 4)
            await store.lease(scope, "o1", [NODE], 60.0)
        await store.forget(SCOPE)
        graph = await store.export(SCOPE)
        assert (graph.task, graph.entries, graph.snapshots) == (None, [], [])
        assert [t.scope_key for t in await store.tasks()] == [other]
        assert len((await store.export(other)).snapshots) == 2  # the other scope is untouched
        await store.close()

    asyncio.run(main())
    keys = server.cli("--scan").split()
    assert keys and not [k for k in keys if SCOPE in k]


def test_a_cancelled_wait_leaves_the_store_usable(server: RedisServer) -> None:
    async def main() -> None:
        store = RedisStore(server.url)
        mine = await store.lookup(SCOPE, NODE, DIGEST, claim=30.0)
        assert isinstance(mine, Claim) and mine.token
        waiter = asyncio.create_task(store.wait(SCOPE, NODE, DIGEST, timeout=30.0))
        await asyncio.sleep(0.1)
        waiter.cancel()  # mid-BLPOP: its connection must not go back to the pool with a reply pending
        with pytest.raises(asyncio.CancelledError):
            await waiter
        second = asyncio.create_task(store.wait(SCOPE, NODE, DIGEST, timeout=30.0))
        await asyncio.sleep(0.1)
        await store.record(SCOPE, NODE, DIGEST, Entry(EDGE, b"done", 0.1), mine.token)
        assert await asyncio.wait_for(second, 5.0) == Entry(EDGE, b"done", 0.1)
        assert await store.lookup(SCOPE, NODE, DIGEST) == Entry(EDGE, b"done", 0.1)
        await store.close()

    asyncio.run(main())


# -- durability, health and failures as StoreError ---------------------------------------------------------------


def test_acknowledged_entries_survive_kill_9_of_redis_itself(doomed_server: RedisServer) -> None:
    """The fixtures run Redis as the README says to (AOF, appendfsync always): every entry, task and snapshot
    record acknowledged before Redis is killed with SIGKILL is there after it restarts."""
    from tvcache.stores import TaskInfo

    count = 300

    async def write() -> None:
        store = RedisStore(doomed_server.url)
        await store.register(TaskInfo(SCOPE, "ns", "task", "fp"))
        for i in range(count):
            await store.record(SCOPE, NODE, i.to_bytes(16, "big"), Entry(EDGE, str(i).encode(), 0.1), None)
        await store.add_snapshot(SCOPE, "o", [NODE], "s1", 4)
        await store.close()

    async def read() -> None:
        store = RedisStore(doomed_server.url)
        for i in range(count):
            assert await store.lookup(SCOPE, NODE, i.to_bytes(16, "big")) == Entry(EDGE, str(i).encode(), 0.1), i
        assert [t.task for t in await store.tasks()] == ["task"]
        assert [r.snapshot_id for r in await store.snapshots(SCOPE)] == ["s1"]
        await store.close()

    asyncio.run(write())
    doomed_server.restart()  # SIGKILL, then the same server on the same files
    asyncio.run(read())


def test_a_server_without_aof_gets_one_warning(caplog: pytest.LogCaptureFixture, server: RedisServer) -> None:
    lossy = start_server("--appendonly", "no")
    refusing = start_server("--appendonly", "no", "--rename-command", "CONFIG", "")

    async def use(url: str) -> None:
        store = RedisStore(url)
        await store.ping()
        await store.record(SCOPE, NODE, DIGEST, Entry(EDGE, b"x", 0.1), None)
        assert await store.lookup(SCOPE, NODE, DIGEST) == Entry(EDGE, b"x", 0.1)
        await store.close()
        await store.ping()  # a new connection, no new warning

    try:
        with caplog.at_level("WARNING", logger="tvcache"):
            asyncio.run(use(lossy.url))
            warned = [r.getMessage() for r in caplog.records]
            caplog.clear()
            asyncio.run(use(server.url))  # AOF on: nothing to say
            asyncio.run(use(refusing.url))  # CONFIG refused: nothing to learn, nothing to say
            assert [r.getMessage() for r in caplog.records] == []
    finally:
        lossy.stop()
        refusing.stop()
    assert len(warned) == 1 and "without AOF (appendonly no)" in warned[0] and str(lossy.ports[0]) in warned[0]


def test_ping(server: RedisServer, cluster: RedisServer) -> None:
    guarded = start_server("--requirepass", "s3cret")
    port = guarded.ports[0]

    async def main() -> None:
        for url in (server.url, cluster.url, f"redis://:s3cret@127.0.0.1:{port}/0"):
            store = RedisStore(url)
            await store.ping()
            await store.close()
        for url, refusal in [
            (f"redis://127.0.0.1:{port}/0", "AuthenticationError"),
            (f"redis://:guess@127.0.0.1:{port}/0", "AuthenticationError"),
            (f"redis://127.0.0.1:{free_port()}/0", "Connect"),
        ]:
            store = RedisStore(url)
            with pytest.raises(StoreError, match=refusal):
                await store.ping()
            await store.close()

    try:
        asyncio.run(main())
    finally:
        guarded.stop()


def test_values_that_do_not_decode_and_wrong_types_are_store_errors(server: RedisServer) -> None:
    """Keys written badly by another program: a blob that is not an Entry, a task that is not a TaskInfo, a
    key of the wrong type. Each raises StoreError, as an unreachable server would."""
    import redis

    raw = redis.Redis.from_url(server.url)
    prefix = f"tvc:{{{SCOPE}}}:"
    other = Scope("ns", "other", "fp").key
    raw.hset(prefix + "entries", NODE + DIGEST, b"\xc1 not msgpack")
    raw.hset("tvc:tasks", SCOPE, b"\x93\x01\x02")
    raw.set(f"tvc:{{{other}}}:entries", b"a string, not a hash")
    raw.close()

    async def main() -> None:
        store = RedisStore(server.url)
        with pytest.raises(StoreError, match="corrupt entry"):
            await store.lookup(SCOPE, NODE, DIGEST, claim=5.0)
        with pytest.raises(StoreError, match="corrupt entry"):
            await store.wait(SCOPE, NODE, DIGEST, 1.0)
        with pytest.raises(StoreError, match="corrupt entry"):  # first writer wins: the corrupt one answers
            await store.record(SCOPE, NODE, DIGEST, Entry(EDGE, b"x", 0.1), None)
        with pytest.raises(StoreError, match="corrupt"):
            await store.export(SCOPE)
        with pytest.raises(StoreError, match="corrupt task"):
            await store.tasks()
        with pytest.raises(StoreError, match="WRONGTYPE"):
            await store.lookup(other, NODE, DIGEST)
        with pytest.raises(StoreError, match="WRONGTYPE"):
            await store.record(other, NODE, DIGEST, Entry(EDGE, b"", 0), None)
        await store.ping()  # the store itself is fine
        await store.close()

    asyncio.run(main())


def test_a_cluster_node_that_dies_fails_its_scopes_and_ping_with_store_errors() -> None:
    """Scopes on the surviving nodes are served; those on the dead node, and ping (which asks every primary),
    raise StoreError."""
    doomed = start_cluster()
    scopes = [Scope("ns", f"task-{i}", "fp").key for i in range(24)]

    async def main() -> None:
        store = RedisStore(doomed.url)
        await store.ping()
        for scope in scopes:
            await store.record(scope, NODE, DIGEST, Entry(EDGE, scope.encode(), 0.1), None)
        doomed.procs[1].kill()
        doomed.procs[1].wait()
        served, failed = 0, 0
        for scope in scopes:
            try:
                assert await store.lookup(scope, NODE, DIGEST) == Entry(EDGE, scope.encode(), 0.1)
                served += 1
            except StoreError:
                failed += 1
        assert served and failed and served + failed == len(scopes)
        with pytest.raises(StoreError):
            await store.ping()
        await store.close()

    try:
        asyncio.run(main())
    finally:
        doomed.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_stalling_cluster_fails_lookups_with_store_errors_only(loop: str) -> None:
    """Nodes that stall past the socket timeout (`CLIENT PAUSE`, as a stuck server does) while 40 lookups run
    make timeouts, and redis-py's asyncio cluster client then disconnects idle connections that other commands
    are taking: those failed inside the client with an AttributeError (under uvloop, which `tvcache serve` runs
    on, a RuntimeError of its transport), which reached the rollout and ended it (seen in tests/test_multihost.py
    under load). Every failure must be a StoreError, on which the cache goes on uncached. Runs until the client's
    own fault has shown up wrapped (5 to 14 s here), or 30 s."""
    new_loop = asyncio.new_event_loop if loop == "asyncio" else pytest.importorskip("uvloop").new_event_loop
    stalling = start_cluster()
    failures: dict[str, int] = {}
    deadline = time.monotonic() + 30

    def over() -> bool:
        return time.monotonic() > deadline or bool(failures.keys() & {"AttributeError", "TypeError", "RuntimeError"})

    async def lookups(store: RedisStore, i: int) -> None:
        while not over():
            try:
                await store.lookup(Scope("ns", f"task-{i % 7}", "fp").key, NODE, DIGEST)
            except StoreError as exc:
                kind = type(exc.__cause__).__name__
                failures[kind] = failures.get(kind, 0) + 1

    async def stalls(k: int, port: int) -> None:
        while not over():
            await asyncio.to_thread(stalling.cli, "CLIENT", "PAUSE", str(80 + 20 * k), port=port)
            await asyncio.sleep(0.2 + 0.1 * k)

    async def main() -> None:
        store = RedisStore(stalling.url + "?socket_timeout=0.05")
        try:
            await asyncio.gather(
                *(stalls(k, p) for k, p in enumerate(stalling.ports)), *(lookups(store, i) for i in range(40))
            )
        finally:
            await store.close()

    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(main())  # any exception but StoreError ends the run here
    finally:
        stalling.stop()
    assert failures, "no lookup failed: the stalls did not stall"
