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
import contextlib
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import pidns
from docker_env import docker_tmp_fixture  # noqa: F401  (a fixture, asked for by name)
from tvcache import ToolCall
from tvcache.sandboxes import reclaim
from tvcache.sandboxes.sqlite import SQLiteSandboxes
from tvcache.sandboxes.workspace import WorkspaceSandboxes

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
POINTS = ("create", "snapshot", "restore", "close", "idle")
RNG = random.Random(os.environ.get("TVCACHE_TEST_SEED", "reclaim"))
#: Alone under pytest-xdist (conftest.py): these tests assert on what a killed child left in /dev/shm and in
#: cgroups, which a factory made meanwhile by a test in the other worker would reclaim.
pytestmark = pytest.mark.serial


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{HERE}"}


class Child:
    """reclaim_child.py running `kind`; `kill_at(point)` SIGKILLs it once it announces `point` (plus up to
    `jitter` seconds, so the kill may land inside the step)."""

    def __init__(
        self, kind: str, *args: str | Path, extra_env: dict[str, str] | None = None, prefix: Sequence[str] = ()
    ) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(HERE / "reclaim_child.py"), kind, *map(str, args)],
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

    def kill_once_it_holds(self, point: str, *parents: Path, jitter: float = 0.05) -> None:
        """Kill at `point`, once something of the child's exists in `parents` (a step that makes its scratch
        only some way in)."""
        self.kill_once(point, lambda: bool(owned_by(self.pid, *parents)), jitter)

    def kill_once(self, point: str, holds: Callable[[], bool], jitter: float = 0.05) -> None:
        """Kill at `point`, once `holds()`."""
        self.wait_for(point)
        deadline = time.monotonic() + 30
        while not holds() and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.005)
        time.sleep(RNG.uniform(0, jitter))
        self.kill()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def owned_by(pid: int, *parents: Path) -> list[str]:
    """Everything in `parents` (and their workspace run dirs), in the mount table, among processes' command lines
    and in the cgroup trees whose name says `pid` made it."""
    found = []
    marks = (f"-{pid}-", f"run-{pid}-")
    for parent in parents:
        for folder in (parent, parent / "tvcache-workspace"):
            if folder.is_dir():
                found += [str(p) for p in folder.iterdir() if any(m in p.name for m in marks)]
    with open("/proc/self/mountinfo") as f:
        found += [line.split()[4] for line in f if any(m in line.split()[4] for m in marks)]
    for proc in Path("/proc").iterdir():  # a helper still working there (bwrap names the run dir it binds)
        if proc.name.isdigit() and int(proc.name) != pid:
            with contextlib.suppress(OSError):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if re.search(rf"/(run|tvcache-[a-z-]+)-{pid}-", command):
                    found.append(f"process {proc.name}: {command[:200]}")
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        found += [os.path.join(root, d) for d in dirs if d.startswith(f"run-{pid}-")]
        if root.count("/") > 6:
            dirs[:] = []
    return found


def left_after(pid: int, *parents: Path) -> list[str]:
    """`owned_by`, once processes already on their way out are gone: a sandbox command whose jail was starting as
    its owner was killed can miss bwrap's --die-with-parent, and runs until it ends (its timeout bounds it)."""
    deadline = time.monotonic() + 10
    while (left := owned_by(pid, *parents)) and all(p.startswith("process ") for p in left):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return left


@pytest.fixture(name="tmp")
def tmp_fixture() -> Iterator[Path]:
    """A private directory on tmpfs (overlay upper dirs need one) for the factories' scratch."""
    path = reclaim.scratch_dir("test-reclaim", "/dev/shm")
    try:
        yield path
    finally:
        from tvcache.sandboxes.workspace._rundir import reap

        for run_dir in (path / "tvcache-workspace").glob("run-*"):  # with its mounts and cgroups
            reap(run_dir)
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
                assert left_after(child.pid, tmp) == []
            assert live.directory.is_dir()
            assert (await box.execute(sql("SELECT count(*) AS n FROM items"))).output.split() == ["n", "3"]

    asyncio.run(go())


def test_a_reused_pid_does_not_pass_for_the_owner(tmp: Path, db: Path) -> None:
    """The owner is the pid and its start time: this process's pid with another start time is a dead owner,
    whatever made it (scratch of another kind, a workspace run dir)."""
    me, start, ns = os.getpid(), reclaim.process_start_time(os.getpid()), reclaim.pid_namespace()
    assert start is not None
    dead = tmp / f"tvcache-sqlite-{me}-{int(start) - 1}-{ns}-0123abcd"
    alive = tmp / f"tvcache-sqlite-{me}-{start}-{ns}-4567abcd"
    other_kind = tmp / f"tvcache-video-{me}-{int(start) - 1}-{ns}-89abcdef"
    run_dir = tmp / "tvcache-workspace" / f"run-{me}-{int(start) - 1}-{ns}-0123abcd"
    live_run_dir = tmp / "tvcache-workspace" / f"run-{me}-{start}-{ns}-4567abcd"
    earlier_run_dir = tmp / "tvcache-workspace" / f"run-{me}-89abcdef"  # as named before: an `owner` file
    for path in (dead, alive, other_kind, run_dir, live_run_dir, earlier_run_dir):
        path.mkdir(parents=True)
        (path / "base.sqlite").write_bytes(b"x" * 10_000)
    (earlier_run_dir / "owner").write_text(f"{me} {int(start) - 1}\n")
    asyncio.run(SQLiteSandboxes(db, tmp=tmp).close())
    assert not dead.exists() and not other_kind.exists() and not run_dir.exists() and not earlier_run_dir.exists()
    assert alive.is_dir() and live_run_dir.is_dir()


#: Run with this process's owner as argv[1:]: fills its own descriptor table, then asks whether that owner lives.
FULL_TABLE = """
import os, resource, sys
from tvcache.sandboxes import reclaim

pid, start, namespace = int(sys.argv[1]), sys.argv[2], sys.argv[3]
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError as exc:
    assert exc.errno == 24, exc  # EMFILE: the table is full, as a busy server's may be
print(reclaim.owner_alive(pid, start, namespace))
"""


def test_an_owner_that_cannot_be_looked_up_is_not_taken_for_dead() -> None:
    """A process whose descriptor table is full (a loaded server, a benchmark holding many sandboxes) cannot
    open /proc/<pid>/stat; that says nothing about the owner, who must count as alive, not as gone."""
    me = [str(os.getpid()), str(reclaim.process_start_time(os.getpid())), reclaim.pid_namespace()]
    command = [sys.executable, "-c", FULL_TABLE, *me]
    ask = subprocess.run(["prlimit", "--nofile=64:64", "--", *command], env=env(), capture_output=True, text=True)
    assert ask.returncode == 0, ask.stderr
    assert ask.stdout.split() == ["True"]


def test_a_run_dir_this_version_cannot_attribute_is_left_alone(tmp: Path, db: Path) -> None:
    """Another tvcache version on the machine (two jobs pinned to different releases share /dev/shm) names its run
    dirs otherwise: this one's run-<pid>-<start>-<token>, without the PID namespace. Whose it is cannot be told
    from here, so it stays however old it is (its own version reclaims it); it was removed once idle for 60 s,
    under a live owner."""
    me, start = os.getpid(), reclaim.process_start_time(os.getpid())
    theirs = tmp / "tvcache-workspace" / f"run-{me}-{start}-89abcdef"
    (theirs / "boxes").mkdir(parents=True)
    os.utime(theirs, (time.time() - 3600, time.time() - 3600))
    asyncio.run(SQLiteSandboxes(db, tmp=tmp).close())
    command = [sys.executable, "-m", "tvcache.cli", "gc", "--tmp", str(tmp), "--no-docker"]
    subprocess.run(command, env=env(), capture_output=True, check=True)
    assert (theirs / "boxes").is_dir()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="a PID namespace needs root")
def test_a_live_owner_in_another_pid_namespace_is_never_taken_for_dead(tmp: Path, db: Path, base: Path) -> None:
    """A container sharing this /dev/shm (`--ipc=host`, common for torch jobs) has pids that name other processes
    here, or none: its live scratch and run dirs must survive every factory and gc made outside it."""
    child = Child(
        "sqlite+workspace", db, base, tmp, prefix=["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
    )
    child.wait_for("idle")
    theirs = [p for p in [*tmp.iterdir(), *(tmp / "tvcache-workspace").iterdir()] if "tvcache-sqlite-" in p.name]
    theirs += list((tmp / "tvcache-workspace").glob("run-*"))
    assert len(theirs) == 2 and f"-{child.pid}-" not in str(theirs), "the child should see its own pids"
    try:
        asyncio.run(SQLiteSandboxes(db, tmp=tmp).close())
        asyncio.run(WorkspaceSandboxes(base, tmp=tmp).close())
        command = [sys.executable, "-m", "tvcache.cli", "gc", "--tmp", str(tmp), "--no-docker"]
        subprocess.run(command, env=env(), capture_output=True, check=True)
        assert all(p.is_dir() for p in theirs)
    finally:
        child.kill()
        from tvcache.sandboxes.workspace._rundir import reap

        for run_dir in (tmp / "tvcache-workspace").glob("run-*"):  # its cgroups too: nobody here judges it
            reap(run_dir)


# -- workspace ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", [False, True], ids=["fork", "fork-into-a-pid-namespace"])
@pytest.mark.parametrize("ending", ["exit", "close"])
def test_a_forked_child_leaves_its_parents_live_sandboxes_alone(
    ending: str, namespace: bool, tmp: Path, db: Path, base: Path
) -> None:
    """A process that forks (a worker pool, a daemonising library) hands its child a copy of every factory, and of
    the finalizer that removes what the factory made. The child ends as a forked worker may: `exit`, the
    interpreter's normal exit (its atexit handlers, which run the finalizers of the factories still alive), or
    `close`, closing its copies (an `async with` unwound). Neither may touch the parent's sandboxes: their run dir,
    cgroups and SQLite copies stay, and their commands still run. With `namespace`, the parent is a container's
    first process (pid 1) and forks its child into a PID namespace of its own: the child's pid is 1 too, so a pid
    cannot tell it from its parent (the child removed its parent's sandboxes then)."""
    if namespace:
        script = "import json, sys, test_reclaim as t; from pathlib import Path\n"
        script += "print(json.dumps(t.fork_and_check(sys.argv[1], True, *map(Path, sys.argv[2:]))))"
        pids = pidns.run_python(script, ending, str(tmp), str(db), str(base), namespace=True)
        assert pids == {"parent": 1, "child": 1}, "the test did not set up what it is about"
    else:
        pids = fork_and_check(ending, False, tmp, db, base)
        assert pids["child"] not in (pids["parent"], 1)


def fork_and_check(ending: str, namespace: bool, tmp: Path, db: Path, base: Path) -> dict[str, int]:
    """test_a_forked_child_leaves_its_parents_live_sandboxes_alone in this process; the parent's and child's pids."""
    loop = asyncio.new_event_loop()  # forked from outside it: the child runs a loop of its own
    readable, writable = os.pipe()
    try:
        trees, tables = WorkspaceSandboxes(base, tmp=tmp), SQLiteSandboxes(db, tmp=tmp)
        tree, table = loop.run_until_complete(trees.create()), loop.run_until_complete(tables.create())
        loop.run_until_complete(tree.execute(ToolCall("bash", {"command": "echo live > mine"})))
        loop.run_until_complete(table.execute(sql("INSERT INTO items VALUES ('live')")))
        groups = [d for d in trees._ctx.cgroups.run_dirs if d.is_dir()]
        pid = pidns.fork(new_namespace=namespace, alarm=60)
        if pid == 0:  # the child: never back into pytest
            try:
                os.write(writable, str(os.getpid()).encode())
                if ending == "close":
                    asyncio.run(close_both(trees, tables))
                import atexit

                atexit._run_exitfuncs()  # what a normal exit of the interpreter runs first
            finally:
                os._exit(0)
        os.close(writable)
        deadline = time.monotonic() + 30
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        child = int(os.read(readable, 100))
        assert trees._run.path.is_dir() and all(d.is_dir() for d in groups), "the child removed the parent's run"
        out = loop.run_until_complete(tree.execute(ToolCall("bash", {"command": "cat mine README"})))
        assert out.output["output"] == "live\nthe base\n"  # type: ignore[index]
        assert tables.directory.is_dir()
        out = loop.run_until_complete(table.execute(sql("SELECT count(*) AS n FROM items")))
        assert out.output.split() == ["n", "3"]
        loop.run_until_complete(close_both(trees, tables))
        return {"parent": os.getpid(), "child": child}
    finally:
        loop.close()
        os.close(readable)


async def close_both(*factories: Any) -> None:
    for factory in factories:
        await asyncio.wait_for(factory.close(), 10)


def test_a_forked_worker_gets_process_sandboxes_of_its_own(tmp: Path, base: Path) -> None:
    """Frameworks build environments in worker processes, often forked from one that already made its factories
    (`process_sandboxes`). The worker gets a factory of its own, named by its pid, whose sandboxes run; it was
    handed the parent's copy, whose mount threads did not survive the fork, and its first create() hung."""
    from tvcache.integrations import process_sandboxes

    key = ("forked-worker", str(tmp))

    async def use() -> str:
        boxes = process_sandboxes(key, lambda: WorkspaceSandboxes(base, tmp=tmp, timeout=30))
        box = await boxes.create()
        out = await box.execute(ToolCall("bash", {"command": "echo ok"}))
        await box.close()
        return f"{boxes._run.path.name} {out.output['output'].strip()}"  # type: ignore[index]

    mine = asyncio.run(use()).split()
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: never back into pytest
        try:
            signal.alarm(60)  # a hung worker dies instead of hanging the test
            said = asyncio.run(use())
            asyncio.run(process_sandboxes(key, lambda: None).close())  # type: ignore[attr-defined]
            os.write(writable, said.encode())
        finally:
            os._exit(0)
    os.close(writable)
    try:
        _, status = os.waitpid(pid, 0)
        theirs = os.read(readable, 1000).decode().split()
    finally:
        os.close(readable)
    try:
        assert status == 0 and theirs[1:] == ["ok"], (status, theirs)
        assert theirs[0].startswith(f"run-{pid}-") and mine[0].startswith(f"run-{os.getpid()}-")
        assert (tmp / "tvcache-workspace" / mine[0]).is_dir()
    finally:
        asyncio.run(process_sandboxes(key, lambda: None).close())  # type: ignore[attr-defined]


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
                assert left_after(child.pid, tmp) == []
            out = await box.execute(ToolCall("bash", {"command": "cat mine README"}))
            assert out.output["output"] == "live\nthe base\n"  # type: ignore[index]

    asyncio.run(go())


@pytest.mark.parametrize("next_kind", ["sqlite", "workspace"])
def test_either_next_factory_reclaims_a_process_that_held_both_kinds(next_kind: str, db: Path, base: Path) -> None:
    """In their default tmp (/dev/shm), as most users run them: whichever factory is made next, nothing stays."""
    shm = Path("/dev/shm")
    child = Child("sqlite+workspace", db, base)
    child.kill_once(RNG.choice(POINTS), lambda: len(owned_by(child.pid, shm)) >= 2)
    assert owned_by(child.pid, shm)
    factory = SQLiteSandboxes(db) if next_kind == "sqlite" else WorkspaceSandboxes(base)
    try:
        assert left_after(child.pid, shm) == []
    finally:
        asyncio.run(factory.close())


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox cgroups need root")
def test_cgroups_whose_run_dir_was_deleted_unreaped_are_reclaimed(tmp: Path, db: Path, base: Path) -> None:
    """Someone removes a killed process's tmp by hand (`rm -rf`): its cgroups, named as the run dir, remain, and
    the next factory anywhere on the machine removes them."""
    child = Child("workspace", base, tmp)
    child.kill_once(RNG.choice(POINTS[1:]), lambda: any("/sys/fs/cgroup" in p for p in owned_by(child.pid, tmp)))
    for run_dir in (tmp / "tvcache-workspace").glob(f"run-{child.pid}-*"):
        reclaim.remove(run_dir)  # mounts and files, not the cgroups
    assert not list((tmp / "tvcache-workspace").glob(f"run-{child.pid}-*")), "the run dir is gone"
    assert [p for p in owned_by(child.pid, tmp) if p.startswith("/sys/fs/cgroup/")], "its cgroups are not"
    asyncio.run(SQLiteSandboxes(db).close())  # elsewhere (in /dev/shm), of another kind
    assert left_after(child.pid, tmp) == []


# -- tvcache gc ------------------------------------------------------------------------------------------------


def test_gc_lists_with_sizes_then_reclaims_only_what_dead_processes_left(tmp: Path, db: Path, base: Path) -> None:
    live = SQLiteSandboxes(db, tmp=tmp)
    try:
        # Both run at once: a factory reclaims what any dead process left in its tmp, so one killed before the
        # other started would be gone before gc looks.
        children = [Child("sqlite", db, tmp), Child("workspace", base, tmp)]
        for child in children:
            child.wait_for(RNG.choice(POINTS))
        for child in children:
            child.kill()
        killed = [child.pid for child in children]
        # What is in tmp (cgroups are the machine's: any factory made meanwhile elsewhere may reclaim those).
        left = {pid: [p for p in owned_by(pid, tmp) if p.startswith(str(tmp))] for pid in killed}
        assert all(left.values())

        def gc(*options: str) -> str:
            command = [sys.executable, "-m", "tvcache.cli", "gc", "--tmp", str(tmp), "--no-docker", *options]
            return subprocess.run(command, env=env(), capture_output=True, text=True, check=True).stdout

        listing = gc("--dry-run")
        for pid, paths in left.items():
            assert [p for p in owned_by(pid, tmp) if p.startswith(str(tmp))] == paths, "--dry-run removed something"
            for path in paths:
                if path.count("/") <= str(tmp).count("/") + 2:  # the scratch and run dirs, not what is below
                    line = next(line for line in listing.splitlines() if line.endswith(path))
                    assert f"pid {pid}" in line and line.split()[1] in ("B", "KiB", "MiB")
        assert str(live.directory) not in listing
        assert "would reclaim" in listing.splitlines()[-1]
        gc()
        for pid in killed:
            assert left_after(pid, tmp) == []
        assert live.directory.is_dir() and (live.directory / "base.sqlite").is_file()
    finally:
        asyncio.run(live.close())


# -- remote: the sandbox server --------------------------------------------------------------------------------


@pytest.mark.parametrize("point", POINTS)
def test_a_sandbox_server_reclaims_on_start_what_a_killed_predecessor_held(
    point: str, tmp: Path, base: Path, db: Path
) -> None:
    """A client drives create, snapshot, restore and close through a `tvcache sandbox-server`; the server is
    killed at `point` (the client's request in flight); the next server on the machine starts clean, before any
    client asks it anything. The next server serves the other kind (workspace after sqlite, sqlite after
    workspace), so what goes is what the server reclaims on start, not what its own factory reaps."""
    from server_helpers import SandboxServer
    from tvcache.sandboxes.remote import RemoteSandboxes

    kinds = {
        "workspace": (base, "bash", {"command": "echo one > a"}),
        "sqlite": (db, "sql", {"query": "CREATE TABLE t (x)"}),
    }
    first_kind, second_kind = ("workspace", "sqlite") if POINTS.index(point) % 2 else ("sqlite", "workspace")

    def server(kind: str) -> SandboxServer:
        return SandboxServer(tmp, ["--sandbox", kind, "--base", str(kinds[kind][0])])

    def call(kind: str) -> ToolCall:
        return ToolCall(kinds[kind][1], kinds[kind][2])

    async def drive(boxes: RemoteSandboxes, dying: SandboxServer) -> None:
        async def step(name: str, op: Any) -> Any:
            if name != point:
                return await op
            task = asyncio.ensure_future(op)
            await asyncio.sleep(RNG.uniform(0, 0.05))
            dying.kill9()
            with contextlib.suppress(Exception):
                await task
            raise Killed

        box = await step("create", boxes.create())
        await box.execute(call(first_kind))
        snapshot = await step("snapshot", box.snapshot())
        other = await step("restore", boxes.restore(snapshot))
        await step("close", other.close())
        await step("idle", asyncio.sleep(0))

    async def go() -> None:
        first = server(first_kind).start()
        assert first.proc is not None
        pid = first.proc.pid
        boxes = RemoteSandboxes(first.url)
        try:
            with contextlib.suppress(Killed):
                await drive(boxes, first)
        finally:
            await boxes.close()
        assert owned_by(pid, Path("/dev/shm")), "the killed server left nothing: the test would prove nothing"
        with server(second_kind) as second:
            assert left_after(pid, Path("/dev/shm")) == []
            async with RemoteSandboxes(second.url) as again:
                box = await again.create()
                assert not (await box.execute(call(second_kind))).error

    asyncio.run(go())


class Killed(Exception):
    """The server was killed at the chosen point."""


# -- the benchmarks' video sandboxes and video builder --------------------------------------------------------


@pytest.mark.parametrize("point", ("build", *POINTS))
def test_video_the_next_build_and_factory_reclaim_a_killed_processs_scratch(point: str, tmp: Path) -> None:
    from tvcache_bench.workloads.video import clips
    from tvcache_bench.workloads.video.sandbox import VideoSandboxes

    videos = tmp / "videos"
    child = Child("video", videos, tmp)
    child.kill_once_it_holds(point, tmp, videos)
    assert owned_by(child.pid, tmp, videos)
    catalogue = clips.build((clips.VideoSpec("alpha", 2, 11, "bunny"),), videos)
    boxes = VideoSandboxes(catalogue, timeout=60, tmp=str(tmp))
    try:
        assert left_after(child.pid, tmp, videos) == []
    finally:
        asyncio.run(boxes.close())


# -- image builders: layer unpacking, debootstrap ---------------------------------------------------------------


def test_unpacking_a_layer_reclaims_what_a_killed_unpacker_left(tmp: Path) -> None:
    layer = tmp / "layer.tar"
    tree = tmp / "tree"
    tree.mkdir()
    for n in range(64):
        (tree / f"file{n}").write_bytes(os.urandom(256 << 10))
    subprocess.run(["tar", "-C", str(tree), "-cf", str(layer), "."], check=True)
    cache = tmp / "layers"
    child = Child("unpack", layer, cache)
    child.kill_once_it_holds("unpack", cache, jitter=0.1)
    from tvcache.sandboxes import images

    with open(layer, "rb") as source:
        unpacked = images.unpack_layer(source, "sha256:" + "0" * 64, cache)
    assert left_after(child.pid, cache) == []
    assert sorted(p.name for p in unpacked.iterdir()) == sorted(p.name for p in tree.iterdir())


#: A stand-in for debootstrap, which needs a Debian mirror (no network here): it makes a small root and mounts
#: /proc in it as debootstrap's second stage does, then works for $STANDIN_SECONDS.
STANDIN_DEBOOTSTRAP = """#!{python}
import os, subprocess, sys, time
root = sys.argv[3]
for d in ("proc", "etc", "var/cache/apt/archives", "var/lib/apt/lists"):
    os.makedirs(os.path.join(root, d), exist_ok=True)
open(os.path.join(root, "etc/os-release"), "w").write("stand-in\\n")
mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "proc", "proc", root + "/proc"]).returncode == 0
open(os.environ["STANDIN_PID"], "w").write(str(os.getpid()))
time.sleep(float(os.environ.get("STANDIN_SECONDS", "0")))
if mounted:
    subprocess.run(["umount", root + "/proc"], check=True)
"""


def test_a_debootstrap_build_killed_midway_is_reclaimed_by_the_next(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tvcache_bench import docker_setup

    bin_dir, pid_file = tmp / "bin", tmp / "standin.pid"
    bin_dir.mkdir()
    (bin_dir / "debootstrap").write_text(STANDIN_DEBOOTSTRAP.format(python=sys.executable))
    (bin_dir / "debootstrap").chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    cache = reclaim.scratch_dir("test-reclaim", "/var/tmp")  # where the build goes: the tarball is moved in
    monkeypatch.setattr(docker_setup, "CACHE", cache / "tvcache")
    (cache / "tvcache").mkdir()
    standin = {"PATH": path, "STANDIN_PID": str(pid_file), "XDG_CACHE_HOME": str(cache)}
    child = Child("debootstrap", extra_env={**standin, "STANDIN_SECONDS": "60"})
    child.wait_for("build")
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(RNG.uniform(0, 0.05))
    child.kill()
    helper = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while reclaim.process_start_time(helper) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reclaim.process_start_time(helper) is None, "debootstrap outlived the process that ran it"
    left = owned_by(child.pid, Path("/var/tmp"))
    assert left and (os.geteuid() != 0 or any(p.endswith("/root/proc") for p in left)), left
    for name, value in {**standin, "STANDIN_SECONDS": "0"}.items():
        monkeypatch.setenv(name, value)
    try:
        tarball = docker_setup._rootfs_tarball()
        assert left_after(child.pid, Path("/var/tmp")) == []
        with tarfile.open(tarball) as tar:
            assert "./etc/os-release" in tar.getnames()
    finally:
        shutil.rmtree(cache)


# -- Docker ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", name="small_image")
def small_image_fixture() -> Iterator[str]:
    """A small real image: this host's bash and rm with their libraries (the Debian base image needs a mirror)."""
    from tvcache_bench.docker_setup import DockerUnavailable, ensure_daemon

    try:
        ensure_daemon()
    except DockerUnavailable as exc:
        pytest.skip(f"Docker cannot run here: {exc}")
    tag = f"tvcache-test/reclaim:{os.getpid()}"
    with reclaim.scratch("test-reclaim-image", "/var/tmp") as root:
        for binary in ("/bin/bash", "/bin/rm"):
            libraries = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
            for path in [binary, *(w for w in libraries.split() if w.startswith("/"))]:
                (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, root / path.lstrip("/"))
        for empty in ("tmp", "root", "dev", "proc", "etc"):
            (root / empty).mkdir(exist_ok=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout, check=True, capture_output=True)
        assert tar.wait() == 0
    yield tag
    # By id, after any container still on it (a forced removal by tag would only untag it).
    image = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", tag], capture_output=True, text=True)
    users = subprocess.run(["docker", "ps", "-aq", "--filter", f"ancestor={tag}"], capture_output=True, text=True)
    if users.stdout.split():
        subprocess.run(["docker", "rm", "-f", *users.stdout.split()], capture_output=True)
    subprocess.run(["docker", "rmi", "-f", image.stdout.strip()], capture_output=True)


def docker_owned_by(pid: int, tmp: Path) -> list[str]:
    """The containers, images and networks whose `tvcache.owner` label names `pid` on this host, and the snapshots'
    files in `tmp` (a directory of the test's own, which no other test's factory reclaims) whose name does."""
    found = [str(p) for p in tmp.glob(f"tvcache-docker-snapshots-{pid}-*")]
    listings = {
        "container": ["docker", "ps", "-aq", "--filter", "label=tvcache.owner"],
        "image": ["docker", "images", "-aq", "--filter", "label=tvcache.owner"],
        "network": ["docker", "network", "ls", "-q", "--filter", "label=tvcache.owner"],
    }
    for kind, listing in listings.items():
        ids = subprocess.run(listing, capture_output=True, text=True, check=True).stdout.split()
        if ids:
            inspect = ["docker", kind, "inspect", "--format", '{{index .Config.Labels "tvcache.owner"}}', *ids]
            if kind == "network":
                inspect[4] = '{{index .Labels "tvcache.owner"}}'
            owners = subprocess.run(inspect, capture_output=True, text=True).stdout.splitlines()
            found += [f"{kind} {i}" for i, owner in zip(ids, owners, strict=False) if f" {pid} " in owner]
    return found


@pytest.mark.parametrize("point", POINTS)
def test_docker_the_next_factory_reclaims_a_killed_processs_containers_and_snapshots(
    point: str, small_image: str, docker_tmp: Path
) -> None:
    from tvcache.sandboxes.docker import DockerSandboxes

    async def go() -> None:
        async with DockerSandboxes(small_image) as live:
            box = await live.create()
            await box.execute(ToolCall("bash", {"command": "echo live > mine"}))
            child = Child("docker", small_image, str(docker_tmp))
            child.kill_once(point, lambda: bool(docker_owned_by(child.pid, docker_tmp)))
            assert docker_owned_by(child.pid, docker_tmp)
            async with DockerSandboxes(small_image, tmp=docker_tmp) as after:
                await (await after.create()).close()
                assert docker_owned_by(child.pid, docker_tmp) == []
            out = await box.execute(ToolCall("bash", {"command": "echo $(<mine)"}))
            assert out.output["output"] == "live\n"  # type: ignore[index]

    asyncio.run(go())


def test_gc_lists_and_reclaims_a_killed_processs_docker_run(small_image: str, docker_tmp: Path) -> None:
    child = Child("docker", small_image, str(docker_tmp))
    child.kill_once(RNG.choice(POINTS), lambda: bool(docker_owned_by(child.pid, docker_tmp)))
    left = docker_owned_by(child.pid, docker_tmp)
    assert left

    def gc(*options: str) -> str:
        command = [sys.executable, "-m", "tvcache.cli", "gc", "--tmp", str(docker_tmp), *options]
        return subprocess.run(command, env=env(), capture_output=True, text=True, check=True).stdout

    line = next(line for line in gc("--dry-run").splitlines() if "docker" in line and f"pid {child.pid} " in line)
    assert line.split()[1] in ("B", "KiB", "MiB", "GiB") and "tvcache-" in line
    assert docker_owned_by(child.pid, docker_tmp) == left
    gc()
    assert docker_owned_by(child.pid, docker_tmp) == []


def test_a_docker_snapshot_left_alone_by_a_killed_process_is_reclaimed(small_image: str, docker_tmp: Path) -> None:
    """A snapshot's files lie in the factory's tmp, named by their owner, with no container of the run left."""
    from tvcache.sandboxes.docker import DockerSandboxes

    child = Child("docker-snapshot", small_image, str(docker_tmp))
    child.kill_at("idle", jitter=0)
    left = docker_owned_by(child.pid, docker_tmp)
    assert left and all("/tvcache-docker-snapshots-" in item for item in left), left

    async def next_factory() -> None:
        async with DockerSandboxes(small_image, tmp=docker_tmp) as after:
            await (await after.create()).close()

    asyncio.run(next_factory())
    assert docker_owned_by(child.pid, docker_tmp) == []
