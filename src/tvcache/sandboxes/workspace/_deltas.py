"""Incremental snapshots: a layer as its parent layer plus copies of the entries changed since (a delta).

A sandbox's upper dirs change between two snapshots in the entries the kernel reported (see _changes: directory
handles and names). `make_deltas` turns that account into one `Delta` per upper dir, with copies of the changed
entries under the new layer's directory; `apply` replays a delta onto an upper dir that holds the parent layer's
files, which is how a restore materialises a chain (a full layer, then each delta in turn).

What a delta records for an entry, at its path (a tuple of names below the upper dir):

- `gone`: no longer there;
- `new`: made (created, renamed there, replaced) since the parent: copied whole, a directory with its subtree.
  Each is made again after everything the parent had, in the order the sandbox made them (its directory's listing
  order, newest first on tmpfs), so that listings print in the same order as in the sandbox;
- `meta`: the same entry, changed in place: a file's bytes, and any entry's owner, mode, times and xattrs (a
  directory's after its contents). In place, so its place in the listing and its hard links stay.

What the kernel's account cannot tell a delta raises `NotIncremental` and the caller copies the whole upper dir
as before: a directory whose path cannot be read back (longer than PATH_MAX) or checked, a new entry with other
hard links (the delta would copy it apart from them), a handle this process may not open.

Entries are opened relative to directory descriptors without following symlinks (see _fdtree), on a frozen sandbox,
as every copy of what a sandbox wrote.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from .._fdtree import OPEN_DIR, TreeChanged, _Remover, open_below
from .._layers import Ref, _copy_data, _copy_entry, _copy_metadata, _LayerCopy, _Links, is_whiteout
from ._changes import NAME_EVENTS

__all__ = ["Delta", "NotIncremental", "Places", "apply", "make_deltas", "open_handle"]

Parts = tuple[str, ...]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]


class NotIncremental(Exception):
    """The changes cannot be told as a delta: copy the whole upper dir."""


@dataclass(frozen=True, slots=True)
class Delta:
    """One upper dir's changes since the parent layer (see the module docstring); `meta` holds (path, is a
    directory), directories deepest first."""

    gone: tuple[Parts, ...] = ()
    new: tuple[Parts, ...] = ()
    meta: tuple[tuple[Parts, bool], ...] = ()


# -- from the kernel's account to paths ---------------------------------------------------------------------


def open_handle(mount_fd: int, handle: bytes, *, directory: bool = True) -> int | None:
    """An O_PATH descriptor of the directory (or, not `directory`, anything) `handle` names (type first, as
    _changes keeps it); None if it is gone."""
    (kind,) = struct.unpack_from("=i", handle)
    raw = struct.pack("=Ii", len(handle) - 4, kind) + handle[4:]
    flags = os.O_PATH | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    fd: int = _libc.open_by_handle_at(mount_fd, raw, flags)
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err in (errno.ESTALE, errno.ENOENT):
        return None
    raise NotIncremental(f"open_by_handle_at: {os.strerror(err)}")


class Places:
    """Where the directories named by handles are: (upper dir index, path below it), or None (gone, or not in an
    upper dir: overlayfs's work dirs)."""

    def __init__(self, scratch: str, mount_path: str, uppers: list[int]):
        self.mount_fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.prefix = mount_path.rstrip("/") + "/"
        self.uppers = uppers
        self._known: dict[bytes, tuple[int, Parts] | None] = {}

    def close(self) -> None:
        os.close(self.mount_fd)

    def find(self, handle: bytes) -> tuple[int, Parts] | None:
        if handle not in self._known:
            self._known[handle] = self._find(handle)
        return self._known[handle]

    def _find(self, handle: bytes) -> tuple[int, Parts] | None:
        fd = open_handle(self.mount_fd, handle)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if st.st_nlink == 0:
                return None  # removed: its parent's account says so
            try:
                # The path in the sandbox's mount namespace (a directory has one); checked below, never trusted.
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError as exc:
                raise NotIncremental(f"the path of a changed directory: {exc}") from exc
            if not path.startswith(self.prefix):
                raise NotIncremental(f"a changed directory outside the sandbox's scratch: {path!r}")
            top, *parts = path[len(self.prefix) :].split("/")
            if top.startswith("w") and top[1:].isdigit():
                return None
            if not (top.startswith("u") and top[1:].isdigit() and int(top[1:]) < len(self.uppers)):
                raise NotIncremental(f"a changed directory outside the upper dirs: {path!r}")
            k = int(top[1:])
            try:
                found = open_below(self.uppers[k], tuple(parts))
            except OSError as exc:
                raise NotIncremental(f"{path!r} is not where it was: {exc}") from exc
            try:
                there = os.fstat(found)
            finally:
                os.close(found)
            if (there.st_dev, there.st_ino) != (st.st_dev, st.st_ino):
                raise NotIncremental(f"{path!r} is not where it was")
            return k, tuple(parts)
        finally:
            os.close(fd)


# -- making a delta ---------------------------------------------------------------------------------------------


def _lstat(root: int, parts: Parts) -> os.stat_result | None:
    try:
        fd = open_below(root, parts[:-1])
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)


def _linked(st: os.stat_result) -> bool:
    """A non-directory with other hard links, which a copy would separate from them. Not whiteouts: overlayfs links
    them all to one inode of its work dir, and nothing can see a whiteout's links (or the whiteout)."""
    return not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1 and not is_whiteout(st)


def _under(parts: Parts, cut: set[Parts]) -> bool:
    return any(parts[:i] in cut for i in range(len(parts)))


def _plan(root: int, touched: dict[Parts, bool], dirs: set[Parts]) -> Delta:
    """One upper dir's delta from the entries touched there ({path: its name changed}) and the directories whose
    own metadata may have changed."""
    gone: list[Parts] = []
    new: list[Parts] = []
    meta: list[tuple[Parts, bool]] = []
    whole: set[Parts] = set()  # copied or removed with everything below
    for parts in sorted(touched, key=len):
        if _under(parts, whole):
            continue
        st = _lstat(root, parts)
        if st is None:
            gone.append(parts)
            whole.add(parts)
        elif touched[parts]:
            if _linked(st):
                raise NotIncremental(f"{parts[-1]!r} was linked or renamed with other hard links")
            new.append(parts)
            whole.add(parts)
        elif stat.S_ISDIR(st.st_mode):
            dirs.add(parts)
        else:
            meta.append((parts, False))
    for parts in sorted(dirs, key=len, reverse=True):
        if not _under(parts, whole) and parts not in whole:
            meta.append((parts, True))
    return Delta(tuple(gone), tuple(_made_in_order(root, new)), tuple(meta))


def _made_in_order(root: int, new: list[Parts]) -> list[Parts]:
    """`new` in the order to make them: per directory, as the sandbox made them (the reverse of tmpfs's listing)."""
    by_dir: dict[Parts, list[str]] = {}
    for parts in new:
        by_dir.setdefault(parts[:-1], []).append(parts[-1])
    ordered: list[Parts] = []
    for parent, names in by_dir.items():
        if len(names) > 1:
            wanted = set(names)
            fd = open_below(root, parent)
            try:
                position = {name: i for i, name in enumerate(os.listdir(fd)) if name in wanted}
            finally:
                os.close(fd)
            if len(position) < len(wanted):  # one went between the plan and this listing: not what the kernel said
                raise NotIncremental(f"{sorted(wanted - position.keys())[0]!r} went while the delta was planned")
            names.sort(key=lambda name: -position[name])
        ordered.extend((*parent, name) for name in names)
    return ordered


class _NoLinks(_LayerCopy):
    """A new directory's subtree, copied; a file in it with other hard links cannot be told apart from one without."""

    def on_other(self, fds: list[int], name: str, st: os.stat_result) -> None:
        if _linked(st):
            raise NotIncremental(f"{name!r} in a new directory has other hard links")
        super().on_other(fds, name, st)


def _copy_whole(src_dir: int, dest_dir: int, name: str) -> None:
    """Copy the entry `name` (a directory with its subtree) from one directory descriptor to another."""
    st = os.stat(name, dir_fd=src_dir, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        _copy_entry(Ref(src_dir, name), st, Ref(dest_dir, name), _Links(dest_dir), name, overlay_xattrs=True)
        return
    os.mkdir(name, 0o700, dir_fd=dest_dir)
    src, dest = os.open(name, OPEN_DIR, dir_fd=src_dir), os.open(name, OPEN_DIR, dir_fd=dest_dir)
    try:
        opened = os.fstat(src)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise TreeChanged(f"{name!r} was replaced while it was copied")
        _NoLinks(src, dest).run()
        _copy_metadata(Ref(src, "."), os.fstat(src), Ref(dest, "."), overlay_xattrs=True)
    finally:
        os.close(src)
        os.close(dest)


@contextlib.contextmanager
def _dirs(root: int, parts: Parts, *, make: bool = False) -> Iterator[int]:
    """The directory at `parts` below `root` (made, as a plain container, where `make` and missing)."""
    fd = os.open(".", OPEN_DIR, dir_fd=root)
    try:
        for name in parts:
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
            inner = os.open(name, OPEN_DIR, dir_fd=fd)
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def _write(upper: int, dest: int, delta: Delta) -> None:
    """Copy what `delta` needs from the upper dir into the new layer's directory `dest`."""
    for parts in delta.new:
        with _dirs(upper, parts[:-1]) as src, _dirs(dest, parts[:-1], make=True) as out:
            _copy_whole(src, out, parts[-1])
    for parts, is_dir in delta.meta:  # directories after what is below them (deepest first)
        where = parts if is_dir else parts[:-1]
        with _dirs(upper, where) as src, _dirs(dest, where, make=True) as out:
            if is_dir:
                _copy_metadata(Ref(src, "."), os.fstat(src), Ref(out, "."), overlay_xattrs=True)
            else:
                st = os.stat(parts[-1], dir_fd=src, follow_symlinks=False)
                _copy_entry(Ref(src, parts[-1]), st, Ref(out, parts[-1]), _Links(out), parts[-1], overlay_xattrs=True)


def make_deltas(
    entries: dict[tuple[bytes, bytes], int], scratch: str, mount_path: str, uppers: list[str], dest: str
) -> list[Delta]:
    """The deltas of the upper dirs `uppers` (this process's paths; the k-th is `u<k>` below the scratch tmpfs,
    reached at `scratch` here and mounted at `mount_path` in the sandbox's mount namespace) since the layer they
    held when the account `entries` began, copied into `dest/<k>` (`dest` exists)."""
    roots = [os.open(upper, OPEN_DIR) for upper in uppers]
    places = Places(scratch, mount_path, roots)
    try:
        touched: list[dict[Parts, bool]] = [{} for _ in roots]
        dirs: list[set[Parts]] = [set() for _ in roots]
        for (handle, name), mask in entries.items():
            if not handle:
                continue  # a link count changed (the file's handle in `name`); the name events say where
            place = places.find(handle)
            if place is None:
                continue
            k, parts = place
            if name == b".":
                dirs[k].add(parts)
                continue
            item = (*parts, os.fsdecode(name))
            renamed = bool(mask & NAME_EVENTS)
            touched[k][item] = touched[k].get(item, False) or renamed
            if renamed:
                dirs[k].add(parts)
        deltas = [_plan(root, touched[k], dirs[k]) for k, root in enumerate(roots)]
        for k, (root, delta) in enumerate(zip(roots, deltas, strict=True)):
            os.mkdir(f"{dest}/{k}", 0o700)
            out = os.open(f"{dest}/{k}", OPEN_DIR)
            try:
                _write(root, out, delta)
            finally:
                os.close(out)
        return deltas
    finally:
        places.close()
        for fd in roots:
            os.close(fd)


# -- replaying a delta ------------------------------------------------------------------------------------------


def _remove(dir_fd: int, name: str) -> None:
    """Remove the entry `name` of the directory descriptor `dir_fd`, a directory with everything in it."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, OPEN_DIR, dir_fd=dir_fd)
    try:
        _Remover([fd]).run()
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _sync_metadata(src: Ref, st: os.stat_result, dest: Ref) -> None:
    """Give the existing entry `dest` exactly the metadata of `src`: xattrs it no longer has are removed."""
    keep = set(os.listxattr(src.path, follow_symlinks=False))
    for name in os.listxattr(dest.path, follow_symlinks=False):
        if name not in keep:
            with contextlib.suppress(OSError):
                os.removexattr(dest.path, name, follow_symlinks=False)
    _copy_metadata(src, st, dest, overlay_xattrs=True)


def _empty(dir_fd: int, name: str) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def _rewrite(src_dir: int, dest_dir: int, name: str) -> None:
    """The regular file `name` gets the bytes and metadata of the delta's copy, in place (its hard links too)."""
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_dir)
    try:
        st = os.fstat(src)
        out = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dest_dir)
        try:
            os.ftruncate(out, 0)
            _copy_data(src, out, st.st_size)
        finally:
            os.close(out)
    finally:
        os.close(src)
    _sync_metadata(Ref(src_dir, name), st, Ref(dest_dir, name))


def apply(layer: str, upper: str, delta: Delta) -> None:
    """Replay `delta`, whose copies are in the directory `layer`, onto `upper` (this process's own tree, holding the
    parent layer's files)."""
    src_root, dest_root = os.open(layer, OPEN_DIR), os.open(upper, OPEN_DIR)
    try:
        for parts in (*delta.gone, *delta.new):
            with _dirs(dest_root, parts[:-1]) as out:
                _remove(out, parts[-1])
        # Every file rewritten in place is emptied before anything is written, so that the upper dir only grows
        # from here to the state the delta ends in, which fitted the sandbox's disk quota. In the order the
        # sandbox changed them, a file that grew before another one shrank needed more than the quota: such a
        # snapshot could never be restored ("No space left on device").
        stats: dict[Parts, os.stat_result] = {}  # of the layer's copies, which nothing changes
        for parts, is_dir in delta.meta:
            if not is_dir:
                with _dirs(src_root, parts[:-1]) as src, _dirs(dest_root, parts[:-1]) as out:
                    st = stats[parts] = os.stat(parts[-1], dir_fd=src, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        _empty(out, parts[-1])
        for parts in delta.new:
            with _dirs(src_root, parts[:-1]) as src, _dirs(dest_root, parts[:-1]) as out:
                _copy_whole(src, out, parts[-1])
        for parts, is_dir in delta.meta:
            if is_dir:
                with _dirs(src_root, parts) as src, _dirs(dest_root, parts) as out:
                    _sync_metadata(Ref(src, "."), os.fstat(src), Ref(out, "."))
                continue
            with _dirs(src_root, parts[:-1]) as src, _dirs(dest_root, parts[:-1]) as out:
                st = stats[parts]
                if stat.S_ISREG(st.st_mode):
                    _rewrite(src, out, parts[-1])
                else:
                    _sync_metadata(Ref(src, parts[-1]), st, Ref(out, parts[-1]))
    finally:
        os.close(src_root)
        os.close(dest_root)
