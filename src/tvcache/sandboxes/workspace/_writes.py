"""Write sets of workspace calls: the state keys (see _reads) of every path a call changed, from the kernel's account.

The kernel reports each entry a call changed in the sandbox's upper dirs (see _changes: a directory handle and a
name; the same account incremental snapshots copy, see _deltas). The write set digests those paths only, in the
sandbox's root after the call, so its cost is the call's changes, not the sandbox's size:

- an entry changed in place (content, mode, owner, times, xattrs): its `path:`, `list:` and `walk:` digests, and
  its directory's;
- an entry whose name changed (made, removed, renamed away or there; a whiteout made for a deletion, a directory
  made opaque): the same, and `below:<path>` = "" (see `Outcome`): nothing that was below it is there any more
  but what the write set names. If it is a directory now, every path below it (the merged view,
  so a renamed directory brings what the lower dirs have below it) is digested too, walked relative to directory
  descriptors (see _fdtree), at any depth;
- a file's link count changed (a hard link made or removed): the kernel names the inode, not a path. Its one name
  is read back and checked; with several names (or a name that cannot be checked) the write set is unknown.

What the account cannot tell makes the write set unknown (None), never a partial one: no account kept (no fanotify
here), a queue overflow, more entries than a batch keeps, a directory handle that leads outside the upper dirs, any
error reading the tree, more keys than a store keeps for one edge. The cache core then reuses by exact history
only from there on.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat

from .._fdtree import OPEN_DIR, Walk, open_below
from .._layers import is_whiteout
from ..base import BELOW
from ._changes import NAME_EVENTS
from ._deltas import NotIncremental, Places, open_handle
from ._reads import Digester

__all__ = ["write_set"]

_KINDS = ("path", "list", "walk")
#: Keys one write set may hold (what a store keeps for one edge, stores.wire.MAX_STATE_KEYS); beyond, unknown.
_MAX_KEYS = 100_000


class _Below(Walk):
    """The paths below a directory of the sandbox's root (`top`, its canonical path)."""

    def __init__(self, fd: int, top: str):
        super().__init__([fd])
        self.top = top
        self.found: list[str] = []

    def _add(self, name: str) -> None:
        self.found.append(posixpath.join(self.top, *self.parts, name))

    def on_dir(self, fds: list[int], name: str, st: os.stat_result) -> None:
        self._add(name)

    def on_other(self, fds: list[int], name: str, st: os.stat_result) -> None:
        self._add(name)


def _below(digests: Digester, path: str) -> list[str]:
    """Every path below `path` in the root, if it is a directory there."""
    try:
        fd = digests.open_canonical(path, OPEN_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink, not a directory
            return []
        raise
    try:
        walk = _Below(fd, path)
        walk.run()
        return walk.found
    finally:
        os.close(fd)


def _ancestors(path: str) -> list[str]:
    found = []
    while path != "/":
        path = posixpath.dirname(path)
        found.append(path)
    return found


def _sandbox_path(point: str, parts: tuple[str, ...]) -> str:
    return posixpath.join(point, *parts) if parts else point


def _linked(places: Places, handle: bytes, points: list[str]) -> str | bool | None:
    """The sandbox path of the file whose link count changed (`handle`), False if nothing can see the change (it
    has no name left, or is a whiteout), None if its names cannot be told."""
    fd = open_handle(places.mount_fd, handle, directory=False)
    if fd is None:
        return False
    try:
        st = os.fstat(fd)
        if st.st_nlink == 0 or is_whiteout(st):  # whiteouts: overlayfs links them to one inode nothing shows
            return False
        if stat.S_ISDIR(st.st_mode):
            place = places.find(handle)
            return False if place is None else _sandbox_path(points[place[0]], place[1])
        if st.st_nlink > 1:
            return None  # other names, which the kernel does not report, show the new link count
        path = os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    if not path.startswith(places.prefix):
        return None
    top, *parts = path[len(places.prefix) :].split("/")
    if not (top.startswith("u") and top[1:].isdigit() and int(top[1:]) < len(places.uppers)) or not parts:
        return None
    k = int(top[1:])
    try:
        parent = open_below(places.uppers[k], parts[:-1])
    except OSError:
        return None
    try:
        there = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(parent)
    if (there.st_dev, there.st_ino) != (st.st_dev, st.st_ino):
        return None
    return _sandbox_path(points[k], tuple(parts))


def write_set(
    entries: dict[tuple[bytes, bytes], int],
    scratch: str,
    mount_path: str,
    overlays: list[tuple[str, str]],
    root: str,
    cache: dict[tuple[int, ...], str],
) -> dict[str, str] | None:
    """The write set of a call whose changes the kernel reported as `entries` (see _changes.Batch), or None.

    `overlays` are (mount point in the sandbox, this process's path of its upper dir), the k-th upper dir being
    `u<k>` below the scratch tmpfs (reached at `scratch` here, mounted at `mount_path` in the sandbox's mount
    namespace); `root` is the sandbox's root here."""
    points = [point for point, _ in overlays]
    uppers = [os.open(upper, OPEN_DIR) for _, upper in overlays]
    places = Places(scratch, mount_path, uppers)
    try:
        touched: set[str] = set()
        renamed: set[str] = set()
        for (handle, name), mask in entries.items():
            if not handle:  # a link count changed: `name` is the file's own handle
                path = _linked(places, name, points)
                if path is None:
                    return None
                if path:
                    touched.add(str(path))
                continue
            place = places.find(handle)
            if place is None:
                continue  # a directory since removed (its parent's account says so), or a work dir
            here = _sandbox_path(points[place[0]], place[1])
            touched.add(here)
            if name != b".":
                path = posixpath.join(here, os.fsdecode(name))
                touched.add(path)
                if mask & NAME_EVENTS:
                    renamed.add(path)
        with Digester(root, cache) as digests:
            walked: set[str] = set()
            for path in sorted(renamed, key=len):  # a directory's walk covers what was renamed below it
                if not any(a in walked for a in _ancestors(path)):
                    walked.add(path)
                    touched.update(_below(digests, path))
            if len(touched) * len(_KINDS) + len(renamed) > _MAX_KEYS:
                return None
            keys = {f"{kind}:{path}": digests.key(f"{kind}:{path}") for path in touched for kind in _KINDS}
        keys.update({BELOW + path: "" for path in renamed})
        return keys
    except (NotIncremental, OSError):
        return None
    finally:
        places.close()
        for fd in uppers:
            os.close(fd)
