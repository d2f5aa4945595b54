"""Change detection from the kernel's account (fanotify, see workspace._changes), in every isolation mode here.

The oracle for "did this call change the files" is the full walk that detection used before (`_layers.listing` of
the tree the sandbox writes into, which is O(files)) plus a digest of every file's bytes: whenever either says the
files changed, the events must say so too (soundness); read-only commands must stay unchanged (precision). Each
verdict is also checked with fanotify switched off, so the fallback keeps working.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from shell_oracle import run
from test_workspace import MODES, factory_for, small_base, usable
from tvcache import SandboxError, ToolCall
from tvcache.sandboxes._layers import listing
from tvcache.sandboxes.workspace import _changes

#: A mapping of three bytes, one written through it: no FAN_MODIFY, only the close of the file opened for writing.
MMAP = "import mmap, os; fd = os.open('data/c.txt', os.O_RDWR); m = mmap.mmap(fd, 3); m[{}:{}] = b'{}'"

#: Commands and whether they change the files (None: they may, the verdict must be True if the oracle says so).
COMMANDS: list[tuple[str, bool | None]] = [
    ("cat README; ls -la /testbed; grep -r hi src; stat data", False),
    ("echo new > data/c.txt", True),
    ("cat data/c.txt; head -c 3 data/c.txt >/dev/null", False),
    ("echo more >> data/c.txt", True),
    (f'python3 -c "{MMAP.format(0, 1, "X")}"', True),
    # The mapping held by a process the kernel kills when the shell exits (the PID namespace goes down).
    (f'python3 -c "{MMAP.format(1, 2, "Y")}; os.close(fd); import time; time.sleep(60)" & sleep 0.5', True),
    ("touch -d @1000000000 README", True),
    ("chmod 600 src/main.py", True),
    ("setfattr -n user.k -v v data/a.txt", True),
    ("mkdir -p d/e/f && ln -s ../README d/e/link && ln data/c.txt d/hard", True),
    ("mv d dd", True),
    ("rm -rf dd", True),
    ("touch data/.tmp && rm data/.tmp", True),  # only a directory's times change
    ("ls -laR /testbed >/dev/null; find / -xdev -name nothing 2>/dev/null", False),
    ("rm README", True),
    ("truncate -s 0 data/c.txt", True),
    ("mkfifo p; python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"s\")'", True),
]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return usable(str(request.param))


def _files(root: str) -> str:
    """Every regular file's path and bytes under `root` (what a listing does not read)."""
    h = hashlib.blake2b(digest_size=16)
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            h.update(path.encode())
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def _oracle(box: Any) -> tuple[str, str]:
    where = box._fs.scratch()
    return listing(where), _files(where)


@pytest.mark.parametrize("kernel", [True, False], ids=["fanotify", "walk"])
def test_changed_is_sound_and_precise(mode: str, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernel:
        monkeypatch.setattr(_changes.Watcher, "watch", lambda self, path: None)

    async def main() -> None:
        with small_base() as base:
            async with factory_for(base, mode) as boxes:
                box = await boxes.create()
                if kernel and os.geteuid() == 0:
                    why_not = boxes._ctx.isolation.changes.why_not
                    if "Too many open files" in why_not:  # the user's 128 fanotify groups, machine-wide, are taken
                        pytest.skip(why_not)
                    assert box._fs._watch is not None, why_not
                before = await asyncio.to_thread(_oracle, box)
                for command, expected in COMMANDS:
                    outcome = await box.execute(ToolCall("bash", {"command": command}))
                    assert not outcome.error, outcome
                    after = await asyncio.to_thread(_oracle, box)
                    if after != before:
                        assert outcome.changed, f"{command!r} changed the files, unseen"
                    if expected is not None:
                        assert outcome.changed is expected, command
                    before = after
                # Neither a snapshot nor a restore counts as a change of the sandbox it copies from or into.
                snap = await box.snapshot()
                assert (await box.execute(ToolCall("bash", {"command": "cat data/c.txt"}))).changed is False
                other = await boxes.restore(snap)
                assert (await other.execute(ToolCall("bash", {"command": "ls -la; cat data/c.txt"}))).changed is False
                assert (await other.execute(ToolCall("write_file", {"path": "w", "content": "w"}))).changed is True

    run(main())


def test_a_lost_account_counts_as_a_change(mode: str) -> None:
    """More events than the kernel queues (16,384): the overflow says "anything may have changed" for every sandbox
    of the factory, and the sandboxes go on being watched."""

    async def main() -> None:
        with small_base() as base:
            async with factory_for(base, mode) as boxes:
                busy, quiet = await boxes.create(), await boxes.create()
                if busy._fs._watch is None:
                    pytest.skip("fanotify is not used here")
                many = "mkdir many && cd many && python3 -c 'import os\nfor i in range(20000): open(str(i), \"w\")'"
                assert (await busy.execute(ToolCall("bash", {"command": many}))).changed is True
                # Nothing changed in `quiet`, but its share of the account was lost with the rest.
                assert (await quiet.execute(ToolCall("bash", {"command": "true"}))).changed is True
                for box in (busy, quiet):
                    assert (await box.execute(ToolCall("bash", {"command": "true"}))).changed is False
                    assert (await box.execute(ToolCall("bash", {"command": "echo x > y"}))).changed is True

    run(main())


def test_the_sandboxes_of_a_factory_are_told_apart(mode: str) -> None:
    async def main() -> None:
        with small_base() as base:
            async with factory_for(base, mode) as boxes:
                a, b = await boxes.create(), await boxes.create()
                assert (await a.execute(ToolCall("bash", {"command": "echo x > a"}))).changed is True
                assert (await b.execute(ToolCall("bash", {"command": "cat README"}))).changed is False
                await a.close()
                c = await boxes.create()
                assert (await c.execute(ToolCall("bash", {"command": "cat README"}))).changed is False
                assert (await b.execute(ToolCall("bash", {"command": "echo y > b"}))).changed is True

    run(main())


def test_batches_merge_and_bound_their_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_changes, "MAX_ENTRIES", 2)
    first, later = _changes.Batch(), _changes.Batch()
    first.add(b"d", b"a", _changes.FAN_CREATE)
    later.add(b"d", b"a", _changes.FAN_MODIFY)
    first.merge(later)
    assert first.events == 2 and first.entries == {(b"d", b"a"): _changes.FAN_CREATE | _changes.FAN_MODIFY}
    for name in (b"b", b"c"):
        first.add(b"d", name, _changes.FAN_CREATE)
    assert first.events == 4 and first.entries is None and not first.lost


def test_no_fanotify_here_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """fanotify_init refused (as without CAP_SYS_ADMIN): the watcher says why and watches nothing."""
    monkeypatch.setattr(_changes._libc, "fanotify_init", lambda flags, event_flags: -1)
    watcher = _changes.Watcher()
    assert watcher.fd is None and watcher.why_not.startswith("fanotify_init")
    assert watcher.watch(str(Path("/dev/shm"))) is None


@pytest.mark.skipif(not os.environ.get("TVCACHE_MILLION"), reason="minutes: set TVCACHE_MILLION=1")
def test_a_million_inodes(mode: str) -> None:
    """A sandbox fills its quota's million inodes: every call answers an Outcome, the account of changes is lost and
    found again, snapshot and restore work (or raise SandboxError), list_dir stays within max_output."""
    fill = (
        "python3 -c 'import os\n"
        "for d in range(10):\n"
        '    os.makedirs(f"m/{d}", exist_ok=True)\n'
        '    for i in range(100_000): open(f"m/{d}/{i}", "w").close()\''
    )

    async def main() -> None:
        with small_base() as base:
            async with factory_for(base, mode, timeout=1800) as boxes:
                box = await boxes.create()
                filled = await box.execute(ToolCall("bash", {"command": fill}))
                assert filled.changed is True, filled
                assert (await box.execute(ToolCall("bash", {"command": "true"}))).changed is False
                listed = await box.execute(ToolCall("list_dir", {"path": "m/0"}))
                assert size(listed.output) <= boxes.max_output + 64 and listed.output["omitted"] > 0
                count = await box.execute(ToolCall("bash", {"command": "find m -type f | wc -l"}))
                files = int(count.output["output"])
                assert files > 900_000, count
                try:
                    snap = await box.snapshot()
                except SandboxError:
                    return
                assert (await box.execute(ToolCall("bash", {"command": "touch m/0/0"}))).changed is True
                await box.snapshot()  # a delta on the million files
                try:
                    other = await boxes.restore(snap)
                except SandboxError:
                    return
                again = await other.execute(ToolCall("bash", {"command": "find m -type f | wc -l"}))
                assert int(again.output["output"]) == files

    run(main())


def size(answer: Any) -> int:
    return len(json.dumps(answer, ensure_ascii=False).encode())
