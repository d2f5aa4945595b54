"""Probes an attacker inside a workspace sandbox would try, each in every isolation mode that works here.

Each test is a finding of issue 10 (or its threat model), reproduced from inside a real sandbox: the write, open
or system call must be refused, and the host must be left as it was. No probe ever makes the host run anything:
the core_pattern probe opens the file for writing without writing a byte, so even a sandbox that let it through
would leave the host's value unchanged (the test then fails on the open succeeding).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tvcache
from shell_oracle import bash, out, run
from test_workspace import AVAILABLE, MODES, TMP, factory_for, small_base, usable
from tvcache import SandboxError, ToolCall
from tvcache.sandboxes.workspace import WorkspaceSandboxes

ROOT = os.geteuid() == 0

# Linux capability numbers (include/uapi/linux/capability.h) of Docker's default set, less CAP_MKNOD and
# CAP_SYS_CHROOT, which the sandboxes drop too.
EXPECTED_CAPS = {
    "chown": 0,
    "dac_override": 1,
    "fowner": 3,
    "fsetid": 4,
    "kill": 5,
    "setgid": 6,
    "setuid": 7,
    "setpcap": 8,
    "net_bind_service": 10,
    "net_raw": 13,
    "audit_write": 29,
    "setfcap": 31,
}
NEVER_CAPS = {"dac_read_search": 2, "net_admin": 12, "sys_module": 16, "sys_rawio": 17, "sys_chroot": 18}
NEVER_CAPS |= {"sys_ptrace": 19, "sys_admin": 21, "sys_boot": 22, "mknod": 27, "bpf": 39}


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """Every isolation mode that works here."""
    return usable(str(request.param))


@pytest.fixture
def base() -> Iterator[Path]:
    with small_base() as path:
        yield path


# -- /proc ------------------------------------------------------------------------------------------------


def _first_writable_file(directory: str) -> str | None:
    """A file under `directory` that root on the host may write, if there is one."""
    for dirpath, _, files in os.walk(directory):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            try:
                if os.stat(path).st_mode & 0o222:
                    return path
            except OSError:
                continue
    return None


def test_proc_sys_and_friends_are_read_only(base: Path, mode: str) -> None:
    host_pattern = Path("/proc/sys/kernel/core_pattern").read_bytes()
    # What root on the host may write: sysctls, the SysRq trigger (if the kernel has one), an IRQ's CPU
    # affinity, a PCI device's configuration space, nfsd's controls (if loaded).
    writable = ["/proc/sys/kernel/core_pattern", "/proc/sysrq-trigger", "/proc/sys/vm/drop_caches"]
    writable = [p for p in writable if os.path.exists(p)]
    writable += [f for d in ("/proc/irq", "/proc/bus", "/proc/fs") if (f := _first_writable_file(d))]

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            # `: >` opens for writing and writes nothing: a refusal is the only thing that can show.
            for path in writable:
                result = await bash(box, f": > {path}")
                assert result["exit_code"] != 0, path
                assert "Read-only file system" in result["output"], result
            # Readable as in Docker: programs read sysctls all the time.
            assert (await bash(box, "cat /proc/sys/kernel/ostype"))["output"] == "Linux\n"

    run(main())
    assert Path("/proc/sys/kernel/core_pattern").read_bytes() == host_pattern


def test_sensitive_proc_files_are_masked(base: Path, mode: str) -> None:
    files = ("kcore", "keys", "key-users", "latency_stats", "timer_list", "timer_stats", "sched_debug")
    files = tuple(f for f in files if os.path.isfile(f"/proc/{f}"))
    dirs = [d for d in ("acpi", "scsi", "asound") if os.path.isdir(f"/proc/{d}")]

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            for name in files:
                assert await out(box, f"head -c 100 /proc/{name} | wc -c") == "0\n", name
            for name in dirs:
                assert await out(box, f"ls -A /proc/{name} | wc -l") == "0\n", name
            assert await out(box, "ls -A /sys | wc -l") == "0\n"  # no sysfs at all

    run(main())


# -- device nodes -------------------------------------------------------------------------------------------


def test_device_nodes_in_the_base_are_dead(base: Path, mode: str) -> None:
    """A /dev/null-like node in the base: neither the shell inside nor the in-process write_file may use it."""
    if not ROOT:
        pytest.skip("making a device node needs root")
    os.mknod(base / "nullish", stat.S_IFCHR | 0o666, os.makedev(1, 3))

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            result = await bash(box, "echo x > /testbed/nullish; cat /testbed/nullish; echo done")
            assert result["output"].count("Permission denied") == 2, result
            for tool, args in [("write_file", {"content": "x"}), ("read_file", {})]:
                outcome = await box.execute(ToolCall(tool, {"path": "/testbed/nullish", **args}))
                assert outcome.output == {"error": "Not a regular file: /testbed/nullish"}, (tool, outcome)
            # /dev/null itself still works: it is bound from the host's /dev, not made in a layer.
            assert await out(box, "echo x > /dev/null && head -c 3 /dev/zero | wc -c") == "3\n"

    run(main())
    assert stat.S_ISCHR(os.lstat(base / "nullish").st_mode)


def test_fast_paths_never_open_fifos_or_write_through_links_to_devices(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            await bash(box, "mkfifo /tmp/fifo; ln -s /dev/zero /tmp/zero")
            for path in ("/tmp/fifo", "/tmp/zero"):
                outcome = await box.execute(ToolCall("write_file", {"path": path, "content": "x"}))
                assert outcome.output == {"error": f"Not a regular file: {path}"}, outcome

    run(main())


# -- capabilities and seccomp -------------------------------------------------------------------------------


def test_capabilities_are_dockers_default_set(base: Path, mode: str) -> None:
    """Effective, permitted and ambient capabilities are Docker's default set (less two); no_new_privs keeps any
    program the shell starts (set-uid, file capabilities, root's own exec) from gaining more."""
    expected = sum(1 << bit for bit in EXPECTED_CAPS.values())

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            status = await out(box, "grep -E '^(Cap(Eff|Prm|Amb)|NoNewPrivs)' /proc/self/status")
            fields = {line.split(":")[0]: int(line.split()[1], 16) for line in status.splitlines()}
            assert fields == {"CapPrm": expected, "CapEff": expected, "CapAmb": expected, "NoNewPrivs": 1}, status
            assert not any(expected & (1 << bit) for bit in NEVER_CAPS.values())
            # A child process, even one started through a set-uid-root binary, has no more.
            setuid_cat = "cp /bin/cat /tmp/cat && chmod u+s /tmp/cat && /tmp/cat /proc/self/status"
            su = await out(box, f"{setuid_cat} | grep CapEff")
            assert int(su.split()[1], 16) == expected, su

    run(main())


OPEN_BY_HANDLE = textwrap.dedent("""\
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    class Handle(ctypes.Structure):
        _fields_ = [("size", ctypes.c_uint), ("type", ctypes.c_int), ("data", ctypes.c_ubyte * 128)]
    handle, mount_id = Handle(size=128), ctypes.c_int()
    if libc.name_to_handle_at(-100, b"/testbed/README", ctypes.byref(handle), ctypes.byref(mount_id), 0) != 0:
        print("no handle:", errno.errorcode[ctypes.get_errno()])
    fd = libc.open_by_handle_at(os.open("/testbed", os.O_RDONLY), ctypes.byref(handle), os.O_RDONLY)
    print("opened" if fd >= 0 else "refused: " + errno.errorcode[ctypes.get_errno()])
    """)


def test_open_by_handle_at_is_refused(base: Path, mode: str) -> None:
    """The "shocker" escape: with CAP_DAC_READ_SEARCH, a handle opens any inode of the filesystem (copy mode's
    tmpfs holds every other sandbox and the host's /dev/shm)."""

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            box = await boxes.create()
            await box.execute(ToolCall("write_file", {"path": "/tmp/probe.py", "content": OPEN_BY_HANDLE}))
            result = await bash(box, "python3 /tmp/probe.py")
            assert result["exit_code"] == 0, result
            assert "refused: EPERM" in result["output"], result

    run(main())


NAMESPACES_AND_KEYS = textwrap.dedent("""\
    import ctypes, errno
    libc = ctypes.CDLL(None, use_errno=True)
    for name, call in [
        ("unshare(CLONE_NEWUSER)", lambda: libc.unshare(0x10000000)),
        ("setns(-1, 0)", lambda: libc.setns(-1, 0)),
        ("socket(AF_VSOCK)", lambda: libc.socket(40, 1, 0)),
        ("personality(READ_IMPLIES_EXEC)", lambda: libc.personality(0x0400000)),
    ]:
        print(name, "allowed" if call() >= 0 else errno.errorcode[ctypes.get_errno()])
    """)


def test_seccomp_filter_refuses_what_dockers_default_profile_refuses(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            assert "seccomp" not in boxes.degraded, boxes.degraded
            box = await boxes.create()
            assert await out(box, "grep '^Seccomp:' /proc/self/status") == "Seccomp:\t2\n"
            await box.execute(ToolCall("write_file", {"path": "/tmp/probe.py", "content": NAMESPACES_AND_KEYS}))
            assert await out(box, "python3 /tmp/probe.py") == (
                "unshare(CLONE_NEWUSER) EPERM\nsetns(-1, 0) EPERM\nsocket(AF_VSOCK) EPERM\n"
                "personality(READ_IMPLIES_EXEC) EPERM\n"
            )
            # What ordinary programs do still works: threads, sockets, subprocesses, personality queries.
            ordinary = "python3 -c 'import socket, threading, subprocess; print(subprocess.run([\"true\"]).returncode)'"
            assert await out(box, ordinary) == "0\n"

    run(main())


# System calls by number, x86-64's and i386's (the numbers of every call since 5.1 are the same on all
# architectures, the older ones differ). i386 calls are made from the 64-bit python with `int 0x80` (a few
# bytes of machine code), which the kernel and the filter treat as a 32-bit program's.
NEWER_AND_FORBIDDEN = textwrap.dedent("""\
    import ctypes, errno, mmap, platform
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def native(nr, *args):
        return "allowed" if libc.syscall(ctypes.c_long(nr), *args) >= 0 else errno.errorcode[ctypes.get_errno()]
    path = ctypes.c_char_p(b"/tmp/f")
    open("/tmp/f", "w").close()
    calls = [
        ("fchmodat2", lambda: native(452, -100, path, 0o600, 0x100)),  # AT_SYMLINK_NOFOLLOW: glibc 2.39's chmod -h
        ("getxattrat", lambda: native(464, -100, path, 0, b"user.x", None)),
        ("file_getattr", lambda: native(468, -100, path, None, 0, 0)),
        ("number 1000", lambda: native(1000)),
        ("clone3", lambda: native(435, None, 0)),
        ("mount", lambda: native(165, b"none", b"/tmp", b"tmpfs", 0, None)),
        ("open_by_handle_at", lambda: native(304, -1, None, 0)),
        ("io_uring_setup", lambda: native(425, 1, None)),
    ]
    def i386(nr):
        code = bytes([0xB8]) + nr.to_bytes(4, "little") + bytes([0xCD, 0x80, 0xC3])  # mov eax, nr; int 0x80; ret
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(code)
        res = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
        return "allowed" if res >= 0 else errno.errorcode[-res]
    if platform.machine() == "x86_64":
        calls += [("i386 fchmodat2", lambda: i386(452)), ("i386 mount", lambda: i386(21))]
    for name, call in calls:
        print(name, call())
    """)


def test_seccomp_answers_enosys_for_calls_newer_than_its_profile_and_eperm_for_forbidden_ones(
    base: Path, mode: str
) -> None:
    """A C library tries a new system call first and falls back to the old one only on ENOSYS (glibc 2.39's
    fchmodat with AT_SYMLINK_NOFOLLOW calls fchmodat2), so a call newer than the filter's profile must look absent,
    as in Docker (runc answers ENOSYS above the newest call its profile names), not forbidden; the calls the
    threat model forbids keep Docker's EPERM."""
    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86-64's system call numbers")

    async def main() -> None:
        async with factory_for(base, mode) as boxes:
            assert "seccomp" not in boxes.degraded, boxes.degraded
            box = await boxes.create()
            await box.execute(ToolCall("write_file", {"path": "/tmp/probe.py", "content": NEWER_AND_FORBIDDEN}))
            assert await out(box, "python3 /tmp/probe.py") == (
                "fchmodat2 ENOSYS\ngetxattrat ENOSYS\nfile_getattr ENOSYS\nnumber 1000 ENOSYS\nclone3 ENOSYS\n"
                "mount EPERM\nopen_by_handle_at EPERM\nio_uring_setup EPERM\n"
                "i386 fchmodat2 ENOSYS\ni386 mount EPERM\n"
            )
            # And the C library's fallback then does what it did before: chmod of the file, from python's
            # os.chmod(follow_symlinks=False), which calls fchmodat(AT_SYMLINK_NOFOLLOW).
            chmod = "python3 -c 'import os; os.chmod(\"/tmp/f\", 0o640, follow_symlinks=False)'; stat -c %a /tmp/f"
            assert await out(box, chmod) == "640\n"

    run(main())


# -- resource limits ---------------------------------------------------------------------------------------

LIMITED = {"memory": 256 << 20, "disk": 32 << 20, "max_processes": 64, "timeout": 10.0}
PROBES = {
    "fork bomb": "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived",
    "memory bomb": "python3 -c \"x = b'x' * (1 << 30); print('allocated')\"",
    "disk fill": "head -c 1G /dev/zero > /testbed/fill; echo written",
}


def test_limit_probes_at_8_concurrent_sandboxes_are_errors_and_never_cached(base: Path) -> None:
    """Eight sandboxes at once each run a fork bomb, then a memory bomb, then a disk fill: every call comes back
    as an error (so nothing is cached), the host can still start processes meanwhile, and every sandbox still
    answers afterwards."""
    if not ROOT:
        pytest.skip("cgroup limits need root")
    host_ok: list[bool] = []
    host_seconds: list[float] = []
    stop = threading.Event()

    def keep_poking_the_host() -> None:
        while not stop.is_set():
            started = time.monotonic()
            host_ok.append(subprocess.run(["true"], check=False).returncode == 0)
            host_seconds.append(time.monotonic() - started)
            stop.wait(0.2)

    async def main() -> dict[str, Any]:
        async with WorkspaceSandboxes(base, **LIMITED) as boxes, tvcache.ToolCache() as cache:  # type: ignore[arg-type]
            assert not {"memory", "processes", "disk"} & set(boxes.degraded), boxes.degraded

            async def rollout(task: str, command: str) -> tuple[bool, bool, bool, str]:
                async with cache.rollout(task, boxes) as r:
                    probe = await r.call("bash", {"command": command})
                    after = await r.call("bash", {"command": "echo alive; rm -f /testbed/fill"})
                alive = after.output == {"output": "alive\n", "exit_code": 0}
                return probe.error, probe.hit, alive, str(probe.output)[-300:]

            for name, command in PROBES.items():
                for _ in range(2):  # the second round must execute again: errors are never recorded
                    results = await asyncio.gather(*(rollout(f"{name}-{i}", command) for i in range(8)))
                    for error, hit, alive, tail in results:
                        assert error and not hit, (name, tail)
                        assert alive, (name, tail)
            return cache.stats()

    poker = threading.Thread(target=keep_poking_the_host)
    poker.start()
    try:
        stats = run(main())
    finally:
        stop.set()
        poker.join()
    assert stats["failures"] == 2 * 8 * len(PROBES), stats
    assert host_ok and all(host_ok)
    # A figure, not a check: how long the host took to run `true` meanwhile.
    host_seconds.sort()
    median, worst = host_seconds[len(host_seconds) // 2], host_seconds[-1]
    print(f"\nhost `true` meanwhile: {len(host_seconds)} runs, median {median:.3f} s, max {worst:.3f} s", end="")
    print(f" (load {os.getloadavg()[0]:.1f})")


def test_a_write_file_past_the_disk_quota_is_an_error(base: Path, mode: str) -> None:
    async def main() -> None:
        async with factory_for(base, mode, disk=8 << 20) as boxes:
            box = await boxes.create()
            small = await box.execute(ToolCall("write_file", {"path": "small", "content": "x" * 1000}))
            assert small.output == {"written": 1000} and not small.error
            big = await box.execute(ToolCall("write_file", {"path": "big", "content": "x" * (16 << 20)}))
            assert big.error, big
            await box.execute(ToolCall("bash", {"command": "rm big"}))
            again = await box.execute(ToolCall("bash", {"command": "cat small | wc -c"}))
            assert again.output == {"output": "1000\n", "exit_code": 0} and not again.error

    run(main())


# -- base="/" -------------------------------------------------------------------------------------------------


def test_the_host_root_as_the_workspace() -> None:
    """`WorkspaceSandboxes("/")`: its fingerprint skips pseudo filesystems and unreadable entries, is computed
    once per factory, and the sandbox sees the host's root filesystem at /testbed."""
    if AVAILABLE["overlay"] is not None:
        pytest.skip("needs overlay isolation")

    first_line = Path("/etc/os-release").read_text().split("\n")[0] + "\n"

    async def main() -> None:
        async with WorkspaceSandboxes("/", isolation="overlay") as boxes:
            first = boxes.fingerprint
            assert boxes.fingerprint == first
            box = await boxes.create()
            assert await out(box, "head -1 /testbed/etc/os-release") == first_line
            assert await out(box, "ls -A /testbed/proc | wc -l") == "0\n"  # a mount point: the overlay shows it empty

    run(main())


def test_the_host_root_cannot_be_a_layer_in_a_user_namespace() -> None:
    if AVAILABLE["userns"] is not None:
        pytest.skip("needs userns isolation")
    with pytest.raises(SandboxError, match="userns isolation cannot use / as a layer: it has mounts below it"):
        WorkspaceSandboxes("/", isolation="userns")


def test_pseudo_filesystems_cannot_be_workspaces() -> None:
    for path in ("/proc", "/sys/kernel", "/dev"):
        with pytest.raises(ValueError, match="pseudo filesystem"):
            WorkspaceSandboxes(path)


def test_fingerprint_walk_survives_unreadable_entries() -> None:
    """Root without CAP_DAC_OVERRIDE (as in many containers) cannot list a directory of mode 000; the walk
    counts it as unreadable instead of crashing, and gives the same fingerprint each time."""
    if not ROOT or AVAILABLE["copy"] is not None:
        pytest.skip("needs root and copy isolation")
    tree = Path(tempfile.mkdtemp(prefix="tvcache-ws-unreadable-", dir=TMP))
    try:
        (tree / "locked").mkdir()
        (tree / "locked" / "inner").write_text("x")
        os.symlink("/nowhere", tree / "dangling")
        os.chmod(tree / "locked", 0)
        code = textwrap.dedent(f"""\
            import asyncio, os
            from tvcache.sandboxes.workspace import WorkspaceSandboxes
            try:
                os.listdir({str(tree / "locked")!r})
                raise SystemExit("the locked directory is readable: the probe proves nothing")
            except PermissionError:
                pass
            prints = set()
            for _ in range(2):
                boxes = WorkspaceSandboxes({str(tree)!r}, isolation="copy")
                prints.add(boxes.fingerprint)
                asyncio.run(boxes.close())
            print(*prints)
            """)
        drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
        proc = subprocess.run([*drop, sys.executable, "-c", code], capture_output=True, text=True, env=_env())
        assert proc.returncode == 0, proc.stderr
        assert len(proc.stdout.split()) == 1 and len(proc.stdout.strip()) == 32, proc.stdout
    finally:
        os.chmod(tree / "locked", 0o755)
        shutil.rmtree(tree)


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
