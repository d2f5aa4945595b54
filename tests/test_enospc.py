"""A full disk, caused for real: small tmpfs mounts of the test's own, unmounted at teardown (needs root).

The SQLite store whose file lives on a full tmpfs, alone and behind `tvcache serve`; workspace sandboxes whose
`tmp` (snapshot layers, each sandbox's directory) runs out of files, and whose disk quota a command fills. What a
full disk may cost is the cache's help (a call runs uncached, a snapshot is not taken), never a wrong answer, a
damaged entry or an exception other than the documented ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kv
from server_helpers import SandboxServer, Server, request
from shell_oracle import out, run
from test_workspace import small_base
from tvcache import RemoteSandboxes, SandboxError, ToolCache, live
from tvcache.calls import ToolCall
from tvcache.graph import EDGE, Entry
from tvcache.live import MAX_SUSPECT_FAILURES
from tvcache.sandboxes._layers import copy_layer
from tvcache.sandboxes.base import no_room
from tvcache.sandboxes.python import PythonSandboxes
from tvcache.sandboxes.sqlite import SQLiteSandboxes
from tvcache.sandboxes.workspace import WorkspaceSandboxes
from tvcache.stores import StoreError, TaskInfo
from tvcache.stores.http import HTTPStore
from tvcache.stores.sqlite import SQLiteStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs of its own (needs root)")

SCOPE = "5c09e" * 6 + "ab"  # a scope key as the wire format takes it: 32 hex digits
DIGEST = b"d" * 16


def node(i: int) -> bytes:
    return i.to_bytes(16, "big")


@contextlib.contextmanager
def small_tmpfs(options: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tvcache-enospc-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tvcache-test", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


def fill_bytes(disk: Path, leave: int = 0) -> None:
    """Write until the filesystem says no room, to the last byte; then give `leave` bytes of it back."""
    for name, chunk in (("filler", 1 << 16), ("filler-tail", 1)):
        fd = os.open(disk / name, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"x" * chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        finally:
            os.close(fd)
    os.truncate(disk / "filler", os.stat(disk / "filler").st_size - leave)


def fill_files(disk: Path, leave: int = 0) -> None:
    """Make empty files until the filesystem has no more inodes, then give `leave` of them back."""
    made = []
    fill = disk / "files"
    fill.mkdir()
    while True:
        try:
            os.close(os.open(fill / str(len(made)), os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            break
        made.append(len(made))
    for i in made[len(made) - leave :]:
        os.unlink(fill / str(i))


def free(disk: Path) -> None:
    subprocess.run(["rm", "-rf", str(disk / "filler"), str(disk / "filler-tail"), str(disk / "files")], check=True)


def entry(i: int, size: int = 300) -> Entry:
    return Entry(EDGE, b"%d:" % i + os.urandom(size), 0.1, f"call {i}")


# -- the SQLite store ---------------------------------------------------------------------------------------


def test_the_sqlite_store_on_a_full_disk_fails_as_a_store_error_and_recovers() -> None:
    """Writes on a full disk fail as `StoreError` (the cache then records nothing of the call, which answers all
    the same), reads go on, nothing recorded before is damaged, and once there is room again the same store writes."""

    async def main(disk: Path) -> None:
        store = SQLiteStore(disk / "cache.db")
        before = {i: entry(i) for i in range(20)}
        for i, e in before.items():
            await store.record(SCOPE, node(i), DIGEST, e, None)
        await store.add_snapshot(SCOPE, "origin", [node(0)], "snap-0", 10)
        fill_bytes(disk)
        for i in range(20, 30):
            with pytest.raises(StoreError, match="database or disk is full"):
                await store.record(SCOPE, node(i), DIGEST, entry(i, 2000), None)
        for failing in (
            store.register(TaskInfo(SCOPE, "ns", "task", "fp")),
            store.lease(SCOPE, "origin", [node(0)], 10),
            store.add_snapshot(SCOPE, "origin", [node(0), node(1)], "snap-1", 10),
        ):
            with pytest.raises(StoreError, match="database or disk is full"):
                await failing
        assert await store.lookup(SCOPE, node(3), DIGEST) == before[3]
        free(disk)
        after = entry(99, 5000)
        assert await store.record(SCOPE, node(99), DIGEST, after, None) == after
        assert (await store.lease(SCOPE, "origin", [node(0)], 10)) is not None
        await store.close()

        reopened = SQLiteStore(disk / "cache.db", cache_mb=0)
        for i, e in [*before.items(), (99, after)]:
            assert await reopened.lookup(SCOPE, node(i), DIGEST) == e
        assert await reopened.lookup(SCOPE, node(25), DIGEST) is None  # refused, so never recorded
        await reopened.close()
        with contextlib.closing(sqlite3.connect(disk / "cache.db")) as db:
            assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]

    with small_tmpfs("size=1m") as disk:
        run(main(disk))


def test_a_server_on_a_full_disk_answers_its_store_error(tmp_path: Path) -> None:
    """`tvcache serve` with that store: a record on the full disk is the documented 503 "store failed: ...",
    which its HTTP client raises as `StoreError`; a rollout through it answers every call, uncached. /healthz,
    which said 200 while every write failed (the store still answered its ping), reports the failed write until
    a write succeeds again."""

    async def main(server: Server, disk: Path) -> None:
        client = HTTPStore(server.url)
        await client.record(SCOPE, node(0), DIGEST, entry(0), None)
        fill_bytes(disk)
        with pytest.raises(StoreError, match=r"503: store failed: .*database or disk is full"):
            await client.record(SCOPE, node(1), DIGEST, entry(1, 4000), None)
        status, reply = request(server, "GET", "/healthz")
        assert status == 503 and re.fullmatch(r"store failed: a write failed 0 s ago: .*disk is full", reply["error"])
        free(disk)
        await client.record(SCOPE, node(1), DIGEST, entry(1, 4000), None)
        assert request(server, "GET", "/healthz") == (200, {"status": "ok"})
        fill_bytes(disk)
        await client.close()
        calls = [("write", {"key": "a", "value": "x" * 4000}), ("read", {"key": "a"})]
        async with PythonSandboxes(dict, kv.run, "kv") as boxes, ToolCache(server.url) as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                got = [(await r.call(tool, args)).output for tool, args in calls]
            assert got == ["ok", "x" * 4000]
            assert cache.stats()["store_errors"] > 0

    with small_tmpfs("size=1m") as disk, Server(tmp_path, f"sqlite:///{disk}/cache.db") as server:
        run(main(server, disk))
        assert "Traceback" not in server.log()


# -- workspace sandboxes --------------------------------------------------------------------------------------


@pytest.fixture
def base() -> Iterator[Path]:
    with small_base() as path:
        yield path


def test_a_layer_copy_with_no_room_for_an_xattr_fails() -> None:
    """tmpfs (Linux 6.6 on) counts xattrs against its files' space, so a copy can make a directory and then find
    no room for its `overlay.opaque` mark. When the copy skipped the mark, a restored sandbox showed the base's
    files in a directory the sandbox had emptied (`ls data` printed a.txt b.txt n, uncached n, in a probe through
    real snapshots into such a tmp). The copy must fail instead, as a copy that found no room for a file does."""
    with small_tmpfs("size=1m") as elsewhere, small_tmpfs("size=1m,nr_inodes=64") as disk:
        src = elsewhere / "upper"  # not on `disk`: its xattr would take a part of an inode's space there
        src.mkdir()
        os.setxattr(src, "trusted.overlay.opaque", b"y")
        fill_files(disk)
        try:
            os.setxattr(disk / "files", "trusted.probe", b"y")
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        else:
            pytest.skip("this kernel's tmpfs does not count xattrs against its files (before Linux 6.6)")
        os.unlink(disk / "files" / "0")  # room for the copy's directory and not one byte more
        with pytest.raises(OSError) as raised:
            copy_layer(str(src), str(disk / "layer"))
        assert raised.value.errno == errno.ENOSPC


def test_sandboxes_on_a_tmp_out_of_room_fail_as_sandbox_errors(base: Path) -> None:
    """`create` and `restore` on a `tmp` with no file left raise `SandboxError` (before, a bare `OSError`, which
    escaped `rollout.call` as such), leave nothing half made, and work again once there is room."""

    async def main(tmp: Path) -> None:
        async with WorkspaceSandboxes(base, tmp=tmp, disk=4 << 20) as boxes:
            box = await boxes.create()
            await out(box, "rm -rf data && mkdir data && echo new > data/n")
            snap = await box.snapshot()
            await box.close()
            made = set(os.listdir(boxes._ctx.boxes))
            for leave in (0, 1, 2):  # each fails at another step of making a sandbox
                fill_files(tmp, leave)
                for make in (boxes.create, lambda: boxes.restore(snap)):
                    with pytest.raises(SandboxError, match=r"could not make a sandbox: .*No space left"):
                        await make()
                free(tmp)
            assert set(os.listdir(boxes._ctx.boxes)) == made  # each half-made sandbox was removed
            fill_files(tmp)
            async with ToolCache() as cache, cache.rollout("task", boxes) as r:
                with pytest.raises(SandboxError):
                    await r.call("bash", {"command": "ls"})
            free(tmp)
            assert await out(await boxes.restore(snap), "ls data; cat data/n") == "n\nnew\n"

    with small_tmpfs("size=16m,nr_inodes=300") as tmp:
        run(main(tmp))


def test_a_command_that_fills_the_quota_answers_as_uncached_after_a_restore(base: Path) -> None:
    """A command that runs into the disk quota gets its own "No space left" (an answer like any other once it
    frees the space again): as many bytes fit in a sandbox restored from a chain of snapshots (a full layer, then
    deltas) as in a fresh sandbox that ran the same history uncached."""
    steps = [
        "head -c 300000 /dev/zero > w1 && cp w1 w2",
        "mkdir d && for i in $(seq 40); do echo $i > d/$i; done",
        "rm w1",
    ]
    fill = "head -c 4000000 /dev/zero > big; echo $?; wc -c < big; rm big"

    async def main() -> None:
        async with WorkspaceSandboxes(base, disk=1 << 20) as boxes:
            lived, fresh = await boxes.create(), await boxes.create()
            for step in steps:
                await out(lived, step)
                snap = await lived.snapshot()
                await out(fresh, step)
            restored = await boxes.restore(snap)
            want = await out(fresh, fill)
            assert "No space left on device" in want
            assert [await out(box, fill) for box in (lived, restored)] == [want, want]

    run(main())


def test_a_delta_that_grew_a_file_before_another_shrank_restores_within_the_quota(base: Path) -> None:
    """A delta replays files rewritten in place; in the order the sandbox changed them (b grew, then a shrank,
    then b grew again) the replay needed 1.1 MB of a 1 MiB quota, so the snapshot of a state that fits could never
    be restored ("No space left on device", every time). Replayed emptied first, it restores as it was."""

    async def main() -> None:
        async with WorkspaceSandboxes(base, disk=1 << 20) as boxes:
            box = await boxes.create()
            await out(box, "head -c 500000 /dev/zero > a; head -c 100000 /dev/zero > b")
            await box.snapshot()  # the full layer the delta is on
            state = "wc -c a b; md5sum a b"
            await out(box, "head -c 300000 /dev/urandom >> b; : > a; head -c 200000 /dev/urandom >> b")
            want = await out(box, state)
            assert await out(await boxes.restore(await box.snapshot()), state) == want

    run(main())


# -- SQLite sandboxes, and what the cache makes of a full `tmp` ---------------------------------------------

# A write dear enough to redo that the cache snapshots the state after it (tens of ms of counting), which adds
# one row: a page the file already has, so it still succeeds on a full disk.
SLOW_INSERT = (
    "INSERT INTO t SELECT count(*) FROM (WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < "
    "{}) SELECT i FROM n)"
)
PATH = [SLOW_INSERT.format(200000 + i) for i in range(2)]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "db.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE t(x)")
        conn.commit()
    return path


async def sql(r: Any, query: str) -> Any:
    return await r.call("sql", {"query": query})


def test_restores_that_fail_for_want_of_room_do_not_lose_the_snapshot(db: Path) -> None:
    """A restore that fails because the sandboxes' `tmp` is full is the machine's failure, not the snapshot's.
    Before, each counted against the snapshot, and after three (`MAX_SUSPECT_FAILURES`) the cache dropped the
    snapshot from the graph and deleted it: a sound, costly state lost to a full disk. Now the snapshots stay,
    and once there is room the next rollout restores one."""

    async def main(tmp: Path) -> None:
        async with SQLiteSandboxes(db, tmp=tmp) as boxes, ToolCache() as cache:
            async with cache.rollout("t", boxes) as r:
                for query in PATH:
                    await sql(r, query)
                await cache.flush()  # the snapshots are taken, so closing the rollout closes its sandbox at once
            snapshots = {s.snapshot_id for s in await cache.store.snapshots(cache.scope("t", boxes).key)}
            assert snapshots and not os.listdir(boxes.directory / "boxes")
            fill_bytes(tmp)
            for i in range(MAX_SUSPECT_FAILURES + 1):
                async with cache.rollout("t", boxes) as r:
                    for query in PATH:
                        assert (await sql(r, query)).hit
                    with pytest.raises(SandboxError, match=r"could not open a sandbox: .*No space left"):
                        await sql(r, f"SELECT count(*) + {i} FROM t")  # a restore, then a fresh sandbox: no room
            assert {s.snapshot_id for s in await cache.store.snapshots(cache.scope("t", boxes).key)} == snapshots
            free(tmp)
            async with cache.rollout("t", boxes) as r:
                for query in PATH:
                    await sql(r, query)
                assert (await sql(r, "SELECT count(*) FROM t")).output == "count(*)\n       2"
            assert cache.stats()["restores"] == 1

    with small_tmpfs("size=1m") as tmp:
        run(main(tmp))


def test_a_snapshot_that_found_no_room_is_tried_again_later(
    db: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A snapshot that fails for want of room may succeed once room is freed. Before, the sandbox took no more
    snapshots after it, as one whose backend cannot save its state; now it tries again after `NO_ROOM_RETRY`
    seconds (not after every call: a full disk must not cost a failed copy per call)."""
    monkeypatch.setattr(live, "NO_ROOM_RETRY", 0.5)

    async def main(tmp: Path) -> None:
        async with SQLiteSandboxes(db, tmp=tmp) as boxes, ToolCache() as cache, cache.rollout("t", boxes) as r:
            await sql(r, "SELECT count(*) FROM t")  # makes the sandbox: a file of its own on the tmpfs
            fill_bytes(tmp)
            for query in PATH:  # the first snapshot fails, and the second call comes too soon to try
                await sql(r, query)
                await cache.flush()
            assert cache.stats()["snapshots"] == 0
            assert caplog.text.count("snapshot failed for want of room") == 1
            free(tmp)
            await asyncio.sleep(0.5)
            await sql(r, SLOW_INSERT.format(300000))
            await cache.flush()
            assert cache.stats()["snapshots"] == 1

    with caplog.at_level(logging.WARNING, logger="tvcache"), small_tmpfs("size=1m") as tmp:
        run(main(tmp))


def test_a_statement_refused_for_want_of_room_is_not_cached(db: Path, tmp_path: Path) -> None:
    """An INSERT that fills the sandboxes' `tmp` gets SQLite's "database or disk is full", as it does uncached;
    but the disk is the machine's, not the database's: the answer was cached as the statement's own, and once
    room was freed a rollout in the same state got it again where uncached the INSERT succeeds."""
    insert = (
        "INSERT INTO t SELECT randomblob(3000) FROM "
        "(WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100) SELECT i FROM n)"
    )

    async def main(tmp: Path) -> None:
        async with SQLiteSandboxes(db, tmp=tmp_path / "roomy") as oracle:
            fresh = await oracle.create()
            assert (await fresh.execute(ToolCall("sql", {"query": insert}))).output == "OK, 100 rows affected"
        fill_bytes(tmp, leave=100_000)  # room for a third of the INSERT
        async with SQLiteSandboxes(db, tmp=tmp) as boxes, ToolCache() as cache:
            for want in ("Error: database or disk is full", "OK, 100 rows affected"):
                async with cache.rollout("t", boxes) as r:
                    res = await sql(r, insert)
                    assert (res.output, res.hit) == (want, False)
                free(tmp)

    with small_tmpfs("size=1m") as tmp:
        run(main(tmp))


def test_a_sandbox_server_out_of_room_says_so_across_the_wire(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The errno of a full disk does not cross HTTP: a sandbox server answered a restore or snapshot that found no
    room with the 502 of any backend failure, so its clients counted such restores against the snapshot. It answers
    507 (Insufficient Storage) now, which `RemoteSandboxes` raises as a `SandboxError` the cache takes for the
    machine's (`no_room`); once there is room the same snapshot restores."""

    async def main(server: SandboxServer, tmp: Path) -> None:
        async with RemoteSandboxes([server.url]) as boxes:
            box = await boxes.create()
            await box.execute(ToolCall("sql", {"query": "INSERT INTO t VALUES (1)"}))
            snap = await box.snapshot()
            fill_bytes(tmp)
            await box.execute(ToolCall("sql", {"query": "INSERT INTO t VALUES (2)"}))  # a page it has: it fits
            for make in (box.snapshot, lambda: boxes.restore(snap)):  # a copy of the file each: no room
                with pytest.raises(SandboxError, match=r"answered \w+ with 507: .*No space left on device") as raised:
                    await make()
                assert no_room(raised.value)
            free(tmp)
            restored = await boxes.restore(snap)
            assert (await restored.execute(ToolCall("sql", {"query": "SELECT count(*) FROM t"}))).output == (
                "count(*)\n       1"
            )

    with small_tmpfs("size=1m") as tmp:
        monkeypatch.setenv("TVCACHE_TEST_TMP", str(tmp))
        sandbox = ["--sandbox", "python:server_helpers:sqlite_in_tmp", "--base", str(db)]
        with SandboxServer(tmp_path, sandbox) as server:
            run(main(server, tmp))
        assert "Traceback" not in server.log()
