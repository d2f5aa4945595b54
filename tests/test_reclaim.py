"""Nothing left behind: a process killed with SIGKILL at any point of create, snapshot, restore or close leaves
nothing that the next factory of the same kind (or `tvcache gc`) does not reclaim, and a live process's things
are never touched.

Each test runs a real child (reclaim_child.py) that prints each step before it takes it; the test kills it at a
step chosen per case, after a random delay (so the kill lands inside the step as often as between steps). What
the child owned is found by its pid in the names tvcache gives things (`tvcache-<kind>-<pid>-<start>-<token>`,
`run-<pid>-<token>`, the `tvcache.owner` label), in mounts and in cgroups.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tvcache import ToolCall
from tvcache.sandboxes import reclaim
from tvcache.sandboxes.sqlite import SQLiteSandboxes
from tvcache.sandboxes.workspace import WorkspaceSandboxes

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
POINTS = ("create", "snapshot", "restore", "close", "idle")
RNG = random.Random(os.environ.get("TVCACHE_TEST_SEED", "reclaim"))


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{HERE}"}


class Child:
    """reclaim_child.py running `kind`; `kill_at(point)` SIGKILLs it once it announces `point` (plus up to
    `jitter` seconds, so the kill may land inside the step)."""

    def __init__(self, kind: str, *args: str | Path, extra_env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "reclaim_child.py"), kind, *map(str, args)],
            stdout=subprocess.PIPE,
            text=True,
            env={**env(), **(extra_env or {})},
        )
        self.pid = self.proc.pid
        self.seen: list[str] = []

    def wait_for(self, point: str) -> None:
        assert self.proc.stdout is not None
        while point not in self.seen:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the child exited ({self.proc.wait()}) before {point!r}; it said {self.seen}")
            self.seen.append(line.strip())

    def kill_at(self, point: str, jitter: float = 0.05) -> None:
        self.wait_for(point)
        time.sleep(RNG.uniform(0, jitter))
        self.kill()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def owned_by(pid: int, *parents: Path) -> list[str]:
    """Everything in `parents` (and their workspace run dirs), in the mount table and in the cgroup trees whose
    name says `pid` made it."""
    found = []
    marks = (f"-{pid}-", f"run-{pid}-")
    for parent in parents:
        for folder in (parent, parent / "tvcache-workspace"):
            if folder.is_dir():
                found += [str(p) for p in folder.iterdir() if any(m in p.name for m in marks)]
    with open("/proc/self/mountinfo") as f:
        found += [line.split()[4] for line in f if any(m in line.split()[4] for m in marks)]
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        found += [os.path.join(root, d) for d in dirs if d.startswith(f"run-{pid}-")]
        if root.count("/") > 6:
            dirs[:] = []
    return found


@pytest.fixture(name="tmp")
def tmp_fixture() -> Iterator[Path]:
    """A private directory on tmpfs (overlay upper dirs need one) for the factories' scratch."""
    path = reclaim.scratch_dir("test-reclaim", "/dev/shm")
    try:
        yield path
    finally:
        for sub in (path / "tvcache-workspace").glob("run-*"):
            reclaim.detach_all(sub)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(name="db")
def db_fixture(tmp: Path) -> Path:
    path = tmp / "source.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript("CREATE TABLE items (name TEXT); INSERT INTO items VALUES ('a'), ('b');")
    conn.close()
    return path


@pytest.fixture(name="base")
def base_fixture(tmp: Path) -> Path:
    path = tmp / "base"
    path.mkdir()
    (path / "README").write_text("the base\n")
    return path


def sql(query: str) -> ToolCall:
    return ToolCall("sql", {"query": query})


# -- SQLite --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("point", POINTS)
def test_sqlite_the_next_factory_reclaims_a_killed_processs_copies(point: str, tmp: Path, db: Path) -> None:
    async def go() -> None:
        async with SQLiteSandboxes(db, tmp=tmp) as live:  # this process's: must survive the reaping
            box = await live.create()
            await box.execute(sql("INSERT INTO items VALUES ('live')"))
            child = Child("sqlite", db, tmp)
            child.kill_at(point)
            assert owned_by(child.pid, tmp), "the killed child left nothing: the test would prove nothing"
            async with SQLiteSandboxes(db, tmp=tmp):
                assert owned_by(child.pid, tmp) == []
            assert live.directory.is_dir()
            assert (await box.execute(sql("SELECT count(*) AS n FROM items"))).output.split() == ["n", "3"]

    asyncio.run(go())


def test_sqlite_a_reused_pid_does_not_pass_for_the_owner(tmp: Path, db: Path) -> None:
    """The owner is the pid and its start time: this process's pid with another start time is a dead owner."""
    me, start = os.getpid(), reclaim.process_start_time(os.getpid())
    assert start is not None
    dead = tmp / f"tvcache-sqlite-{me}-{int(start) - 1}-0123abcd"
    alive = tmp / f"tvcache-sqlite-{me}-{start}-4567abcd"
    other_kind = tmp / f"tvcache-video-{me}-{int(start) - 1}-89abcdef"
    for path in (dead, alive, other_kind):
        path.mkdir()
        (path / "base.sqlite").write_bytes(b"x" * 10_000)
    asyncio.run(SQLiteSandboxes(db, tmp=tmp).close())
    assert not dead.exists() and alive.is_dir()
    assert other_kind.is_dir(), "a factory reclaims only its own kind"


# -- workspace ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("point", POINTS)
def test_workspace_the_next_factory_reclaims_run_dir_mounts_and_cgroups(point: str, tmp: Path, base: Path) -> None:
    async def go() -> None:
        async with WorkspaceSandboxes(base, tmp=tmp) as live:
            box = await live.create()
            await box.execute(ToolCall("bash", {"command": "echo live > mine"}))
            child = Child("workspace", base, tmp)
            child.kill_at(point)
            assert owned_by(child.pid, tmp)
            async with WorkspaceSandboxes(base, tmp=tmp):
                assert owned_by(child.pid, tmp) == []
            out = await box.execute(ToolCall("bash", {"command": "cat mine README"}))
            assert out.output["output"] == "live\nthe base\n"  # type: ignore[index]

    asyncio.run(go())


# -- tvcache gc ------------------------------------------------------------------------------------------------


def test_gc_lists_with_sizes_then_reclaims_only_what_dead_processes_left(tmp: Path, db: Path, base: Path) -> None:
    live = SQLiteSandboxes(db, tmp=tmp)
    try:
        killed = []
        for kind, args in (("sqlite", (db, tmp)), ("workspace", (base, tmp))):
            child = Child(kind, *args)
            child.kill_at(RNG.choice(POINTS))
            killed.append(child.pid)
        left = {pid: owned_by(pid, tmp) for pid in killed}
        assert all(left.values())

        def gc(*options: str) -> str:
            command = [sys.executable, "-m", "tvcache.cli", "gc", "--tmp", str(tmp), "--no-docker", *options]
            return subprocess.run(command, env=env(), capture_output=True, text=True, check=True).stdout

        listing = gc("--dry-run")
        for pid, paths in left.items():
            assert owned_by(pid, tmp) == paths, "--dry-run removed something"
            for path in paths:
                if "/sys/fs/cgroup" not in path and path.count("/") <= str(tmp).count("/") + 2:
                    line = next(line for line in listing.splitlines() if line.endswith(path))
                    assert f"pid {pid}" in line and line.split()[1] in ("B", "KiB", "MiB")
        assert str(live.directory) not in listing
        assert "would reclaim" in listing.splitlines()[-1]
        gc()
        for pid in killed:
            assert owned_by(pid, tmp) == []
        assert live.directory.is_dir() and (live.directory / "base.sqlite").is_file()
    finally:
        asyncio.run(live.close())
