"""How a sandbox's root filesystem is made, frozen and restored: one class per isolation mode.

- `OverlayIsolation` (root): kernel overlayfs, each sandbox's in a mount namespace of its own (see _mounts).
- `UsernsIsolation` (no root needed): the same overlays, with `userxattr`, made by a helper process in a user
  namespace of its own; this process reaches them through the helper's /proc/PID/root.
- `CopyIsolation` (no overlayfs): each sandbox and snapshot is a full copy of the workspace (as root, in a
  mount namespace of its own; otherwise in the helper's).

`choose()` tries them in that order (or the one asked for) with a test mount. An isolation makes a
`SandboxRoot` per sandbox: the root's mounts, the observation of changes, the freezing into a snapshot.

**Disk quota.** A sandbox writes only into a tmpfs of its own, `disk` bytes big (and one file per KiB of it):
the overlay modes' upper dirs, which hold everything the sandbox changed since the base (a restored sandbox's
start with a copy of its snapshot's layer), or copy mode's private tree (a tmpfs of the copy's size plus `disk`).
A full quota is an ENOSPC for the writer and `full()` here. Layers are plain directories, not mounts: the number
of mounts stays a few per live sandbox, however many snapshots there are (every command's jail reads the mount
table several times).

Paths: a root's mounts live in its mount space (see _mounts), made there by `space.run(...)` with their own
paths; this process reads and writes files (also inside `run`) through `space.view(path)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import stat
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .._fdtree import OPEN_DIR, Walk, remove_tree
from .._layers import LayerStore, copy_layer, listing, merge_layers
from .._shell import ShellState
from ..base import SandboxError
from ._changes import Batch, Watch, Watcher
from ._deltas import NotIncremental, apply, make_deltas
from ._layout import DEVICES, Layout, build_layout
from ._mounts import HelperMounter, Mounter, MountSpace, PrivateMounter
from ._rundir import mounts_below

__all__ = ["Isolation", "SandboxRoot", "Snapshot", "choose"]

log = logging.getLogger("tvcache")

#: Bytes of quota per file the quota allows (tmpfs's nr_inodes).
_BYTES_PER_INODE = 1024
#: Layers a restore may replay (a full one and deltas on it); the next snapshot copies the upper dirs whole.
MAX_CHAIN = 16
#: A new sandbox's tmpfs skips fewer inode numbers than the first, and holds apart fewer inodes than the second,
#: each drawn at random (see `_scramble`).
SCRAMBLE = (1 << 7, 1 << 6)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A saved sandbox: its shell state and its files."""

    state: ShellState
    layer: str | None = None
    """Overlay modes: the layer holding the snapshot's upper dirs (None: nothing changed from the base)."""
    copy: Path | None = None
    """Copy mode: the snapshot's private tree."""
    size: int = 0
    """Copy mode: the template's bytes and files, which every sandbox gets beyond its quota (a snapshot's copy
    counts against the quota, as its files did in the sandbox it was taken from)."""
    files: int = 0


class Isolation(ABC):
    """What one mode does for every sandbox of a factory."""

    mode: ClassVar[str]

    def __init__(
        self,
        run: Path,
        mounter: Mounter,
        workspace: dict[str, tuple[str, ...]],
        system: str | None,
        *,
        disk: int | None,
    ):
        self.run = run
        self.mounter = mounter
        self.disk = disk
        self.layout: Layout = build_layout(
            self.mode, workspace, system, run / "skeleton", opaque_xattr=mounter.opaque_xattr
        )
        self.changes = Watcher()

    @property
    def inodes(self) -> int | None:
        return None if self.disk is None else max(self.disk // _BYTES_PER_INODE, 1024)

    async def prepare(self) -> Snapshot:
        """The snapshot every new sandbox starts from, made once (its shell state is filled in later)."""
        return Snapshot(ShellState(cwd=b"/"))

    @abstractmethod
    def root(self, box: Path) -> SandboxRoot:
        """A new sandbox's root, to be mounted under the (not yet existing) directory `box`."""

    @abstractmethod
    def acquire(self, snap: Snapshot) -> None:
        """A new snapshot record holds its files."""

    @abstractmethod
    def release(self, snap: Snapshot) -> list[Path]:
        """A snapshot record is deleted: the directories nobody needs any more."""

    async def remove(self, dead: Sequence[Path]) -> None:
        """Delete directories this isolation made."""
        if dead:
            await asyncio.to_thread(_remove_all, dead)

    def mount_binds(self, space: MountSpace, root: str) -> None:
        """The read-only system directories and device stand-ins every root of the layout has."""
        for source, point in self.layout.ro_binds:
            space.bind(source, root + point, readonly=True)
        if self.layout.dev_binds:
            # So this process's file tools see /dev as commands do (devices, which they refuse).
            for name in DEVICES:
                space.bind(f"/dev/{name}", f"{root}/dev/{name}", readonly=False)


class SandboxRoot(ABC):
    """One sandbox's root filesystem, mounted in a space of its own (see _mounts)."""

    def __init__(self, isolation: Isolation, box: Path):
        self.iso = isolation
        self.box = box
        self.path = str(box / "root")
        self._space: MountSpace | None = None
        self._watch: Watch | None = None

    @property
    def space(self) -> MountSpace:
        if self._space is None:
            raise SandboxError("the sandbox's root is not mounted")
        return self._space

    @property
    def view(self) -> str:
        """The root as this process sees it."""
        return self.space.view(self.path)

    async def start(self, snap: Snapshot) -> None:
        """Make the box directory and mount the root in the snapshot's state."""
        self.box.mkdir()
        os.mkdir(self.path)
        self._space = await self.iso.mounter.space(self.box)
        await self._start(snap)

    @abstractmethod
    async def _start(self, snap: Snapshot) -> None: ...

    async def changed(self) -> bool:
        """Did the files change since the last look? From the kernel's account of changes where it keeps one (see
        _changes), else by walking the tree (`_relisted`)."""
        if self._watch is None:
            return await self._relisted()
        batch = self._watch.take()
        self._seen(batch)
        return batch.events > 0

    def _seen(self, batch: Batch) -> None:
        """What the kernel reported since the last look (where it keeps an account)."""
        return None

    @abstractmethod
    async def _relisted(self) -> bool:
        """Did the files change since the last listing (see `_layers.listing`)? Lists them anew."""

    async def _watch_or_list(self) -> None:
        """Once the root is mounted: watch its scratch filesystem for changes, or list its files to compare with."""
        self._watch = self.iso.changes.watch(self.scratch())
        if self._watch is None:
            await self._relisted()

    @abstractmethod
    def scratch(self) -> str:
        """This process's path of the tmpfs the sandbox writes into."""

    def full(self) -> bool:
        """Is the disk quota used up (no block or no file left)?"""
        if self.iso.disk is None:
            return False
        st = os.statvfs(self.scratch())
        return st.f_bavail == 0 or st.f_favail == 0

    @abstractmethod
    async def freeze(self, state: ShellState) -> Snapshot:
        """Save the current files as a snapshot; the sandbox goes on."""

    @abstractmethod
    def _mounts(self) -> list[str]:
        """What to unmount (with everything below) when the sandbox goes."""

    async def remove(self) -> None:
        """Unmount everything and delete the box (the snapshots it made stay)."""
        space, self._space = self._space, None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if space is not None:

            def unmount() -> None:
                for target in self._mounts():
                    with contextlib.suppress(OSError):
                        space.detach(target)

            with contextlib.suppress(OSError, SandboxError):  # the mounts may be gone with the factory
                await space.run(unmount)
            await space.close()
        await self.iso.remove([self.box])


# -- overlay modes -------------------------------------------------------------------------------------------


class OverlayIsolation(Isolation):
    mode = "overlay"

    def __init__(self, run: Path, mounter: Mounter, *args: Any, **kwargs: Any):
        super().__init__(run, mounter, *args, **kwargs)
        self.layers = LayerStore(run / "layers")

    def root(self, box: Path) -> SandboxRoot:
        return LayeredRoot(self, box)

    def acquire(self, snap: Snapshot) -> None:
        self.layers.acquire(_held(snap.layer))

    def release(self, snap: Snapshot) -> list[Path]:
        return self.layers.release(_held(snap.layer))


class UsernsIsolation(OverlayIsolation):
    mode = "userns"

    def __init__(self, run: Path, mounter: Mounter, workspace: dict[str, tuple[str, ...]], *args: Any, **kwargs: Any):
        # In a user namespace the mounts below a directory are locked to it, and overlayfs refuses such a
        # directory as a layer (it would show what they cover).
        for lower in (d for dirs in workspace.values() for d in dirs):
            below = [m for m in mounts_below(Path(lower)) if m != lower]
            if below:
                raise SandboxError(
                    f"userns isolation cannot use {lower} as a layer: it has mounts below it ({', '.join(below[:3])}"
                    f"{', ...' if len(below) > 3 else ''}); use overlay isolation (as root) or a directory without "
                    "mounts inside"
                )
        super().__init__(run, mounter, workspace, *args, **kwargs)


class LayeredRoot(SandboxRoot):
    """Overlays of the layout's lower dirs under upper dirs on the sandbox's own tmpfs.

    A snapshot is a layer: a copy of the upper dirs, taken while the sandbox goes on in them. A sandbox restored
    from it starts with a copy of the layer in its upper dirs. Either way every file stays in the layer where the
    uncached history put it, which commands can see: overlayfs shows a directory's size, link count and times
    from its upper dir (tmpfs counts a directory's entries in its size) or, for a directory only in a lower one,
    from there, and a merged directory has link count 1. Snapshot layers stacked as lower dirs under an empty
    upper would change all of that (`ls -la` printed other sizes after a snapshot than uncached)."""

    iso: OverlayIsolation

    def __init__(self, isolation: OverlayIsolation, box: Path):
        super().__init__(isolation, box)
        self.layer: str | None = None
        """The layer the upper dirs hold the same files as (since the last restore or snapshot); None: empty."""
        self._dirty = False
        self._listings: list[str | None] = [None] * len(isolation.layout.overlays)
        self._changes = Batch()
        """The kernel's account of the changes since the last restore or snapshot (where it keeps one)."""
        self._recent = Batch()
        """The same since the last `take_recent` (a call's changes, for its write set)."""

    def _scratch_mount(self) -> str:
        return str(self.box / "scratch")

    def _mounts(self) -> list[str]:
        return [self.path, self._scratch_mount()]

    def scratch(self) -> str:
        return self.space.view(self._scratch_mount())

    def _upper(self, k: int) -> str:
        return f"{self.scratch()}/u{k}"

    async def _start(self, snap: Snapshot) -> None:
        self.layer = snap.layer
        self.iso.layers.acquire(_held(self.layer))
        await self.space.run(self._new_scratch)
        if self.layer is not None:
            await asyncio.to_thread(self._fill, self.layer)
        await self.space.run(self._mount)
        # Once mounted (mounting sets xattrs on the upper dirs): changes count from here, also a file made and
        # deleted by one command, which leaves an upper dir empty but its times changed.
        await self._watch_or_list()
        self._changes, self._recent = Batch(), Batch()

    def _new_scratch(self) -> None:
        """The tmpfs of the (empty) upper and work dirs."""
        scratch, view = self._scratch_mount(), self.space.view
        os.mkdir(view(scratch))
        held = secrets.randbelow(SCRAMBLE[1])
        self.space.tmpfs(scratch, size=self.iso.disk, inodes=_plus(self.iso.inodes, held))
        _scramble(view(scratch), held)
        for k, mnt in enumerate(self.iso.layout.overlays):
            os.mkdir(view(f"{scratch}/u{k}"))
            os.mkdir(view(f"{scratch}/w{k}"))
            _like_lower_root(view(f"{scratch}/u{k}"), mnt.lowers[-1])

    def _fill(self, layer: str) -> None:
        """Copy the layer into the upper dirs (not mounted yet): its full ancestor, then each delta in turn."""
        layers = self.iso.layers
        full, *deltas = layers.chain(layer)
        for k in range(len(self.iso.layout.overlays)):
            if (frozen := layers.dir(full, k)).is_dir():
                os.rmdir(self._upper(k))
                copy_layer(str(frozen), self._upper(k))
            for delta in deltas:
                apply(str(layers.dir(delta, k)), self._upper(k), layers.deltas[delta][k])

    def _mount(self) -> None:
        """The overlays of the layout's lower dirs under the upper dirs, and the layout's binds."""
        scratch = self._scratch_mount()
        for k, mnt in enumerate(self.iso.layout.overlays):
            target = self.path + (mnt.point if mnt.point != "/" else "")
            self.space.overlay(target, list(reversed(mnt.lowers)), f"{scratch}/u{k}", f"{scratch}/w{k}")
        self.iso.mount_binds(self.space, self.path)

    async def changed(self) -> bool:
        changed = await super().changed()
        self._dirty = self._dirty or changed
        return changed

    def _seen(self, batch: Batch) -> None:
        self._changes.merge(batch)
        self._recent.merge(batch)

    def take_recent(self) -> Batch | None:
        """The kernel's account of the changes since the last take (a call's), or None where it keeps none."""
        recent, self._recent = self._recent, Batch()
        return None if self._watch is None else recent

    async def _relisted(self) -> bool:
        changed = False
        for k, before in enumerate(self._listings):
            self._listings[k] = await asyncio.to_thread(listing, self._upper(k))
            changed = changed or self._listings[k] != before
        return changed

    async def freeze(self, state: ShellState) -> Snapshot:
        """Copy the upper dirs into a new layer, unless nothing changed since the last restore or snapshot.

        No command is running (the caller holds the sandbox) and each one's PID namespace died with it, so
        nothing writes into the upper dirs while they are copied. If the copy fails, the sandbox goes on as if
        no snapshot had been asked for."""
        if self._watch is not None:
            await self.changed()  # anything since the last call, too
        if self._dirty:
            layers = self.iso.layers
            layer_id = await self._delta_layer()
            if layer_id is None:
                layer_id, path = layers.new()
                layers.acquire([layer_id])
                try:
                    for k in range(len(self._listings)):  # an empty one too: its root's times may have changed
                        await asyncio.to_thread(copy_layer, self._upper(k), str(path / str(k)))
                except BaseException:
                    await self.iso.remove(layers.release([layer_id]))
                    raise
            dead = layers.release(_held(self.layer))
            self.layer, self._dirty, self._changes = layer_id, False, Batch()
            await self.iso.remove(dead)
        return Snapshot(state, self.layer)

    async def _delta_layer(self) -> str | None:
        """A new layer as the current one plus the entries changed since (see _deltas), or None where the kernel's
        account cannot tell them (or the chain of deltas is long enough: a restore replays all of it)."""
        layers, parent, entries = self.iso.layers, self.layer, self._changes.entries
        if parent is None or entries is None or self._watch is None or len(layers.chain(parent)) >= MAX_CHAIN:
            return None
        layer_id, path = layers.new(parent)
        layers.acquire([layer_id])
        uppers = [self._upper(k) for k in range(len(self._listings))]
        try:
            layers.deltas[layer_id] = await asyncio.to_thread(
                make_deltas, entries, self.scratch(), self._scratch_mount(), uppers, str(path)
            )
        except (NotIncremental, OSError) as exc:  # the full copy says whether the sandbox itself is the problem
            log.debug("a full snapshot instead of a delta: %s", exc)
            await self.iso.remove(layers.release([layer_id]))
            return None
        except BaseException:
            await self.iso.remove(layers.release([layer_id]))
            raise
        return layer_id

    async def remove(self) -> None:
        await super().remove()
        dead = self.iso.layers.release(_held(self.layer))
        self.layer = None
        await self.iso.remove(dead)


def _like_lower_root(upper: str, lower: str) -> None:
    """Give an upper dir the mode, owner and times of the topmost lower dir's root: overlayfs shows the mount's
    root with the upper dir's, which would otherwise be whenever and however this sandbox was made."""
    st = os.stat(lower)
    with contextlib.suppress(OSError):  # userns mode without root: the helper's own user owns everything
        os.chown(upper, st.st_uid, st.st_gid)
    os.chmod(upper, stat.S_IMODE(st.st_mode))
    os.utime(upper, ns=(st.st_atime_ns, st.st_mtime_ns))


def _scramble(scratch: str, held: int) -> None:
    """Start the new tmpfs `scratch`'s inode numbers at a random point, and hold `held` of its inodes apart (its
    quota of files was raised by as many).

    A restore can give the files neither the inode numbers they had nor `df -i` the count it had: tmpfs numbers
    files from a counter of its own that no call reads or sets (a file opened with O_TMPFILE and closed, as Python's
    TemporaryFile does, takes a number and leaves no trace), and overlayfs takes numbers and links of its own in
    the same filesystem (its work dir at each mount, one whiteout all whiteouts link to, copy-up files) in an order
    a restore cannot replay. So every sandbox draws them, as Docker's come from a filesystem shared with the
    machine: an answer that prints them differs between two uncached runs, and is in the exceptions to the
    correctness invariant (docs/threat-model.md)."""
    for _ in range(secrets.randbelow(SCRAMBLE[0])):
        os.close(os.open(scratch, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600))
    if not held:
        return
    try:
        # tmpfs (Linux 6.6 on) counts an xattr's bytes against its files, a KiB each (with room for its own
        # bookkeeping): one call where as many links would take as many. On the root, which no command sees.
        os.setxattr(scratch, "user.tvcache.held", bytes(held * 1024 - 512))
    except OSError:
        first = os.path.join(scratch, "held")
        os.close(os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        for i in range(1, held):
            os.link(first, f"{first}.{i}")  # tmpfs counts each link as a file


def _plus(limit: int | None, more: int) -> int | None:
    return None if limit is None else limit + more


def _held(layer: str | None) -> list[str]:
    return [] if layer is None else [layer]


# -- copy mode -------------------------------------------------------------------------------------------------


class CopyIsolation(Isolation):
    mode = "copy"

    async def prepare(self) -> Snapshot:
        lowers = [lower for mnt in self.layout.overlays for lower in mnt.lowers]
        need = sum(await asyncio.gather(*(asyncio.to_thread(_du, lower) for lower in lowers)))
        st = os.statvfs(self.run)
        if need > st.f_bavail * st.f_frsize // 4:
            raise SandboxError(
                f"copy isolation copies the whole workspace into every sandbox and snapshot, and this one holds "
                f"{need / 1e9:.1f} GB against {st.f_bavail * st.f_frsize / 1e9:.1f} GB free in {self.run.parent}: "
                "use overlay or userns isolation, or a smaller workspace"
            )
        template = self.run / "template"
        template.mkdir()
        for mnt in self.layout.overlays:
            dest = str(template) + (mnt.point if mnt.point != "/" else "")
            if len(mnt.lowers) == 1:
                await copy_tree(mnt.lowers[0], dest)
            else:
                # Layers (an image's, say) hold whiteouts and opaque directories: flatten them as overlayfs
                # would show them, rather than copy one over the other.
                await asyncio.to_thread(_flatten, list(reversed(mnt.lowers)), dest, self.mounter.opaque_xattr)
        size, files = await asyncio.to_thread(_usage, str(template))
        return Snapshot(ShellState(cwd=b"/"), copy=template, size=size, files=files)

    def root(self, box: Path) -> SandboxRoot:
        return CopiedRoot(self, box)

    def acquire(self, snap: Snapshot) -> None:
        return None  # a copy belongs to its one record

    def release(self, snap: Snapshot) -> list[Path]:
        return [] if snap.copy is None else [snap.copy]


class CopiedRoot(SandboxRoot):
    """A private copy of the snapshot's tree on a tmpfs of its own, bound as the root.

    Copies are made by `copy_layer`, like the overlay modes' layers: it keeps each directory's listing order and
    the access times of what it reads, which `cp -a` does not."""

    def __init__(self, isolation: Isolation, box: Path):
        super().__init__(isolation, box)
        self._data = str(box / "data")
        self._tree = f"{self._data}/tree"
        self._listing: str | None = None
        self._base: Snapshot | None = None

    def _mounts(self) -> list[str]:
        return [self.path, self._data]

    def scratch(self) -> str:
        return self.space.view(self._data)

    async def _start(self, snap: Snapshot) -> None:
        assert snap.copy is not None
        self._base = snap
        disk, inodes = self.iso.disk, self.iso.inodes

        def mount() -> None:
            os.mkdir(self.space.view(self._data))
            held = secrets.randbelow(SCRAMBLE[1])
            self.space.tmpfs(
                self._data,
                size=None if disk is None else snap.size + disk,
                inodes=None if inodes is None else snap.files + inodes + held,
            )
            _scramble(self.space.view(self._data), held)

        await self.space.run(mount)
        tree = self.space.view(self._tree)
        await asyncio.to_thread(copy_layer, str(snap.copy), tree)

        def bind() -> None:
            self.space.bind(self._tree, self.path, readonly=False)
            self.iso.mount_binds(self.space, self.path)

        await self.space.run(bind)
        await self._watch_or_list()

    async def _relisted(self) -> bool:
        now = await asyncio.to_thread(listing, self.space.view(self._tree))
        changed = now != self._listing
        self._listing = now
        return changed

    async def freeze(self, state: ShellState) -> Snapshot:
        dest = self.iso.run / "copies" / secrets.token_hex(6)
        dest.parent.mkdir(exist_ok=True)
        try:
            await asyncio.to_thread(copy_layer, self.space.view(self._tree), str(dest))
        except BaseException:
            await self.iso.remove([dest])
            raise
        # The same quota as this sandbox's, of which the copy uses part, as the sandbox did.
        assert self._base is not None
        return Snapshot(state, copy=dest, size=self._base.size, files=self._base.files)


def _remove_all(paths: Sequence[Path]) -> None:
    for path in paths:
        remove_tree(path)


def _flatten(layers_top_first: list[str], dest: str, opaque_xattr: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(dest)  # a mount point the skeleton made, empty: the layers give it its metadata
    merge_layers(layers_top_first, [], dest, opaque_xattr)


def _du(root: str) -> int:
    """Bytes the files under `root` occupy, on its own filesystem only (as a copy would take them)."""
    found = subprocess.run(["du", "-s", "-x", "-B1", root], capture_output=True, text=True, check=False)
    try:
        return int(found.stdout.split()[0])
    except (IndexError, ValueError):
        raise SandboxError(f"cannot measure {root}: {found.stderr.strip()}") from None


class _Usage(Walk):
    size = files = 0

    def on_dir(self, fds: list[int], name: str, st: os.stat_result) -> None:
        self.files += 1

    def on_other(self, fds: list[int], name: str, st: os.stat_result) -> None:
        self.files += 1
        self.size += st.st_blocks * 512


def _usage(root: str) -> tuple[int, int]:
    """Bytes of the files under `root` (as tmpfs counts them) and how many entries it has."""
    fd = os.open(root, OPEN_DIR)
    try:
        usage = _Usage([fd])
        usage.run()
    finally:
        os.close(fd)
    return usage.size, usage.files


async def copy_tree(src: str, dest: str) -> None:
    """`cp -a` the contents of `src` into the (existing or new) directory `dest`, without crossing into other
    filesystems (as overlayfs would not)."""
    proc = await asyncio.create_subprocess_exec(
        "cp", "-a", "--one-file-system", "--reflink=auto", "--", src + "/.", dest, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxError(f"copying {src} to {dest} failed: {err.decode(errors='replace').strip()}")


# -- choosing -------------------------------------------------------------------------------------------------

_MODES: dict[str, type[Isolation]] = {"overlay": OverlayIsolation, "userns": UsernsIsolation, "copy": CopyIsolation}


def choose(
    isolation: str,
    run: Path,
    workspace: dict[str, tuple[str, ...]],
    system: str | None,
    *,
    disk: int | None,
) -> Isolation:
    """The first isolation mode that works here, in the order overlay, userns, copy (or the one asked for)."""
    if isolation not in ("auto", *_MODES):
        raise ValueError(f"isolation must be 'auto', 'overlay', 'userns' or 'copy', got {isolation!r}")
    if shutil.which("nsenter") is None:
        raise SandboxError("workspace sandboxes need `nsenter` (util-linux) on PATH")
    order = list(_MODES) if isolation == "auto" else [isolation]
    errors = []
    for mode in order:
        mounter: Mounter | None = None
        try:
            if mode == "overlay" and os.geteuid() != 0:
                raise SandboxError("needs root (CAP_SYS_ADMIN)")
            mounter = PrivateMounter() if mode != "userns" and os.geteuid() == 0 else HelperMounter()
            mounter.probe(run / f"probe-{mode}", overlay=mode != "copy")
            return _MODES[mode](run, mounter, workspace, system, disk=disk)
        except (OSError, SandboxError) as exc:
            if mounter is not None:
                mounter.close()
            errors.append(f"{mode}: {exc}")
    raise SandboxError("no workspace isolation works on this machine (" + "; ".join(errors) + ")")
