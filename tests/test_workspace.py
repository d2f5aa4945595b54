"""Workspace sandboxes, with real overlay mounts and namespaces, in every isolation mode this machine allows.

Every test that takes `mode` runs once per mode that works here (overlay needs root; userns needs user
namespaces; copy needs bind mounts); a mode that cannot work is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bad_calls
from shell_oracle import Listener, bash, cached_rollouts_wrong, out, random_command, rollout_plan, run, uncached
from tvcache import SandboxError, ToolCall
from tvcache.sandboxes.workspace import WorkspaceSandboxes

MODES = ["overlay", "userns", "copy"]
TMP = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _probe_modes() -> dict[str, str | None]:
    """mode -> None if it works here, else why not."""
    base = tempfile.mkdtemp(dir=TMP)
    Path(base, "f").write_text("x")
    found: dict[str, str | None] = {}
    try:
        for mode in MODES:
            try:
                factory = WorkspaceSandboxes(base, isolation=mode)  # type: ignore[arg-type]
                asyncio.run(factory.close())
                found[mode] = None
            except (SandboxError, OSError) as exc:
                found[mode] = str(exc)
    finally:
        shutil.rmtree(base)
    return found


AVAILABLE = _probe_modes()


def usable(mode: str) -> str:
    """`mode`, or a skip saying why it does not work here."""
    reason = AVAILABLE[mode]
    if reason is not None:
        pytest.skip(f"{mode} isolation does not work here: {reason}")
    return mode


@contextlib.contextmanager
def small_base() -> Iterator[Path]:
    """A small task directory: files at the top, a nested one, and a directory to delete."""
    path = Path(tempfile.mkdtemp(prefix="tvcache-ws-base-", dir=TMP))
    (path / "README").write_text("the readme\n")
    (path / "src").mkdir()
    (path / "src" / "main.py").write_text("print('hi')\n")
    (path / "data").mkdir()
    for name in ("a.txt", "b.txt"):
        (path / "data" / name).write_text(f"{name} from base\n")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return usable(str(request.param))


@pytest.fixture
def base() -> Iterator[Path]:
    with small_base() as path:
        yield path


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            full = Path(root, name)
            h.update(str(full.relative_to(path)).encode() + b"\0" + full.read_bytes())
    return h.hexdigest()


def factory_for(base: Path, mode: str, **kw: Any) -> WorkspaceSandboxes:
    return WorkspaceSandboxes(base, isolation=mode, **kw)  # type: ignore[arg-type]


# -- execution ----------------------------------------------------------------------------------------


def test_bash_sees_the_task_at_testbed_with_working_tools(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            assert boxes.mode == mode
            box = await boxes.create()
            assert await bash(box, "pwd; cat README; ls data") == {
                "output": "/testbed\nthe readme\na.txt\nb.txt\n",
                "exit_code": 0,
            }
            # stdout and stderr interleave as written; the exit code is the shell's.
            assert await bash(box, "echo a; echo b >&2; echo c; exit 3") == {"output": "a\nb\nc\n", "exit_code": 3}
            assert (await bash(box, "python3 -c 'print(6*7)'"))["output"] == "42\n"
            assert (await bash(box, "nosuchcommand"))["exit_code"] == 127
            # /tmp, /dev and /proc are the sandbox's own.
            assert await out(box, "ls -A /tmp | wc -l; echo x > /dev/null && echo ok; echo $$") == "0\nok\n1\n"

    run(main())


def test_cwd_and_env_carry_over_and_into_forks(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            await bash(box, "cd src && export GREETING='hello world' QUOTE=\"it's\" && unset HOME")
            state = 'pwd; echo "$GREETING|$QUOTE|${HOME-unset}"; cd - >/dev/null; pwd'
            assert await out(box, 'pwd; echo "$GREETING|$QUOTE|${HOME-unset}"') == (
                "/testbed/src\nhello world|it's|unset\n"
            )
            snap = await box.snapshot()
            fork = await boxes.restore(snap)
            await bash(box, "cd /; export GREETING=changed")  # the original moves on; the fork must not care
            assert await out(fork, state) == "/testbed/src\nhello world|it's|unset\n/testbed\n"
            assert await out(box, "pwd; echo $GREETING") == "/\nchanged\n"
            # A fresh sandbox starts from the initial state, not from anyone's.
            fresh = await boxes.create()
            assert await out(fresh, "pwd; echo ${GREETING-none}; echo $HOME") == "/testbed\nnone\n/root\n"

    run(main())


def test_changed_is_observed(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()

            async def changed(tool: str, **args: str) -> bool | None:
                outcome = await box.execute(ToolCall(tool, args))
                assert not outcome.error
                return outcome.changed

            assert await changed("bash", command="cat README; ls -la /; grep -r hi src") is False
            assert await changed("read_file", path="README") is False
            assert await changed("list_dir", path="data") is False
            assert await changed("bash", command="echo new > data/c.txt") is True
            assert await changed("bash", command="cat data/c.txt") is False  # non-empty upper, unchanged
            assert await changed("bash", command="echo more >> data/c.txt") is True
            assert await changed("bash", command="touch README") is True
            assert await changed("bash", command="cd data") is True
            assert await changed("bash", command="pwd") is False
            assert await changed("bash", command="export X=1") is True
            assert await changed("bash", command="export X=1") is False
            assert await changed("write_file", path="w.txt", content="w") is True
            assert await changed("bash", command="rm /testbed/README") is True
            assert await changed("bash", command="ls /testbed") is False

    run(main())


def test_fast_paths_resolve_inside_the_root(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()

            async def call(tool: str, **args: str) -> Any:
                return (await box.execute(ToolCall(tool, args))).output

            await bash(box, "mkdir -p /secret && echo inside > /secret/s && ln -s /secret/s data/link")
            assert await call("read_file", path="data/link") == {"content": "inside\n"}
            assert await call("read_file", path="../../../../secret/s") == {"content": "inside\n"}
            assert await call("read_file", path="nope") == {"error": "No such file or directory: nope"}
            assert await call("read_file", path="data") == {"error": "Is a directory: data"}
            assert await call("write_file", path="/tmp/x/y/z.txt", content="zz") == {"written": 2}
            assert await out(box, "cat /tmp/x/y/z.txt") == "zz"
            assert await call("list_dir", path="/tmp/x") == {"entries": ["y/"]}
            assert await call("list_dir", path=".") == {"entries": ["README", "data/", "src/"]}
            # Devices and FIFOs could stream or block forever: refused. Big files are cut like bash output.
            await bash(box, "mkfifo /tmp/fifo && head -c 300000 /dev/zero | tr '\\0' y > big")
            assert await call("read_file", path="/dev/zero") == {"error": "Not a regular file: /dev/zero"}
            assert await call("read_file", path="/tmp/fifo") == {"error": "Not a regular file: /tmp/fifo"}
            content = (await call("read_file", path="big"))["content"]
            assert content.startswith("y" * 1000) and "300000 bytes in all" in content and len(content) < 70_000

    run(main())
    assert not Path("/secret/s").exists()


def test_huge_output_is_bounded_with_a_marker(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode, max_output=10_000) as boxes:
            box = await boxes.create()
            result = await bash(box, "head -c 5000000 /dev/zero | tr '\\0' x; echo; echo the-end")
            text = result["output"]
            assert result["exit_code"] == 0
            assert len(text) < 10_200
            assert text.startswith("x" * 5000)
            assert text.endswith("x\nthe-end\n")
            assert "bytes of output omitted: 5000009 bytes in all" in text

    run(main())


def test_timeout_kills_everything_and_keeps_the_sandbox(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode, timeout=1.0) as boxes:
            box = await boxes.create()
            await bash(box, "cd data")
            outcome = await box.execute(ToolCall("bash", {"command": "echo started; cd /; sleep 1234.25"}))
            assert outcome.error and outcome.changed is None
            assert isinstance(outcome.output, dict)
            assert outcome.output["output"] == "started\n" and "timed out" in outcome.output["error"]
            assert not _host_processes_with("1234.25")
            assert await out(box, "pwd") == "/testbed/data\n"  # the state before the failed call

    run(main())


# -- isolation ----------------------------------------------------------------------------------------


def _host_processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def test_nothing_outside_the_root_is_writable(base: Path, mode: str) -> None:
    outside = Path(tempfile.mkdtemp(prefix="tvcache-ws-outside-", dir="/var/tmp"))
    (outside / "keep").write_text("host\n")
    before = tree_digest(base)

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            await bash(box, f"echo changed > {outside}/keep; echo new > {outside}/new; echo x > /etc/tvcache-test")
            await bash(box, "echo changed > README; rm -rf data; mkdir /proc/x /sys/x 2>/dev/null")
            # A chroot escape needs CAP_SYS_CHROOT, and mounting CAP_SYS_ADMIN: both are gone.
            escape = await out(box, "mkdir -p e && chroot e true 2>&1; mount -t tmpfs none /tmp 2>&1; mknod d b 7 0")
            assert "cannot change root directory to 'e': Operation not permitted" in escape
            assert "mount: /tmp: permission denied" in escape
            assert "mknod: d: Operation not permitted" in escape
            assert await out(box, "ls -A /testbed") == "README\ne\nsrc\n"

    try:
        run(main())
        assert (outside / "keep").read_text() == "host\n"
        assert not (outside / "new").exists()
        assert not Path("/etc/tvcache-test").exists()
        assert tree_digest(base) == before
    finally:
        shutil.rmtree(outside)


@pytest.fixture(scope="module")
def mini_rootfs() -> Iterator[Path]:
    """A tiny root filesystem (bash, coreutils' rm/ls/cat and their libraries), so `rm -rf /` finishes fast."""
    root = Path(tempfile.mkdtemp(prefix="tvcache-ws-rootfs-", dir=TMP))
    (root / "bin").mkdir()
    for tool in ("bash", "rm", "ls", "cat"):
        binary = shutil.which(tool)
        assert binary is not None
        shutil.copy2(binary, root / "bin" / tool)
        for line in subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout.splitlines():
            lib = next((w for w in line.split() if w.startswith("/")), None)
            if lib is not None:
                dest = root / lib.lstrip("/")
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(os.path.realpath(lib), dest)
    os.symlink("bash", root / "bin" / "sh")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_rm_rf_root_breaks_only_its_own_sandbox(base: Path, mode: str, mini_rootfs: Path) -> None:
    before = tree_digest(base), tree_digest(mini_rootfs)

    async def main() -> None:
        async with factory_for({"/": mini_rootfs, "/testbed": base}, mode) as boxes:  # type: ignore[arg-type]
            box = await boxes.create()
            await bash(box, "echo kept > data/c.txt")
            snap = await box.snapshot()
            neighbour = await boxes.create()
            await bash(box, "rm -rf --no-preserve-root / 2>/dev/null; echo gone")
            # bash itself is gone there: the command cannot start, a failure of the sandbox, never an answer.
            gone = await box.execute(ToolCall("bash", {"command": "ls /testbed"}))
            assert gone.error and "could not start the command" in str(gone.output), gone
            assert await out(neighbour, "cat data/a.txt; ls /bin") == "a.txt from base\nbash\ncat\nls\nrm\nsh\n"
            again = await boxes.restore(snap)
            assert await out(again, "cat data/c.txt README") == "kept\nthe readme\n"

    run(main())
    assert (tree_digest(base), tree_digest(mini_rootfs)) == before


def test_a_root_made_of_image_layers(base: Path, mode: str, mini_rootfs: Path) -> None:
    """What `from_image` builds on: "/" mapped to layer directories, bottom first, whose whiteouts delete what
    lies below, with the image's environment and working directory."""
    if os.geteuid() != 0:
        pytest.skip("a whiteout is a device node: making one needs root")
    top = Path(tempfile.mkdtemp(prefix="tvcache-ws-layer-", dir=TMP))
    try:
        (top / "app").mkdir()
        (top / "app" / "main.txt").write_text("from the top layer\n")
        (top / "bin").mkdir()
        os.mknod(top / "bin" / "ls", stat.S_IFCHR, 0)  # deletes /bin/ls of the layer below

        async def main() -> None:
            env = {"PATH": "/bin", "GREETING": "hi"}
            async with factory_for({"/": [mini_rootfs, top]}, mode, env=env, cwd="/app") as boxes:  # type: ignore[arg-type]
                box = await boxes.create()
                assert await out(box, 'pwd; cat main.txt; echo "$GREETING"; echo /bin/*') == (
                    "/app\nfrom the top layer\nhi\n/bin/bash /bin/cat /bin/rm /bin/sh\n"
                )

        run(main())
    finally:
        shutil.rmtree(top)


def test_no_process_outlives_its_command(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            spawn = "sleep 4321.5 & disown; setsid nohup sleep 4321.5 >/dev/null 2>&1 & (sleep 4321.5 &) ; echo ok"
            assert await out(box, spawn) == "ok\n"
            assert not _host_processes_with("4321.5")
            assert await out(box, "ps -e -o comm=") == "bash\nps\n"  # a new PID namespace, nothing left

    run(main())


def test_fork_bomb_is_contained(base: Path, mode: str) -> None:
    # A name of this test's own: other processes (a pytest -k fork_bomb, a concurrent run) must not count.
    bomb = f"bomb_{uuid.uuid4().hex}"

    async def main() -> None:
        async with factory_for(base, mode, timeout=4.0, max_processes=200) as boxes:
            box = await boxes.create()
            command = f"{bomb}() {{ {bomb} | {bomb} & }}; {bomb}; sleep 1; echo survived"
            outcome = await box.execute(ToolCall("bash", {"command": command}))
            assert isinstance(outcome.output, dict)
            if box._cgroup is not None:  # capped by the sandbox's pids cgroup, else only by the timeout
                assert "Resource temporarily unavailable" in outcome.output["output"]
            assert await out(box, "echo alive") == "alive\n"

    run(main())
    # The host can still start processes, and none of the bomb's are left.
    assert subprocess.run(["true"]).returncode == 0
    assert not _host_processes_with(bomb)


def test_network_is_cut_unless_asked_for(base: Path, mode: str) -> None:
    listener = Listener()
    connect = f"exec 3<>/dev/tcp/127.0.0.1/{listener.port} && head -1 <&3"

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            assert (await bash(box, connect))["exit_code"] != 0
            assert await out(box, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '") == "lo\n"
            # Loopback is up inside: a server there is reachable there.
            serve = textwrap.dedent("""\
                python3 -c 'import socket
                s = socket.socket(); s.bind(("127.0.0.1", 8765)); s.listen(); print("up", flush=True)
                c, _ = s.accept(); c.sendall(b"inner\\n")' &
                for i in $(seq 300); do { exec 3<>/dev/tcp/127.0.0.1/8765; } 2>/dev/null && break; sleep 0.05; done
                head -1 <&3""")
            assert await out(box, serve) == "up\ninner\n"
        async with factory_for(base, mode, network=True) as boxes:
            box = await boxes.create()
            assert await out(box, connect) == "hello from the host\n"

    try:
        run(main())
    finally:
        listener.sock.close()


# -- filesystem layers --------------------------------------------------------------------------------


def test_whiteouts_and_opaque_dirs_across_forks(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            await bash(box, "rm README && rm -r data && mkdir data && echo fresh > data/new.txt")
            first = await boxes.restore(await box.snapshot())
            listing = "ls -A; ls -A data"
            assert await out(first, listing) == "data\nsrc\nnew.txt\n"
            await bash(first, "echo back > README && rm data/new.txt && mv src lib")
            second = await boxes.restore(await first.snapshot())
            assert await out(second, listing + "; cat README; ls lib") == "README\ndata\nlib\nback\nmain.py\n"
            assert await out(box, listing) == "data\nsrc\nnew.txt\n"  # the original is untouched by its forks
            assert await out(await boxes.create(), listing) == "README\ndata\nsrc\na.txt\nb.txt\n"

    run(main())


def test_snapshot_chains_and_layers_freed(base: Path, mode: str) -> None:
    if mode == "copy":
        pytest.skip("copy mode keeps full copies, not layers")
    steps = [
        "echo 1 > one",
        "rm README",
        "mkdir -p deep/er && echo 2 > deep/er/two",
        "rm -r data && mkdir data && echo 3 > data/three",
        "echo again > README",
        "mv deep/er/two deep/two && rmdir deep/er",
        "ln -s one soft && echo 4 >> one",
        "rm -r src",
        "mkdir src && echo 5 > src/five",
        "chmod 600 one",
    ]
    show = "find . | sort; cat one soft README data/* src/* deep/two; stat -c '%n %a %h %F' one soft deep"

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            snaps = []
            for step in steps:
                await bash(box, step)
                snaps.append(await box.snapshot())
            oracle = await boxes.create()
            for step in steps:
                await bash(oracle, step)
            expected = await out(oracle, show)
            assert await out(box, show) == expected
            assert await out(await boxes.restore(snaps[-1]), show) == expected
            assert await out(await boxes.restore(snaps[4]), "cat README; ls data") == "again\nthree\n"
            for snap in snaps:
                await boxes.delete(snap)
            await boxes.delete(snaps[0])  # deleting twice is harmless
            with pytest.raises(SandboxError, match="does not exist"):
                await boxes.restore(snaps[0])
            held = boxes.layer_count
            for live in list(boxes._live):
                await live.close()
            assert boxes.layer_count == 0 < held
            assert os.listdir(boxes._run.path / "layers") == []

    run(main())


def test_snapshot_of_an_unchanged_sandbox_adds_no_layer(base: Path, mode: str) -> None:
    if mode == "copy":
        pytest.skip("copy mode keeps full copies, not layers")

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            await bash(box, "echo x > x")
            await box.snapshot()
            layers = boxes.layer_count
            await bash(box, "cat x; cd src")  # changes the state but not the files
            snap = await box.snapshot()
            assert boxes.layer_count == layers
            assert await out(await boxes.restore(snap), "pwd; cat ../x") == "/testbed/src\nx\n"

    run(main())


def test_a_failed_snapshot_leaves_the_sandbox_as_it_was(base: Path, mode: str) -> None:
    """Layers live in `tmp`; a snapshot that cannot be written there (full) fails, and the sandbox goes on with
    its own changes, as if no snapshot had been asked for."""
    if mode == "copy" or os.geteuid() != 0:
        pytest.skip("needs root (to mount a small tmp) and a layered mode")
    tmp = Path(tempfile.mkdtemp(prefix="tvcache-ws-smalltmp-", dir=TMP))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tvcache-test", str(tmp)], check=True)
    try:

        async def main() -> None:
            async with factory_for(base, mode, tmp=tmp, disk=64 << 20) as boxes:
                box = await boxes.create()
                await bash(box, "head -c 12000000 /dev/zero > big && echo small > small")
                with pytest.raises(SandboxError, match=r"could not snapshot the sandbox: .*No space left"):
                    await box.snapshot()
                assert await out(box, "wc -c < big; cat small") == "12000000\nsmall\n"
                await bash(box, "rm big")
                again = await boxes.restore(await box.snapshot())
                assert await out(again, "ls; cat small") == "README\ndata\nsmall\nsrc\nsmall\n"

        run(main())
    finally:
        subprocess.run(["umount", "-l", str(tmp)], check=False)
        tmp.rmdir()


def test_mount2_fallback_for_kernels_without_lowerdir_plus(base: Path) -> None:
    """Before Linux 6.8 overlays are mounted with mount(2) and one option string; forced here."""
    if AVAILABLE["overlay"] is not None:
        pytest.skip("needs overlay isolation")

    async def main() -> None:
        async with WorkspaceSandboxes(base, isolation="overlay") as boxes:
            boxes._mounter._ops.new_api = False  # type: ignore[attr-defined]
            box = await boxes.create()
            for i in range(6):
                await bash(box, f"echo {i} >> log && rm -f data/a.txt")
                box = await boxes.restore(await box.snapshot())
            assert await out(box, "cat log; ls data") == "0\n1\n2\n3\n4\n5\nb.txt\n"
            assert boxes._mounter._ops.new_api is False  # type: ignore[attr-defined]

    run(main())


# -- the oracle invariant ------------------------------------------------------------------------------


def test_a_directory_lists_in_the_same_order_after_snapshots(base: Path, mode: str) -> None:
    """`find`, `ls -f` and `os.listdir` print a directory in the order the filesystem lists it, not sorted. A
    directory lists the same after snapshots and restores as in the uncached history, also one written on both
    sides of a snapshot (the last step)."""
    steps = [
        "mkdir -p /tmp/r/src/p && touch /tmp/r/src/__init__.py /tmp/r/a /tmp/r/b && echo x > /tmp/r/src/p/f.py",
        "mkdir /tmp/s && touch /tmp/s/3 /tmp/s/1 /tmp/s/2",
        "mkdir /testbed/new && touch /testbed/new/y /testbed/new/x",
        "touch /tmp/s/0 /testbed/new/z /tmp/r/c",
    ]
    show = "find /tmp/r /tmp/s /testbed/new; ls -f /tmp/s; python3 -c 'import os; print(os.listdir(\"/tmp/r\"))'"

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            oracle = await boxes.create()
            for step in steps:
                await bash(oracle, step)
            expected = await out(oracle, show)
            box = await boxes.create()
            for step in steps:
                await bash(box, step)
                box = await boxes.restore(await box.snapshot())
            assert await out(box, show) == expected

    run(main())


def test_snapshot_restore_then_continue_equals_fresh_history(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            for seed in range(2):
                rng = random.Random(seed)
                trunk = [random_command(rng) for _ in range(10)]
                box = await boxes.create()
                snaps = []
                for i, command in enumerate(trunk):
                    await bash(box, command)
                    if rng.random() < 0.5:
                        snaps.append((i + 1, await box.snapshot()))
                for cut, snap in rng.sample(snaps, min(2, len(snaps))):
                    fork = await boxes.restore(snap)
                    branch = [random_command(rng) for _ in range(5)]
                    got = [await bash(fork, c) for c in branch]
                    expected = await uncached(boxes, trunk[:cut] + branch)
                    assert got == expected[cut:], (trunk[:cut], branch)
                    await fork.close()
                await box.close()

    run(main())


def test_cache_results_equal_fresh_history(base: Path) -> None:
    """Concurrent rollouts through tvcache.ToolCache: each result equals the uncached full history."""
    if AVAILABLE["overlay"] is not None and AVAILABLE["userns"] is not None:
        pytest.skip("needs overlay or userns isolation")

    async def main() -> int:
        async with WorkspaceSandboxes(base) as boxes:
            return await cached_rollouts_wrong(boxes, boxes, rollout_plan(7, 4, 6), rounds=2)

    assert run(main()) == 0


# -- cleanup, errors, fingerprint ----------------------------------------------------------------------


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


def test_close_removes_everything(base: Path, mode: str) -> None:
    async def main() -> Path:
        boxes = factory_for(base, mode)
        run_dir = boxes._run.path
        box = await boxes.create()
        await bash(box, "echo x > x")
        await box.snapshot()
        await boxes.restore(await box.snapshot())
        # The host's mount table never holds a sandbox's mounts: they live in namespaces of their own.
        assert not _mounts_under(run_dir)
        assert await out(box, "cat x") == "x\n"
        await box.close()
        await boxes.close()
        with pytest.raises(SandboxError, match="closed"):
            await boxes.create()
        return run_dir

    run_dir = run(main())
    assert not run_dir.exists()
    assert not _mounts_under(run_dir)


def test_a_crashed_process_is_cleaned_up_by_the_next(base: Path, mode: str) -> None:
    crash = textwrap.dedent(f"""\
        import asyncio, os
        from tvcache import ToolCall
        from tvcache.sandboxes.workspace import WorkspaceSandboxes
        async def main():
            boxes = WorkspaceSandboxes({str(base)!r}, isolation={mode!r})
            box = await boxes.create()
            await box.execute(ToolCall("bash", {{"command": "echo x > x"}}))
            await boxes.restore(await box.snapshot())
            print(boxes._run.path, flush=True)
            os._exit(1)  # no cleanup at all
        asyncio.run(main())
        """)
    proc = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=60)
    run_dir = Path(proc.stdout.strip())
    assert run_dir.is_dir(), proc.stderr
    run(factory_for(base, mode).close())  # a new factory reaps what the dead process left
    assert not run_dir.exists()
    assert not _mounts_under(run_dir)


def test_bad_input_gets_clear_errors(base: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        WorkspaceSandboxes(base / "missing")
    with pytest.raises(ValueError, match="absolute"):
        WorkspaceSandboxes({"testbed": base})
    with pytest.raises(ValueError, match="isolation"):
        WorkspaceSandboxes(base, isolation="docker")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        WorkspaceSandboxes(42)  # type: ignore[arg-type]

    async def main() -> None:
        async with WorkspaceSandboxes(base) as boxes:
            await boxes.create()
            with pytest.raises(SandboxError, match="does not exist"):
                await boxes.restore("nope")

    run(main())


def test_a_models_bad_calls_are_answers_and_the_sandbox_goes_on(base: Path) -> None:
    async def main() -> Any:
        async with WorkspaceSandboxes(base) as boxes:
            await bad_calls.check(boxes, bad_calls.SHELL, *bad_calls.SHELL_STATE)
            return (await (await boxes.create()).execute(ToolCall("bash", {"cmd": "ls"}))).output

    answer = run(main())
    assert answer == {"error": 'bash needs a string argument \'command\', got args bash {"cmd":"ls"}'}


def test_mapping_base_and_fingerprint(base: Path) -> None:
    other = Path(tempfile.mkdtemp(prefix="tvcache-ws-other-", dir=TMP))
    (other / "lib.txt").write_text("lib\n")
    try:

        async def main() -> None:
            async with WorkspaceSandboxes({"/srv/app": base, "/opt/lib": [other, base / "src"]}) as boxes:
                box = await boxes.create()
                assert await out(box, "pwd; ls /opt/lib; cat README") == "/srv/app\nlib.txt\nmain.py\nthe readme\n"

        run(main())

        def fingerprint(**kw: Any) -> str:
            boxes = WorkspaceSandboxes(base, **kw)
            try:
                return boxes.fingerprint
            finally:
                run(boxes.close())

        same = fingerprint()
        assert fingerprint() == same
        assert fingerprint(network=True) != same
        (base / "data" / "a.txt").write_text("changed size\n")
        assert fingerprint() != same
    finally:
        shutil.rmtree(other)


PID_NAMESPACE_SCRIPT = """
import asyncio, json, os, sys
from tvcache import SandboxError, ToolCall
from tvcache.sandboxes.workspace import WorkspaceSandboxes

async def main():
    try:
        boxes = WorkspaceSandboxes(sys.argv[1], isolation=sys.argv[2])
    except SandboxError as exc:
        return {"error": str(exc)}
    async with boxes:
        box = await boxes.create()
        return (await box.execute(ToolCall("bash", {"command": "cat README; echo $$"}))).output

print(json.dumps({"pid": os.getpid(), "result": asyncio.run(main())}))
"""


def test_a_pid_namespace_without_its_own_proc_is_refused_clearly(base: Path, mode: str) -> None:
    """`unshare --pid --fork` without `--mount-proc`: this process is pid 1 and /proc is the machine's, where pid 1
    is another process. bubblewrap then opens its children's namespaces by pids /proc does not know (it failed
    with "open /proc/11/ns/ns", or worked when another process had that pid), so the factory refuses, saying why."""
    import pidns

    own = pidns.run_python(PID_NAMESPACE_SCRIPT, str(base), mode, namespace=True)
    assert own == {"pid": 1, "result": {"output": "the readme\n1\n", "exit_code": 0}}  # with its own /proc
    machines = pidns.run_python(PID_NAMESPACE_SCRIPT, str(base), mode, namespace=True, own_proc=False)
    assert machines["pid"] == 1 and "/proc belongs to another PID namespace" in machines["result"]["error"]
