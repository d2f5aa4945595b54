"""What changed in a sandbox's files since the last look, from the kernel's own account (fanotify), in
O(changes) instead of a walk of the whole tree.

Each sandbox writes only into a tmpfs of its own (see _isolation). A fanotify group per factory watches each of
those filesystems whole (`FAN_MARK_FILESYSTEM`) and reports, for every change, the directory (a file handle) and
the name of the entry it touched (`FAN_REPORT_DFID_NAME`). Overlayfs makes its changes to the upper dirs through
the same kernel calls as any process, so a write through the sandbox's root shows up here as a change of its
upper dir. Events are read when asked for (`Watch.take`), after a call ended, and routed to the sandbox whose
filesystem they came from (by its fsid).

Sound, not merely usually right:

- every kind of change is subscribed: data (`FAN_MODIFY`), metadata and xattrs (`FAN_ATTRIB`), names
  (create, delete, both ends of a rename), and every close of a file that was open for writing
  (`FAN_CLOSE_WRITE`), which covers writes through `mmap` (they raise no `FAN_MODIFY`): a call's processes are
  all gone when it returns, and so are their mappings;
- a queue overflow (`FAN_Q_OVERFLOW`), an event from a filesystem nobody watches or one that cannot be parsed
  marks every watch of the group `lost`: "anything may have changed";
- events are queued by the kernel in the changing process's own system call, so all of a finished call's are
  there when it is read.

Where fanotify is unavailable (no CAP_SYS_ADMIN, an old kernel, the per-user limit of groups reached, a
filesystem id shared by two mounts) `Watcher.watch` returns None and the caller walks the tree as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import struct
import threading
import weakref
from dataclasses import dataclass, field

__all__ = ["Batch", "Watch", "Watcher"]

log = logging.getLogger("tvcache")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]

_FAN_CLOEXEC, _FAN_NONBLOCK = 0x1, 0x2
_FAN_REPORT_FID, _FAN_REPORT_DIR_FID, _FAN_REPORT_NAME = 0x200, 0x400, 0x800
_FAN_MARK_ADD, _FAN_MARK_FILESYSTEM = 0x1, 0x100

FAN_MODIFY, FAN_ATTRIB, FAN_CLOSE_WRITE = 0x2, 0x4, 0x8
FAN_MOVED_FROM, FAN_MOVED_TO, FAN_CREATE, FAN_DELETE = 0x40, 0x80, 0x100, 0x200
FAN_Q_OVERFLOW, FAN_ONDIR = 0x4000, 0x40000000
#: The events that change a name in a directory (the entry there may now be another one, or none).
NAME_EVENTS = FAN_MOVED_FROM | FAN_MOVED_TO | FAN_CREATE | FAN_DELETE
_MASK = FAN_MODIFY | FAN_ATTRIB | FAN_CLOSE_WRITE | NAME_EVENTS | FAN_ONDIR

_INFO_FID, _INFO_DFID_NAME = 1, 2
_METADATA = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
_INFO_HEADER = struct.Struct("=BBH")  # struct fanotify_event_info_header
_FSID_AND_HANDLE = struct.Struct("=8sIi")  # __kernel_fsid_t, then struct file_handle's two fields

#: Distinct entries a watch remembers between two takes; beyond, it says "many" (`Batch.entries` None).
MAX_ENTRIES = 20_000


@dataclass(slots=True)
class Batch:
    """What happened on one watched filesystem since the last take.

    `events`: how many events (0: nothing at all changed). `entries`: {(directory handle, name): mask} of the
    entries touched (name b"." for the directory itself; (b"", the file's handle) for a file whose link count
    changed), or None if there were too many to keep or the account was `lost`. A handle is the kernel's file
    handle, type first, for `open_by_handle_at`.
    """

    events: int = 0
    entries: dict[tuple[bytes, bytes], int] | None = field(default_factory=dict)
    lost: bool = False

    def add(self, handle: bytes, name: bytes, mask: int) -> None:
        self.events += 1
        self._note(handle, name, mask)

    def _note(self, handle: bytes, name: bytes, mask: int) -> None:
        if self.entries is not None:
            key = (handle, name)
            self.entries[key] = self.entries.get(key, 0) | mask
            if len(self.entries) > MAX_ENTRIES:
                self.entries = None

    def merge(self, later: Batch) -> None:
        """Fold a later batch into this one."""
        self.events += later.events
        self.lost = self.lost or later.lost
        if self.lost or later.entries is None:
            self.entries = None
        else:
            for (handle, name), mask in later.entries.items():
                self._note(handle, name, mask)


class Watcher:
    """A fanotify group for the filesystems of one factory's sandboxes (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: dict[bytes, Batch] = {}
        self.fd: int | None = None
        self.why_not = ""
        flags = _FAN_CLOEXEC | _FAN_NONBLOCK | _FAN_REPORT_FID | _FAN_REPORT_DIR_FID | _FAN_REPORT_NAME
        fd = _libc.fanotify_init(flags, os.O_RDONLY | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            self.why_not = f"fanotify_init: {os.strerror(err)}"
            _log_once(err, "no fanotify here (%s): change detection walks the tree", self.why_not)
            return
        self.fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    def watch(self, path: str) -> Watch | None:
        """Start watching the whole filesystem that holds `path` (a tmpfs of one sandbox's own); None where that
        does not work here (see the module docstring)."""
        if self.fd is None:
            return None
        try:
            fsid = _fsid(path)
        except OSError:
            return None
        with self._lock:
            if fsid in self._watches:
                return None  # two filesystems the events could not tell apart
            if _libc.fanotify_mark(self.fd, _FAN_MARK_ADD | _FAN_MARK_FILESYSTEM, _MASK, -100, os.fsencode(path)):
                err = ctypes.get_errno()
                _log_once(err, "no fanotify for %s (%s): change detection walks the tree", path, os.strerror(err))
                return None
            self._watches[fsid] = Batch()
        return Watch(self, fsid)

    def _drain(self) -> None:
        """Read every queued event into the batches of the watches (the caller holds the lock)."""
        assert self.fd is not None
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                self._lose_all()
                return
            if not buf:
                return
            try:
                self._route(buf)
            except (struct.error, ValueError):
                self._lose_all()

    def _route(self, buf: bytes) -> None:
        offset = 0
        while offset < len(buf):
            length, _, _, meta_len, mask, fd, _ = _METADATA.unpack_from(buf, offset)
            if fd >= 0:  # never asked for (FID mode reports none), closed all the same
                os.close(fd)
            if length < meta_len or offset + length > len(buf):
                raise ValueError("a truncated fanotify event")
            if mask & FAN_Q_OVERFLOW:
                self._lose_all()
            else:
                self._one(buf, offset + meta_len, offset + length, mask)
            offset += length

    def _one(self, buf: bytes, at: int, end: int, mask: int) -> None:
        """One event's info records: the directory and name (or, for a change of link count, the file alone)."""
        place: tuple[bytes, bytes, bytes] | None = None
        while at < end:
            kind, _, size = _INFO_HEADER.unpack_from(buf, at)
            if size < _INFO_HEADER.size or at + size > end:
                raise ValueError("a malformed fanotify info record")
            if kind in (_INFO_FID, _INFO_DFID_NAME):
                fsid, handle_bytes, handle_type = _FSID_AND_HANDLE.unpack_from(buf, at + _INFO_HEADER.size)
                start = at + _INFO_HEADER.size + _FSID_AND_HANDLE.size
                handle = struct.pack("=i", handle_type) + buf[start : start + handle_bytes]
                if kind == _INFO_DFID_NAME:
                    name = buf[start + handle_bytes : at + size].split(b"\0", 1)[0]
                    place = (fsid, handle, name)
                elif place is None:
                    # Only the file, no name: a link count changed (link, unlink, rename over it). Kept as
                    # (b"", the file's handle): the name events of the same call say which entries, but not
                    # which other names the file has (see _writes).
                    place = (fsid, b"", handle)
            at += size
        if place is None:
            self._lose_all()
            return
        batch = self._watches.get(place[0])
        if batch is not None:
            batch.add(place[1], place[2], mask)
        # else: a filesystem no longer watched (a closed sandbox's, its events still queued)

    def _lose_all(self) -> None:
        for batch in self._watches.values():
            batch.lost = True
            batch.events += 1
            batch.entries = None

    def _take(self, fsid: bytes) -> Batch:
        with self._lock:
            if self.fd is not None:
                self._drain()
            batch = self._watches.get(fsid)
            if batch is None:
                return Batch(events=1, entries=None, lost=True)
            self._watches[fsid] = Batch()
            return batch

    def _forget(self, fsid: bytes) -> None:
        # The mark goes with the filesystem (unmounted with the sandbox); events already queued for it are dropped
        # when read, as those of a filesystem nobody watches.
        with self._lock:
            self._watches.pop(fsid, None)

    def close(self) -> None:
        with self._lock:
            self._watches.clear()
            if self.fd is not None:
                self._finalizer()
                self.fd = None


class Watch:
    """One sandbox's filesystem, watched."""

    def __init__(self, watcher: Watcher, fsid: bytes):
        self._watcher = watcher
        self._fsid = fsid

    def take(self) -> Batch:
        """What happened there since the last take (or since the watch began)."""
        return self._watcher._take(self._fsid)

    def close(self) -> None:
        self._watcher._forget(self._fsid)


#: Errors of fanotify_init and fanotify_mark already logged.
_logged: set[int] = set()


def _log_once(err: int, message: str, *args: object) -> None:
    if err not in _logged:
        _logged.add(err)
        log.info(message, *args)


def _fsid(path: str) -> bytes:
    """The filesystem id fanotify reports for `path`'s filesystem (statfs's f_fsid: two 32-bit words)."""
    fsid = os.statvfs(path).f_fsid
    with contextlib.suppress(OverflowError):
        return struct.pack("=II", fsid & 0xFFFFFFFF, fsid >> 32)
    raise OSError(errno.EINVAL, f"unexpected filesystem id {fsid!r}")
