"""The sandbox server and RemoteSandboxes, tested as they run: real `tvcache sandbox-server` processes on
loopback serving real SQLite sandboxes (or the kv world, for outputs and hangs no database makes), clients in
this process.

Correctness is checked against local sandboxes: a remote sandbox must answer exactly as a local one of the same
base does, through snapshots and restores, and the cache over remote sandboxes must satisfy the oracle. Then
placement, losing a server, leases, bounds, malformed input, slow clients, and a schemathesis fuzz of the API.
The multi-host run on real network namespaces is tests/test_multihost.py; a slowloris against this server is in
tests/test_issue19_check.py (silent, trickling-header and trickling-body connections at once).
"""

from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kv
import tvcache
from docker_env import docker_base_fixture, task_image_fixture  # noqa: F401  (fixtures)
from sandbox_oracle import check_snapshots_against_fresh_replay
from server_helpers import (
    SandboxServer,
    assert_schemathesis_finds_nothing,
    assert_slow_clients_are_cut_off,
    request,
)
from test_oracle import SQL_READS, SQL_WRITES, run_plan, small_db, sql_plan  # noqa: F401  (small_db: a fixture)
from tvcache import SandboxError, ToolCall

TOKEN = "sandbox-token-for-tests"


@pytest.fixture(scope="module")
def db(request: pytest.FixtureRequest) -> Path:
    """test_oracle's small database (t: id, v), which its SQL_READS and SQL_WRITES are written for."""
    return Path(request.getfixturevalue("small_db"))


def sqlite_server(tmp: Path, db: Path, *extra: str, token: str | None = TOKEN) -> SandboxServer:
    return SandboxServer(tmp, ["--sandbox", "sqlite", "--base", str(db)], token, *extra)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, db: Path) -> Iterator[list[SandboxServer]]:
    """Two servers of the same database, for the checks that leave them as they found them."""
    tmp = tmp_path_factory.mktemp("pair")
    servers = [sqlite_server(tmp, db).start(), sqlite_server(tmp, db).start()]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


def remote(*servers: SandboxServer) -> tvcache.RemoteSandboxes:
    return tvcache.RemoteSandboxes([s.url for s in servers], token=TOKEN)


def listing(server: SandboxServer) -> dict[str, Any]:
    status, body = request(server, "GET", "/v1/sandboxes")
    assert status == 200, body
    return dict(body)


def sql(query: str) -> ToolCall:
    return ToolCall("sql", {"query": query})


# -- answers as local sandboxes do ---------------------------------------------------------------------


def test_remote_sandboxes_answer_exactly_as_local_ones(pair: list[SandboxServer], db: Path) -> None:
    """The sandbox-level oracle through the server (snapshots, restores and rewinds at random points), and every
    outcome (output, changed, error) equal to a local SQLiteSandboxes' for the same history."""

    async def main() -> None:
        boxes, local = remote(*pair), tvcache.SQLiteSandboxes(db)
        assert boxes.fingerprint == local.fingerprint
        try:
            for seed in range(8):
                rng = random.Random(seed)
                steps: list[tuple[str, Any]] = []
                for _ in range(12):
                    roll = rng.random()
                    if roll < 0.15:
                        steps.append(("restore", None))
                    elif roll < 0.25:
                        steps.append(("rewind", rng.randrange(4)))
                    else:
                        steps.append(("call", sql(rng.choice(SQL_READS + SQL_WRITES + ["SELEC nonsense"]))))
                await check_snapshots_against_fresh_replay(boxes, steps)
                calls = [arg for kind, arg in steps if kind == "call"]
                here, there = await local.create(), await boxes.create()
                try:
                    for call in calls:
                        assert await there.execute(call) == await here.execute(call), call
                finally:
                    await here.close()
                    await there.close()
        finally:
            await boxes.close()
            await local.close()
        assert all(listing(s)["sandboxes"] == [] for s in pair)  # every sandbox closed on its server

    asyncio.run(main())


def test_the_cache_over_remote_sandboxes_satisfies_the_oracle(pair: list[SandboxServer], db: Path) -> None:
    """Concurrent rollouts through a ToolCache whose sandboxes are on two servers; every answer equals the local,
    uncached execution of that rollout's history."""

    async def main() -> tuple[int, dict[str, float]]:
        wrong = 0
        boxes, local = remote(*pair), tvcache.SQLiteSandboxes(db)
        try:
            async with tvcache.ToolCache(snapshot_budget=3) as cache:
                for seed in range(6):
                    plan = sql_plan(seed, 6, 8)
                    got = await run_plan(cache, boxes, plan, tvcache.Tools(), task=f"t{seed}", seed=seed)
                    for calls, outputs in zip(plan, got, strict=True):
                        expected = await kv.execute_uncached(local, calls, tvcache.Tools())
                        wrong += sum(a != b for a, b in zip(outputs, expected, strict=True))
                return wrong, cache.stats()
        finally:
            await boxes.close()
            await local.close()

    wrong, stats = asyncio.run(main())
    assert wrong == 0
    assert stats["executions"] > 0 and stats["hits"] > 0


# -- placement and origins ---------------------------------------------------------------------------------


def test_new_sandboxes_go_to_the_least_loaded_server_and_restores_to_the_one_holding_the_snapshot(
    pair: list[SandboxServer],
) -> None:
    async def main() -> str:
        a = remote(*pair)
        b = tvcache.RemoteSandboxes([pair[1].url, pair[0].url], token=TOKEN)  # another worker, listed otherwise
        assert a.origin == b.origin and a.fingerprint == b.fingerprint
        try:
            held = [await a.create() for _ in range(6)]
            assert [len(listing(s)["sandboxes"]) for s in pair] == [3, 3]
            box = held[0]
            await box.execute(sql("INSERT INTO t (v) VALUES (42)"))
            snapshot = await box.snapshot()
            restored = await b.restore(snapshot)  # through the other worker's client
            assert restored.server == box.server
            assert (await restored.execute(sql("SELECT sum(v) FROM t"))).output.endswith("49")
            await restored.close()
            await b.delete(snapshot)
            with pytest.raises(SandboxError, match="404"):
                await a.restore(snapshot)
            return snapshot
        finally:
            await a.close()
            await b.close()

    snapshot = asyncio.run(main())
    for server in pair:
        assert listing(server)["sandboxes"] == []
        assert snapshot not in {s["snapshot"] for s in listing(server)["snapshots"]}


def test_clients_of_servers_with_other_bases_are_refused(tmp_path: Path, db: Path) -> None:
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).executescript("CREATE TABLE u (x);")
    with sqlite_server(tmp_path, db) as one, sqlite_server(tmp_path, other) as two:
        with pytest.raises(ValueError, match="different starting states"):
            remote(one, two)
        status, body = request(one, "POST", "/v1/create", {"fingerprint": "sqlite-v1-" + "0" * 32})
        assert status == 409 and "fingerprint" in body["error"]


def test_docker_sandboxes_through_the_server(tmp_path: Path, task_image: str) -> None:
    """The Docker backend served: snapshots and restores through the server answer as a fresh container
    replaying the same history does."""
    steps: list[tuple[str, Any]] = [
        ("call", ToolCall("bash", {"command": "cat README && echo one > notes && export STEP=1"})),
        ("restore", None),
        ("call", ToolCall("bash", {"command": "echo $STEP; cat notes; rm README; ls"})),
        ("call", ToolCall("read_file", {"path": "/testbed/notes"})),
        ("rewind", 0),
        ("call", ToolCall("bash", {"command": "ls; echo $STEP"})),
    ]
    with SandboxServer(tmp_path, ["--sandbox", "docker", "--image", task_image, "--timeout", "60"]) as server:

        async def main() -> None:
            boxes = tvcache.RemoteSandboxes(server.url)
            try:
                await check_snapshots_against_fresh_replay(boxes, steps)
            finally:
                await boxes.close()

        asyncio.run(main())
        assert listing(server)["sandboxes"] == []


# -- losing a server -------------------------------------------------------------------------------------


def test_a_lost_server_fails_its_calls_and_restores_and_creates_go_elsewhere(tmp_path: Path, db: Path) -> None:
    servers = [sqlite_server(tmp_path, db).start(), sqlite_server(tmp_path, db).start()]

    async def main() -> None:
        boxes = remote(*servers)
        try:
            first, second = await boxes.create(), await boxes.create()
            doomed = first if first.server == servers[0].url else second
            snapshot = await doomed.snapshot()
            servers[0].kill9()
            with pytest.raises(SandboxError, match="failed on execute"):
                await doomed.execute(sql("SELECT 1"))
            with pytest.raises(SandboxError, match="did not answer lately"):
                await boxes.restore(snapshot)  # at once: no request to a server that just failed
            made = [await boxes.create() for _ in range(3)]
            assert {box.server for box in made} == {servers[1].url}
            with pytest.raises(SandboxError, match="failed on delete"):
                await boxes.delete(snapshot)
            await doomed.close()
        finally:
            await boxes.close()

    try:
        asyncio.run(main())
    finally:
        for server in servers:
            server.stop()


def test_a_hung_server_fails_calls_by_their_deadline_and_a_hung_tool_is_cut(tmp_path: Path) -> None:
    """The server gives up on a call the backend does not end (timeout 0.5 s, plus as much grace) and closes
    its sandbox; the client gives up on a server that does not answer (SIGSTOP) by the server's deadline plus a
    margin. Both raise SandboxError; nothing waits forever."""
    with SandboxServer(tmp_path, ["--sandbox", "python:server_helpers:sandboxes", "--timeout", "0.5"]) as server:

        async def main() -> None:
            boxes = tvcache.RemoteSandboxes(server.url)
            try:
                box = await boxes.create()
                with pytest.raises(SandboxError, match="did not answer within 1 s; it was closed"):
                    await box.execute(ToolCall("sleep", {"seconds": 30}))
                with pytest.raises(SandboxError, match="404"):
                    await box.execute(ToolCall("read", {"key": "a"}))
                box = await boxes.create()
                assert server.proc is not None
                server.proc.send_signal(signal.SIGSTOP)
                try:
                    with pytest.raises(SandboxError, match="TimeoutError"):
                        await box.execute(ToolCall("read", {"key": "a"}))
                finally:
                    server.proc.send_signal(signal.SIGCONT)
            finally:
                await boxes.close()

        asyncio.run(main())


# -- leases and bounds -----------------------------------------------------------------------------------


def test_sandboxes_of_a_vanished_client_expire_and_held_ones_do_not(tmp_path: Path, db: Path) -> None:
    with sqlite_server(tmp_path, db, "--lease", "1") as server:
        # A client that vanished: it created a sandbox and never came back.
        status, body = request(server, "POST", "/v1/create", {"fingerprint": tvcache.SQLiteSandboxes(db).fingerprint})
        assert status == 200
        orphan = body["sandbox"]

        async def main() -> str:
            boxes = remote(server)
            try:
                box = await boxes.create()
                dropped = (await boxes.create()).id  # forgotten without close(): no longer renewed
                deadline = time.monotonic() + 30
                while {orphan, dropped} & {s["sandbox"] for s in listing(server)["sandboxes"]}:
                    assert time.monotonic() < deadline, "the orphan or the dropped sandbox was never closed"
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.5)  # idle longer than a lease: only the renewals keep it
                return str((await box.execute(sql("SELECT count(*) FROM t"))).output)
            finally:
                await boxes.close()

        assert asyncio.run(main()).endswith("2")
        status, text = request(server, "GET", "/metrics")
        assert "tvcache_sandbox_expired_total 2.0" in text


def test_a_full_server_refuses_and_the_client_goes_to_another(tmp_path: Path, db: Path) -> None:
    with sqlite_server(tmp_path, db, "--max-sandboxes", "1") as full, sqlite_server(tmp_path, db) as free:
        fingerprint = {"fingerprint": tvcache.SQLiteSandboxes(db).fingerprint}
        assert request(full, "POST", "/v1/create", fingerprint)[0] == 200
        status, body = request(full, "POST", "/v1/create", fingerprint)
        assert status == 429 and "maximum" in body["error"]

        async def main() -> set[str]:
            boxes = remote(full, free)
            try:
                return {(await boxes.create()).server for _ in range(4)}
            finally:
                await boxes.close()

        assert asyncio.run(main()) == {free.url}


def test_snapshots_past_the_limit_are_evicted_oldest_first(tmp_path: Path, db: Path) -> None:
    with sqlite_server(tmp_path, db, "--max-snapshots", "2") as server:

        async def main() -> list[str]:
            boxes = remote(server)
            try:
                box = await boxes.create()
                snapshots = []
                for value in (1, 2, 3):
                    await box.execute(sql(f"INSERT INTO t (v) VALUES ({value})"))
                    snapshots.append(await box.snapshot())
                with pytest.raises(SandboxError, match="404"):
                    await boxes.restore(snapshots[0])
                sums = []
                for snapshot in snapshots[1:]:
                    restored = await boxes.restore(snapshot)
                    sums.append(str((await restored.execute(sql("SELECT sum(v) FROM t"))).output))
                return sums
            finally:
                await boxes.close()

        assert [s.splitlines()[-1].strip() for s in asyncio.run(main())] == ["10", "13"]
        assert "tvcache_sandbox_evicted_total 1.0" in request(server, "GET", "/metrics")[1]


def test_outputs_are_bounded(tmp_path: Path) -> None:
    with SandboxServer(tmp_path, ["--sandbox", "python:server_helpers:sandboxes"]) as server:

        async def main() -> tuple[tvcache.Outcome, tvcache.Outcome]:
            boxes = tvcache.RemoteSandboxes(server.url)
            try:
                box = await boxes.create()
                return await box.execute(ToolCall("big", {"bytes": 17 << 20})), await box.execute(
                    ToolCall("big", {"bytes": 1 << 20})
                )
            finally:
                await boxes.close()

        over, under = asyncio.run(main())
        assert over.error and "over its 16,777,216-byte limit" in over.output
        assert not under.error and under.output == "x" * (1 << 20)


# -- hardening -------------------------------------------------------------------------------------------

SANDBOX = "0" * 24
SNAPSHOT = "0" * 12 + "." + "0" * 16
MALFORMED: list[tuple[str, str, Any, int, str]] = [
    ("POST", "/v1/create", b"{not json", 400, "malformed"),
    ("POST", "/v1/create", {}, 400, "missing required field"),
    ("POST", "/v1/create", {"fingerprint": "x", "extra": 1}, 400, "unknown field"),
    ("POST", "/v1/create", {"fingerprint": "wrong"}, 409, "fingerprint"),
    ("POST", "/v1/execute", {"sandbox": "../../etc/passwd", "tool": "sql", "args": {}}, 400, "$.sandbox"),
    ("POST", "/v1/execute", {"sandbox": SANDBOX, "tool": "", "args": {}}, 400, "$.tool"),
    ("POST", "/v1/execute", {"sandbox": SANDBOX, "tool": "sql", "args": [1]}, 400, "$.args"),
    ("POST", "/v1/execute", {"sandbox": SANDBOX, "tool": "sql", "args": {"q": "x"}}, 404, "no sandbox"),
    ("POST", "/v1/execute", b'{"sandbox": "' + SANDBOX.encode() + b'", "tool": "s", "args": {"a": 1e999}}', 400, "$"),
    ("POST", "/v1/snapshot", {"sandbox": SANDBOX}, 404, "no sandbox"),
    ("POST", "/v1/restore", {"snapshot": SNAPSHOT}, 404, "no snapshot"),
    ("POST", "/v1/restore", {"snapshot": "/tmp/x"}, 400, "$.snapshot"),
    ("POST", "/v1/renew", {"sandboxes": ["nope"]}, 400, "$.sandboxes"),
    ("GET", "/v1/create", None, 405, "takes POST"),
    ("POST", "/v1/info", {}, 405, "takes GET"),
    ("GET", "/v1/nope", None, 404, "no such path"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "message"), MALFORMED, ids=[m[1] for m in MALFORMED])
def test_malformed_requests_get_a_4xx_with_a_message(
    pair: list[SandboxServer], method: str, path: str, body: Any, status: int, message: str
) -> None:
    got, reply = request(pair[0], method, path, body)
    assert got == status
    assert message in reply["error"]


def test_rejected_requests_change_nothing(tmp_path: Path, db: Path) -> None:
    with sqlite_server(tmp_path, db, "--max-body-mb", str(4096 / 2**20)) as server:
        before = request(server, "GET", "/v1/info")[1]
        for method, path, body, _, _ in MALFORMED:
            request(server, method, path, body)
        big = {"sandbox": SANDBOX, "tool": "sql", "args": {"query": "x" * 5000}}
        assert request(server, "POST", "/v1/execute", big)[0] == 413
        assert request(server, "POST", "/v1/create", b"{}", headers={"Content-Type": "text/plain"})[0] == 415
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            assert request(server, "POST", "/v1/create", {}, headers=headers, auth=bool(headers))[0] == 401
        after = request(server, "GET", "/v1/info")[1]
        assert (after["live"], after["snapshots"], after["server"]) == (0, 0, before["server"])
        assert listing(server) == {"sandboxes": [], "snapshots": []}
        text = request(server, "GET", "/metrics")[1]
        for name in ("creates", "restores", "executions", "snapshots", "failures"):
            assert f"tvcache_sandbox_{name}_total 0.0" in text
        assert "tvcache_sandbox_errors_total 20.0" in text
        assert request(server, "GET", "/healthz", auth=False) == (200, {"status": "ok"})


def test_a_wrong_token_is_refused_before_anything_runs(pair: list[SandboxServer]) -> None:
    with pytest.raises(SandboxError, match="401"):
        tvcache.RemoteSandboxes(pair[0].url, token="wrong")
    with pytest.raises(SandboxError, match="no sandbox server answered"):
        tvcache.RemoteSandboxes(f"http://127.0.0.1:{SandboxServer(Path('.'), []).port}")


def test_slow_clients_are_cut_off(tmp_path: Path, db: Path) -> None:
    with sqlite_server(tmp_path, db, "--read-timeout", "1") as server:
        assert_slow_clients_are_cut_off(server, "/v1/create")


def test_command_line_refusals(db: Path) -> None:
    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "tvcache.server", "sandbox-server", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0
        return done.stderr

    assert "needs a token" in run("--sandbox", "sqlite", "--base", str(db), "--host", "0.0.0.0")
    assert "unknown --sandbox 'nope'" in run("--sandbox", "nope")
    assert "--sandbox sqlite needs --base FILE" in run("--sandbox", "sqlite")
    assert "is not a directory" in run("--sandbox", "workspace", "--base", str(db))
    assert "expected python:module:factory" in run("--sandbox", "python:nomodule")
    assert "--sandbox docker needs --image IMAGE" in run("--sandbox", "docker")


def test_schemathesis_finds_no_failure_in_the_api(tmp_path: Path, db: Path) -> None:
    # A schema-valid call may name a tool the backend does not have (which tools a backend has is not in the
    # schema): its 422 counts as accepting valid input.
    (tmp_path / "schemathesis.toml").write_text(
        '[checks.positive_data_acceptance]\nexpected-statuses = ["2xx", "401", "403", "404", "409", "422", "429"]\n'
    )
    with sqlite_server(tmp_path, db, "--max-sandboxes", "16") as server:
        assert_schemathesis_finds_nothing(server, tmp_path)
