"""Reads of bash commands traced with eBPF, without stopping the traced processes.

One tracer per Python process (ebpf/reads.bpf.c, loaded into the kernel by _bpf) watches the processes of the cgroup
v2 groups in its map `watched`: a command's sandbox group is in it from the command's start to its end (a marker call
puts it in and takes it out, see `Tracer.begin`), so untraced sandboxes and idle ones cost it nothing. System call
tracepoints, no ptrace stops: a command runs at nearly its untraced speed, with the PIDs it has untraced. Each traced
call records, at its exit (when the kernel has copied the path in), the path it named, its directory descriptor,
flags and result, and as kernel identities (mount, dentry) the directory a relative path starts from (the
descriptor's file or the working directory), the file an open made and the process's root. Identities become paths
here: a directory a command uses was opened or entered by a traced call of the same command, whose path is known; an
identity never seen makes the read set None. The paths are then resolved in the sandbox's root as _reads does for
strace's, into the same keys.

Records go to one ring buffer for all CPUs, which this process reads from shared memory; after a command, a marker
call's record says the buffer has been read past the command's end. A lost record (a full buffer), a watch the map
had no room for, or any record that cannot be read, makes the read set of every command whose window it falls in
None.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import secrets
import select
import struct
import threading
import time
from dataclasses import dataclass, field

from ..._owner import forks, inherited
from . import _bpf, _reads
from ._reads import EXEC, FOLLOW, LIST, MARK, NOFOLLOW, WALK, Digester, Known, Trace

__all__ = ["NOT_WATCHED", "Event", "Tracer", "Window", "available", "hold", "release", "to_trace"]

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
#: Sends that are hazards when given an address (see reads.bpf.c): name -> (the argument, whether the address is
#: the first field of the structure it points to).
_SENDS = {"sendto": (4, False), "sendmsg": (1, True)}
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
    "fstatfs",  # free space, as statfs's (whatever it found: a failed one is rare)
    "sendmmsg",  # as sendto's and sendmsg's below, without looking for an address in each message
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
NAMES = [*_PATH_CALLS, "execve", *_FD_CALLS, *_HAZARDS, "connect", *_SENDS, _COMPAT, _NEWER]
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
#: The kernel side's config (struct config in reads.bpf.c).
_CONFIG = struct.Struct("<QQII")


@functools.cache
def _calls_h() -> str:
    """calls.h for reads.bpf.c: the table of traced system calls, by number (see `struct call` there)."""
    kinds = {"path": 1, "fd": 2, "hazard": 3, "connect": 4, "execve": 5, "send": 6}
    rows: list[tuple[str, int, int, int, int, int | None, int | None, int | None]] = []
    for name, (dfd, path, flags) in _PATH_CALLS.items():
        made = 1 if name in ("open", "openat", "creat") else 2 if name == "chdir" else 0
        kind = kinds["execve" if name == "execveat" else "path"]  # read on entry, as execve (see reads.bpf.c)
        rows.append((name, kind, made, name in _FSTAT_CALLS, NAMES.index(name), dfd, path, flags))
    rows.append(("execve", kinds["execve"], 0, 0, NAMES.index("execve"), None, 0, None))
    rows += [(n, kinds["fd"], 2 if n == "fchdir" else 0, 0, NAMES.index(n), 0, None, None) for n in _FD_CALLS]
    rows += [(n, kinds["hazard"], 0, 0, NAMES.index(n), None, None, None) for n in _HAZARDS]
    rows.append(("connect", kinds["connect"], 0, 0, NAMES.index("connect"), None, None, None))
    rows += [(n, kinds["send"], int(deref), 0, NAMES.index(n), None, at, None) for n, (at, deref) in _SENDS.items()]
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


def _config(pid: int, tag: int) -> bytes:
    """The kernel side's config for the marker calls of process `pid` (this one) with `tag`. The process is named as
    bpf_get_ns_current_pid_tgid names it, by its PID namespace and its pid there: in a container (a PID namespace of
    its own) os.getpid() is not the pid the kernel's other helpers give, and no marker would be recognised."""
    ns = os.stat("/proc/self/ns/pid")
    device = os.major(ns.st_dev) << 20 | os.minor(ns.st_dev)  # the kernel's dev_t, not stat's encoding of it
    return _CONFIG.pack(device, ns.st_ino, pid, tag)


def available() -> bool:
    """Can the eBPF tracer run here (see _bpf.available)?"""
    return _bpf.available(_calls_h())


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
_holders = 0  # of `_shared`
_shared_lock = threading.Lock()


def hold() -> Tracer:
    """This process's tracer, attached on first use; `release` it when done. While attached, its programs run at
    every system call of every process on the machine (about 220 ns each, measured with `getppid`), watched or
    not, so the last release detaches it, and the next `hold` attaches it again (about 90 ms)."""
    global _shared, _holders
    with _shared_lock:
        if _shared is None or _shared.ended or _shared.inherited:  # a forked child makes its own
            _shared, _holders = Tracer(), 0
        _holders += 1
        return _shared


def release(tracer: Tracer) -> None:
    """Give back what `hold` gave: the last holder's release detaches the tracer. A tracer no longer this process's
    own (detached, or a forked child's copy of its parent's) is left alone."""
    global _shared, _holders
    with _shared_lock:
        if tracer is not _shared:
            return
        _holders -= 1
        if _holders > 0:
            return
        _shared = None
    tracer.close()


class Tracer:
    """The eBPF programs (see reads.bpf.c and _bpf) watching the sandbox groups of this process's traced commands
    (see `begin`). `ring`: the size of the kernel's buffer of records, in bytes (a power of two; 32 MiB holds about
    200,000 records: a Python import is about 10,000). A thread takes records when the buffer fills up (an eighth
    of it; the kernel wakes it then), `collect` takes the rest itself."""

    def __init__(self, *, ring: int = 32 << 20):
        # Tells this tracer's marker calls from another's in the same process (a test's second tracer).
        self._tag = secrets.randbelow(1 << 28) + 1
        self._owner = forks()  # a forked child's copy must not read the kernel's buffer: see `inherited`
        self._program = _bpf.Program(_bpf.build(_calls_h()), ring=ring, config=_config(os.getpid(), self._tag))
        self._lock = threading.Condition()
        self._windows: dict[int, Window] = {}
        self._synced = 0
        self._unreadable = 0  # records this side could not read
        self._kernel_lost = 0  # records the kernel could not write, as it last said
        self._token = 0
        self._ended = False
        self._wake, self._waker = os.pipe()  # `close` ends the thread's wait
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Take records whenever the kernel says the buffer filled up, until `close`."""
        with select.epoll() as poll:
            poll.register(self._program.ring.fd, select.EPOLLIN)
            poll.register(self._wake, select.EPOLLIN)
            while not any(fd == self._wake for fd, _ in poll.poll()):
                self._drain()

    def _drain(self) -> None:
        """Take what the buffer holds: here, by the thread when it filled up, and by `collect` after a command."""
        if self.inherited:  # the buffer is the parent's to read
            return
        with self._lock:
            if not self._ended:
                self._program.ring.take(self._take)

    def _take(self, record: memoryview) -> None:
        """One record (see reads.bpf.c's struct record)."""
        size, n = _HEAD.size, len(record)
        if n < size:
            self._unreadable += 1
            return
        ns, cg, result, dirfd, flags, bm, bd, mm, md, rm, rd, tid, call, kind = _HEAD.unpack_from(record)
        if kind == ord("E") or kind == ord("C"):
            window = self._windows.get(cg)
            if window is not None and ns >= window.since and call < len(NAMES):
                path = bytes(record[size : n - 1]) if n > size else b""
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
    def inherited(self) -> bool:
        """Is this a forked child's copy of its parent's tracer?"""
        return inherited(self._owner)

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
        for all CPUs, in the order records were made, read here: once the sync marker's record (made after the
        command's last call) is read, so is every record of the command."""
        if self.inherited:  # the buffer is the parent's to read
            return [], "the eBPF tracer belongs to the process this one was forked from"
        self._mark(_UNWATCH, window.group)
        with self._lock:
            self._token += 1
            token = self._token
        start = time.monotonic()
        marked = -1
        while (waited := time.monotonic() - start) < 60:
            if int(waited) > marked:  # a marker the full buffer had no room for is made again, a second later
                marked = int(waited)
                self._mark(_SYNC, token)
            self._drain()
            with self._lock:
                if self._ended or self._synced >= token:
                    break
            # Behind a record another CPU has reserved and not yet written (microseconds), or a full buffer.
            time.sleep(0.0002 if waited < 0.01 else 0.01)
        with self._lock:
            if not self._close(window):
                return [], "the eBPF tracer's window was closed meanwhile"
            if self._ended or self._synced < token:
                return [], "the eBPF tracer stopped"
            if not window.watched:
                return [], NOT_WATCHED
            if self._lost != window.lost:
                return [], "the eBPF tracer lost events"
            return window.events, window.hazard

    def close(self) -> None:
        """Detach the programs (in the process that made them; a forked child's copy does nothing)."""
        with self._lock:
            if self._ended or self.inherited:
                return
            self._ended = True
            os.write(self._waker, b"x")
        self._reader.join()
        self._program.close()
        os.close(self._wake)
        os.close(self._waker)


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
        if text == "" and e.flags & _AT_EMPTY_PATH and name == "execveat":
            # fexecve: the open that made the descriptor was recorded, but not the interpreter the kernel runs.
            program = where(e.base)
            if program is None:
                trace.unsound("execveat of a descriptor the trace does not show")
            else:
                trace.read(program, EXEC)
            continue
        if text == "":
            if e.flags & _AT_EMPTY_PATH and name in _FSTAT_CALLS:
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
