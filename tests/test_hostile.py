"""A hostile command against the sandbox machinery itself (issue 19): a PID 1 that outlives its timeout, a racer
that swaps files and symlinks while a snapshot copies them, trees deeper and paths longer than the host's own
walks and PATH_MAX allow. Each reproduces what an attacker did to the landed code, in every isolation mode that
works here; each failed before its fix.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shell_oracle import bash, out, run
from test_workspace import MODES, small_base, usable
from tvcache import SandboxError, ToolCall
from tvcache.sandboxes._fdtree import remove_tree
from tvcache.sandboxes.workspace import WorkspaceSandbox, WorkspaceSandboxes


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return usable(str(request.param))


@pytest.fixture
def base() -> Iterator[Path]:
    with small_base() as path:
        yield path


def _running(token: str) -> list[int]:
    """Live processes whose command line holds `token` (a zombie's reads as empty)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _gone(token: str) -> bool:
    # The kernel tears a PID namespace down asynchronously; give it a moment, not a deadline to meet.
    for _ in range(200):
        if not _running(token):
            return True
        time.sleep(0.01)
    return False


# Clears its parent-death signal, ignores every signal it can, and runs until killed.
SURVIVOR = """import ctypes, signal, time
ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(s, signal.SIG_IGN)
while True:
    time.sleep(0.05)
"""


async def _timed_out(box: object, command: str) -> None:
    await box.execute(ToolCall("write_file", {"path": "/tmp/survivor.py", "content": SURVIVOR}))  # type: ignore[attr-defined]
    outcome = await box.execute(ToolCall("bash", {"command": command}))  # type: ignore[attr-defined]
    assert outcome.error and "timed out" in outcome.output["error"], outcome


def test_a_timeout_ends_a_pid_1_that_cleared_its_parent_death_signal(base: Path, mode: str) -> None:
    token = "survivor-" + secrets.token_hex(6)

    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation=mode, timeout=2) as boxes:  # type: ignore[arg-type]
            box = await boxes.create()
            await _timed_out(box, f"exec python3 /tmp/survivor.py {token}")
            assert _gone(token), f"the command's PID 1 outlived its timeout: {_running(token)}"
            # The sandbox goes on, and a snapshot of it copies a sandbox where nothing runs.
            assert await out(box, "echo after") == "after\n"
            other = await boxes.restore(await box.snapshot())
            assert await out(other, "echo restored") == "restored\n"

    run(main())


def test_a_timeout_ends_every_process_the_command_started(base: Path, mode: str) -> None:
    token = "orphan-" + secrets.token_hex(6)
    # Children in new sessions, double-forked, each clearing its parent-death signal.
    command = f"for i in 1 2 3; do setsid sh -c 'python3 /tmp/survivor.py {token} &'; done; sleep 100"

    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation=mode, timeout=2) as boxes:  # type: ignore[arg-type]
            box = await boxes.create()
            await _timed_out(box, command)
            assert _gone(token), f"processes the command started outlived its timeout: {_running(token)}"

    run(main())


# -- a racer in the upper dir while a snapshot copies it ----------------------------------------------------

ROUNDS = 10
#: Pairs of entries per kind: enough that a copy takes a while and some pair is always mid-swap.
PAIRS = 400
# Makes, in /testbed/race, PAIRS files with as many symlinks to a host file or /proc/self/environ, and PAIRS
# directories with as many symlinks to a host directory.
RACE_SETUP = """python3 -c '
import os, sys
os.makedirs("/testbed/race")
os.chdir("/testbed/race")
for i in range({pairs}):
    open(f"f{{i}}", "w").write("sandbox\\n")
    os.symlink("/proc/self/environ" if i % 2 else "{host}/secret", f"l{{i}}")
    os.mkdir(f"d{{i}}")
    open(f"d{{i}}/x", "w").write("sandbox\\n")
    os.symlink("{host}/dir", f"h{{i}}")
'"""
# Swaps each file with its symlink and each directory with its symlink, with renameat2(RENAME_EXCHANGE), as
# fast as it can until its stdin closes.
RACER = """
import ctypes, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
pairs = [(f"{a}{i}".encode(), f"{b}{i}".encode()) for i in range(int(sys.argv[2])) for a, b in (("f", "l"), ("d", "h"))]
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("racing", flush=True)
while not stop.is_set():
    for a, b in pairs:
        libc.renameat2(-100, a, -100, b, 2)  # AT_FDCWD, RENAME_EXCHANGE
"""


def _leaks(tree: Path, secrets_: list[bytes]) -> list[str]:
    """What in `tree` (walked without following symlinks) came from the host rather than from the sandbox."""
    found = []
    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            if name.startswith("host-only"):
                found.append(f"{path}: a host directory's entry")
            elif path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                if any(s in data for s in secrets_):
                    found.append(f"{path}: {data[:60]!r}")
    return found


def _race_dir(box: WorkspaceSandbox) -> str:
    """/testbed/race in the upper dir that holds it."""
    fs: Any = box._fs
    for k in range(len(fs._listings)):
        for top in (Path(fs._upper(k)), Path(fs._upper(k), "testbed")):
            if os.path.lexists(top / "race"):
                return str(top / "race")
    raise AssertionError("no upper dir holds /testbed/race")


def _start_racer(where: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-c", RACER, where, str(PAIRS)]
    racer = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert racer.stdout is not None and racer.stdout.readline() == b"racing\n"
    return racer


def test_a_snapshot_copies_nothing_from_the_host_however_the_upper_dir_races(base: Path) -> None:
    usable("overlay")
    token = secrets.token_hex(8).encode()
    host = Path(tempfile.mkdtemp(prefix="tvcache-host-", dir="/dev/shm"))
    (host / "secret").write_bytes(b"host secret " + token)
    (host / "dir").mkdir()
    (host / "dir" / "host-only-file").write_bytes(b"host dir " + token)
    setup = RACE_SETUP.format(pairs=PAIRS, host=host)
    watched = [host / "secret", host / "dir", host / "dir" / "host-only-file"]
    for path in watched:
        os.utime(path, ns=(0, time.time_ns()))

    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation="overlay") as boxes:
            box = await boxes.create()
            await bash(box, setup)
            leaks: list[str] = []
            for _ in range(ROUNDS):
                racer = _start_racer(_race_dir(box))
                try:
                    try:
                        snap = await box.snapshot()
                    except SandboxError:
                        continue  # the copy saw the tree change under it: no snapshot, nothing copied
                finally:
                    racer.communicate(b"")
                layers = boxes._ctx.isolation.layers  # type: ignore[attr-defined]
                leaks += _leaks(layers.root / box._fs.layer, [token, b"PATH="])  # type: ignore[attr-defined]
                await boxes.delete(snap)
                # The snapshot moved the entries into its layer: make them again on the new upper dir.
                await bash(box, "rm -rf /testbed/race && " + setup)
            assert not leaks, leaks
            # Read by nobody: a read (by a copy that followed a symlink) would have moved their access times.
            assert [os.stat(p).st_atime_ns for p in watched] == [0] * len(watched), "the host's files were read"

    try:
        run(main())
    finally:
        shutil.rmtree(host)


# -- trees deeper than recursion, paths longer than PATH_MAX -------------------------------------------------

DEPTH = 10_000
# /testbed/deep/d/d/.../d/f: DEPTH levels, a path of about 2 * DEPTH bytes, far past PATH_MAX (4096).
DEEP = f"""python3 -c '
import os
os.chdir("/testbed")
os.mkdir("deep")
os.chdir("deep")
for _ in range({DEPTH}):
    os.mkdir("d")
    os.chdir("d")
open("f", "w").write("at the bottom\\n")
'"""
COUNT = "find /testbed/deep -name f | wc -l"


async def _every_tool_answers(box: WorkspaceSandbox) -> None:
    """Each tool returns an Outcome on the deep tree (an error where the path is too long)."""
    assert await out(box, COUNT) == "1\n"
    long_path = "/testbed/deep/" + "d/" * DEPTH + "f"
    for call in (
        ToolCall("read_file", {"path": long_path}),
        ToolCall("write_file", {"path": long_path, "content": "x"}),
        ToolCall("list_dir", {"path": long_path[:-2]}),
    ):
        outcome = await box.execute(call)
        assert outcome.error or "error" in outcome.output, (call.tool, outcome)
    listed = await box.execute(ToolCall("list_dir", {"path": "/testbed/deep"}))
    assert listed.output == {"entries": ["d/"]}, listed


def test_a_tree_deeper_than_any_recursion_and_paths_past_path_max(base: Path, mode: str) -> None:
    async def main() -> None:
        boxes = WorkspaceSandboxes(base, isolation=mode)  # type: ignore[arg-type]
        try:
            box = await boxes.create()
            await bash(box, DEEP)
            await _every_tool_answers(box)
            snap = await box.snapshot()
            await _every_tool_answers(box)  # the sandbox goes on over its own snapshot
            await bash(box, "rm -rf /testbed/deep")
            assert await out(box, "ls /testbed/deep 2>&1 | wc -l; echo ok") == "1\nok\n"
            other = await boxes.restore(snap)
            await _every_tool_answers(other)
            again = await other.snapshot()  # a snapshot of a restored deep tree, for the merge below
            await boxes.restore(again)
        finally:
            await boxes.close()  # removes every layer and copy of the deep tree, and must not raise

    run(main())


# Hard links between files deeper than PATH_MAX, and from the top down there.
DEEP_LINKS = f"""python3 -c '
import os
os.chdir("/testbed/deep")
for _ in range({DEPTH}):
    os.chdir("d")
os.link("f", "g")
os.link("f", "/testbed/top")
'"""
LINKS_SEEN = f"""python3 -c '
import os
os.chdir("/testbed/deep")
for _ in range({DEPTH}):
    os.chdir("d")
print(os.stat("f").st_nlink, os.stat("f").st_ino == os.stat("g").st_ino == os.stat("/testbed/top").st_ino)
print(open("g").read(), end="")
'"""


def test_hard_links_deeper_than_path_max_survive_a_snapshot(base: Path, mode: str) -> None:
    """A snapshot linked the second name to the first by its path from the layer's root, which was too long."""

    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation=mode) as boxes:  # type: ignore[arg-type]
            box = await boxes.create()
            await bash(box, DEEP)
            await bash(box, DEEP_LINKS)
            assert await out(box, LINKS_SEEN) == "3 True\nat the bottom\n"
            other = await boxes.restore(await box.snapshot())
            assert await out(other, "echo changed > /testbed/top; " + LINKS_SEEN) == "3 True\nchanged\n"
            again = await boxes.restore(await other.snapshot())
            assert await out(again, LINKS_SEEN) == "3 True\nchanged\n"

    run(main())


# A process that leaves a deep tree in its sandboxes' layers and copies, then is killed.
KILLED = """
import asyncio, os, signal, sys
from tvcache import ToolCall
from tvcache.sandboxes.workspace import WorkspaceSandboxes

async def main():
    boxes = WorkspaceSandboxes(sys.argv[1], tmp=sys.argv[2], isolation=sys.argv[3])
    box = await boxes.create()
    await box.execute(ToolCall("bash", {"command": sys.argv[4]}))
    await box.snapshot()
    print(boxes._run.path, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_the_next_factory_removes_the_deep_tree_a_killed_process_left(base: Path, mode: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="tvcache-hostile-", dir="/dev/shm"))
    try:
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH", "")]),
        )
        proc = subprocess.run(
            [sys.executable, "-c", KILLED, str(base), str(tmp), mode, DEEP], capture_output=True, text=True, env=env
        )
        run_dir = Path(proc.stdout.strip())
        assert proc.returncode == -9 and run_dir.is_dir(), proc.stderr[-2000:]

        async def main() -> None:
            async with WorkspaceSandboxes(base, tmp=tmp, isolation=mode) as boxes:  # type: ignore[arg-type]
                assert not os.path.lexists(run_dir)  # noqa: ASYNC240
                box = await boxes.create()
                assert await out(box, "echo fine") == "fine\n"

        run(main())
    finally:
        remove_tree(tmp)


def test_a_snapshot_freezes_a_racer_left_in_the_sandboxs_cgroup(base: Path) -> None:
    """As if a process had outlived its command: the racer joins the sandbox's cgroup, which a snapshot freezes
    (cgroup.freeze), so every copy sees a tree nothing changes and succeeds (unfrozen, most fail mid-copy)."""
    usable("overlay")
    host = Path(tempfile.mkdtemp(prefix="tvcache-host-", dir="/dev/shm"))
    (host / "secret").write_bytes(b"host secret")
    (host / "dir").mkdir()

    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation="overlay") as boxes:
            box = await boxes.create()
            await bash(box, RACE_SETUP.format(pairs=PAIRS, host=host))
            cgroup = box._cgroup
            if cgroup is None or cgroup.core is None:
                pytest.skip("no cgroup2 group to freeze here")
            for _ in range(3):
                racer = _start_racer(_race_dir(box))
                try:
                    (cgroup.core / "cgroup.procs").write_text(str(racer.pid))
                    await box.snapshot()  # raises SandboxError if the tree changed during the copy
                    assert racer.poll() is None, "the racer died: it froze nothing"
                finally:
                    racer.kill()
                    racer.wait()
                await bash(box, "rm -rf /testbed/race && " + RACE_SETUP.format(pairs=PAIRS, host=host))

    try:
        run(main())
    finally:
        shutil.rmtree(host)


def test_file_tools_honour_max_output_on_a_huge_directory(base: Path, mode: str) -> None:
    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation=mode, max_output=4096) as boxes:  # type: ignore[arg-type]
            box = await boxes.create()
            await bash(box, "mkdir /testbed/many && cd /testbed/many && touch $(seq -f 'file-%05g' 5000) && mkdir sub")
            listed = (await box.execute(ToolCall("list_dir", {"path": "/testbed/many"}))).output
            assert len(json.dumps(listed)) <= 4096 + 200, len(json.dumps(listed))
            names = sorted([f"file-{i:05d}" for i in range(1, 5001)] + ["sub/"])
            shown = listed["entries"]
            assert shown == names[: len(shown)] and listed["omitted"] == len(names) - len(shown), listed
            small = await box.execute(ToolCall("list_dir", {"path": "/testbed"}))
            assert small.output == {"entries": ["README", "data/", "many/", "src/"]}, small

    run(main())
