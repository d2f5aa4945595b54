"""Read-only layers of frozen overlay upper dirs: reference counts, merging, listings.

A layer is a directory `<root>/<id>/` with one subdirectory per overlay mount of the sandbox layout (named by
the mount's index) for each mount that had changed when the layer was frozen. A stack is a tuple of layer ids,
oldest first. A layer lives as long as some snapshot or live sandbox holds a reference to it.

Layers hold what overlayfs puts into an upper dir: files, directories, whiteouts (character devices 0/0)
and opaque directories (an `overlay.opaque` xattr). Mounts never create redirect or metacopy xattrs (see
_mounts), so that is all `merge` has to understand.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import shutil
import stat
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["LayerStore", "copy_layer", "is_empty", "listing", "listing_digest", "merge_layers", "relisted"]

#: One entry of a change-detection listing: (relative path, inode, size, mtime, ctime, mode).
Entry = tuple[str, int, int, int, int, int]


def is_empty(path: str) -> bool:
    with os.scandir(path) as it:
        return next(it, None) is None


def _walk(root: str, rel: str = "") -> Iterator[tuple[str, os.stat_result]]:
    with os.scandir(os.path.join(root, rel) if rel else root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        path = f"{rel}/{entry.name}" if rel else entry.name
        st = entry.stat(follow_symlinks=False)
        yield path, st
        if stat.S_ISDIR(st.st_mode):
            yield from _walk(root, path)


def listing(root: str) -> list[Entry]:
    """Everything under `root` (the root itself included) as change-detection entries, sorted by path."""
    st = os.lstat(root)
    out: list[Entry] = [(".", st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)]
    for path, st in _walk(root):
        out.append((path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode))
    return out


#: Top-level directories of a whole root filesystem that hold the host's volatile pseudo files, not its state.
PSEUDO_TOPS = frozenset({b"proc", b"sys", b"dev", b"run"})
#: What `find` prints per entry: its relative path, then type, mode, owner, group, size, mtime, symlink target.
_FIND_FORMAT = "%P\\0%y %m %U %G %s %T@ %l\\0"


async def relisted(upper: str, previous: list[Entry] | None) -> tuple[bool, list[Entry] | None]:
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


def _copy_metadata(src: str, st: os.stat_result, dest: str, *, overlay_xattrs: bool = False) -> None:
    for name in os.listxattr(src, follow_symlinks=False):
        if ".overlay." in name and not overlay_xattrs:
            continue  # overlayfs bookkeeping (origin, impure, opaque) belongs to the source layer
        with contextlib.suppress(OSError):  # e.g. security.* xattrs this process may not set
            os.setxattr(dest, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    os.chown(dest, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dest, stat.S_IMODE(st.st_mode))
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_entry(
    src: str, st: os.stat_result, dest: str, links: dict[tuple[int, int], str], *, overlay_xattrs: bool = False
) -> None:
    key = (st.st_dev, st.st_ino)
    if st.st_nlink > 1 and key in links:
        os.link(links[key], dest, follow_symlinks=False)  # a hard link made inside the sandbox stays one
        return
    mode = st.st_mode
    if stat.S_ISREG(mode):
        shutil.copyfile(src, dest)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(src), dest)
    elif is_whiteout(st) or stat.S_ISFIFO(mode):
        os.mknod(dest, mode, st.st_rdev)
    else:
        return  # sockets are not state worth keeping; a device node is not a sandbox's to keep
    _copy_metadata(src, st, dest, overlay_xattrs=overlay_xattrs)
    if st.st_nlink > 1:
        links[key] = dest


def _in_creation_order(directory: str) -> list[os.DirEntry[str]]:
    """The entries of `directory` in the order to create their copies in.

    tmpfs, where layers live, lists a directory newest first. Creating the copies in reverse listing order makes
    the copy list in the same order as the original, so that `find`, `os.listdir` or a glob print the same order
    in a sandbox restored from a snapshot as in the sandbox that took it (an uncached run)."""
    with os.scandir(directory) as it:
        return list(it)[::-1]


def copy_layer(src: str, dest: str) -> None:
    """Copy a frozen upper dir to the new directory `dest` as it is: whiteouts, opaque directories and the rest
    of overlayfs's xattrs, hard links between its files, times (directories' after their contents)."""
    links: dict[tuple[int, int], str] = {}

    def copy_dir(src_dir: str, dest_dir: str) -> None:
        for entry in _in_creation_order(src_dir):
            st = entry.stat(follow_symlinks=False)
            target = os.path.join(dest_dir, entry.name)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(target)
                copy_dir(entry.path, target)
                _copy_metadata(entry.path, st, target, overlay_xattrs=True)
            else:
                _copy_entry(entry.path, st, target, links, overlay_xattrs=True)

    os.mkdir(dest)
    copy_dir(src, dest)
    _copy_metadata(src, os.lstat(src), dest, overlay_xattrs=True)


def _merge_dir(
    stack: list[str], below: list[str], dest: str, opaque: bool, xattr: str, links: dict[tuple[int, int], str]
) -> None:
    """Write into the existing dir `dest` the union of `stack` (the same directory in several layers,
    topmost first). `below` are the directories at this path in the base layers under the merged ones.

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
    for i, entry in reversed(chosen):  # see _in_creation_order
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
            _merge_dir(sub, [] if cut else sub_below, target, cut and bool(sub_below), xattr, links)
            _copy_metadata(entry.path, st, target)
        else:
            _copy_entry(entry.path, st, target, links)
    if opaque:
        os.setxattr(dest, xattr, b"y")


def merge_layers(layers_top_first: list[str], base: list[str], dest: str, opaque_xattr: str) -> None:
    """Flatten several layers of one mount into the new layer `dest`, as overlayfs would show them over
    the directories `base` (the mount's fixed lower layers, which stay beneath the new one).

    Files are copied, not hard-linked: a link would change the link count that `ls -l` shows in sandboxes.
    """
    os.mkdir(dest)
    if layers_top_first:
        _merge_dir(layers_top_first, base, dest, False, opaque_xattr, {})
        _copy_metadata(layers_top_first[0], os.lstat(layers_top_first[0]), dest)


class LayerStore:
    """Reference-counted layer directories under `root`."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir()
        self._refs: dict[str, int] = {}

    def new(self) -> tuple[str, Path]:
        layer_id = secrets.token_hex(6)
        path = self.root / layer_id
        path.mkdir()
        self._refs[layer_id] = 0
        return layer_id, path

    def dir(self, layer_id: str, mount: int) -> Path:
        return self.root / layer_id / str(mount)

    def acquire(self, stack: Iterable[str]) -> None:
        for layer_id in stack:
            self._refs[layer_id] += 1

    def release(self, stack: Iterable[str]) -> list[Path]:
        """Drop one reference to each layer; returns the directories of layers nobody uses any more."""
        dead = []
        for layer_id in stack:
            self._refs[layer_id] -= 1
            if self._refs[layer_id] == 0:
                del self._refs[layer_id]
                dead.append(self.root / layer_id)
        return dead

    def __len__(self) -> int:
        return len(self._refs)
