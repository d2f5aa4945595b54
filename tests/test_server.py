"""The shared cache server, tested as it runs: a real `tvcache serve` on loopback in a subprocess, clients in
other processes. Correctness is the core's oracle; single flight, claim expiry, durability under SIGKILL and
riding through a restart are checked across processes; auth, limits and malformed input at the HTTP level,
and the whole API is fuzzed with schemathesis from its OpenAPI document."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import kv
import test_stores
import tvcache
from redis_server import start_server
from server_helpers import (
    FLIGHT_CALLS,
    WRITER_NODE,
    WRITER_SCOPE,
    Server,
    assert_schemathesis_finds_nothing,
    assert_slow_clients_are_cut_off,
    finish_client,
    free_port,
    request,
    slowloris,
    spawn_client,
    stats,
)
from tvcache.graph import Entry, Scope
from tvcache.stores import Claim, StoreError
from tvcache.stores.http import HTTPStore
from tvcache.stores.wire import LookupReply, LookupRequest

TOKEN = "correct-horse-battery-staple"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with Server(tmp_path) as s:
        yield s


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the many small checks that change nothing."""
    with Server(tmp_path_factory.mktemp("shared")) as s:
        yield s


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def spawn_all(args: list[list[str]]) -> list[Any]:
    """Client processes that begin their rollouts at the same moment (once all have started up)."""
    start_at = time.time() + 1.5 + 0.2 * len(args)
    procs = [spawn_client(*a, start_at=start_at) for a in args]
    return [finish_client(p) for p in procs]


# -- the core's checks, across processes -------------------------------------------------------------------


def test_oracle_holds_with_four_client_processes(server: Server) -> None:
    seeds = [str(s) for s in range(6)]
    half = len(seeds) // 2
    # Two processes run the same plans in the same order (the same calls at the same time), two start halfway.
    orders = [seeds, seeds, seeds[half:] + seeds[:half], seeds[half:] + seeds[:half]]
    results = spawn_all([["oracle", server.url, *order] for order in orders])
    assert [r["wrong"] for r in results] == [0, 0, 0, 0]
    assert all(r["stats"]["store_errors"] == 0 for r in results)
    hits = sum(r["stats"]["hits"] for r in results)
    executions = sum(r["stats"]["executions"] for r in results)
    assert hits > executions  # the processes really shared one graph
    server_stats = stats(server)["totals"]
    assert server_stats["hits"] + server_stats["waited_hits"] == hits


def test_eight_rollouts_in_four_processes_execute_each_distinct_call_once(server: Server) -> None:
    results = spawn_all([["flight", server.url, "2"] for _ in range(4)])
    outputs = [o for r in results for o in r["outputs"]]
    expected = asyncio.run(kv.execute_uncached(kv.sandboxes(), FLIGHT_CALLS, kv.TOOLS))
    assert all(o == expected for o in outputs)
    total = {k: sum(r["stats"][k] for r in results) for k in ("executions", "hits", "waits", "store_errors")}
    assert total["executions"] == len(FLIGHT_CALLS)
    assert total["hits"] == 7 * len(FLIGHT_CALLS)
    assert total["waits"] > 0
    assert total["store_errors"] == 0


def test_a_waiter_in_another_process_wakes_when_the_entry_is_recorded(server: Server) -> None:
    slow = spawn_client("slow", server.url, "1.0")  # claims with a 60 s ttl, records after 1 s

    while stats(server)["totals"]["claims"] == 0:  # the slow process holds the claim
        assert slow.poll() is None, slow.stderr.read() if slow.stderr else ""
        time.sleep(0.02)

    async def main() -> tuple[tvcache.Result, float, dict[str, float]]:
        async with tvcache.ToolCache(server.url, namespace="slow", claim_ttl=60) as cache:
            async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                result = await r.call("write", {"key": "a", "value": "x"})
            return result, time.time(), cache.stats()

    result, woke_at, cache_stats = asyncio.run(main())
    recorded_at = finish_client(slow)["recorded_at"]
    assert (result.output, result.source) == ("ok", "waited")
    assert cache_stats["executions"] == 0
    # Woken by the record, not by the claim's 60 s expiry (the writer prints after its record returns).
    assert woke_at - recorded_at < 5.0


def test_a_claim_whose_owner_died_expires_and_is_taken_over(server: Server) -> None:
    hang = spawn_client("hang", server.url, "1.0")
    try:
        deadline = time.monotonic() + 30
        while stats(server)["totals"]["claims"] == 0:
            assert hang.poll() is None and time.monotonic() < deadline, hang.stderr.read() if hang.stderr else ""
            time.sleep(0.02)
    finally:
        hang.send_signal(signal.SIGKILL)
        hang.wait()

    async def main() -> tuple[tvcache.Result, dict[str, float]]:
        async with tvcache.ToolCache(server.url, namespace="hang", claim_ttl=1.0) as cache:
            async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                # Bounded so a claim that never expires fails the test instead of hanging it.
                result = await asyncio.wait_for(r.call("write", {"key": "a", "value": "x"}), 30)
            return result, cache.stats()

    result, cache_stats = asyncio.run(main())
    assert (result.output, result.source) == ("ok", "executed")
    assert cache_stats["waits"] >= 1 and cache_stats["executions"] == 1


def test_a_claim_whose_lookup_answer_was_lost_is_given_back(server: Server) -> None:
    """A claiming lookup the server runs while its client has stopped listening (the lookup timed out, or its
    caller was cancelled) takes a claim nobody knows the token of. The client gives it back by the id it chose for
    the lookup, so another client making the call claims it at once rather than after the claim's 30 s. The server
    is stopped (SIGSTOP) while the lookup is sent and for a second after, so the give-back times out too; resumed,
    it runs the lookup and the give-back requests waiting in its sockets, in either order. (That a give-back the
    server never got is tried again is the next test.)"""
    assert server.proc is not None
    proc = server.proc

    async def main() -> None:
        lost, other = HTTPStore(server.url, timeout=0.5), HTTPStore(server.url)
        try:
            for case, digest in (("timed out", b"t" * 16), ("cancelled", b"c" * 16)):
                proc.send_signal(signal.SIGSTOP)
                try:
                    lookup = asyncio.ensure_future(lost.lookup(KEY, ROOT, digest, claim=30))
                    if case == "cancelled":
                        await asyncio.sleep(0.2)  # sent, and waiting for its answer
                        lookup.cancel()
                    with pytest.raises(StoreError if case == "timed out" else asyncio.CancelledError):
                        await lookup
                    await asyncio.sleep(1.2)  # the give-back is sent, and times out (0.5 s) as well
                finally:
                    proc.send_signal(signal.SIGCONT)
                deadline = time.monotonic() + 10
                while (found := await other.lookup(KEY, ROOT, digest, claim=30)) == Claim(None):
                    assert time.monotonic() < deadline, f"{case}: the lost claim was not given back"
                    await asyncio.sleep(0.05)
                assert isinstance(found, Claim) and found.token is not None, (case, found)
        finally:
            await lost.close()
            await other.close()

    asyncio.run(main())


def test_a_give_back_no_server_took_is_tried_again() -> None:
    """A give-back that cannot reach the server (here: nothing listens on its port yet) is tried every 0.5 s until
    one does: the server then records it, and the lookup it names does not claim."""
    from test_server_short_path import serving
    from tvcache.stores.memory import MemoryStore

    async def main() -> None:
        port = free_port()
        store = HTTPStore(f"http://127.0.0.1:{port}")
        try:
            giving = asyncio.ensure_future(store._give_back("late-server"))
            await asyncio.sleep(1.2)  # refused twice or three times
            assert not giving.done()
            async with serving(MemoryStore(), port=port) as (app, _):
                await giving
                assert app.counters.latency["give_back"].statuses == {200: 1}
                late = LookupRequest(KEY, ROOT, b"l" * 16, 30.0, "late-server")
                assert (await store._call("lookup", late, LookupReply)) == LookupReply()
        finally:
            await store.close()

    asyncio.run(main())


class OldLookupRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`LookupRequest` as servers before give-backs decode it."""

    scope_key: str
    node: bytes
    digest: bytes
    claim: float = 0.0


def test_a_server_older_than_give_backs_is_asked_as_before() -> None:
    """Such a server refuses a lookup's id (400: an unknown field); the client then looks up without one, there and
    from then on, and its claims work as they did. (A stand-in for an older server: this one, with the lookup's
    decoder of before and no give_back.)"""
    from test_server_short_path import serving
    from tvcache.server.app import CacheApp
    from tvcache.stores.memory import MemoryStore

    async def old_lookup(app: CacheApp, req: OldLookupRequest, receive: Any) -> Any:
        return await CacheApp._lookup(app, LookupRequest(req.scope_key, req.node, req.digest, req.claim), receive)

    async def main() -> None:
        async with serving(MemoryStore()) as (app, port):
            route = app._routes["/v1/lookup"]
            old = functools.partial(old_lookup, app)
            app._routes["/v1/lookup"] = dataclasses.replace(
                route, decoder=msgspec.json.Decoder(OldLookupRequest), handler=old
            )
            store = HTTPStore(f"http://127.0.0.1:{port}")
            try:
                for digest in (b"o" * 16, b"p" * 16):
                    first = await store.lookup(KEY, ROOT, digest, claim=30)
                    assert isinstance(first, Claim) and first.token is not None, first
                    assert await store.lookup(KEY, ROOT, digest, claim=30) == Claim(None)
                assert not store._names_lookups
                # Nor does it know give-backs (404): one given back anyway, as after a lookup that timed out before
                # the first refusal, is tried once, not for a minute.
                del app._routes["/v1/give_back"]
                await store._give_back("never-sent")
                assert app.counters.latency["other"].statuses == {404: 1}
            finally:
                await store.close()

    asyncio.run(main())


def test_a_claim_given_back_before_its_lookup_comes_is_never_taken(shared: Server) -> None:
    """The give-back can reach the server first (another connection): the lookup, when it comes, does not claim."""
    digest = b64(b"g" * 16)
    assert request(shared, "POST", "/v1/give_back", {"lookup": "early"}) == (200, None)
    early = LOOKUP | {"digest": digest, "claim": 30.0, "lookup": "early"}
    assert request(shared, "POST", "/v1/lookup", early) == (200, {})
    taken = request(shared, "POST", "/v1/lookup", LOOKUP | {"digest": digest, "claim": 30.0, "lookup": "late"})
    assert taken[0] == 200 and taken[1]["claim"]["token"], taken
    assert request(shared, "POST", "/v1/give_back", {"lookup": "late"}) == (200, None)
    again = request(shared, "POST", "/v1/lookup", LOOKUP | {"digest": digest, "claim": 30.0})
    assert again[1]["claim"]["token"] not in (None, taken[1]["claim"]["token"]), again


@pytest.mark.parametrize(
    "check",
    [
        test_stores.test_first_writer_wins,
        test_stores.test_claims_single_flight_and_expiry,
        test_stores.test_leases_find_the_deepest_snapshot_and_protect_it,
        test_stores.test_export_names_tasks_and_counts_hits,
    ],
    ids=lambda check: check.__name__.removeprefix("test_"),
)
def test_http_store_passes_the_checks_every_store_passes(server: Server, check: Any) -> None:
    store = HTTPStore(server.url)
    check(store)
    asyncio.run(store.close())


# -- durability and restarts -------------------------------------------------------------------------------


def test_sigkill_under_load_keeps_every_acknowledged_entry(tmp_path: Path) -> None:
    server = Server(tmp_path, f"sqlite:///{tmp_path}/cache.db").start()
    writer = spawn_client("writer", server.url, "8")
    acked: set[int] = set()
    errors = 0
    try:
        assert writer.stdout is not None
        for line in writer.stdout:  # under load: eight concurrent writers
            kind, i = line.split()
            if kind == "ack":
                acked.add(int(i))
            if len(acked) >= 400:
                break
        server.kill9()
        for line in writer.stdout:  # the writer rides on through the outage
            kind, i = line.split()
            errors += kind == "err"
            acked.update([int(i)] if kind == "ack" else [])
            if errors >= 20:
                break
        server.start()
        after = len(acked)
        for line in writer.stdout:  # and is served again once the server is back
            kind, i = line.split()
            acked.update([int(i)] if kind == "ack" else [])
            if len(acked) >= after + 200:
                break
    finally:
        writer.kill()
        writer.wait()
    assert errors >= 20 and len(acked) >= after + 200

    async def missing() -> list[int]:
        store = HTTPStore(server.url)
        lost = []
        for i in sorted(acked):
            found = await store.lookup(WRITER_SCOPE, WRITER_NODE, i.to_bytes(16, "big"))
            if not (isinstance(found, Entry) and found.output == b"%d" % i):
                lost.append(i)
        await store.close()
        return lost

    try:
        assert asyncio.run(missing()) == []
    finally:
        server.stop()


def test_rollouts_ride_through_a_server_restart(tmp_path: Path) -> None:
    server = Server(tmp_path, f"sqlite:///{tmp_path}/cache.db").start()
    calls = [("write", {"key": "a", "value": "x"}), ("append", {"key": "a", "value": "y"}), ("read", {"key": "a"})]
    expected = asyncio.run(kv.execute_uncached(kv.sandboxes(), calls, kv.TOOLS))

    async def rollout(cache: tvcache.ToolCache, boxes: Any) -> list[Any]:
        async with cache.rollout("t", boxes, kv.TOOLS) as r:
            return [(await r.call(t, a)).output for t, a in calls]

    async def main() -> list[dict[str, float]]:
        snapshots = []
        async with tvcache.ToolCache(server.url) as cache:
            boxes = kv.sandboxes()
            assert await rollout(cache, boxes) == expected
            snapshots.append(cache.stats())
            server.kill9()
            assert await rollout(cache, boxes) == expected  # executed directly, still right
            snapshots.append(cache.stats())
            server.start()
            assert await rollout(cache, boxes) == expected  # the cache again, with what it held before
            snapshots.append(cache.stats())
        return snapshots

    try:
        before, down, back = asyncio.run(main())
    finally:
        server.stop()
    assert before["store_errors"] == 0 and before["executions"] == 3
    assert down["store_errors"] > 0 and down["uncached"] >= 3 and down["hits"] == before["hits"]
    assert back["store_errors"] == down["store_errors"]
    assert back["hits"] - down["hits"] == 3


def test_a_dead_server_fails_fast_with_store_error(tmp_path: Path) -> None:
    async def main() -> None:
        store = HTTPStore(f"http://127.0.0.1:{Server(tmp_path).port}")  # nobody listens there
        with pytest.raises(StoreError, match="failed on lookup"):
            await store.lookup("ab" * 16, b"n" * 16, b"d" * 16)
        await store.close()

    asyncio.run(main())


# -- hardening ---------------------------------------------------------------------------------------------

SCOPE = Scope("ns", "task", "fp")
KEY, ROOT, DIGEST = SCOPE.key, SCOPE.root, b"d" * 16
LOOKUP = {"scope_key": KEY, "node": b64(ROOT), "digest": b64(DIGEST), "claim": 5.0}


def test_auth_needs_the_token_when_one_is_set(tmp_path: Path) -> None:
    with Server(tmp_path, "memory://", TOKEN) as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            status, body = request(server, "POST", "/v1/lookup", LOOKUP, headers=headers, auth=bool(headers))
            assert status == 401 and "token" in body["error"]
        assert request(server, "GET", "/metrics", auth=False)[0] == 401
        assert request(server, "GET", "/metrics")[0] == 200
        for public in ("/healthz", "/", "/openapi.json", "/static/dashboard.js"):  # no data in these
            assert request(server, "GET", public, auth=False)[0] == 200
        assert stats(server)["totals"]["lookups"] == 0  # refused requests did nothing

        async def main() -> None:
            assert isinstance(await HTTPStore(server.token_url).lookup(KEY, ROOT, DIGEST, 5.0), Claim)
            os.environ["TVCACHE_TOKEN"] = TOKEN
            try:
                assert await HTTPStore(server.url).lookup(KEY, ROOT, DIGEST) is None
            finally:
                del os.environ["TVCACHE_TOKEN"]
            with pytest.raises(StoreError, match="401"):
                await HTTPStore(server.url, token="wrong").lookup(KEY, ROOT, DIGEST)
            # A rollout with the wrong token is not stopped: it executes without the cache.
            async with tvcache.ToolCache(server.url) as cache, cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                assert (await r.call("write", {"key": "a", "value": "x"})).output == "ok"
                assert cache.stats()["store_errors"] > 0

        asyncio.run(main())


def test_the_token_comes_from_a_file_or_the_environment_and_not_from_ps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--token-file and TVCACHE_TOKEN keep the token out of the command line every user can read; --token still
    works, with a warning; a file that cannot serve as a token is refused before the server starts."""

    def authenticates(server: Server, token: str) -> bool:
        assert request(server, "GET", "/v1/stats", headers={"Authorization": "Bearer wrong"})[0] == 401
        return request(server, "GET", "/v1/stats", headers={"Authorization": f"Bearer {token}"})[0] == 200

    def command_line(server: Server) -> bytes:
        assert server.proc is not None
        return Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()

    with Server(tmp_path, "memory://", TOKEN) as server:  # the helper passes --token-file
        assert authenticates(server, TOKEN) and TOKEN.encode() not in command_line(server)
        assert "is visible to every user" not in server.log()
    monkeypatch.setenv("TVCACHE_TOKEN", "from-the-environment")
    with Server(tmp_path) as server:
        assert authenticates(server, "from-the-environment") and b"from-the-environment" not in command_line(server)
    monkeypatch.delenv("TVCACHE_TOKEN")
    with Server(tmp_path, "memory://", None, "--token", "on-the-command-line") as server:
        assert authenticates(server, "on-the-command-line")
        assert "--token is visible to every user" in server.log()

    def refusal(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "tvcache.server", "serve", *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        return done.stderr

    assert "cannot read" in refusal("--token-file", str(tmp_path / "missing"))
    for content in ("", "\n", "two words\n", "two\nlines\n"):
        (tmp_path / "bad").write_text(content)
        assert "must hold the token alone" in refusal("--token-file", str(tmp_path / "bad"))
    (tmp_path / "good").write_text(TOKEN)
    assert "not allowed with" in refusal("--token-file", str(tmp_path / "good"), "--token", TOKEN)
    assert "--token-file FILE or set TVCACHE_TOKEN" in refusal("--host", "0.0.0.0")


def test_oversized_requests_are_refused_and_change_nothing(tmp_path: Path) -> None:
    with Server(tmp_path, "memory://", None, "--max-body-mb", str(8192 / 2**20)) as server:
        record = {"scope_key": KEY, "node": b64(ROOT), "digest": b64(DIGEST)}
        big = dict(record, entry={"kind": "edge", "output": b64(b"x" * 9000), "seconds": 1.0})
        status, body = request(server, "POST", "/v1/record", big)
        assert status == 413 and "limit" in body["error"]
        # The same without a Content-Length (chunked): refused while reading.
        chunked = _chunked(server, "/v1/record", big)
        assert chunked == 413
        small = dict(record, entry={"kind": "edge", "output": b64(b"x" * 3000), "seconds": 1.0})
        assert request(server, "POST", "/v1/lookup", LOOKUP | {"claim": 0})[1] == {}
        assert request(server, "POST", "/v1/record", small)[0] == 200
        assert request(server, "POST", "/v1/lookup", LOOKUP)[1]["entry"]["output"] == b64(b"x" * 3000)


def test_a_client_still_sending_an_oversized_body_reads_the_refusal(tmp_path: Path) -> None:
    """A client sends its whole body before it reads the answer (http.client, httpx, the HTTP store). The server
    refuses a body over its limit before it has all of it; were it to close at once, the data still coming would
    make the kernel reset the connection, and the client would see a broken pipe or a reset, not the 413. It reads
    and drops the rest first (`JSONApi._discard_body`), so the client reads the refusal, sent whole or in chunks."""
    import msgspec

    with Server(tmp_path, "memory://", None, "--max-body-mb", str(8192 / 2**20)) as server:
        record = {"scope_key": KEY, "node": b64(ROOT), "digest": b64(DIGEST)}
        huge = msgspec.json.encode(dict(record, entry={"kind": "edge", "output": b64(b"x" * (8 << 20)), "seconds": 1}))
        for chunked in (False, True, False, True):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            try:
                pieces = [huge[i : i + 65536] for i in range(0, len(huge), 65536)]
                conn.request(
                    "POST",
                    "/v1/record",
                    body=iter(pieces) if chunked else huge,
                    headers={"Content-Type": "application/json"},
                    encode_chunked=chunked,
                )
                answer = conn.getresponse()
                assert answer.status == 413 and b"limit" in answer.read()
            finally:
                conn.close()
        # A client that waits for `100 Continue` has sent nothing more: it is answered at once, not told to go on
        # (reading its body would send it `100 Continue` first).
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/record HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(huge)
            )
            assert sock.recv(4096).startswith(b"HTTP/1.1 413 ")
        assert request(server, "POST", "/v1/lookup", LOOKUP | {"claim": 0})[1] == {}


def _chunked(server: Server, path: str, body: Any) -> int:
    import http.client

    import msgspec

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    data = msgspec.json.encode(body)
    # Chunks of 1000 bytes, framed here and sent in one write: sent chunk by chunk, the last ones could come after
    # the server had answered 413 and closed, and the client's write then failed (a broken pipe) under load.
    pieces = [data[i : i + 1000] for i in range(0, len(data), 1000)]
    framed = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
    conn.request(
        "POST", path, body=framed, headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"}
    )
    status = conn.getresponse().status
    conn.close()
    return status


MALFORMED: list[tuple[str, str, Any, int, str]] = [
    ("POST", "/v1/lookup", b"{not json", 400, "malformed"),
    ("POST", "/v1/lookup", b"", 400, "invalid lookup"),
    ("POST", "/v1/lookup", [1, 2], 400, "Expected `object`"),
    ("POST", "/v1/lookup", LOOKUP | {"scope_key": "../../etc/passwd"}, 400, "$.scope_key"),
    ("POST", "/v1/lookup", LOOKUP | {"node": "short"}, 400, "$.node"),
    ("POST", "/v1/lookup", LOOKUP | {"node": b64(b"x" * 17)}, 400, "$.node"),
    ("POST", "/v1/lookup", LOOKUP | {"claim": "5"}, 400, "$.claim"),
    ("POST", "/v1/lookup", LOOKUP | {"claim": -1}, 400, "$.claim"),
    ("POST", "/v1/lookup", LOOKUP | {"claim": 1e999}, 400, "$.claim"),
    ("POST", "/v1/lookup", LOOKUP | {"extra": 1}, 400, "unknown field"),
    ("POST", "/v1/lookup", {k: v for k, v in LOOKUP.items() if k != "digest"}, 400, "missing required field"),
    ("POST", "/v1/wait", {k: v for k, v in LOOKUP.items() if k != "claim"} | {"timeout": 1e6}, 400, "$.timeout"),
    (
        "POST",
        "/v1/record",
        {"scope_key": KEY, "node": b64(ROOT), "digest": b64(DIGEST), "entry": ["edge", "", 1]},
        400,
        "$.entry",
    ),
    (
        "POST",
        "/v1/record",
        {
            "scope_key": KEY,
            "node": b64(ROOT),
            "digest": b64(DIGEST),
            "entry": {"kind": "bogus", "output": "", "seconds": 1},
        },
        400,
        "$.entry.kind",
    ),
    (
        "POST",
        "/v1/record",
        {
            "scope_key": KEY,
            "node": b64(ROOT),
            "digest": b64(DIGEST),
            "entry": {"kind": "edge", "output": "", "seconds": -1},
        },
        400,
        "$.entry.seconds",
    ),
    (
        "POST",
        "/v1/add_snapshot",
        {"scope_key": KEY, "origin": "o", "path": [], "snapshot_id": "s", "budget": 1},
        400,
        "$.path",
    ),
    (
        "POST",
        "/v1/add_snapshot",
        {"scope_key": KEY, "origin": "o", "path": [b64(ROOT)], "snapshot_id": "s", "budget": 1.5},
        400,
        "$.budget",
    ),
    (
        "POST",
        "/v1/register",
        {"scope_key": "/tmp/x", "namespace": "n", "task": "t", "fingerprint": "f"},
        400,
        "$.scope_key",
    ),
    ("POST", "/v1/export", {"scope_key": KEY, "limit": 10**9}, 400, "$.limit"),
    ("GET", "/v1/lookup", None, 405, "takes POST"),
    ("POST", "/v1/tasks", {}, 405, "takes GET"),
    ("GET", "/v1/nope", None, 404, "no such path"),
    ("GET", "/static/../../etc/passwd", None, 404, "no such path"),
    ("GET", "/static/%2e%2e/app.py", None, 404, "no such path"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"), MALFORMED, ids=[f"{m[1]}-{m[4]}" for m in MALFORMED]
)
def test_malformed_requests_get_a_4xx_with_a_message(
    shared: Server, method: str, path: str, body: Any, status: int, message: str
) -> None:
    got, reply = request(shared, method, path, body)
    assert got == status
    assert message in reply["error"]


def test_malformed_requests_change_nothing(server: Server) -> None:
    for method, path, body, _, _ in MALFORMED:
        request(server, method, path, body)
    got, reply = request(server, "POST", "/v1/lookup", LOOKUP, headers={"Content-Type": "text/plain"})
    assert got == 415 and "JSON" in reply["error"]
    totals = stats(server)["totals"]
    assert (totals["lookups"], totals["records"], totals["waits"]) == (0, 0, 0)
    assert totals["errors"] == len(MALFORMED) + 1
    assert request(server, "GET", "/v1/tasks")[1] == []
    assert request(server, "POST", "/v1/export", {"scope_key": KEY})[1]["entries"] == []
    assert request(server, "POST", "/v1/snapshots", {"scope_key": KEY})[1] == []


def test_slow_clients_are_cut_off(tmp_path: Path) -> None:
    with Server(tmp_path, "memory://", TOKEN, "--read-timeout", "1") as server:
        assert_slow_clients_are_cut_off(server, "/v1/lookup")


def test_health_says_when_the_store_is_down(tmp_path: Path) -> None:
    """/healthz pings the store: 200 while it answers, 503 with the reason while it is stuck or gone."""
    redis = start_server()
    try:
        with Server(tmp_path, redis.url) as server:
            assert request(server, "GET", "/healthz") == (200, {"status": "ok"})
            redis.pause()
            status, body = request(server, "GET", "/healthz")
            assert status == 503 and "store" in body["error"]
            redis.resume()
            assert request(server, "GET", "/healthz") == (200, {"status": "ok"})
            redis.stop()
            status, body = request(server, "GET", "/healthz")
            assert status == 503 and "store failed" in body["error"]
    finally:
        redis.stop()


def test_metrics_health_and_openapi(server: Server) -> None:
    async def main() -> None:
        async with tvcache.ToolCache(server.url) as cache:
            for _ in range(2):
                async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                    await r.call("write", {"key": "a", "value": "x"})

    asyncio.run(main())
    status, text = request(server, "GET", "/metrics")
    assert status == 200
    assert "tvcache_lookups_total 2.0" in text and "tvcache_hits_total 1.0" in text
    assert 'tvcache_request_duration_seconds_count{path="lookup"} 2.0' in text
    assert request(server, "GET", "/healthz") == (200, {"status": "ok"})
    status, doc = request(server, "GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    assert {"/v1/lookup", "/v1/wait", "/v1/record", "/v1/export", "/v1/stats", "/metrics"} <= set(doc["paths"])
    # Structured logs: every line the server wrote is a JSON object.
    import json

    lines = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    assert any(line["msg"] == "serving" and line["store"] == "memory://" for line in lines)


def test_stats_cli_prints_a_table(server: Server) -> None:
    request(server, "POST", "/v1/lookup", LOOKUP)
    out = subprocess.run(
        [sys.executable, "-m", "tvcache.server", "stats", server.url], capture_output=True, text=True, check=True
    ).stdout
    assert "lookups" in out and "hit rate" in out and "memory://" in out


def test_schemathesis_finds_no_failure_in_the_api(tmp_path: Path) -> None:
    # Short waits, so fuzzed waits on fuzzed claims return at once rather than after their timeouts.
    with Server(tmp_path, "memory://", TOKEN, "--max-wait", "0.2") as server:
        assert_schemathesis_finds_nothing(server, tmp_path)


@pytest.mark.parametrize("slow", ["head", "body"])
def test_a_slowloris_from_loopback_leaves_legitimate_requests_served(tmp_path: Path, slow: str) -> None:
    """1,100 connections trickling their headers (or their bodies) at a server that may open 1,024 files (the
    finding of issue 19): at least 95% of the legitimate requests made meanwhile are answered, and a client's
    pooled connection, idle during the attack, is still open after it."""
    with Server(tmp_path, nofile=1024) as server:
        pooled = http.client.HTTPConnection(server.host, server.port, timeout=30)
        pooled.request("GET", "/healthz")
        assert pooled.getresponse().read() and pooled.sock is not None
        local = pooled.sock.getsockname()
        served, sent = slowloris(server, connections=1100, seconds=12, requests=40, slow=slow)
        assert served >= 0.95 * sent, f"{served} of {sent} legitimate requests answered during the attack"
        pooled.request("GET", "/healthz")  # on the same connection: the server did not close it under attack
        assert pooled.getresponse().status == 200 and pooled.sock.getsockname() == local
        pooled.close()
