"""Read and write sets of workspace calls: what a call observed of the sandbox's files, and what it changed.

A result can be reused in another state when everything the call read is the same there (two-phase lookup, see
the cache core). This module says what a workspace call read and wrote, as a map from state keys to digests:

- `path:<p>`: what a read of the object at the canonical path `p` (no symlink in it, no `.` or `..`) could
  observe: its type, mode, owner, group, size, link count, mtime, symlink target, extended attributes, and the
  content of a regular file; "" when nothing is there.
- `list:<d>`: the directory's entry names and types in the order `getdents` returns them; "" when no directory.
- `walk:<d>`: what walking through the directory `d` to something below it depends on: that it is a directory,
  and its mode, owner and group (search permission). Not its mtime or size, which a walk cannot see: a file
  created next to `/testbed/src/a.py` does not change what opening `/testbed/src/a.py` finds. Which entry the
  walk takes is recorded by the next component's own key.
- `shell:`: the shell state the next command inherits (working directories, exported variables).

**Reads of a bash command** are traced inside the jail with `strace -f --seccomp-bpf` (Debian's strace, found in the
sandbox's own root): opens, the stat family, access, readlink, directory listings, execve (and the interpreter a
script's `#!` line or an ELF file's PT_INTERP names, which the kernel reads without a system call), chdir. Failed
lookups count: `test -e missing` records `path:<missing>` = "". Every traced path is resolved inside the sandbox's
root as the kernel did (openat2 with RESOLVE_IN_ROOT on each component), recording each symlink passed (`path:` of
the link, so a swapped link target invalidates) and each directory walked through (`walk:`). An fstat adds nothing:
every descriptor a command opens was opened by a traced call, which records the whole `path:`. The shell's own start
before the command (see _shell.TRACE_MARK) only walks directories. The tracer runs with `-D` (as a detached
grandchild), so the command's shell keeps PID 1 as without tracing; the tracer's two forks shift the PIDs of the
command's children by two.

**Soundness first**: the read set is None (the result is reused only by exact history) when the call read anything
its digests cannot describe: /proc beyond the command's own processes, /dev other than null, zero, full and tty, a
socket (connect/bind), statfs; when it wrote anything (the write set's keys are then what changed, and what it read
of them before is gone); when the trace is incomplete (the tracer lost the shell's exit, the trace was too large to
keep) or a relative path cannot be placed.

**Write sets** are not traced: see _writes (the kernel's account of the entries a call changed).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import re
import shutil
import stat
import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from .._shell import ShellState
from .._syscalls import RESOLVE_IN_ROOT, openat2

__all__ = [
    "Digester",
    "Known",
    "Trace",
    "find_strace",
    "parse_trace",
    "shell_digest",
    "shell_ended",
    "strace_argv",
]

#: The system calls traced: everything that takes a path, listings, free space, the working directory, processes
#: (for the working directory a child inherits), the shell's exit (the trace's completeness), sockets, and sends
#: (one to an address talks to the world without a connect; sendmsg's structure is decoded to see its address).
_TRACED = (
    "%file,fstatfs,getdents64,getdents,fchdir,exit_group,clone,clone3,fork,vfork,connect,bind,sendto,sendmsg,sendmmsg"
)
#: Devices and kernel files whose reads are the same in every sandbox: tty (no sandbox has a controlling terminal,
#: so opening it always fails) and /proc/filesystems (the filesystems this kernel knows, which `ls` reads).
_PURE = frozenset({"/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/proc/filesystems"})
#: What procfs shows of the command's own processes (its memory map, descriptors, status: what glibc and grep read
#: for the stack's bounds), and the list of them: nothing of the sandbox's files, only what the processes did
#: (their reads are traced) and the kernel's random choices (addresses, pipe numbers), which an uncached run
#: would not repeat either. Every other /proc file shows the machine (load, memory, uptime): not reusable.
#: Not below `root`, `cwd`, `exe`, `map_files` or a descriptor: those lead back into the sandbox's files. Not the
#: mounts, the cgroup or `fdinfo` either: they name the sandbox's own directories, group and mount ids, another in
#: each sandbox.
_OWN_PROC = re.compile(
    r"^/proc(/(self|thread-self|\d+)(/task/\d+)?"
    r"(/(?!(root|cwd|exe|map_files|mounts|mountinfo|mountstats|cgroup|fdinfo)(/|$))[^/]+(/\d+)?)?)?$"
)
#: Where strace is looked for inside the sandbox's root.
_STRACE_PATHS = ("/usr/bin/strace", "/bin/strace", "/usr/local/bin/strace")
_BASH_PATHS = ("/bin/bash", "/usr/bin/bash", "/usr/local/bin/bash")
_MAX_SYMLINKS = 40
#: Programs the kernel runs for one exec: up to four `#!` interpreters (BINPRM_MAX_RECURSION), then an ELF loader.
_MAX_INTERPRETERS = 5
#: Canonical paths hold no symlink: one found on the way means the path is not there as such.
_CANONICAL = RESOLVE_IN_ROOT | 0x04  # RESOLVE_NO_SYMLINKS
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
_HASH_CHUNK = 1 << 20
#: Cached path digests per factory before the cache starts over (about 200 bytes each).
_CACHE_LIMIT = 500_000
#: A sandbox's keys of earlier reads, by (path, how): see `Digester`. Pairs, not dicts: a sandbox may keep thousands.
Known = dict[tuple[str, str], tuple[tuple[str, str], ...]]
#: Reads a sandbox keeps before it starts over (a test run reads a few thousand paths).
_KNOWN_LIMIT = 20_000


def strace_argv(strace: str, bash: str, fd: int) -> list[str]:
    """The tracer's argv up to the shell's options: strace writing to descriptor `fd`, then `bash`."""
    return [
        strace,
        *("-D", "-f", "--seccomp-bpf", "-qq", "-y", "-xx"),
        *("-e", "signal=none", "-e", "verbose=connect,sendmsg", "-e", f"trace={_TRACED}"),
        *("-o", f"/proc/self/fd/{fd}", "--", bash),
    ]


def find_strace(root: str) -> tuple[str, str] | None:
    """(strace, bash) as paths inside the sandbox root `root` (this process's view of it), or None."""

    def first(paths: Iterable[str]) -> str | None:
        for path in paths:
            with contextlib.suppress(OSError):
                fd = openat2(_open_root(root), path, os.O_PATH)
                try:
                    if stat.S_ISREG(os.fstat(fd).st_mode):
                        return path
                finally:
                    os.close(fd)
        return None

    if shutil.which("strace") is None and first(_STRACE_PATHS) is None:
        return None
    strace, bash = first(_STRACE_PATHS), first(_BASH_PATHS)
    return None if strace is None or bash is None else (strace, bash)


def _open_root(root: str) -> int:
    return os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def _hex(text: str) -> str:
    return bytes.fromhex(text.replace("\\x", "")).decode(errors="surrogateescape")


def shell_digest(state: ShellState) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in (state.cwd, state.oldpwd, b"\1" if state.exports is None else b"\0" + state.exports):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


# -- parsing the trace -----------------------------------------------------------------------------------------

#: A traced path is read by following a final symlink, without following it, by listing it, by running it, or only
#: walked to (a chdir, and the shell's own start before the command: see below).
FOLLOW, NOFOLLOW, LIST, EXEC, WALK = "follow", "nofollow", "list", "exec", "walk"
#: The lookup the traced shell makes right before the command (see _shell.TRACE_MARK).
MARK = "/proc/.tvcache-start"


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


_LINE = re.compile(r"^(\d+) +(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)\) += (.*)$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
_STR = re.compile(r'"((?:\\x[0-9a-f]{2})*)"')
_FD = re.compile(r"^(AT_FDCWD|-?\d+)(?:<((?:\\x[0-9a-f]{2})*)>)?")
_AT_EMPTY = "AT_EMPTY_PATH"
_WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC")
#: System calls that change what is at a path (their first path argument, and the second one of the pairs).
_WRITES = _names(
    "creat mkdir mkdirat rmdir unlink unlinkat rename renameat renameat2 link linkat symlink symlinkat chmod "
    "fchmodat chown lchown fchownat utime utimes utimensat futimesat setxattr lsetxattr removexattr lremovexattr "
    "mknod mknodat truncate"
)
#: System calls taking (dirfd, path, ...) rather than (path, ...).
_AT_CALLS = _names(
    "openat openat2 newfstatat fstatat64 statx faccessat faccessat2 readlinkat execveat mkdirat unlinkat renameat "
    "renameat2 linkat symlinkat fchmodat fchownat utimensat futimesat mknodat name_to_handle_at"
)
_STAT_NOFOLLOW = frozenset({"lstat", "readlink", "readlinkat", "lgetxattr", "llistxattr"})
#: Calls the digests cannot describe, and newer calls taking a path that the parser does not place (the sandbox's
#: seccomp filter answers them ENOSYS, unseen by strace, but a newer strace traces them should one be allowed).
_UNSOUND = _names(
    "bind name_to_handle_at inotify_add_watch fanotify_mark fchmodat2 getxattrat listxattrat setxattrat removexattrat "
    "file_getattr file_setattr open_tree_attr"
)


@dataclass
class Trace:
    """What a traced command touched: paths read (with how), paths written, and why the trace cannot be used."""

    reads: dict[str, set[str]] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)
    hazard: str | None = None
    complete: bool = False
    started: bool = False
    """Whether the command itself runs (the shell made its mark): before, the reads are the shell's own start."""
    threads: set[int] = field(default_factory=set)
    """Processes sharing their working directory with another (threads)."""

    def read(self, path: str, how: str) -> None:
        if not self.started and how in (FOLLOW, NOFOLLOW):
            # The shell's start (the prelude's `cd`, bash checking that $PWD is `.`) looks at directories only to
            # walk into them or compare their device and inode numbers: never at their times or sizes.
            how = WALK
        self.reads.setdefault(path, set()).add(how)

    def unsound(self, why: str) -> None:
        if self.hazard is None:
            self.hazard = why


def shell_ended(tail: bytes) -> bool:
    """Does the end of a trace record the shell's exit (see `Trace.complete`)?"""
    return re.search(rb"(^|\n)1 +exit_group\(", tail) is not None


def _split_args(args: str) -> list[str]:
    """The arguments, split at commas: strings are hex, so no comma hides in one; an array or structure (execve's
    argv, connect's address) is cut into pieces, but only ever comes after the arguments read here."""
    return [arg.strip() for arg in args.split(",")]


def _string(arg: str) -> str | None:
    m = _STR.fullmatch(arg)
    return None if m is None else _hex(m.group(1))


def parse_trace(data: bytes) -> Trace:
    """Parse strace's output (see `strace_argv`) into a Trace. The shell is PID 1 and starts in `/`."""
    trace = Trace()
    cwd: dict[int, str] = {1: "/"}
    pending: dict[int, str] = {}
    for raw in data.decode(errors="surrogateescape").splitlines():
        m = _LINE.match(raw)
        if m is None:
            if raw.strip():
                trace.unsound(f"unparsed trace line {raw[:80]!r}")
            continue
        pid, rest = int(m.group(1)), m.group(2)
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest[: -len("<unfinished ...>")].rstrip()
            continue
        resumed = _RESUMED.match(rest)
        if resumed is not None:
            rest = pending.pop(pid, resumed.group(1) + "(") + resumed.group(2)
        if rest.startswith("+++") or rest.startswith("---"):
            continue
        call = _CALL.match(rest)
        if call is None:
            if rest.startswith("exit_group(") and pid == 1:
                trace.complete = True
                continue
            if rest.startswith("exit_group("):
                continue
            trace.unsound(f"unparsed trace line {raw[:80]!r}")
            continue
        _one(trace, cwd, pid, call.group(1), _split_args(call.group(2)), call.group(3))
    return trace


_FD_CALLS = frozenset({"getdents64", "getdents", "fstat", "fchdir"})


def _one(trace: Trace, cwd: dict[int, str], pid: int, name: str, args: list[str], result: str) -> None:
    ok = not result.startswith("-1")
    if name == "exit_group":
        trace.complete = trace.complete or pid == 1
        return
    if name in ("clone", "clone3", "fork", "vfork"):
        child = result.split()[0]
        if ok and child.isdigit():
            # A thread (CLONE_FS) shares its working directory with its creator: a chdir in one moves both, which
            # the per-process record below cannot follow, so theirs is unknown for relative paths without a dirfd.
            shared = "CLONE_FS" in ",".join(args)
            cwd[int(child)] = "" if shared else cwd.get(pid, "")
            if shared:
                trace.threads.update((pid, int(child)))
        return
    if name in _UNSOUND:
        trace.unsound(f"{name} (not described by file digests)")
        return
    if name in ("statfs", "statfs64", "fstatfs", "fstatfs64") and ok:
        trace.unsound("statfs (free space is not described by file digests)")
        return
    if name in ("sendto", "sendmsg", "sendmmsg"):
        # Sent to an address: talks to whatever is there, with no connect (a datagram socket). A send on a
        # connected socket or a pair has none (sendto's fifth argument NULL, sendmsg's msg_name absent or NULL).
        joined = ", ".join(args)
        named = "msg_name=" in joined and "msg_name=NULL" not in joined
        if name == "sendmmsg" or (name == "sendto" and (len(args) < 5 or args[4] != "NULL")) or named:
            trace.unsound(f"{name} to an address (not described by file digests)")
        return
    if name == "connect":
        # A failed connection to a Unix socket's path (glibc asking for nscd) probes that path; anything else
        # talks to something outside the files.
        found = re.search(r'sun_path="((?:\\x[0-9a-f]{2})*)"', ", ".join(args))
        if ok or found is None:
            trace.unsound("a connection (not described by file digests)")
        else:
            trace.read(_hex(found.group(1)), FOLLOW)
        return

    def fd_path(arg: str) -> str | None:
        """What a descriptor argument names: a path, "" for a pipe, socket or the like, None if unknown."""
        m = _FD.match(arg)
        if m is None:
            return None
        if m.group(2) is None:
            return cwd.get(pid) if m.group(1) == "AT_FDCWD" and pid not in trace.threads else None
        path = _hex(m.group(2))
        if m.group(1) == "AT_FDCWD":
            cwd[pid] = path
        if path.endswith(" (deleted)"):
            trace.unsound(f"{name} of a deleted file")
        return path if path.startswith("/") else ""

    path: str | None
    if name in _FD_CALLS:
        base, path, rest = (fd_path(args[0]) if args else None), "", []
    elif name in _AT_CALLS:
        base = fd_path(args[0]) if args else None
        path, rest = (_string(args[1]) if len(args) > 1 else None), args[2:]
    else:
        base = None if pid in trace.threads else cwd.get(pid)
        path, rest = (_string(args[0]) if args else None), args[1:]
    flags = " ".join(rest)
    if path is None:
        trace.unsound(f"{name} with a path the trace does not show: {', '.join(args)[:80]}")
        return
    if path == "" and (name in _FD_CALLS or _AT_EMPTY in flags):
        if name == "execveat" and not base:
            # fexecve of a pipe, memfd or the like: the kernel reads the interpreter its content names.
            trace.unsound("execveat of a descriptor the trace does not show")
            return
        if name not in ("getdents64", "getdents", "fchdir", "execveat"):
            # fstat of an open file: what it sees, the open that made the descriptor recorded already (every open
            # is traced; the only descriptors not opened by the command are the machinery's pipes and cgroups).
            return
        if base == "":
            return  # the process's own pipe, socket or anonymous file: no file state
        target = base
    elif path.startswith("/"):
        target = path
    else:
        target = None if not base else posixpath.join(base, path)
    if target is None:
        trace.unsound(f"{name} of {path!r} from a directory the trace does not show")
        return
    if pid == 1 and not trace.started and target == MARK:
        trace.started = True
        return
    if name in ("chdir", "fchdir"):
        trace.read(target, WALK)  # what a chdir depends on: the walk there, and that it ends in a directory
        if ok:
            # As named, not normalised: `..` after a symlink is the parent of where the link led (resolved later).
            cwd[pid] = target
        return
    if name in ("getdents64", "getdents"):
        trace.read(target, LIST)
        return
    if name in ("execve", "execveat"):
        trace.read(target, EXEC)
        return
    if name == "openat2" and "RESOLVE_" in flags:
        trace.unsound("openat2 with resolution flags of its own")
    if "O_TMPFILE" in flags:
        # An unnamed file of the process's own in the directory (Python's TemporaryFile): the directory is only
        # walked to, and what the process writes there and reads back is no state of the sandbox's.
        trace.read(target, WALK)
        return
    nofollow = name in _STAT_NOFOLLOW or "AT_SYMLINK_NOFOLLOW" in flags or "O_NOFOLLOW" in flags or name in _WRITES
    trace.read(target, NOFOLLOW if nofollow else FOLLOW)
    opened_to_write = name in ("open", "openat", "openat2", "creat") and any(f in flags for f in _WRITE_FLAGS)
    if ok and (name in _WRITES or opened_to_write):
        trace.written.add(target)


# -- digests -----------------------------------------------------------------------------------------------------


def _kind(mode: int) -> str:
    return stat.filemode(mode)[0]


class Digester:
    """Digests of state keys in one sandbox root (this process's view of it), resolved inside it.

    A path's digest is cached across the roots of one factory (`cache`) by everything `lstat` says of it, its
    change time and inode included (any write, chmod or xattr change sets the change time; a symlink is never
    rewritten in place): a file of the base is read once per factory, not once per call.

    `known`, if given, holds the keys each `read` recorded in earlier calls of one sandbox whose files have not
    changed since (its owner starts it over when they do): a read found there records them again without a look
    at the files (the walk, not the hashing, was most of a short command's digest time).
    """

    def __init__(self, root: str, cache: dict[tuple[int, ...], str], known: Known | None = None):
        self.root = root
        self.cache = cache
        self._known = known
        if known is not None and len(known) > _KNOWN_LIMIT:
            known.clear()
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        self._rfd = _open_root(root)
        self.keys: dict[str, str] = {}
        #: Why the reads cannot all be placed (a relative `#!` interpreter, found from a directory not known here).
        self.unplaced: str | None = None
        self._resolved: dict[tuple[str, bool, bool], str | None] = {}
        self._stats: dict[str, os.stat_result | None] = {}

    def close(self) -> None:
        os.close(self._rfd)

    def __enter__(self) -> Digester:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_canonical(self, path: str, flags: int) -> int:
        """A descriptor of the canonical `path` (see the module docstring) in the root: a symlink on the way
        fails with ELOOP."""
        return openat2(self._rfd, path, flags, resolve=_CANONICAL)

    # What the kernel would find at a path, recording each step in `keys`.

    def _lstat(self, path: str) -> os.stat_result | None:
        if path not in self._stats:
            self._stats[path] = self._lstat_now(path)
        return self._stats[path]

    def _lstat_now(self, path: str) -> os.stat_result | None:
        try:
            fd = self.open_canonical(path, os.O_PATH | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return None
            raise
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def resolve(self, path: str, follow: bool, walk: bool = False) -> str | None:
        """Walk `path` (absolute) as the kernel would, in the root; record `walk:` of each directory passed
        and `path:` of each symlink followed and of the end (`walk`: only `walk:` of the end if a directory);
        return the canonical path found, or None when the walk stopped (a missing component, a file in the
        middle, too many symlinks)."""
        key = (path, follow, walk)
        if key not in self._resolved:
            self._resolved[key] = self._resolve(path, follow, walk)
        return self._resolved[key]

    def _resolve(self, path: str, follow: bool, walk: bool) -> str | None:
        todo = [p for p in path.split("/") if p]
        done = "/"
        links = 0
        while todo:
            part = todo.pop(0)
            if part == ".":
                continue
            if part == "..":
                done = posixpath.dirname(done)
                continue
            here = posixpath.join(done, part)
            st = self._lstat(here)
            last = not todo
            if st is None:
                self.keys[f"path:{here}"] = ""
                return None
            if stat.S_ISLNK(st.st_mode) and (follow or not last):
                self.path(here)
                links += 1
                if links > _MAX_SYMLINKS:
                    return None
                target = self._readlink(here)
                todo = [p for p in target.split("/") if p] + todo
                if target.startswith("/"):
                    done = "/"
                continue
            if last:
                if walk and stat.S_ISDIR(st.st_mode):
                    self.keys.setdefault(f"walk:{here}", _walk_digest(st))
                else:
                    self.path(here)
                return here
            if not stat.S_ISDIR(st.st_mode):
                self.path(here)  # ENOTDIR: what is there decides it
                return None
            self.keys.setdefault(f"walk:{here}", _walk_digest(st))
            done = here
        self.keys.setdefault("walk:/", _walk_digest(os.fstat(self._rfd)))
        if done == "/" and not walk:
            self.path("/")
        return done

    def _readlink(self, path: str) -> str:
        parent, name = posixpath.split(path)
        dfd = self.open_canonical(parent, os.O_PATH | os.O_DIRECTORY)
        try:
            return os.fsdecode(os.readlink(name, dir_fd=dfd))
        finally:
            os.close(dfd)

    # Digests of one canonical path.

    def path(self, path: str) -> str:
        key = f"path:{path}"
        if key not in self.keys:
            self.keys[key] = self._path_digest(path)
        return self.keys[key]

    def _path_digest(self, path: str) -> str:
        seen = self._lstat(path)
        if seen is None:
            return ""
        fields = (seen.st_mode, seen.st_uid, seen.st_gid, seen.st_size, seen.st_nlink, seen.st_mtime_ns)
        cached = (seen.st_dev, seen.st_ino, seen.st_ctime_ns, seen.st_rdev, *fields)
        found = self.cache.get(cached)
        if found is not None:
            return found
        try:
            fd = self.open_canonical(path, os.O_PATH | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return ""
            raise
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, st.st_ctime_ns) != (seen.st_dev, seen.st_ino, seen.st_ctime_ns):
                raise OSError(errno.EAGAIN, f"{path} changed while it was digested")
            h = hashlib.blake2b(digest_size=16)
            h.update(repr((_kind(st.st_mode), *fields)).encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(b"\0link\0" + os.fsencode(self._readlink(path)))
            h.update(b"\0xattr\0" + _xattrs(fd, st))
            if stat.S_ISREG(st.st_mode):
                h.update(b"\0content\0" + self._content(fd, st).encode())
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                h.update(b"\0dev\0%d" % st.st_rdev)
            found = self.cache[cached] = h.hexdigest()
            return found
        finally:
            os.close(fd)

    def _content(self, path_fd: int, st: os.stat_result) -> str:
        h = hashlib.blake2b(digest_size=16)
        fd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            while chunk := os.read(fd, _HASH_CHUNK):
                h.update(chunk)
        finally:
            os.close(fd)
        return h.hexdigest()

    def listing(self, path: str) -> str:
        key = f"list:{path}"
        if key not in self.keys:
            self.keys[key] = self._list_digest(path)
        return self.keys[key]

    def _list_digest(self, path: str) -> str:
        try:
            fd = self.open_canonical(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return ""
            raise
        try:
            with os.scandir(fd) as it:  # in the directory's own order, which `find` and `ls -f` print
                entries = [(e.name, _entry_type(e)) for e in it]
        finally:
            os.close(fd)
        h = hashlib.blake2b(digest_size=16)
        for name, kind in entries:
            h.update(os.fsencode(name) + b"\0" + kind.encode() + b"\n")
        return h.hexdigest()

    def walk(self, path: str) -> str:
        key = f"walk:{path}"
        if key not in self.keys:
            st = self._lstat(path)
            self.keys[key] = "" if st is None or not stat.S_ISDIR(st.st_mode) else _walk_digest(st)
        return self.keys[key]

    def key(self, key: str) -> str:
        """The digest of any state key but `shell:`, in this root."""
        kind, _, path = key.partition(":")
        if kind == "path":
            return self.path(path)
        if kind == "list":
            return self.listing(path)
        if kind == "walk":
            return self.walk(path)
        raise ValueError(f"not a workspace file key: {key!r}")

    # A traced access.

    def read(self, path: str, how: str) -> None:
        """Record what reading `path` (absolute, as the process named it) the way `how` depended on."""
        if self._known is None:
            return self._read(path, how)
        found = self._known.get((path, how))
        if found is None:
            # Recorded on its own: a resolution or key shared with an earlier read would be missing from its entry.
            outer = self.keys, self._resolved
            self.keys, self._resolved = {}, {}
            try:
                self._read(path, how)
                found = tuple(self.keys.items())
                if self.unplaced is None:
                    self._known[(path, how)] = found
            finally:
                self.keys, self._resolved = outer
        self.keys.update(found)
        return None

    def _read(self, path: str, how: str) -> None:
        # A trailing slash makes the kernel follow a final symlink, lstat's and O_NOFOLLOW's too.
        canonical = self.resolve(path, follow=how != NOFOLLOW or path.endswith("/"), walk=how == WALK)
        if canonical is None:
            return
        if how == LIST:
            self.listing(canonical)
        elif how == EXEC:
            # An interpreter may be a script in turn, and an ELF interpreter has a loader: each is the kernel's read.
            program: str | None = canonical
            for _ in range(_MAX_INTERPRETERS):
                interpreter = None if program is None else self._interpreter(program)
                if interpreter is None:
                    break
                if not interpreter.startswith("/"):
                    self.unplaced = f"{path} names its interpreter {interpreter!r} from the working directory"
                    break
                program = self.resolve(interpreter, follow=True)

    def _interpreter(self, path: str) -> str | None:
        """What the kernel reads to run `path` without a system call of the process: a script's `#!`
        interpreter or an ELF file's PT_INTERP (the dynamic loader)."""
        try:
            fd = self.open_canonical(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            head = os.pread(fd, 4096, 0)
            if head.startswith(b"#!"):
                line = head[2:].split(b"\n", 1)[0].strip()
                return os.fsdecode(line.split()[0]) if line else None
            if head[:4] == b"\x7fELF" and head[4] == 2 and head[5] == 1:  # 64-bit little-endian
                (phoff,) = struct.unpack_from("<Q", head, 0x20)
                phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
                for i in range(phnum):
                    at = phoff + i * phentsize
                    entry = head[at : at + 56] if at + 56 <= len(head) else os.pread(fd, 56, at)
                    if len(entry) < 56:
                        break
                    kind, _, offset, _, _, size = struct.unpack_from("<IIQQQQ", entry, 0)
                    if kind == 3:  # PT_INTERP
                        return os.fsdecode(os.pread(fd, size, offset).rstrip(b"\0"))
            return None
        finally:
            os.close(fd)


def _walk_digest(st: os.stat_result) -> str:
    return f"d{stat.S_IMODE(st.st_mode):o}.{st.st_uid}.{st.st_gid}"


def _entry_type(entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        return "l"
    if entry.is_dir(follow_symlinks=False):
        return "d"
    if entry.is_file(follow_symlinks=False):
        return "-"
    return "?"


def _xattrs(path_fd: int, st: os.stat_result) -> bytes:
    """The extended attributes (names and values), sorted; through /proc because an O_PATH descriptor takes none."""
    proc = f"/proc/self/fd/{path_fd}"
    try:
        names = sorted(os.listxattr(proc, follow_symlinks=False))
    except OSError:
        return b""
    out = []
    for name in names:
        with contextlib.suppress(OSError):
            out.append(name.encode() + b"=" + os.getxattr(proc, name, follow_symlinks=False))
    return b"\0".join(out)


def unsound_path(path: str) -> str | None:
    """Why reading `path` cannot be described by file digests, or None."""
    norm = posixpath.normpath(path)
    top = norm.split("/")[1] if norm.count("/") else ""
    if top == "proc" and ".." in path.split("/"):
        # `..` after a magic link (/proc/self/fd/3/..) is the parent of what it leads to, not of the link.
        return f"a read of {path} (.. through /proc)"
    if norm in _PURE or _OWN_PROC.match(norm):
        return None
    if top == "proc":  # /sys is not mounted in the jail: its skeleton directory is part of the state
        return f"a read of {norm} (kernel state)"
    if top == "dev" and norm != "/dev":
        return f"a read of {norm} (a device)"
    return None


def read_set(
    trace: Trace, root: str, cache: dict[tuple[int, ...], str], known: Known | None = None
) -> tuple[dict[str, str] | None, str]:
    """The traced command's read set in `root` (after it ran; it wrote nothing), or None and why. What procfs
    showed of the command's own processes is left out (see _OWN_PROC): this process sees another procfs.
    `known`: see `Digester`."""
    if not trace.complete or not trace.started:
        return None, "the trace is incomplete"
    if trace.hazard is not None:
        return None, trace.hazard
    for path in trace.written:
        if posixpath.normpath(path) != "/dev/null":
            return None, f"it wrote {path}"
    for path in trace.reads:
        why = unsound_path(path)
        if why is not None:
            return None, why
    with Digester(root, cache, known) as digests:
        for path, hows in trace.reads.items():
            if _OWN_PROC.match(posixpath.normpath(path)):
                if EXEC in hows:  # /proc/self/fd/N: a file the digests know by another name, if at all
                    return None, f"a program run as {path}"
                continue
            for how in sorted(hows):
                digests.read(path, how)
        if digests.unplaced is not None:
            return None, digests.unplaced
        for key in digests.keys:
            # A symlink into /proc or /dev: resolved here, in the sandbox's files, where both are empty directories
            # and say nothing of what the process found there (the machine's state, a device).
            found = key.partition(":")[2]
            if found.startswith(("/proc/", "/dev/")) and found not in _PURE:
                return None, f"a read of {found} through a symlink (kernel state)"
        return dict(digests.keys), ""


def file_tool_reads(
    root: str, cwd: bytes, path: str, listing: bool, cache: dict[tuple[int, ...], str], known: Known | None = None
) -> dict[str, str]:
    """The read set of read_file (`listing` False) or list_dir of `path` (relative to `cwd`); `known`: see
    `Digester`."""
    raw = os.fsencode(path)
    full = os.fsdecode(raw if raw.startswith(b"/") else posixpath.join(cwd, raw))
    with Digester(root, cache, known) as digests:
        digests.read(full, LIST if listing else FOLLOW)
        return dict(digests.keys)


def base_digests(keys: Collection[str], root: str, cache: dict[tuple[int, ...], str]) -> Mapping[str, str]:
    with Digester(root, cache) as digests:
        return {key: digests.key(key) for key in keys}
