"""Reads of bash commands traced with eBPF (bpftrace), without stopping the traced processes.

One bpftrace process per Python process watches the processes of the cgroup v2 groups in its map @w: a command's
sandbox group is in it from the command's start to its end (a marker call puts it in and takes it out, see
`Bpftrace.begin`), so untraced sandboxes and idle ones cost it nothing. System call tracepoints, no ptrace stops: a
command runs at nearly its untraced speed, with the PIDs it has untraced. Each traced call prints, at its exit (when
the kernel has copied the path in), the path it named, its directory descriptor, flags and result, and as kernel
identities (mount, dentry) the directory a relative path starts from (the descriptor's file or the working
directory), the file an open made and the process's root. Identities become paths here: a directory a command uses
was opened or entered by a traced call of the same command, whose path is known; an identity never seen makes the
read set None. The paths are then resolved in the sandbox's root as _reads does for strace's, into the same keys.

Events come out of one buffer per CPU; after a command, a marker call on every CPU says that each buffer has been
read past the command's end. A lost event (a full buffer), a watch the map had no room for, or any record that
cannot be read, makes the read set of every command whose window it falls in None.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import posixpath
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from ..reclaim import die_with_parent
from . import _reads
from ._reads import EXEC, FOLLOW, LIST, MARK, NOFOLLOW, WALK, Digester, Known, Trace

__all__ = ["NOT_WATCHED", "Bpftrace", "Event", "Window", "available", "program", "shared", "to_trace"]

#: name: (directory fd argument or None, path argument, flags argument or None), as the tracepoints name them.
_PATH_CALLS: dict[str, tuple[str | None, str, str | None]] = {
    "open": (None, "filename", "flags"),
    "openat": ("dfd", "filename", "flags"),
    "creat": (None, "pathname", None),
    "newstat": (None, "filename", None),
    "newlstat": (None, "filename", None),
    "newfstatat": ("dfd", "filename", "flag"),
    "statx": ("dfd", "filename", "flags"),
    "access": (None, "filename", None),
    "faccessat": ("dfd", "filename", None),
    "faccessat2": ("dfd", "filename", "flags"),
    "readlink": (None, "path", None),
    "readlinkat": ("dfd", "pathname", None),
    "chdir": (None, "filename", None),
    "execveat": ("fd", "filename", "flags"),
    "getxattr": (None, "pathname", None),
    "lgetxattr": (None, "pathname", None),
    "listxattr": (None, "pathname", None),
    "llistxattr": (None, "pathname", None),
    "mkdir": (None, "pathname", None),
    "mkdirat": ("dfd", "pathname", None),
    "rmdir": (None, "pathname", None),
    "unlink": (None, "pathname", None),
    "unlinkat": ("dfd", "pathname", "flag"),
    "rename": (None, "oldname", None),
    "renameat": ("olddfd", "oldname", None),
    "renameat2": ("olddfd", "oldname", "flags"),
    "link": (None, "oldname", None),
    "linkat": ("olddfd", "oldname", "flags"),
    "symlink": (None, "newname", None),
    "symlinkat": ("newdfd", "newname", None),
    "chmod": (None, "filename", None),
    "fchmodat": ("dfd", "filename", None),
    "chown": (None, "filename", None),
    "lchown": (None, "filename", None),
    "fchownat": ("dfd", "filename", "flag"),
    "utime": (None, "filename", None),
    "utimes": (None, "filename", None),
    "utimensat": ("dfd", "filename", "flags"),
    "futimesat": ("dfd", "filename", None),
    "mknod": (None, "filename", None),
    "mknodat": ("dfd", "filename", None),
    "truncate": (None, "path", None),
    "setxattr": (None, "pathname", None),
    "lsetxattr": (None, "pathname", None),
    "removexattr": (None, "pathname", None),
    "lremovexattr": (None, "pathname", None),
    "statfs": (None, "pathname", None),
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
#: bpftrace's longest string (BPFTRACE_STRLEN); a path this long or longer may have been cut. An event is one
#: printf, its path and numbers together, and bpftrace 0.17 puts the string on the BPF stack (512 bytes) twice.
STRLEN = 176
#: The marker calls, made by this process: lseek of descriptor -1 (EBADF), whose `whence` is the tracer's tag
#: times 4 plus one of these, and whose offset is a sandbox group's cgroup id or a sync token.
_WATCH, _UNWATCH, _SYNC = 1, 2, 3
NOT_WATCHED = "the eBPF tracer could not watch the sandbox (its map of watched groups was full)"


def _has(call: str) -> bool:
    """Does this kernel have the system call (and its tracepoints)? A call it lacks cannot be made either."""
    return os.path.isdir(f"{_TRACEFS}/sys_enter_{call}")


def program() -> str:
    """The bpftrace program, tracing the processes of the cgroup v2 groups in @w (a command's window, see
    `Bpftrace.begin`). $1 is this process's pid, whose `lseek` calls of descriptor -1 with `whence` >> 2 equal to
    $2 are the marker calls that watch a group, stop watching it and sync (see `_WATCH`)."""
    only = "/@w[cgroup]/"
    fd_file = "(*(curtask->files->fdt->fd + {fd}))"
    pwd = "$bm = (uint64)curtask->fs->pwd.mnt; $bd = (uint64)curtask->fs->pwd.dentry;"
    root = "(uint64)curtask->fs->root.mnt, (uint64)curtask->fs->root.dentry"
    fields = "\\t".join(
        ["E", "%llu", "%d", "%llu", "{name}", "%d", "%d", "%d", "%llx:%llx", "%llx:%llx", "%llx:%llx", "%s"]
    )
    head = f'printf("{fields}\\n", nsecs, tid, cgroup, '
    zero = "$bm = (uint64)0; $bd = (uint64)0; $rm = (uint64)0; $rd = (uint64)0;"

    def of_fd(fd: str, m: str, d: str) -> str:
        f = fd_file.format(fd=fd)
        return (
            f"if ({fd} >= 0 && {fd} < (int64)curtask->files->fdt->max_fds) "
            f"{{ {m} = (uint64){f}->f_path.mnt; {d} = (uint64){f}->f_path.dentry; }}"
        )

    out = ['BEGIN { printf("READY\\n"); }']
    for name, (dfd, path, flags) in _PATH_CALLS.items():
        if not _has(name):
            continue
        save = f"@p[tid] = (uint64)args->{path}; @f[tid] = (int64){'args->' + flags if flags else 0};"
        base = pwd
        if dfd:
            save += f" @d[tid] = (int64)(int32)args->{dfd};"
            base = (
                f"$dfd = (int64)@d[tid]; if ($dfd == {_AT_FDCWD}) {{ {pwd} }} else {{ {of_fd('$dfd', '$bm', '$bd')} }}"
            )
        made = ""
        if name in ("open", "openat", "creat"):
            made = of_fd("$r", "$rm", "$rd")
        elif name == "chdir":
            made = "if ($r == 0) { $rm = (uint64)curtask->fs->pwd.mnt; $rd = (uint64)curtask->fs->pwd.dentry; }"
        emit = (
            head.format(name=name)
            + f"$r, {'$dfd' if dfd else _AT_FDCWD}, @f[tid], $bm, $bd, $rm, $rd, {root}, str(@p[tid]));"
        )
        if name in _FSTAT_CALLS:
            # fstat of an open file (glibc's fstat is newfstatat(fd, "", AT_EMPTY_PATH)): a third of all events,
            # which `to_trace` passes over; the kernel has read the path's first byte by the exit.
            emit = f"if (!(@f[tid] & {_AT_EMPTY_PATH}) || *(uint8 *)uptr(@p[tid]) != 0) {{ {emit} }}"
        out.append(f"tracepoint:syscalls:sys_enter_{name} {only} {{ {save} }}")
        out.append(
            f"tracepoint:syscalls:sys_exit_{name} {only} {{ $r = (int64)args->ret; {zero} {base} {made} {emit} "
            + "delete(@p[tid]); delete(@f[tid]);"
            + (" delete(@d[tid]);" if dfd else "")
            + " }"
        )
    # execve: the name is read on entry (the old memory is gone at the exit), its result follows.
    out.append(
        f"tracepoint:syscalls:sys_enter_execve {only} {{ {zero} {pwd} "
        + head.format(name="execve")
        + f"0, {_AT_FDCWD}, 0, $bm, $bd, $rm, $rd, {root}, str(args->filename)); }}"
    )
    for name in filter(_has, _FD_CALLS):
        made = "$rm = (uint64)curtask->fs->pwd.mnt; $rd = (uint64)curtask->fs->pwd.dentry;" if name == "fchdir" else ""
        out.append(f"tracepoint:syscalls:sys_enter_{name} {only} {{ @d[tid] = (int64)args->fd; }}")
        out.append(
            f"tracepoint:syscalls:sys_exit_{name} {only} {{ $r = (int64)args->ret; {zero} $dfd = (int64)@d[tid]; "
            f"{of_fd('$dfd', '$bm', '$bd')} {made} "
            + head.format(name=name)
            + f'$r, $dfd, 0, $bm, $bd, $rm, $rd, {root}, ""); delete(@d[tid]); }}'
        )
    for name in filter(_has, _HAZARDS):
        out.append(
            f"tracepoint:syscalls:sys_exit_{name} {only} "
            f'{{ printf("H\\t%llu\\t%d\\t%llu\\t{name}\\t%d\\n", nsecs, tid, cgroup, args->ret); }}'
        )
    # connect: a failed connection to a Unix socket's path probes that path; any other connection is a hazard.
    out.append(f"tracepoint:syscalls:sys_enter_connect {only} {{ @p[tid] = (uint64)args->uservaddr; }}")
    out.append(
        f"tracepoint:syscalls:sys_exit_connect {only} {{ $a = (uint8 *)@p[tid]; {pwd} "
        'printf("C\\t%llu\\t%d\\t%llu\\tconnect\\t%d\\t%d\\t%llx:%llx\\t%s\\n", nsecs, tid, cgroup, args->ret, '
        "*(uint16 *)uptr($a), $bm, $bd, str(uptr($a + 2))); delete(@p[tid]); }"
    )
    # The markers. A watch that did not fit in the map (it is full) shows as 0 when the window closes.
    out.append(
        "tracepoint:syscalls:sys_enter_lseek /pid == $1 && (int32)args->fd == -1 && (args->whence >> 2) == $2/ "
        f"{{ $op = args->whence & 3; $x = (uint64)args->offset; "
        f"if ($op == {_WATCH}) {{ @w[$x] = 1; }} "
        f'if ($op == {_UNWATCH}) {{ printf("U\\t%llu\\t%d\\n", $x, @w[$x]); delete(@w[$x]); }} '
        f'if ($op == {_SYNC}) {{ printf("Y\\t%d\\t%llu\\n", cpu, $x); }} }}'
    )
    return "\n".join(out) + "\n"


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
    """One command's watch of its sandbox group (cgroup id `group`), from `since` (CLOCK_MONOTONIC, as bpftrace's
    nsecs) until `Bpftrace.collect`: what was seen of it. `lost`: the tracer's count of losses when it began;
    `watched`: what the kernel said when it closed (False: the watch did not fit in its map, or was taken out
    early; None: not closed yet)."""

    group: int
    since: int
    lost: int
    events: list[Event] = field(default_factory=list)
    hazard: str | None = None
    watched: bool | None = None


def available() -> str | None:
    """bpftrace's path, if it is installed and the kernel's tracepoints are visible (tracefs mounted)."""
    found = shutil.which("bpftrace")
    return found if found is not None and os.path.isdir(_TRACEFS) else None


_TRACEFS = "/sys/kernel/tracing/events/syscalls"
log = logging.getLogger("tvcache")
_shared: Bpftrace | None = None
_shared_lock = threading.Lock()


def shared(bpftrace: str) -> Bpftrace:
    """This process's tracer, started on first use (it takes seconds: bpftrace compiles and attaches about 120
    programs) and kept for the process's life."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.ended:
            _shared = Bpftrace(bpftrace)
        return _shared


class Bpftrace:
    """One bpftrace process watching the sandbox groups of this process's traced commands (see `begin`).
    `pages`: the size of each CPU's event buffer, in pages (4 MiB: a Python import is about 10k events)."""

    def __init__(self, bpftrace: str, *, pages: int = 1024):
        self._cpus = sorted(os.sched_getaffinity(0))
        # Tells this tracer's marker calls from another's in the same process (a test's second tracer).
        self._tag = secrets.randbelow(1 << 28) + 1
        env = {**os.environ, "BPFTRACE_STRLEN": str(STRLEN), "BPFTRACE_PERF_RB_PAGES": str(pages)}
        argv = [bpftrace, "-f", "json", "-B", "none", "-e", program(), str(os.getpid()), str(self._tag)]
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Condition()
        self._hurry = threading.Event()  # set while a `collect` waits
        self._waiting = 0
        self._windows: dict[int, Window] = {}
        self._synced: dict[int, int] = defaultdict(int)
        self._lost = 0
        self._token = 0
        self._ready = False
        self._ended = False
        self._reader = threading.Thread(target=self._read, args=(argv, env), daemon=True)
        self._reader.start()
        with self._lock:
            self._lock.wait_for(lambda: self._ready or self._ended, timeout=300)
        if not self._ready:
            self.close()
            raise OSError("bpftrace did not start")

    def _read(self, argv: list[str], env: dict[str, str]) -> None:
        """Start bpftrace and take its records, as many as have come at once: one JSON decoding and one hold of the
        lock for all of them (one wake-up and decoding per line cost more than bpftrace's own work)."""
        _batched()  # this thread too: it need not read before the command ends
        try:
            # Started by this thread, which lives as long as this process: the kernel kills bpftrace with it.
            self._proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_start_bpftrace,
            )
        except OSError as exc:
            log.debug("bpftrace did not start: %s", exc)
            with self._lock:
                self._ended = True
                self._lock.notify_all()
            return
        assert self._proc.stdout is not None
        out, rest = self._proc.stdout.fileno(), b""
        with contextlib.suppress(OSError):  # room for a burst (a Python start) while this thread waits
            fcntl.fcntl(out, fcntl.F_SETPIPE_SZ, 1 << 20)
        while chunk := os.read(out, 1 << 20):
            *lines, rest = (rest + chunk).split(b"\n")
            records = _decode(lines)
            with self._lock:
                for line, record in zip(lines, records, strict=True):
                    self._take(line, record)
                self._lock.notify_all()
            if len(chunk) < 1 << 14:
                # A trickle (bpftrace writes each event as it comes): let it gather, one wake-up a millisecond
                # rather than one a line, unless `collect` waits for it.
                self._hurry.wait(0.001)
        with self._lock:
            self._ended = True
            self._lock.notify_all()

    def _take(self, line: bytes, record: object) -> None:
        """One record of bpftrace's (`line`, decoded); lost events, or anything unexpected: never trust a window
        open now."""
        kind, data = (record.get("type"), record.get("data")) if isinstance(record, dict) else (None, None)
        if kind == "attached_probes":
            return
        if kind != "printf" or not isinstance(data, str) or not data.endswith("\n"):
            self._lose(line)
            return
        tag, _, rest = data[:-1].partition("\t")
        try:
            if tag == "E":
                ns, tid, cg, name, result, dirfd, flags, base, made, root, path = rest.split("\t", 10)
                event = Event(int(ns), int(tid), name, int(result), int(dirfd), int(flags), base, made, root)
                self._add(int(cg), event, path)
            elif tag == "C":
                ns, tid, cg, _, result, family, base, path = rest.split("\t", 7)
                self._add(int(cg), Event(int(ns), int(tid), "connect", int(result), int(family), 0, base), path)
            elif tag == "H":
                ns, _, cg, name, _ = rest.split("\t")
                window = self._windows.get(int(cg))
                if window is not None and window.hazard is None and int(ns) >= window.since:
                    window.hazard = f"{name} (not described by file digests)"
            elif tag == "U":
                group, watched = rest.split("\t")
                window = self._windows.get(int(group))
                if window is not None:
                    # Any unwatch that found the group unwatched counts, whatever the order of the records: a
                    # collect cancelled in its thread may unwatch the group after the next command watched it.
                    window.watched = watched == "1" and window.watched is not False
            elif tag == "Y":
                cpu, token = rest.split("\t")
                self._synced[int(cpu)] = max(self._synced[int(cpu)], int(token))
            elif data == "READY\n":
                self._ready = True
            else:
                self._lose(line)
        except ValueError:
            self._lose(line)

    def _add(self, group: int, event: Event, path: str) -> None:
        window = self._windows.get(group)
        if window is not None and event.ns >= window.since:
            event.path = path.encode(errors="surrogateescape")
            window.events.append(event)

    def _lose(self, line: bytes) -> None:
        self._lost += 1
        log.debug("eBPF tracer: events lost (%r)", line[:200])

    def _mark(self, op: int, value: int) -> None:
        """A marker call (see `_WATCH`): bpftrace's program acts on it before the call returns."""
        with contextlib.suppress(OSError):
            os.lseek(-1, value, self._tag << 2 | op)

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def lost_count(self) -> int:
        """How many times events were lost (or a line came unreadable) since the start."""
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
        """After the command begun with `window` ended: its events, and why they cannot be used, if so."""
        with self._lock:
            self._token += 1
            token = self._token
            self._waiting += 1
            self._hurry.set()  # the reader takes what comes without its trickle wait from now on
        self._mark(_UNWATCH, window.group)  # its record comes before this CPU's sync marker's
        mask = os.sched_getaffinity(0)
        try:
            for cpu in self._cpus:
                os.sched_setaffinity(0, {cpu})
                self._mark(_SYNC, token)
        finally:
            os.sched_setaffinity(0, mask)
        with self._lock:
            done = self._lock.wait_for(
                lambda: self._ended or all(self._synced[c] >= token for c in self._cpus), timeout=60
            )
            self._waiting -= 1
            if not self._waiting:
                self._hurry.clear()
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
            self._proc.send_signal(signal.SIGINT)  # how bpftrace is told to stop (it detaches its programs)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _start_bpftrace() -> None:
    """bpftrace's `preexec_fn`: it dies with its parent, and is batched (see `_batched`)."""
    die_with_parent()
    _batched()


def _batched() -> None:
    """Make the calling thread SCHED_BATCH: woken, it waits for its turn instead of preempting what runs. Woken for
    every event, bpftrace took the core from the traced command over a hundred times in a 10 ms `cat` (and the command
    waited for each record's formatting); batched, it runs about ten times and takes what came meanwhile at once."""
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def _decode(lines: list[bytes]) -> list[object]:
    """bpftrace's JSON lines, all in one decoding when they are all JSON; a line that is not: None."""
    with contextlib.suppress(ValueError):
        found = json.loads(b"[" + b",".join(lines) + b"]")
        if isinstance(found, list) and len(found) == len(lines):
            return found
    out: list[object] = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append(None)
    return out


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
    tracer: Bpftrace, window: Window, root: str, cache: dict[tuple[int, ...], str], known: Known
) -> tuple[dict[str, str] | None, str]:
    """The read set in `root` of the command watched through `window`, or None and why (see _reads.read_set).
    Collected and digested in one thread: each hop between threads is a wake-up on the call's critical path."""
    events, hazard = tracer.collect(window)
    with Digester(root, cache) as digests:
        trace = to_trace(events, hazard, lambda path, follow: digests.resolve(path, follow))
    return _reads.read_set(trace, root, cache, known)
