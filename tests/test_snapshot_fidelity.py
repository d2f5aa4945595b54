"""Snapshots are invisible: a differential fuzzer over workspace sandboxes, in every isolation mode that works here.

Random file-system operations (files, directories, deletes of base entries (whiteouts), renames, replaced
directories (opaque), hard links, symlinks, FIFOs, sockets, set-uid bits, owners, xattrs and file capabilities,
sparse files, deep trees, long names, empty directories, fixed times) run twice on the same workspace: once in a
fresh sandbox, uncached, and once with a snapshot after random steps, the run going on either in the sandbox that
took it or in one restored from it. After each of those steps both runs look at everything: `ls -laR`, `stat` of
every path, `find`'s listing order, `getfattr -d -m -`, `getcap`, `du` and `df`. The two must print the same.

Times are compared by the step that set them: each timestamp is replaced by the label of the step during whose
execution it lies (or kept as it is when it lies before both runs, as the base's do). A time a snapshot or restore
set itself lies in no step and stays a raw number, which the uncached run never prints.

What a sandbox restored from a snapshot does not keep, listed in the exceptions to the correctness invariant
(docs/threat-model.md): inode numbers, change times (the kernel sets both when a file is made; no call sets them),
and `df -i`'s count. Where the run went through a restore they are left out; where it only took snapshots and went
on, they are compared too: every sandbox draws where its inode numbers start and how many inodes it holds apart
(workspace._isolation._scramble), which these tests turn off, so that they see whether taking a snapshot changed
any of them in the sandbox that goes on. Access times are not compared: relatime updates one on a read when it is
not newer than the last change, which at the kernel's clock granularity differs between two uncached runs of the
same history.

CI runs a fixed, derandomized set of examples per mode; `TVCACHE_FUZZ_EXAMPLES=500` runs a longer search.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shell_oracle import cached_rollouts_wrong, run
from test_workspace import MODES, usable
from tvcache import Outcome, ToolCall
from tvcache.sandboxes.workspace import WorkspaceSandboxes, _changes, _isolation

T = TypeVar("T")
EXAMPLES = int(os.environ.get("TVCACHE_FUZZ_EXAMPLES", "8"))
#: Linux's clock id (not in Python 3.11's time module).
CLOCK_REALTIME_COARSE = 5

#: Names the operations pick from, so that they meet: base entries, new ones, nested ones.
PATHS = [
    ".",
    "README",
    "data",
    "data/a.txt",
    "src",
    "src/main.py",
    "empty",
    "hl1",
    "sym",
    "fifo",
    "n0",
    "n1",
    "d0",
    "d0/n0",
    "d0/d1",
    "d0/d1/n1",
    "data/n2",
]
LONG = "L" * 255

path = st.sampled_from(PATHS)
text = st.sampled_from(["", "x", "hello\n", "a much longer line of text\n" * 40])
OPS = st.one_of(
    st.tuples(st.just("write"), path, text),
    st.tuples(st.just("append"), path, text),
    st.tuples(st.just("mkdir"), path),
    st.tuples(st.just("rm"), path),
    st.tuples(st.just("mv"), path, path),
    st.tuples(st.just("link"), path, path),
    st.tuples(st.just("symlink"), st.sampled_from(["README", "../etc/passwd", "nowhere", "d0"]), path),
    st.tuples(st.just("fifo"), path),
    st.tuples(st.just("socket"), path),
    st.tuples(st.just("chmod"), path, st.sampled_from(["4755", "2755", "1777", "600", "0"])),
    st.tuples(st.just("chown"), path),
    st.tuples(st.just("xattr"), path, st.sampled_from(["user.a", "user.b"])),
    st.tuples(st.just("setcap"), path),
    st.tuples(st.just("sparse"), path),
    st.tuples(st.just("deep"), path, st.integers(1, 40)),
    st.tuples(st.just("long"), path),
    st.tuples(st.just("opaque"), path),
    st.tuples(st.just("touch"), path),
    st.tuples(st.just("scratch"), path),
    st.tuples(st.just("system"), text),
    st.tuples(st.just("several"), path),
)


def shell(op: tuple[Any, ...]) -> str:
    """The bash command of one operation, run in /testbed; failures are part of its output."""
    kind, p, *rest = op
    # Opening a FIFO waits for the other end (to the command's timeout): an op that opens `p` skips a FIFO.
    not_fifo = f"[ ! -p {p} ]"
    parent = f"{not_fifo} && mkdir -p $(dirname {p})"
    match kind:
        case "write":
            return f"{parent} && printf %s {rest[0]!r} > {p}"
        case "append":
            return f"{not_fifo} && printf %s {rest[0]!r} >> {p}"
        case "mkdir":
            return f"mkdir -p {p}"
        case "rm":
            return f"rm -rf {p}"
        case "mv":
            return f"mkdir -p $(dirname {rest[0]}); mv -T {p} {rest[0]}"
        case "link":
            return f"ln {p} {rest[0]}"
        case "symlink":
            return f"mkdir -p $(dirname {rest[0]}); ln -s {p} {rest[0]}"
        case "fifo":
            return f"{parent}; mkfifo {p}"
        case "socket":
            # perl-base is in every Debian root, also in images without python (tests/test_docker_fidelity.py).
            bind = "socket(S, PF_UNIX, SOCK_STREAM, 0); bind(S, sockaddr_un($ARGV[0])) or die $!"
            return f"{parent}; perl -MSocket -e '{bind}' {p}"
        case "chmod":
            return f"chmod {rest[0]} {p}"
        case "chown":
            return f"chown -h 1000:1000 {p}"
        case "xattr":
            return f"setfattr -h -n {rest[0]} -v v{len(p)} {p}"
        case "setcap":  # setcap opens what it names
            return f"{not_fifo} && setcap cap_net_raw+ep {p}"
        case "sparse":
            return f"{parent} && truncate -s 3M {p} && printf x | dd of={p} bs=1 seek=1500000 conv=notrunc status=none"
        case "deep":
            return f"mkdir -p {p}/{'/'.join(['x'] * rest[0])} && echo deep > {p}/{'/'.join(['x'] * rest[0])}/f"
        case "long":
            return f"mkdir -p {p} && echo long > {p}/{LONG}"
        case "opaque":
            return f"rm -rf {p} && mkdir -p {p} && echo new > {p}/inner"
        case "scratch":  # a file made and deleted by one command: only the directory's times change
            return f"[ -d {p} ] && touch {p}/.tmp && rm {p}/.tmp"
        case "touch":
            return f"touch -h -d @1000000000 {p}"
        case "several":  # entries made in one step, in an order their names do not have
            return f"mkdir -p {p} && touch {p}/n1 {p}/b {p}/n0 {p}/a && mkdir {p}/c"
        case "system":
            return f"printf %s {p!r} >> /opt/tvcache-fuzz && ls -la --ignore=proc --time-style=+%s.%N / /opt"
    raise AssertionError(kind)


#: Everything a command can see of the files: run after each snapshot point and at the end, in both runs.
OBSERVE = r"""
cd /testbed
echo '== ls'; ls -laR --time-style=+%s.%N . 2>&1
echo '== stat'; find . -exec stat -c '%n|%F|%A|%h|%u:%g|%s|%b|%t:%T|%.9Y|ino=%i|ctime=%.9Z|%N' {} + 2>&1
echo '== roots'; stat -c '%n|%F|%A|%h|%s|%.9Y' / /opt /testbed; ls -la --ignore=proc --time-style=+%s.%N /
echo '== order'; find . 2>&1
echo '== xattrs'; getfattr -R -P -d -m - -e hex . 2>&1
echo '== caps'; getcap -r . 2>&1
echo '== du'; du -a -l . 2>&1; du -a -l --apparent-size . 2>&1
echo '== df'; df --output=used,avail /testbed / 2>&1; df --output=iused /testbed / | sed 's/^/iused=/'
"""

TIME = re.compile(rb"\b(\d{10})\.(\d{9})\b")
RESTORED_ONLY = re.compile(rb"ino=\d+|ctime=[^|]*|iused=.*")


class Run:
    """One execution of the operations, recording when each step ran."""

    def __init__(self, factory: WorkspaceSandboxes):
        self.factory = factory
        self.windows: list[tuple[int, int, str]] = []
        self.answers: list[tuple[str, Outcome]] = []
        self.restored = False

    async def timed(self, label: str, work: Awaitable[T]) -> T:
        # The kernel stamps files from its coarse clock, which lags the fine one by up to two ticks (8 ms seen
        # here): a step starts at the coarse reading, which no timestamp set during it can be earlier than (a
        # fixed margin of 5 ms put the change time of a sandbox made in 7 ms outside its `create`). Steps lie
        # apart by more than that lag, so every timestamp belongs to one of them at most.
        await asyncio.sleep(0.01)
        start = time.clock_gettime_ns(CLOCK_REALTIME_COARSE)
        result = await work
        self.windows.append((start, time.time_ns(), label))
        return result

    async def step(self, box: Any, label: str, command: str) -> None:
        call = ToolCall("bash", {"command": "cd /testbed && { " + command + "\n} 2>&1"})
        self.answers.append((label, await self.timed(label, box.execute(call))))

    async def run(self, ops: list[tuple[Any, ...]], points: dict[int, str], snapshot: bool) -> list[Any]:
        box = await self.timed("create", self.factory.create())
        snaps: dict[int, str] = {}
        try:
            for i, op in enumerate(ops):
                await self.step(box, f"op{i}", shell(op))
                if i in points:
                    if snapshot:
                        snap = snaps[i] = await self.timed(f"snapshot{i}", box.snapshot())
                        earlier = sorted(j for j in snaps if j != i)
                        if points[i] == "restore" or (points[i] == "rewind" and earlier):
                            await box.close()
                            self.restored = True
                        if points[i] == "restore":
                            box = await self.timed(f"restore{i}", self.factory.restore(snap))
                        elif points[i] == "rewind" and earlier:
                            # Back to the latest earlier snapshot (the middle of a chain when there are two), then
                            # the steps since once more, under the same labels: the state the uncached run is in.
                            box = await self.timed(f"restore{i}", self.factory.restore(snaps[earlier[-1]]))
                            for m in range(earlier[-1] + 1, i + 1):
                                call = ToolCall("bash", {"command": "cd /testbed && { " + shell(ops[m]) + "\n} 2>&1"})
                                await self.timed(f"op{m}", box.execute(call))
                    await self.step(box, f"look{i}", OBSERVE)
            await self.step(box, "end", OBSERVE)
        finally:
            await box.close()
        return [self.normalized(label, outcome) for label, outcome in self.answers]

    def normalized(self, label: str, outcome: Outcome) -> Any:
        def when(m: re.Match[bytes]) -> bytes:
            ns = int(m[1]) * 1_000_000_000 + int(m[2])
            for start, end, step in self.windows:
                if start <= ns <= end:
                    return b"<" + step.encode() + b">"
            return m[0]

        assert isinstance(outcome.output, dict), outcome
        text = TIME.sub(when, outcome.output.get("output", "").encode())
        return label, outcome.changed, outcome.error, outcome.output.get("exit_code"), text


@pytest.fixture(autouse=True)
def unscrambled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same inode numbers and `df -i` in every fresh sandbox (see the module docstring)."""
    monkeypatch.setattr(_isolation, "SCRAMBLE", (1, 1))


@pytest.fixture
def workspace() -> Iterator[Path]:
    """A base on the disk (as tasks are), with one of everything the operations make, for them to change."""
    base = Path(tempfile.mkdtemp(prefix="tvcache-fuzz-", dir="/var/tmp"))
    base.chmod(0o755)
    (base / "README").write_text("the readme\n")
    (base / "src").mkdir()
    (base / "src" / "main.py").write_text("print('hi')\n")
    (base / "data").mkdir()
    (base / "data" / "a.txt").write_text("a\n")
    (base / "data" / "b.txt").write_text("b\n")
    (base / "empty").mkdir()
    os.link(base / "README", base / "hl1")
    os.symlink("README", base / "sym")
    os.mkfifo(base / "fifo")
    os.chmod(base / "src" / "main.py", 0o4755)
    os.setxattr(base / "data" / "a.txt", "user.base", b"yes")
    if shutil.which("setcap"):
        subprocess.run(["setcap", "cap_chown+ep", str(base / "data" / "b.txt")], check=False)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def compare(uncached: list[Any], cached: list[Any], restored: bool, plan: object) -> None:
    for fresh, seen in zip(uncached, cached, strict=True):
        if restored:
            fresh = (*fresh[:4], RESTORED_ONLY.sub(b"", fresh[4]))
            seen = (*seen[:4], RESTORED_ONLY.sub(b"", seen[4]))
        if fresh != seen:
            import difflib

            diff = difflib.unified_diff(
                fresh[4].decode(errors="replace").splitlines(),
                seen[4].decode(errors="replace").splitlines(),
                "uncached",
                "snapshotted",
                lineterm="",
            )
            why = f"{plan}\nstep {fresh[0]}: {fresh[:4]} != {seen[:4]}\n"
            raise AssertionError(why + "\n".join(diff))


def check(base: Path, mode: str, ops: list[tuple[Any, ...]], points: dict[int, str]) -> None:
    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation=mode, timeout=30) as boxes:  # type: ignore[arg-type]
            uncached = await Run(boxes).run(ops, points, snapshot=False)
            cached_run = Run(boxes)
            cached = await cached_run.run(ops, points, snapshot=True)
        compare(uncached, cached, cached_run.restored, (ops, points))

    run(main())


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return usable(str(request.param))


# -- the findings, as they were reported -------------------------------------------------------------------


def test_directory_sizes_after_a_snapshot(workspace: Path, mode: str) -> None:
    """Finding 3: `mkdir -p /testbed/d && echo x > /testbed/d/x`, snapshot, `ls -la /testbed`: the mount root's
    size (tmpfs counts its entries) was 40 after the snapshot, 60 uncached."""
    ops: list[tuple[Any, ...]] = [("mkdir", "d0"), ("write", "d0/n0", "x")]
    check(workspace, mode, ops, {1: "continue"})
    check(workspace, mode, ops, {1: "restore"})


def test_the_reported_history_through_the_cache(workspace: Path, mode: str) -> None:
    """Finding 3 as reported: rollouts through a ToolCache that snapshots on its own answered 40, uncached 60."""
    history = "mkdir -p /testbed/d && echo x > /testbed/d/x"
    look = "ls -la --time-style=+ /testbed; stat -c %s /testbed"
    plan = [[history, look, "echo y > /testbed/d/y", look], [history, look, "echo z > /testbed/z", look]]

    async def main() -> int:
        async with WorkspaceSandboxes(workspace, isolation=mode) as boxes:  # type: ignore[arg-type]
            return await cached_rollouts_wrong(boxes, boxes, plan, rounds=3)

    assert run(main()) == 0


def test_a_directory_written_on_both_sides_of_a_snapshot(workspace: Path, mode: str) -> None:
    """A directory created, snapshotted, then written again: uncached it is one directory of the upper layer (its
    link count and size count every entry); over a snapshot layer it was a merged directory (link count 1)."""
    ops: list[tuple[Any, ...]] = [("mkdir", "d0/d1"), ("write", "d0/n0", "x"), ("write", "d0/n1", "y")]
    check(workspace, mode, ops, {1: "continue"})
    check(workspace, mode, ops, {1: "restore"})


def test_sockets_and_capabilities_survive_a_restore(workspace: Path, mode: str) -> None:
    """Finding 4: snapshots dropped socket files and `security.capability` (set before the chown that clears it)."""
    ops: list[tuple[Any, ...]] = [("socket", "n0"), ("write", "n1", "x"), ("chmod", "n1", "4755"), ("setcap", "n1")]
    check(workspace, mode, ops, {3: "restore"})


def test_a_quick_sandbox_stamps_its_root_within_its_create_step(workspace: Path, mode: str) -> None:
    """The fuzzer's clock, not a snapshot: a sandbox made in a few ms stamps its mount root at the start of `create`
    from the kernel's coarse clock, which lags the fine one by up to two ticks. With a fixed margin of 5 ms about
    one quick create in four got a change time of /testbed before its `create` step, which the fuzzer reported as
    a change time moved across an in-place snapshot (overlay mode, plan [write '.'], continue)."""

    async def main() -> set[bytes]:
        async with WorkspaceSandboxes(workspace, isolation=mode, timeout=30) as boxes:  # type: ignore[arg-type]
            seen = set()
            for _ in range(8):
                look = Run(boxes)
                box = await look.timed("create", boxes.create())
                try:
                    await look.step(box, "look", "stat -c %.9Z .")
                finally:
                    await box.close()
                seen.add(look.normalized(*look.answers[0])[4])
            return seen

    assert run(main()) == {b"<create>\n"}


def test_a_file_made_and_deleted_by_one_command(workspace: Path, mode: str) -> None:
    """It leaves the upper dir empty but the mount root's times changed: that is a change, kept by a snapshot."""
    check(workspace, mode, [("scratch", ".")], {0: "restore"})


def test_sparse_files_stay_sparse(workspace: Path, mode: str) -> None:
    check(workspace, mode, [("sparse", "n0")], {0: "restore"})


def test_a_chain_of_incremental_snapshots(workspace: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Snapshots along one sandbox's life are deltas on the one before (see workspace._deltas); a restore from the
    end and from the middle of the chain replays them, and every later step sees what the uncached run sees."""
    made: list[object] = []
    real = _isolation.make_deltas

    def counted(*args: Any) -> Any:
        made.append(deltas := real(*args))
        return deltas

    monkeypatch.setattr(_isolation, "make_deltas", counted)
    ops: list[tuple[Any, ...]] = [
        ("write", "n0", "x"),
        ("append", "README", "more"),  # a base file, copied up
        ("mkdir", "d0/d1"),
        ("rm", "data/a.txt"),  # a whiteout
        ("mv", "d0", "n1"),  # a directory renamed: its subtree is new
        ("opaque", "src"),
        ("chmod", "n0", "4755"),
        ("xattr", "n0", "user.a"),
        ("append", "n0", "hello\n"),  # in place, keeping its place in the listing
        ("deep", "d0", 30),
        ("touch", "."),
        ("write", "data/n2", "y"),
        ("several", "data"),
        ("several", "."),
    ]
    every = dict.fromkeys(range(len(ops)), "continue")
    check(workspace, mode, ops, {**every, 8: "rewind", 11: "restore", 13: "rewind"})
    check(workspace, mode, ops, {0: "continue", 3: "continue", 6: "continue", 9: "rewind", 12: "rewind"})
    if mode != "copy" and _changes.Watcher().fd is not None:
        assert len(made) >= 10, "the snapshots were not incremental"


# -- the fuzzer ------------------------------------------------------------------------------------------------


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[tuple[Any, ...]], dict[int, str]]:
    ops = draw(st.lists(OPS, min_size=1, max_size=10))
    at = draw(st.sets(st.integers(0, len(ops) - 1), min_size=1, max_size=4))
    return ops, {i: draw(st.sampled_from(["continue", "restore", "rewind"])) for i in sorted(at)}


@pytest.mark.slow
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(plan=plans())
def test_snapshots_are_invisible(
    workspace: Path, mode: str, plan: tuple[list[tuple[Any, ...]], dict[int, str]]
) -> None:
    check(workspace, mode, *plan)
