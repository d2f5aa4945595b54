"""Issue 19's held-out check, written as an attacker would run it, apart from the tests that came with the fixes.

Against every sandbox kind that runs a shell: workspace sandboxes in each isolation mode that works here, Docker
sandboxes, and both through `tvcache sandbox-server` + `RemoteSandboxes`:

- the survivor: a PID 1 that clears its parent-death signal and ignores signals, at a timeout and left behind by
  a command that returned; nothing of it may outlive the call;
- the race: a command that swaps files and directories with symlinks to host files, a host directory and
  `/proc/self/environ` (`renameat2(RENAME_EXCHANGE)`) while a snapshot is taken; no host byte may reach a snapshot
  (on Docker also with the racer on the host, in the container's upper dir, as a survivor would be);
- deep trees (10,000 levels; 2,500 in some kinds, see `levels`) and paths past PATH_MAX, also as the shell's
  working directory: every call is an Outcome, a snapshot works or raises SandboxError, nothing else raises, and
  the next factory removes what a killed process left;
- `ls -la` across a snapshot, with sockets, capabilities, xattrs, whiteouts, opaque directories, hard links: what
  a sandbox restored after any step prints equals what a fresh one printed uncached, also through a ToolCache;
- a slowloris against `tvcache serve` and `tvcache sandbox-server` under `ulimit -n 1024`.

The commands use only bash, coreutils, perl (perl-base is in every Debian root) and the attr/libcap tools, which
the Docker image gets from the host (tests/test_docker_fidelity.py's image).
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import tvcache
from server_helpers import SandboxServer, Server
from shell_oracle import run
from test_workspace import AVAILABLE, MODES
from tvcache import Outcome, SandboxError, ToolCall

TOKEN = "issue19-check-token"
KINDS = [*MODES, "docker", "remote-workspace", "remote-docker"]
#: Seconds per call where a test makes a command time out (elsewhere: 120, so a loaded machine times out nothing).
TIMEOUT = 3.0
#: An environment variable of every process that makes snapshots here (this one, the sandbox servers): what
#: `/proc/self/environ` of the copier would hand a racer.
SECRET_VAR = "TVCACHE_ISSUE19_SECRET"


@pytest.fixture(scope="module")
def secret() -> Iterator[str]:
    value = "env-secret-" + secrets.token_hex(8)
    old = os.environ.get(SECRET_VAR)
    os.environ[SECRET_VAR] = value
    try:
        yield value
    finally:
        if old is None:
            del os.environ[SECRET_VAR]
        else:
            os.environ[SECRET_VAR] = old


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest) -> str:
    """The same task as a Docker image (tests/test_docker_fidelity.py's, which has the attr and libcap tools)."""
    pytest.importorskip("aiodocker", reason="the docker extra is not installed")
    return str(request.getfixturevalue("fuzz_image"))


# The Docker image fixtures, by name.
from docker_env import docker_base_fixture, docker_root, docker_tmp_fixture  # noqa: E402, F401
from test_docker_fidelity import fuzz_image  # noqa: E402, F401
from test_snapshot_fidelity import workspace  # noqa: E402, F401  (the task at /testbed, as the image has it)


def task(kind: str, request: pytest.FixtureRequest) -> tuple[str, Path]:
    """Where `kind`'s sandboxes start (the base directory or the image; a skip where `kind` cannot run here), and a
    directory of the test's own for their `tmp`: on tmpfs for workspaces (overlayfs refuses upper dirs on the root
    filesystem, their lower layer), on the daemon's filesystem for Docker, anywhere for a server's files."""
    if kind in MODES and AVAILABLE[kind] is not None:
        pytest.skip(f"{kind} isolation does not work here: {AVAILABLE[kind]}")
    where = str(request.getfixturevalue("image" if "docker" in kind else "workspace"))
    tmp = {"docker": "docker_tmp", "remote-workspace": "tmp_path", "remote-docker": "tmp_path"}.get(kind, "shm_tmp")
    return where, Path(request.getfixturevalue(tmp))


@pytest.fixture
def shm_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tvcache-test-tmp-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def sandboxes(kind: str, where: str, tmp: Path, timeout: float = 120) -> AsyncIterator[Any]:
    """A factory of `kind` whose sandboxes start at the task `where` (see `task`), with `timeout` per call."""
    if kind in MODES:
        from tvcache.sandboxes.workspace import WorkspaceSandboxes

        async with WorkspaceSandboxes(where, isolation=kind, timeout=timeout, tmp=tmp) as boxes:  # type: ignore[arg-type]
            yield boxes
    elif kind == "docker":
        from tvcache.sandboxes.docker import DockerSandboxes

        async with DockerSandboxes(where, timeout=timeout, tmp=tmp) as boxes:
            yield boxes
    else:
        sandbox = ["--sandbox", kind.removeprefix("remote-"), "--base" if kind == "remote-workspace" else "--image"]
        with SandboxServer(tmp, [*sandbox, where, "--timeout", str(timeout)], TOKEN) as server:
            boxes = tvcache.RemoteSandboxes(server.url, token=TOKEN)
            try:
                yield boxes
            finally:
                await boxes.close()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, secret: str) -> str:
    return str(request.param)


async def call(box: Any, command: str) -> Outcome:
    outcome = await box.execute(ToolCall("bash", {"command": command}))
    assert isinstance(outcome, Outcome)
    return outcome


async def output(box: Any, command: str) -> str:
    outcome = await call(box, command)
    assert not outcome.error, outcome
    return str(outcome.output["output"])


def running(token: str) -> list[int]:
    """Processes on this machine (in any container or sandbox) whose command line holds `token`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if token.encode() in f.read():
                found.append(int(pid))
    return found


def gone(token: str) -> bool:
    for _ in range(300):  # a PID namespace's or a container's processes die asynchronously: a moment, no deadline
        if not running(token):
            return True
        time.sleep(0.01)
    return False


# -- the survivor ------------------------------------------------------------------------------------------

#: Clears its parent-death signal (prctl is system call 157 on x86-64), ignores what it can, runs until killed.
SURVIVOR = """cat > /tmp/survivor.pl <<'EOF'
syscall(157, 1, 0, 0, 0, 0);
$SIG{$_} = "IGNORE" for qw(TERM HUP INT QUIT);
sleep 1 while 1;
EOF
"""


def test_the_survivor_dies_at_the_timeout_and_after_a_command_that_returned(
    kind: str, request: pytest.FixtureRequest
) -> None:
    where, tmp = task(kind, request)
    if os.uname().machine != "x86_64":
        pytest.skip("the survivor calls prctl by its x86-64 number")
    at_timeout, left_behind = (f"survivor-{secrets.token_hex(6)}" for _ in range(2))

    async def main() -> None:
        async with sandboxes(kind, where, tmp, TIMEOUT) as boxes:
            box = await boxes.create()
            await output(box, SURVIVOR)
            outcome = await call(box, f"exec perl /tmp/survivor.pl {at_timeout}")
            assert outcome.error and "timed out" in str(outcome.output), outcome
            assert gone(at_timeout), f"the command's PID 1 outlived its timeout: {running(at_timeout)}"
            # In a new session, double-forked, output closed: the command itself returns at once.
            command = f"(setsid perl /tmp/survivor.pl {left_behind} </dev/null >/dev/null 2>&1 &); echo started"
            assert await output(box, command) == "started\n"
            assert gone(left_behind), f"a process the command started outlived it: {running(left_behind)}"
            assert await output(box, "echo after") == "after\n"
            other = await boxes.restore(await box.snapshot())
            assert await output(other, "echo restored") == "restored\n"

    run(main())


# -- the race ------------------------------------------------------------------------------------------------

PAIRS = 300
#: In /testbed/race: PAIRS files with as many symlinks to the host's secret file or /proc/self/environ, and PAIRS
#: directories with as many symlinks to a host directory.
RACE_SETUP = """perl -e '
mkdir "/testbed/race" or die; chdir "/testbed/race" or die;
for my $i (0 .. {pairs} - 1) {{
    open my $f, ">", "f$i" or die; print $f "sandbox\\n"; close $f;
    symlink(($i % 2 ? "/proc/self/environ" : "{host}/secret"), "l$i") or die;
    mkdir "d$i" or die; open $f, ">", "d$i/x" or die; print $f "sandbox\\n"; close $f;
    symlink("{host}/dir", "h$i") or die;
}}'"""
#: Swaps every pair with renameat2(RENAME_EXCHANGE) (system call 316 on x86-64) until killed.
RACER = """perl -e 'chdir "/testbed/race" or die; while (1) {{ for my $i (0 .. {pairs} - 1) {{
    syscall(316, -100, "f$i", -100, "l$i", 2); syscall(316, -100, "d$i", -100, "h$i", 2) }} }}' {token}"""
#: What a snapshot must not hold: any file (symlinks not followed) with a host secret, a host directory's entry.
LEAKS = "grep -rlF -e {a} -e {b} /testbed /tmp 2>/dev/null; find /testbed -name 'host-only*' 2>/dev/null; true"


@pytest.fixture
def host_secrets(secret: str) -> Iterator[tuple[Path, str]]:
    host = Path(tempfile.mkdtemp(prefix="tvcache-i19-host-", dir="/dev/shm"))
    host.chmod(0o755)
    token = "host-secret-" + secrets.token_hex(8)
    (host / "secret").write_text(token + "\n")
    (host / "dir").mkdir()
    (host / "dir" / "host-only-file").write_text(token + "\n")
    try:
        yield host, token
    finally:
        shutil.rmtree(host, ignore_errors=True)


async def _no_leaks(boxes: Any, snapshot: str, token: str, secret: str, *, whole: bool = True) -> None:
    """No host data in the snapshot; `whole`: and it is the sandbox's tree as it was, whichever names the swaps had
    left (nothing of the sandbox races a snapshot: its commands are over, and it is frozen)."""
    restored = await boxes.restore(snapshot)
    try:
        assert await output(restored, LEAKS.format(a=token, b=secret)) == ""
        if whole:
            count = "cd /testbed/race && find . -type f | wc -l && find . -type l | wc -l"
            assert await output(restored, count) == f"{2 * PAIRS}\n{2 * PAIRS}\n"
    finally:
        await restored.close()


def test_no_host_data_gets_into_a_snapshot_however_a_command_races_it(
    kind: str, request: pytest.FixtureRequest, host_secrets: tuple[Path, str], secret: str
) -> None:
    where, tmp = task(kind, request)
    if os.uname().machine != "x86_64":
        pytest.skip("the racer calls renameat2 by its x86-64 number")
    host, token = host_secrets
    racer = f"racer-{secrets.token_hex(6)}"

    async def main() -> None:
        async with sandboxes(kind, where, tmp, TIMEOUT) as boxes:
            box = await boxes.create()
            await output(box, RACE_SETUP.format(pairs=PAIRS, host=host))
            for command in (
                f"{RACER.format(pairs=PAIRS, token=racer)} & sleep 100",  # times out, racer running
                f"setsid {RACER.format(pairs=PAIRS, token=racer)} </dev/null >/dev/null 2>&1 & echo bye",
            ):
                await call(box, command)
                try:
                    snapshot = await box.snapshot()
                except SandboxError:
                    continue  # the tree changed under the copy: no snapshot, nothing copied
                await _no_leaks(boxes, snapshot, token, secret)
            assert gone(racer)

    run(main())


def test_a_racer_on_the_host_in_a_docker_containers_upper_dir(
    request: pytest.FixtureRequest, host_secrets: tuple[Path, str], secret: str
) -> None:
    """As a survivor of the command would race, were one to survive: from the host, in the container's upper dir,
    while snapshots copy it."""
    where, tmp = task("docker", request)
    host, token = host_secrets
    racer = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
print("racing", flush=True)
while True:
    for i in range(int(sys.argv[2])):
        libc.renameat2(-100, f"f{i}".encode(), -100, f"l{i}".encode(), 2)
        libc.renameat2(-100, f"d{i}".encode(), -100, f"h{i}".encode(), 2)
"""

    async def main() -> None:
        async with sandboxes("docker", where, tmp) as boxes:
            box = await boxes.create()
            await output(box, RACE_SETUP.format(pairs=PAIRS, host=host))
            taken = 0
            for _ in range(6):
                argv = [sys.executable, "-c", racer, f"{box._upper}/testbed/race", str(PAIRS)]
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE)  # noqa: ASYNC220 - started, not waited on
                try:
                    assert proc.stdout is not None and proc.stdout.readline() == b"racing\n"
                    try:
                        snapshot = await box.snapshot()
                    except SandboxError:
                        continue
                finally:
                    proc.kill()
                    proc.wait()
                taken += 1
                # Racing from outside the sandbox, it can make the copy see a file twice: no host data all the same.
                await _no_leaks(boxes, snapshot, token, secret, whole=False)
            print(f"{taken} of 6 snapshots taken under the racer, the others refused")

    run(main())


# -- deep trees and PATH_MAX -----------------------------------------------------------------------------------

#: 10,000 levels in one kind of sandbox; 2,500 in the others: past Python's recursion limit (1,100 levels first
#: failed) and PATH_MAX (1,361 levels of `dd/`), and deeper than the 2,100-level working directory below. Every kind
#: walks trees with the same code (`_fdtree`, `_layers`), whose cost each level adds to; at 10,000 levels a Docker
#: kind takes a minute. The full depth in every kind is a long run's: `TVCACHE_MILLION=1` (docs/development.md).
FULL_DEPTH = "overlay"


def levels(kind: str) -> int:
    return 10_000 if kind == FULL_DEPTH or os.environ.get("TVCACHE_MILLION") else 2_500


def deep(levels: int) -> str:
    """A command that makes a tree of `levels` directories under /testbed/deep, with a file at the bottom."""
    return f"""perl -e 'mkdir "/testbed/deep" or die; chdir "/testbed/deep" or die;
for (1 .. {levels}) {{ mkdir "dd" or die "$!"; chdir "dd" or die "$!" }}
open my $f, ">", "bottom" or die; print $f "deep\\n"'"""


LONG = "/testbed/deep/" + "dd/" * 2100 + "bottom"  # 6,314 bytes: past PATH_MAX (4,096)


def test_deep_trees_and_paths_past_path_max_are_answers_and_nothing_raises(
    kind: str, request: pytest.FixtureRequest
) -> None:
    where, tmp = task(kind, request)
    depth = levels(kind)

    async def main() -> None:
        async with sandboxes(kind, where, tmp) as boxes:
            box = await boxes.create()
            before = await output(box, "ls -A /testbed")
            assert (await call(box, deep(depth))).output["exit_code"] == 0
            assert await output(box, "find /testbed/deep | wc -l") == f"{depth + 2}\n"
            # The shell's working directory past PATH_MAX: an answer now, and in the next call.
            # (In steps of 700 levels: bash walks its whole $PWD at each `cd`, quadratic one level at a time.)
            await call(box, 'cd /testbed/deep; p=$(printf "dd/%.0s" {1..700}); cd $p; cd $p; cd $p; pwd | wc -c')
            await call(box, "pwd | wc -c; cat bottom 2>&1; ls 2>&1 | head -3")
            for tool, args in (
                ("read_file", {"path": LONG}),
                ("list_dir", {"path": LONG.rsplit("/", 1)[0]}),
                ("write_file", {"path": LONG + "2", "content": "x"}),
            ):
                assert isinstance(await box.execute(ToolCall(tool, args)), Outcome)
            await call(box, "cd /testbed")
            try:
                snapshot = await box.snapshot()
            except SandboxError:
                snapshot = None
            if snapshot is not None:
                try:
                    other = await boxes.restore(snapshot)
                except SandboxError:
                    other = None
                if other is not None:
                    assert await output(other, "find /testbed/deep -name bottom | wc -l") == "1\n"
                    assert await output(other, "rm -rf /testbed/deep && echo removed") == "removed\n"
            assert await output(box, "rm -rf /testbed/deep && ls -A /testbed") == before
            await call(box, deep(depth))  # left for close to remove

    run(main())


KILLED = """
import asyncio, sys
from tvcache import ToolCall
async def main():
    kind, where, tmp = sys.argv[1:4]
    if kind == "docker":
        from tvcache.sandboxes.docker import DockerSandboxes
        boxes = DockerSandboxes(where, tmp=tmp)
    else:
        from tvcache.sandboxes.workspace import WorkspaceSandboxes
        boxes = WorkspaceSandboxes(where, isolation=kind, tmp=tmp)
    box = await boxes.create()
    await box.execute(ToolCall("bash", {"command": sys.argv[4]}))
    await box.snapshot()
    print("ready", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@pytest.mark.parametrize("local", [*MODES, "docker"])
def test_the_next_factory_removes_the_deep_trees_a_killed_process_left(
    local: str, request: pytest.FixtureRequest
) -> None:
    where, tmp = task(local, request)
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED, local, where, str(tmp), deep(levels(local))], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    left = [p for p in [*tmp.iterdir(), *tmp.glob("tvcache-workspace/*")] if f"-{child.pid}-" in p.name]
    assert left

    async def main() -> None:
        async with sandboxes(local, where, tmp) as boxes:
            await output(await boxes.create(), "true")

    run(main())
    assert [p for p in left if p.exists()] == []


# -- ls -la across a snapshot -----------------------------------------------------------------------------

HISTORY = [
    "mkdir -p /testbed/d && echo x > /testbed/d/x",  # the reported finding
    "rm /testbed/data/a.txt && mkdir /testbed/d/e /testbed/empty",  # a whiteout; directories' link counts
    "perl -MSocket -e 'socket(S, PF_UNIX, SOCK_STREAM, 0); bind(S, sockaddr_un(q(/testbed/d/sock))) or die $!'",
    "echo run > /testbed/d/tool && chmod 4755 /testbed/d/tool && setcap cap_net_raw+ep /testbed/d/tool",
    "setfattr -n user.note -v hello /testbed/README && ln /testbed/README /testbed/d/hard && mkfifo /testbed/d/p",
    "rm -rf /testbed/src && mkdir /testbed/src && echo new > /testbed/src/new",  # an opaque directory
    "mv /testbed/d/e /testbed/moved && ln -s ../README /testbed/d/link && truncate -s 5M /testbed/sparse",
    "echo y > /testbed/d/y && rm /testbed/d/x && touch -d @1000000000 /testbed/d/y",
    "mkdir -p /testbed/" + "/".join(["n"] * 60) + " && echo " + "L" * 250 + " > /testbed/d/" + "L" * 250,
]
#: Everything `ls -la`, `stat`, `find`, getfattr, getcap and `du` print, but the times: every time a history sets
#: itself is set by `touch -d`, the others are clock readings (another uncached run prints other ones).
LOOK = r"""cd /testbed
ls -laR --time-style=+ . 2>&1
find . -exec stat -c '%n|%F|%A|%h|%u:%g|%s|%b' {} + 2>&1; find . -printf '%p %s %n\n'
stat -c '%n|%s|%h' / /testbed /testbed/d; stat -c '%n %.9Y' /testbed/d/y 2>&1
getfattr -R -P -d -m - -e hex . 2>&1; getcap -r . 2>&1; du -a -l . 2>&1; du -a -l --apparent-size . 2>&1"""


def test_ls_la_across_a_snapshot_equals_the_uncached_answer(kind: str, request: pytest.FixtureRequest) -> None:
    where, tmp = task(kind, request)

    async def main() -> None:
        async with sandboxes(kind, where, tmp) as boxes:
            fresh = await boxes.create()
            expected = [await output(fresh, command + " 2>&1; " + LOOK) for command in HISTORY]
            await fresh.close()
            assert re.search(r"^s\S+ .* sock$", expected[2], re.M)  # the socket is there uncached
            for cut in (1, 4, 7):  # after the reported step; after the socket and capability; after the opaque dir
                box = await boxes.create()
                for command in HISTORY[:cut]:
                    await output(box, command + " 2>&1")
                restored = await boxes.restore(await box.snapshot())
                await box.close()
                for i in range(cut, len(HISTORY)):
                    got = await output(restored, HISTORY[i] + " 2>&1; " + LOOK)
                    assert got == expected[i], f"after a restore at step {cut}, step {i}:\n" + _diff(expected[i], got)
                await restored.close()

    run(main())


def _diff(a: str, b: str) -> str:
    import difflib

    return "\n".join(difflib.unified_diff(a.splitlines(), b.splitlines(), "uncached", "restored", lineterm=""))


def test_ls_la_through_a_cache_that_snapshots_equals_the_uncached_answer(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Rollouts that share the history and then diverge: every answer the cache gives (executed in a restored
    sandbox, or served) equals what a fresh sandbox printed for the same rollout uncached."""
    where, tmp = task(kind, request)
    plans = [[*HISTORY[:k], f"echo {k} > /testbed/d/z{k}", "true"] for k in (2, 5, 9)]

    async def main() -> None:
        async with sandboxes(kind, where, tmp) as boxes:
            expected = []
            for plan in plans:
                fresh = await boxes.create()
                expected.append([await output(fresh, command + " 2>&1; " + LOOK) for command in plan])
                await fresh.close()
            async with tvcache.ToolCache(snapshot_budget=16) as cache:
                for _ in range(2):
                    for plan, want in zip(plans, expected, strict=True):
                        async with cache.rollout("task", boxes) as r:
                            for command, answer in zip(plan, want, strict=True):
                                got = (await r.call("bash", {"command": command + " 2>&1; " + LOOK})).output
                                assert got["output"] == answer, _diff(answer, got["output"])
                assert cache.stats()["hits"] > 0

    run(main())


# -- a slowloris against the servers ----------------------------------------------------------------------


class Slowloris:
    """`connections` unauthenticated connections from loopback: a third send nothing, a third trickle a request
    line and headers that never end, a third announce a body and trickle it; each sends a byte a second."""

    def __init__(self, port: int, connections: int):
        self.port, self.connections = port, connections
        self.stop = threading.Event()
        self.connected = threading.Event()  # every connection was tried
        self.opened = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        socks: list[tuple[socket.socket, bytes]] = []
        heads = [
            b"",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-a: b\r\n" * 100000,
            b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            + b"{" * 100000,
        ]
        for i in range(self.connections):
            if self.stop.is_set():
                break
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            except OSError:
                continue  # refused or reset: the server is shedding, which is its right
            s.setblocking(False)
            socks.append((s, heads[i % 3]))
            self.opened += 1
        self.connected.set()
        sent = 0
        while not self.stop.wait(1.0):
            sent += 1
            for s, data in socks:
                if data and sent < len(data):
                    with contextlib.suppress(OSError):
                        s.send(data[sent - 1 : sent])
        for s, _ in socks:
            s.close()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.mark.parametrize("which", ["serve", "sandbox-server"])
def test_a_slowloris_leaves_95_percent_of_legitimate_requests_served(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2000:
        pytest.skip(f"this process may open only {hard} files, fewer than the attack's connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    if which == "serve":
        server: Server = Server(tmp_path, "memory://", TOKEN, nofile=1024)
    else:
        sandbox = ["--sandbox", "workspace", "--base", str(request.getfixturevalue("workspace"))]
        server = SandboxServer(tmp_path, sandbox, TOKEN, nofile=1024)
    with server:
        attack = Slowloris(server.port, 1100)
        attack.thread.start()
        try:
            assert attack.connected.wait(60)  # the attack's connections are open (they take under a second)
            served = sum(_healthy(server.port) for _ in range(40) if time.sleep(0.2) is None)
        finally:
            attack.stop.set()
            attack.thread.join()
        assert attack.opened >= 500, f"only {attack.opened} attacking connections opened"
        assert served >= 38, f"{served} of 40 legitimate requests answered during the slowloris"
        assert _healthy(server.port)


# -- what cannot be kept equal ----------------------------------------------------------------------------------

PROBE = "cd /testbed && mkdir -p q && echo x > q/x && rm data/b.txt && echo y > y"
READ_INODES = "cd /testbed && stat -c '%n %i' q q/x y"
READ_DF_I = "df --output=iused /testbed | tail -1"


def fresh_runs(kind: str, request: pytest.FixtureRequest, look: str, runs: int = 2) -> list[str]:
    """What `look` prints after PROBE in `runs` fresh sandboxes of `kind`, uncached."""
    where, tmp = task(kind, request)

    async def main() -> list[str]:
        async with sandboxes(kind, where, tmp) as boxes:
            seen = []
            for _ in range(runs):
                box = await boxes.create()
                await output(box, PROBE)
                seen.append(await output(box, look))
                await box.close()
            return seen

    return list(run(main()))


@pytest.mark.parametrize("local", [*MODES, "docker"])
def test_change_times_differ_between_two_uncached_runs(local: str, request: pytest.FixtureRequest) -> None:
    """Why change times are an exception: the kernel sets them from the clock, so two fresh sandboxes that ran the
    same history print other ones (and a restored one prints the restore's)."""
    first, second = fresh_runs(local, request, "cd /testbed && stat -c '%n %.9Z' q q/x y")
    assert first != second


@pytest.mark.parametrize("mode", MODES)
def test_inode_numbers_and_df_i_of_a_workspace_differ_between_uncached_runs(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """Why the inode numbers of what a sandbox made, and `df -i`, are an exception: a restore cannot keep them (its
    copies are numbered anew, overlayfs's whiteouts are links of one inode), so every sandbox's tmpfs starts its
    numbers at a random point and holds a random number of inodes apart (workspace._isolation._scramble), and four
    fresh sandboxes that ran the same history print other ones. They printed the same before, and a restore other
    ones: a cached answer that printed them was not one an uncached run gives."""
    seen = fresh_runs(mode, request, READ_INODES + "; " + READ_DF_I, runs=4)
    numbers = {answer.rsplit("\n", 2)[0] for answer in seen}
    counts = {answer.rsplit("\n", 2)[1] for answer in seen}
    assert len(numbers) > 1, seen
    assert len(counts) > 1, seen


#: Base entries, read in another order than the history looked them up in: a copied-up directory, a directory and
#: files only in the base.
READ_BASE_INODES = "cd /testbed && stat -c '%n %i' data src src/main.py README"


@pytest.mark.parametrize("mode", [m for m in MODES if m != "copy"])
def test_inode_numbers_of_base_entries_survive_a_restore(mode: str, request: pytest.FixtureRequest) -> None:
    """What of inode numbers is state in the overlay modes: a base entry shows the base's number (overlayfs's xino),
    restored or not, also a copied-up directory, and in overlay mode a copied-up file (without other hard links).
    Without xino a directory showed a number from a counter of the mount's, in the order directories were looked
    up, which a restored sandbox did in another order. (In userns mode overlayfs may not follow the origin of a
    copied-up file: it shows the base's number only until the kernel drops the file from its cache, then its
    copy's, an exception; see docs/threat-model.md.)"""
    where, tmp = task(mode, request)
    history = "ls /testbed/src > /dev/null && echo more >> /testbed/data/a.txt && " + PROBE
    look = READ_BASE_INODES + (" data/a.txt" if mode == "overlay" else "")

    async def main() -> tuple[str, str]:
        async with sandboxes(mode, where, tmp) as boxes:
            fresh = await boxes.create()
            await output(fresh, history)
            uncached = await output(fresh, look)
            box = await boxes.create()
            await output(box, history)
            restored = await boxes.restore(await box.snapshot())
            return uncached, await output(restored, look)

    uncached, restored = run(main())
    assert restored == uncached


@pytest.mark.parametrize("mode", MODES)
def test_a_tmp_off_tmpfs_is_refused(mode: str, request: pytest.FixtureRequest) -> None:
    """Found by this check on Docker (fixed there: snapshots live on the daemon's filesystem), and the same in a
    workspace sandbox in copy mode with `tmp` on the disk: a copy lists in its source's order only from and to
    tmpfs, so with a tmp on ext4 a restored directory listed in reverse. Such a tmp is refused, in every mode,
    before anything is made in it."""
    from tvcache.sandboxes import _syscalls as sc
    from tvcache.sandboxes.workspace import WorkspaceSandboxes

    disk = Path(tempfile.mkdtemp(prefix="tvcache-test-tmp-", dir="/var/tmp"))
    try:
        if sc.filesystem_type(str(disk)) == sc.TMPFS_MAGIC:
            pytest.skip("/var/tmp is a tmpfs here")
        with pytest.raises(ValueError, match="is not on a tmpfs"):
            WorkspaceSandboxes(request.getfixturevalue("workspace"), isolation=mode, tmp=disk)  # type: ignore[arg-type]
        assert not any(disk.iterdir())
    finally:
        shutil.rmtree(disk, ignore_errors=True)
