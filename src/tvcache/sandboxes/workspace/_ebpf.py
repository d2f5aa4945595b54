"""Reads of bash commands traced with eBPF, without stopping the traced processes.

One tracer process per Python process (ebpf/tracer.c, which loads ebpf/reads.bpf.c into the kernel) watches the
processes of the cgroup v2 groups in its map `watched`: a command's sandbox group is in it from the command's start
to its end (a marker call puts it in and takes it out, see `Tracer.begin`), so untraced sandboxes and idle ones cost
it nothing. System call tracepoints, no ptrace stops: a command runs at nearly its untraced speed, with the PIDs it
has untraced. Each traced call records, at its exit (when the kernel has copied the path in), the path it named,
its directory descriptor, flags and result, and as kernel identities (mount, dentry) the directory a relative path
starts from (the descriptor's file or the working directory), the file an open made and the process's root.
Identities become paths here: a directory a command uses was opened or entered by a traced call of the same command,
whose path is known; an identity never seen makes the read set None. The paths are then resolved in the sandbox's
root as _reads does for strace's, into the same keys.

Records go to one ring buffer for all CPUs without waking the tracer; after a command, a marker call's record (which
wakes it) says that the buffer has been read past the command's end. A lost record (a full buffer), a watch the map
had no room for, or any record that cannot be read, makes the read set of every command whose window it falls in
None. The tracer is built from its C sources with clang on first use (see `build`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import posixpath
import secrets
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..reclaim import die_with_parent
from . import _reads
from ._reads import EXEC, FOLLOW, LIST, MARK, NOFOLLOW, WALK, Digester, Known, Trace

__all__ = ["NOT_WATCHED", "Event", "Tracer", "Window", "available", "build", "shared", "to_trace"]

#: name: (directory fd argument, path argument, flags argument), by position (None: the call has none).
_PATH_CALLS: dict[str, tuple[int | None, int, int | None]] = {
    "open": (None, 0, 1),
    "openat": (0, 1, 2),
    "creat": (None, 0, None),
    "newstat": (None, 0, None),
    "newlstat": (None, 0, None),
    "newfstatat": (0, 1, 3),
    "statx": (0, 1, 2),
    "access": (None, 0, None),
    "faccessat": (0, 1, None),
    "faccessat2": (0, 1, 3),
    "readlink": (None, 0, None),
    "readlinkat": (0, 1, None),
    "chdir": (None, 0, None),
    "execveat": (0, 1, 4),
    "getxattr": (None, 0, None),
    "lgetxattr": (None, 0, None),
    "listxattr": (None, 0, None),
    "llistxattr": (None, 0, None),
    "mkdir": (None, 0, None),
    "mkdirat": (0, 1, None),
    "rmdir": (None, 0, None),
    "unlink": (None, 0, None),
    "unlinkat": (0, 1, 2),
    "rename": (None, 0, None),
    "renameat": (0, 1, None),
    "renameat2": (0, 1, 4),
    "link": (None, 0, None),
    "linkat": (0, 1, 4),
    "symlink": (None, 1, None),
    "symlinkat": (1, 2, None),
    "chmod": (None, 0, None),
    "fchmodat": (0, 1, None),
    "chown": (None, 0, None),
    "lchown": (None, 0, None),
    "fchownat": (0, 1, 4),
    "utime": (None, 0, None),
    "utimes": (None, 0, None),
    "utimensat": (0, 1, 3),
    "futimesat": (0, 1, None),
    "mknod": (None, 0, None),
    "mknodat": (0, 1, None),
    "truncate": (None, 0, None),
    "setxattr": (None, 0, None),
    "lsetxattr": (None, 0, None),
    "removexattr": (None, 0, None),
    "lremovexattr": (None, 0, None),
    "statfs": (None, 0, None),
}
_FD_CALLS = ("getdents64", "getdents", "fchdir")
#: Calls the file digests cannot describe, or that escape the model of paths here, whatever their result.
_HAZARDS = [
    "openat2",
    "bind",
    "name_to_handle_at",
    "open_by_handle_at",
    "inotify_add_watch",
    "fanotify_mark",
    "mount",
    "umount",
    "pivot_root",
    "chroot",
    "io_uring_setup",
    "open_tree",
    "move_mount",
    "fsopen",
    "pidfd_getfd",
    "quotactl",
    "swapon",
    "acct",
    # Newer calls that take a path (or read file state) which neither tracer resolves: hazards, whatever they found.
    "fchmodat2",
    "getxattrat",
    "listxattrat",
    "setxattrat",
    "removexattrat",
    "file_getattr",
    "file_setattr",
    "open_tree_attr",
    "fspick",
    "fsmount",
    "fsconfig",
    "mount_setattr",
    "statmount",
    "listmount",
    "quotactl_fd",
]
_WRITES = frozenset(
    [
        "creat",
        "mkdir",
        "mkdirat",
        "rmdir",
        "unlink",
        "unlinkat",
        "rename",
        "renameat",
        "renameat2",
        "link",
        "linkat",
        "symlink",
        "symlinkat",
        "chmod",
        "fchmodat",
        "chown",
        "lchown",
        "fchownat",
        "utime",
        "utimes",
        "utimensat",
        "futimesat",
        "mknod",
        "mknodat",
        "truncate",
        "setxattr",
        "lsetxattr",
        "removexattr",
        "lremovexattr",
    ]
)
#: Calls that describe an open file when given an empty path and AT_EMPTY_PATH (execveat runs it: kept).
_FSTAT_CALLS = ("newfstatat", "statx", "faccessat2")
_NOFOLLOW_CALLS = frozenset({"newlstat", "readlink", "readlinkat", "lgetxattr", "llistxattr"})
_O_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
_O_TMPFILE = 0o20000000
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_EMPTY_PATH = 0x1000
_AT_FDCWD = -100
#: The longest path the tracer reads (PATH_MAX, its terminating zero included): one this long may have been cut.
STRLEN = 4096
#: The marker calls, made by this process: lseek of descriptor -1 (EBADF), whose `whence` is the tracer's tag
#: times 4 plus one of these, and whose offset is a sandbox group's cgroup id or a sync token.
_WATCH, _UNWATCH, _SYNC = 1, 2, 3
NOT_WATCHED = "the eBPF tracer could not watch the sandbox (its map of watched groups was full)"

#: Every name a record can carry, by its index (`struct call`'s); the last two are hazards the kernel side finds.
_COMPAT, _NEWER = "a 32-bit system call", "a system call newer than this tracer"
NAMES = [*_PATH_CALLS, "execve", *_FD_CALLS, *_HAZARDS, "connect", _COMPAT, _NEWER]
#: System calls x86-64 names unlike their tracepoints (and this module).
_NR_NAMES = {"newstat": "stat", "newlstat": "lstat", "umount": "umount2"}
#: The numbers of calls newer than Debian 12's kernel headers: from 424 on, one numbering for every architecture.
_UNIFIED = {
    "openat2": 437,
    "fchmodat2": 452,
    "statmount": 457,
    "listmount": 458,
    "setxattrat": 463,
    "getxattrat": 464,
    "listxattrat": 465,
    "removexattrat": 466,
    "open_tree_attr": 467,
    "file_getattr": 468,
    "file_setattr": 469,
}
#: The kernel side's record header (struct record in reads.bpf.c, up to its path).
_HEAD = struct.Struct("<QQqqq6QIHBx")
_SOURCES = Path(__file__).with_name("ebpf")


def _calls_h() -> str:
    """calls.h for reads.bpf.c: the table of traced system calls, by number (see `struct call` there)."""
    kinds = {"path": 1, "fd": 2, "hazard": 3, "connect": 4, "execve": 5}
    rows: list[tuple[str, int, int, int, int, int | None, int | None, int | None]] = []
    for name, (dfd, path, flags) in _PATH_CALLS.items():
        made = 1 if name in ("open", "openat", "creat") else 2 if name == "chdir" else 0
        rows.append((name, kinds["path"], made, name in _FSTAT_CALLS, NAMES.index(name), dfd, path, flags))
    rows.append(("execve", kinds["execve"], 0, 0, NAMES.index("execve"), None, 0, None))
    rows += [(n, kinds["fd"], 2 if n == "fchdir" else 0, 0, NAMES.index(n), 0, None, None) for n in _FD_CALLS]
    rows += [(n, kinds["hazard"], 0, 0, NAMES.index(n), None, None, None) for n in _HAZARDS]
    rows.append(("connect", kinds["connect"], 0, 0, NAMES.index("connect"), None, None, None))
    out = ["// Written by _ebpf.py: which system calls the tracer traces, and where their arguments are."]
    out += [f"#ifndef __NR_{n}\n#define __NR_{n} {nr}\n#endif" for n, nr in _UNIFIED.items()]
    out += [
        "#define CALLS_MAX 512",
        f"#define LAST_KNOWN {max(_UNIFIED.values())}",
        f"#define COMPAT_INDEX {NAMES.index(_COMPAT)}",
        f"#define NEWER_INDEX {NAMES.index(_NEWER)}",
        "static const struct call CALLS[CALLS_MAX] = {",
    ]
    for name, kind, made, fstat, index, *places in rows:
        number = f"__NR_{_NR_NAMES.get(name, name)}"
        at = ", ".join(str(-1 if a is None else a) for a in places)
        out.append(f"#ifdef {number}\n\t[{number}] = {{{kind}, {made}, {int(fstat)}, {at}, {index}}},\n#endif")
    return "\n".join([*out, "};", ""])


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tvcache" / "ebpf"


def _clang() -> str | None:
    found = shutil.which("clang")
    return found if found is not None and os.path.isfile("/usr/include/bpf/bpf_helpers.h") else None


def _built() -> Path:
    """Where this version's tracer is, or is to be, built (a name per content of its sources)."""
    text = _calls_h()
    digest = hashlib.sha256(text.encode())
    for name in ("reads.bpf.c", "tracer.c"):
        digest.update((_SOURCES / name).read_bytes())
    digest.update(os.uname().machine.encode())
    return _cache_home() / digest.hexdigest()[:16]


def available() -> bool:
    """Can the eBPF tracer run here? x86-64 (where its table of calls is), the kernel's type information (BTF,
    for its reads of kernel structures), and either a built tracer or clang and libbpf's headers to build it."""
    if os.uname().machine != "x86_64" or not os.path.isfile("/sys/kernel/btf/vmlinux"):
        return False
    return _clang() is not None or (_built() / "tracer").is_file()


def build() -> Path:
    """The directory of the tracer (`tracer` and its `reads.bpf.o`), built with clang on first use (about a
    second) and kept in the user's cache, one per version of the sources. Raises OSError if it cannot be built."""
    where = _built()
    if (where / "tracer").is_file():
        return where
    clang = _clang()
    if clang is None:
        raise OSError("the eBPF tracer needs clang and libbpf's headers to build (apt-get install clang libbpf-dev)")
    where.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=where.parent))
    try:
        shutil.copy(_SOURCES / "reads.bpf.c", work)
        (work / "calls.h").write_text(_calls_h())
        include = f"/usr/include/{os.uname().machine}-linux-gnu"
        steps = [
            [clang, "-O2", "-g", "-target", "bpf", f"-I{include}", "-c", "reads.bpf.c", "-o", "reads.bpf.o"],
            [clang, "-O2", "-o", "tracer", str(_SOURCES / "tracer.c"), "-lbpf"],
        ]
        for argv in steps:
            done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
            if done.returncode != 0:
                raise OSError(f"could not build the eBPF tracer ({argv[-1]}): {done.stderr.strip()[-2000:]}")
        with contextlib.suppress(OSError):  # another process built it meanwhile: theirs is the same
            work.rename(where)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return where


@dataclass(slots=True)
class Event:
    """One traced call of a sandbox's process. `base`, `made` and `root` are kernel identities "mount:dentry"
    (see the module docstring); `dirfd` is the address family for `connect`."""

    ns: int
    tid: int
    name: str
    result: int
    dirfd: int
    flags: int
    base: str
    made: str = ""
    root: str = ""
    path: bytes = b""


@dataclass
class Window:
    """One command's watch of its sandbox group (cgroup id `group`), from `since` (CLOCK_MONOTONIC, as the
    kernel's records) until `Tracer.collect`: what was seen of it. `lost`: the tracer's count of losses when it
    began; `watched`: what the kernel said when it closed (False: the watch did not fit in its map, or was taken out
    early; None: not closed yet)."""

    group: int
    since: int
    lost: int
    events: list[Event] = field(default_factory=list)
    hazard: str | None = None
    watched: bool | None = None


log = logging.getLogger("tvcache")
_shared: Tracer | None = None
_shared_lock = threading.Lock()


def shared() -> Tracer:
    """This process's tracer, built and started on first use, and kept for the process's life."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.ended:
            _shared = Tracer()
        return _shared


class Tracer:
    """The tracer process (see reads.bpf.c and tracer.c) watching the sandbox groups of this process's traced
    commands (see `begin`). `ring`: the size of the kernel's buffer of records, in bytes (a power of two; 32 MiB
    holds about 200,000 records: a Python import is about 10,000)."""

    def __init__(self, *, ring: int = 32 << 20):
        where = build()
        # Tells this tracer's marker calls from another's in the same process (a test's second tracer).
        self._tag = secrets.randbelow(1 << 28) + 1
        argv = [str(where / "tracer"), str(where / "reads.bpf.o"), str(os.getpid()), str(self._tag), str(ring)]
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Condition()
        self._windows: dict[int, Window] = {}
        self._synced = 0
        self._unreadable = 0  # records this side could not read
        self._kernel_lost = 0  # records the kernel could not write, as it last said
        self._token = 0
        self._ready = False
        self._ended = False
        self._error = ""
        self._reader = threading.Thread(target=self._read, args=(argv,), daemon=True)
        self._reader.start()
        with self._lock:
            self._lock.wait_for(lambda: self._ready or self._ended, timeout=60)
        if not self._ready:
            self.close()
            raise OSError(f"the eBPF tracer did not start: {self._error or 'no answer in 60 s'}")

    def _read(self, argv: list[str]) -> None:
        """Start the tracer and take its records, as many as have come at once, in one hold of the lock."""
        try:
            # Started by this thread, which lives as long as this process: the kernel kills the tracer with it.
            pipe, none = subprocess.PIPE, subprocess.DEVNULL
            self._proc = subprocess.Popen(argv, stdout=pipe, stderr=pipe, stdin=none, preexec_fn=die_with_parent)
        except OSError as exc:
            with self._lock:
                self._ended, self._error = True, str(exc)
                self._lock.notify_all()
            return
        assert self._proc.stdout is not None and self._proc.stderr is not None
        out, data = self._proc.stdout.fileno(), bytearray()
        with contextlib.suppress(OSError):  # room for a burst while this thread waits
            fcntl.fcntl(out, fcntl.F_SETPIPE_SZ, 1 << 20)
        while chunk := os.read(out, 1 << 20):
            data += chunk
            if not self._ready:
                if b"\n" not in data:
                    continue
                line, _, rest = bytes(data).partition(b"\n")
                data = bytearray(rest)
                with self._lock:
                    self._ready = line == b"READY"
                    self._lock.notify_all()
            with self._lock:
                used = self._take(data)
                self._lock.notify_all()
            del data[:used]
        error = self._proc.stderr.read().decode(errors="replace").strip()
        with self._lock:
            self._ended, self._error = True, error[-2000:]
            self._lock.notify_all()

    def _take(self, data: bytearray) -> int:
        """Take the whole records at the start of `data`; how many bytes they were."""
        at, end, size = 0, len(data), _HEAD.size
        while end - at >= 4:
            n = int.from_bytes(data[at : at + 4], "little")
            if end - at - 4 < n:
                break
            start, at = at + 4, at + 4 + n
            if n < size:
                self._unreadable += 1
                continue
            ns, cg, result, dirfd, flags, bm, bd, mm, md, rm, rd, tid, call, kind = _HEAD.unpack_from(data, start)
            if kind == ord("E") or kind == ord("C"):
                window = self._windows.get(cg)
                if window is not None and ns >= window.since and call < len(NAMES):
                    path = bytes(data[start + size : at - 1]) if n > size else b""
                    base, made, root = f"{bm:x}:{bd:x}", f"{mm:x}:{md:x}", f"{rm:x}:{rd:x}"
                    window.events.append(Event(ns, tid, NAMES[call], result, dirfd, flags, base, made, root, path))
            elif kind == ord("H"):
                window = self._windows.get(cg)
                if window is not None and window.hazard is None and ns >= window.since:
                    name = NAMES[call] if call < len(NAMES) else "an unknown call"
                    window.hazard = f"{name} (not described by file digests)"
            elif kind == ord("U"):
                self._kernel_lost = max(self._kernel_lost, flags)
                window = self._windows.get(cg)
                if window is not None:
                    # Any unwatch that found the group unwatched counts, whatever the order of the records: a
                    # collect cancelled in its thread may unwatch the group after the next command watched it.
                    window.watched = result == 1 and window.watched is not False
            elif kind == ord("Y"):
                self._kernel_lost = max(self._kernel_lost, flags)
                self._synced = max(self._synced, result)
            else:
                self._unreadable += 1
        return at

    @property
    def _lost(self) -> int:
        return self._unreadable + self._kernel_lost

    def _mark(self, op: int, value: int) -> None:
        """A marker call (see `_WATCH`): the kernel side acts on it before the call returns."""
        with contextlib.suppress(OSError):
            os.lseek(-1, value, self._tag << 2 | op)

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def lost_count(self) -> int:
        """How many records were lost (or came unreadable) since the start, as far as this side knows yet."""
        with self._lock:
            return self._lost

    def begin(self, group: int) -> Window:
        """Watch the sandbox group `group` (its cgroup id) from now on until `collect`: before this returns, the
        kernel traces the group's processes."""
        with self._lock:
            window = self._windows[group] = Window(group, time.monotonic_ns(), self._lost)
        self._mark(_WATCH, group)
        return window

    def abandon(self, window: Window) -> None:
        """Stop watching, without waiting for the events: for a command whose events are not wanted (it did not run
        its course, or changed files) or after `collect` (then a no-op)."""
        if self._close(window):
            self._mark(_UNWATCH, window.group)

    def _close(self, window: Window) -> bool:
        """Take `window` out of the open ones, if it still is (another command of its group may have begun since:
        a collect cancelled in its thread ends late)."""
        with self._lock:
            if self._windows.get(window.group) is not window:
                return False
            del self._windows[window.group]
            return True

    def collect(self, window: Window) -> tuple[list[Event], str | None]:
        """After the command begun with `window` ended: its events, and why they cannot be used, if so. One buffer
        for all CPUs, read in the order records were made: once the sync marker's record (made after the command's
        last call) is read, so is every record of the command."""
        self._mark(_UNWATCH, window.group)
        with self._lock:
            self._token += 1
            token = self._token
        done = False
        for _ in range(60):  # a marker the full buffer had no room for is made again, a second later
            self._mark(_SYNC, token)
            with self._lock:
                done = self._lock.wait_for(lambda: self._ended or self._synced >= token, timeout=1)
            if done:
                break
        with self._lock:
            if not self._close(window):
                return [], "the eBPF tracer's window was closed meanwhile"
            if self._ended or not done:
                return [], "the eBPF tracer stopped"
            if not window.watched:
                return [], NOT_WATCHED
            if self._lost != window.lost:
                return [], "the eBPF tracer lost events"
            return window.events, window.hazard

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)  # how the tracer is told to stop (it detaches its programs)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def to_trace(events: list[Event], hazard: str | None, resolve: object) -> Trace:
    """The Trace (see _reads) of one command's events. `resolve(path, follow)` is the canonical path of `path`
    (absolute) in the sandbox, or None (see _reads.Digester.resolve)."""
    trace = Trace()
    if hazard is not None:
        trace.unsound(hazard)
    trace.complete = True
    events = sorted(events, key=lambda e: e.ns)
    if not events:
        return trace
    root = events[0].root
    #: (mount, dentry) identities -> the path (absolute, as named) and whether it followed a final symlink.
    known: dict[str, tuple[str, bool]] = {root: ("/", True)}
    canonical: dict[str, str | None] = {}

    def where(identity: str) -> str | None:
        if identity not in canonical:
            named = known.get(identity)
            canonical[identity] = None if named is None else resolve(*named)  # type: ignore[operator]
        return canonical[identity]

    for e in events:
        if e.root and e.root != root:
            trace.unsound(f"{e.name} from another root directory (chroot)")
            break
        name, ok = e.name, e.result >= 0
        text = e.path.decode(errors="surrogateescape")
        if name in _FD_CALLS:
            base = where(e.base)
            if base is None:
                if ok or name != "fchdir":
                    trace.unsound(f"{name} of a descriptor the trace does not show")
                continue
            trace.read(base, LIST if name != "fchdir" else WALK)
            if name == "fchdir" and ok:
                known[e.made] = (base, True)
                canonical.pop(e.made, None)
            continue
        if len(e.path) >= STRLEN - 1:
            trace.unsound(f"{name} of a path too long for the tracer")
            continue
        if name == "statfs" and ok:
            trace.unsound("statfs (free space is not described by file digests)")
            continue
        if name == "connect" and (ok or e.dirfd != 1):  # dirfd: the address family, 1 AF_UNIX
            trace.unsound("a connection (not described by file digests)")
            continue
        if text == "":
            if e.flags & _AT_EMPTY_PATH and name in (*_FSTAT_CALLS, "execveat"):
                continue  # fstat of an open file: the open that made the descriptor was recorded
            trace.unsound(f"{name} with a path the tracer could not read")
            continue
        if text.startswith("/"):
            target = text
        else:
            base = where(e.base)
            if base is None:
                trace.unsound(f"{name} of {text!r} from a directory the trace does not show")
                continue
            target = posixpath.join(base, text)
        if not trace.started and target == MARK:
            trace.started = True
            continue
        if name == "chdir":
            trace.read(target, WALK)
            if ok:
                known[e.made] = (target, True)
                canonical.pop(e.made, None)
            continue
        if name in ("execve", "execveat"):
            trace.read(target, EXEC)
            continue
        flags = e.flags
        if name in ("open", "openat") and flags & _O_TMPFILE == _O_TMPFILE:
            trace.read(target, WALK)
            continue
        nofollow = (
            name in _NOFOLLOW_CALLS
            or name in _WRITES
            or (name in ("newfstatat", "statx", "faccessat2", "fchownat", "utimensat") and flags & _AT_SYMLINK_NOFOLLOW)
            or (name in ("open", "openat") and flags & os.O_NOFOLLOW)
        )
        trace.read(target, NOFOLLOW if nofollow else FOLLOW)
        if ok and name in ("open", "openat", "creat"):
            known[e.made] = (target, not flags & os.O_NOFOLLOW)
            canonical.pop(e.made, None)
        if ok and (name in _WRITES or (name in ("open", "openat") and flags & _O_WRITE) or name == "creat"):
            trace.written.add(target)
    return trace


def read_set(
    tracer: Tracer, window: Window, root: str, cache: dict[tuple[int, ...], str], known: Known
) -> tuple[dict[str, str] | None, str]:
    """The read set in `root` of the command watched through `window`, or None and why (see _reads.read_set).
    Collected and digested in one thread: each hop between threads is a wake-up on the call's critical path."""
    events, hazard = tracer.collect(window)
    with Digester(root, cache) as digests:
        trace = to_trace(events, hazard, lambda path, follow: digests.resolve(path, follow))
    return _reads.read_set(trace, root, cache, known)
