"""Read-only layers of frozen overlay upper dirs: reference counts, merging, listings.

A layer is a directory `<root>/<id>/` with one subdirectory per overlay mount of the sandbox layout (named by
the mount's index): a copy of a sandbox's upper dirs, which restores copy back (see workspace._isolation). A
layer lives as long as some snapshot or live sandbox holds a reference to it. `merge_layers` flattens an image's layers.

Layers hold what overlayfs puts into an upper dir: files, directories, whiteouts (character devices 0/0)
and opaque directories (an `overlay.opaque` xattr). Mounts never create redirect or metacopy xattrs (see
workspace._mounts), so that is all `merge` has to understand.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import secrets
import stat
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from ._fdtree import OPEN_DIR, TreeChanged, Walk, open_below

__all__ = ["LayerStore", "copy_layer", "is_empty", "listing", "listing_digest", "merge_layers", "relisted"]


def is_empty(path: str) -> bool:
    with os.scandir(path) as it:
        return next(it, None) is None


class _Lister(Walk):
    """Hashes every entry's place, inode, size, times and mode, in name order (see `listing`)."""

    def __init__(self, root: int):
        super().__init__([root])
        self.hash = hashlib.blake2b(digest_size=16)

    def order(self, names: list[str]) -> list[str]:
        return sorted(names)

    def _add(self, name: str, st: os.stat_result) -> None:
        # Depth and name, in depth-first order, say where an entry is as well as its path would.
        fields = (len(self._stack), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)
        self.hash.update(b"%d %d %d %d %d %o " % fields + os.fsencode(name) + b"\0")

    def on_dir(self, fds: list[int], name: str, st: os.stat_result) -> None:
        self._add(name, st)

    def on_other(self, fds: list[int], name: str, st: os.stat_result) -> None:
        self._add(name, st)


def listing(root: str) -> str:
    """A digest of everything under `root` (the root itself included) for change detection: each entry's path,
    inode, size, mtime, ctime and mode. A digest, not the list: a sandbox of 200k files would otherwise keep tens
    of MiB of listing in this process."""
    fd = os.open(root, OPEN_DIR)
    try:
        lister = _Lister(fd)
        lister._add(".", os.fstat(fd))
        lister.run()
    finally:
        os.close(fd)
    return lister.hash.hexdigest()


#: Top-level directories of a whole root filesystem that hold the host's volatile pseudo files, not its state.
PSEUDO_TOPS = frozenset({b"proc", b"sys", b"dev", b"run"})
#: What `find` prints per entry: its relative path, then type, mode, owner, group, size, mtime, symlink target.
_FIND_FORMAT = "%P\\0%y %m %U %G %s %T@ %l\\0"


async def relisted(upper: str, previous: str | None) -> tuple[bool, str | None]:
    """Whether the upper dir `upper` changed since its `previous` listing (None: never listed), and its listing
    now. An upper dir nothing wrote to is empty, which is checked in microseconds without listing it."""
    if previous is None and is_empty(upper):
        return False, None
    now = await asyncio.to_thread(listing, upper)
    return now != previous, now


def listing_digest(roots: Iterable[str]) -> str:
    """A hash of the trees under `roots`: paths, types, modes, owners, sizes, mtimes and symlink targets.

    File contents are not read: `find` walks the tree (a 300 MB base in milliseconds, a whole root filesystem
    of 400k files in a few seconds), and a change that keeps a file's size and mtime is not seen. Only each
    root's own filesystem counts, as overlayfs shows it (a mount point appears, empty); a root that is a
    filesystem's `/` leaves out /proc, /sys, /dev and /run. A directory that cannot be read counts as empty.
    """
    h = hashlib.blake2b(digest_size=16)
    for root in roots:
        h.update(b"\0root\0" + os.fsencode(root))
        found = subprocess.run(
            ["find", root, "-xdev", "-printf", _FIND_FORMAT], capture_output=True, check=False, env={"LC_ALL": "C"}
        )
        if found.returncode != 0 and not found.stdout:
            raise OSError(f"cannot walk {root}: {found.stderr.decode(errors='replace').strip()}")
        fields = found.stdout.split(b"\0")
        entries = sorted(zip(fields[0:-1:2], fields[1::2], strict=True))
        if os.path.realpath(root) == "/":
            entries = [e for e in entries if e[0].split(b"/", 1)[0] not in PSEUDO_TOPS]
        h.update(b"".join(b"%s\0%s\n" % entry for entry in entries))
    return h.hexdigest()


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str, xattr: str) -> bool:
    try:
        return os.getxattr(path, xattr, follow_symlinks=False) in (b"y", b"x")
    except OSError:
        return False


class Ref(NamedTuple):
    """An entry named by a directory descriptor and one component (`dir_fd` None: `name` is a path of ours)."""

    dir_fd: int | None
    name: str

    @property
    def path(self) -> str:
        """A path for the calls that take no directory descriptor (the xattr ones): through the descriptor's
        /proc link, so only the last component is looked up, and never followed (they are called with
        follow_symlinks=False)."""
        return self.name if self.dir_fd is None else f"/proc/self/fd/{self.dir_fd}/{self.name}"


def _copy_metadata(src: Ref, st: os.stat_result, dest: Ref, *, overlay_xattrs: bool = False) -> None:
    """Give `dest` the xattrs, owner, mode and times of `src` (whose lstat is `st`); `dest` is this process's own
    new entry, `src` is never followed if it is a symlink."""
    # Owner first: a chown clears set-uid bits and `security.capability`, which the mode and xattrs then restore.
    os.chown(dest.name, st.st_uid, st.st_gid, dir_fd=dest.dir_fd, follow_symlinks=False)
    for name in os.listxattr(src.path, follow_symlinks=False):
        if ".overlay." in name and not overlay_xattrs:
            continue  # overlayfs bookkeeping (origin, impure, opaque) belongs to the source layer
        try:
            os.setxattr(dest.path, name, os.getxattr(src.path, name, follow_symlinks=False), follow_symlinks=False)
        except OSError as exc:  # e.g. security.* xattrs this process may not set: skipped
            # But not for want of room (tmpfs counts xattrs against its files): a copy without its opaque mark
            # would bring back, on restore, the files the sandbox had deleted.
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dest.name, stat.S_IMODE(st.st_mode), dir_fd=dest.dir_fd)
    os.utime(dest.name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dest.dir_fd, follow_symlinks=False)


class _Links:
    """The first copy of each file with several hard links, so that the others become links to it: as paths
    relative to the directory descriptor `root` (None: absolute paths)."""

    def __init__(self, root: int | None):
        self.root = root
        self.first: dict[tuple[int, int], str] = {}


def _link(links: _Links, first: str, dest: Ref) -> None:
    """Make `dest` a hard link to the copy at `first`, however deep that lies."""
    try:
        os.link(first, dest.name, src_dir_fd=links.root, dst_dir_fd=dest.dir_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG or links.root is None:
            raise
        *parents, name = first.split("/")
        fd = open_below(links.root, parents)  # past PATH_MAX: one component at a time
        try:
            os.link(name, dest.name, src_dir_fd=fd, dst_dir_fd=dest.dir_fd, follow_symlinks=False)
        finally:
            os.close(fd)


def _copy_file(src: Ref, st: os.stat_result, dest: Ref) -> None:
    """Copy the regular file `src` (lstat `st`), opened without following a symlink, and only if it is still the
    file that was stat'ed. Its holes stay holes (`du` and `df` see the same), and its access time stays as it was."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(src.name, flags | os.O_NOATIME, dir_fd=src.dir_fd)
    except PermissionError:  # O_NOATIME needs the file's owner or CAP_FOWNER
        fd = os.open(src.name, flags, dir_fd=src.dir_fd)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            raise TreeChanged(f"{src.name!r} was replaced while it was copied")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(dest.name, flags, 0o600, dir_fd=dest.dir_fd)
        try:
            _copy_data(fd, out, now.st_size)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _copy_data(src_fd: int, dest_fd: int, size: int) -> None:
    """Copy a file's bytes, only its data extents (SEEK_DATA), so that a sparse file's copy is as sparse."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src_fd, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            break
        end = os.lseek(src_fd, start, os.SEEK_HOLE)
        os.lseek(dest_fd, start, os.SEEK_SET)
        while start < end:
            copied = os.sendfile(dest_fd, src_fd, start, end - start)  # layers and upper dirs: two filesystems
            if copied == 0:
                break
            start += copied
        offset = end
    os.ftruncate(dest_fd, size)


def _copy_entry(
    src: Ref, st: os.stat_result, dest: Ref, links: _Links, rel: str, *, overlay_xattrs: bool = False
) -> None:
    """Copy the non-directory `src` (lstat `st`) to `dest`; `rel` is where `dest` is for `links`."""
    key = (st.st_dev, st.st_ino)
    if st.st_nlink > 1 and key in links.first:
        # A hard link made inside the sandbox stays one.
        _link(links, links.first[key], dest)
        return
    mode = st.st_mode
    if stat.S_ISREG(mode):
        _copy_file(src, st, dest)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(src.name, dir_fd=src.dir_fd), dest.name, dir_fd=dest.dir_fd)
    else:
        # Whiteouts, FIFOs, sockets (a name `ls -la` shows, without a listener, as after a reboot) and device nodes
        # (a base's, in copy mode: a sandbox cannot make one, and every mount is nodev).
        os.mknod(dest.name, mode, st.st_rdev, dir_fd=dest.dir_fd)
    _copy_metadata(src, st, dest, overlay_xattrs=overlay_xattrs)
    if st.st_nlink > 1:
        links.first[key] = rel


class _LayerCopy(Walk):
    """copy_layer's walk: the source tree and the copy in step."""

    def __init__(self, src: int, dest: int):
        super().__init__([src, dest])
        self.links = _Links(dest)

    def order(self, names: list[str]) -> list[str]:
        # tmpfs, where layers live, lists a directory newest first. Creating the copies in reverse listing order
        # makes the copy list in the same order as the original, so that `find`, `os.listdir` or a glob print
        # the same order in a sandbox restored from a snapshot as in the sandbox that took it (an uncached run).
        return names[::-1]

    def on_dir(self, fds: list[int], name: str, st: os.stat_result) -> None:
        os.mkdir(name, 0o700, dir_fd=fds[1])

    def on_other(self, fds: list[int], name: str, st: os.stat_result) -> None:
        rel = "/".join([*self.parts, name])
        _copy_entry(Ref(fds[0], name), st, Ref(fds[1], name), self.links, rel, overlay_xattrs=True)

    def after_dir(self, fds: list[int], name: str, st: os.stat_result, inner: list[int]) -> None:
        # Times last: filling the directory changed its mtime.
        _copy_metadata(Ref(fds[0], name), st, Ref(fds[1], name), overlay_xattrs=True)


def copy_layer(src: str, dest: str) -> None:
    """Copy a frozen upper dir to the new directory `dest` as it is: whiteouts, opaque directories and the rest
    of overlayfs's xattrs, hard links between its files, times (directories' after their contents).

    `src` is a tree the sandbox wrote: it is walked relative to directory descriptors without following any
    symlink (see _fdtree), so whatever it holds, the copy holds nothing from outside it; a tree that changes
    under the copy is a `TreeChanged` error."""
    src_fd = os.open(src, OPEN_DIR)
    try:
        os.mkdir(dest, 0o700)
        dest_fd = os.open(dest, OPEN_DIR)
        try:
            _LayerCopy(src_fd, dest_fd).run()
            # "." of each descriptor: the /proc/self/fd link itself is a symlink, which calls that do not follow
            # one would change instead of the directory (its times, owner and xattrs were lost).
            _copy_metadata(Ref(src_fd, "."), os.fstat(src_fd), Ref(dest_fd, "."), overlay_xattrs=True)
        finally:
            os.close(dest_fd)
    finally:
        os.close(src_fd)


def _fill_dir(
    stack: list[str], below: list[str], dest: str, xattr: str, links: _Links
) -> list[tuple[list[str], list[str], str, bool]]:
    """Write into the existing dir `dest` the union of `stack` (the same directory in several layers,
    topmost first), all but the subdirectories' contents; returns those, as `_fill_dir`'s arguments and
    whether the subdirectory is opaque, in the order they were made. `below` are the directories at this path
    in the base layers under the merged ones.

    Whiteouts and opaque marks are kept only where they hide something in `below`: overlayfs reads a
    directory that exists in one layer alone as it is, so a whiteout left there would show up as a file.
    """
    seen: set[str] = set()
    # Topmost layer first, each newest first: the order one upper dir holding them all would list (see below).
    chosen: list[tuple[int, os.DirEntry[str]]] = []
    for i, layer_dir in enumerate(stack):
        with os.scandir(layer_dir) as it:
            for entry in it:
                if entry.name not in seen:
                    seen.add(entry.name)
                    chosen.append((i, entry))
    subdirs = []
    for i, entry in reversed(chosen):  # see _LayerCopy.order
        st = entry.stat(follow_symlinks=False)
        target = os.path.join(dest, entry.name)
        if is_whiteout(st):
            if any(os.path.lexists(os.path.join(b, entry.name)) for b in below):
                os.mknod(target, stat.S_IFCHR, 0)
        elif stat.S_ISDIR(st.st_mode):
            sub = [entry.path]
            cut = _is_opaque(entry.path, xattr)
            for lower in stack[i + 1 :] if not cut else ():
                path = os.path.join(lower, entry.name)
                try:
                    lst = os.lstat(path)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(lst.st_mode):
                    cut = True  # a file or whiteout there hid everything further down
                    break
                sub.append(path)
                if _is_opaque(path, xattr):
                    cut = True
                    break
            sub_below = [p for b in below if os.path.isdir(p := os.path.join(b, entry.name))]
            os.mkdir(target)
            subdirs.append((sub, [] if cut else sub_below, target, cut and bool(sub_below)))
        else:
            _copy_entry(Ref(None, entry.path), st, Ref(None, target), links, target)
    return subdirs


def merge_layers(layers_top_first: list[str], base: list[str], dest: str, opaque_xattr: str) -> None:
    """Flatten several layers of one mount into the new layer `dest`, as overlayfs would show them over
    the directories `base` (the mount's fixed lower layers, which stay beneath the new one).

    Files are copied, not hard-linked: a link would change the link count that `ls -l` shows in sandboxes.
    Layers are this process's own copies, so paths serve; the walk keeps its own stack, for trees of any depth.
    """
    os.mkdir(dest)
    if not layers_top_first:
        return
    links = _Links(None)
    # Work items: a directory to fill, or (after its contents) one whose metadata to copy.
    work: list[tuple[bool, list[str], list[str], str, bool]] = [(False, layers_top_first, [], dest, False)]
    work.append((True, layers_top_first, base, dest, False))
    while work:
        fill, stack, below, target, opaque = work.pop()
        if not fill:
            _copy_metadata(Ref(None, stack[0]), os.lstat(stack[0]), Ref(None, target))
            continue
        for sub, sub_below, sub_target, sub_opaque in reversed(_fill_dir(stack, below, target, opaque_xattr, links)):
            work.append((False, sub, sub_below, sub_target, sub_opaque))
            work.append((True, sub, sub_below, sub_target, sub_opaque))
        if opaque:
            os.setxattr(target, opaque_xattr, b"y")


class LayerStore:
    """Reference-counted layer directories under `root`. A layer may be a delta on a parent layer (which it holds a
    reference to): what it adds is in `deltas`, in the form its user keeps (see workspace._deltas)."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir()
        self._refs: dict[str, int] = {}
        self._parents: dict[str, str] = {}
        self.deltas: dict[str, Any] = {}

    def new(self, parent: str | None = None) -> tuple[str, Path]:
        layer_id = secrets.token_hex(6)
        path = self.root / layer_id
        path.mkdir()
        self._refs[layer_id] = 0
        if parent is not None:
            self._parents[layer_id] = parent
            self._refs[parent] += 1
        return layer_id, path

    def chain(self, layer_id: str) -> list[str]:
        """The layers `layer_id` is made of, a full one first, then each delta on it in turn."""
        chain = [layer_id]
        while chain[-1] in self._parents:
            chain.append(self._parents[chain[-1]])
        return chain[::-1]

    def dir(self, layer_id: str, mount: int) -> Path:
        return self.root / layer_id / str(mount)

    def acquire(self, stack: Iterable[str]) -> None:
        for layer_id in stack:
            self._refs[layer_id] += 1

    def release(self, stack: Iterable[str]) -> list[Path]:
        """Drop one reference to each layer; returns the directories of layers nobody uses any more."""
        dead = []
        todo = list(stack)
        while todo:
            layer_id = todo.pop()
            self._refs[layer_id] -= 1
            if self._refs[layer_id] == 0:
                del self._refs[layer_id]
                self.deltas.pop(layer_id, None)
                dead.append(self.root / layer_id)
                if layer_id in self._parents:
                    todo.append(self._parents.pop(layer_id))
        return dead

    def __len__(self) -> int:
        return len(self._refs)
