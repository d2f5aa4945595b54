"""What a workspace sandbox's root is made of, and the skeleton layer that holds it together.

The user names workspace directories and the mount points where they appear (`/testbed`), plus a system
root that provides bash and the tools (by default the host's `/`, read-only). This module turns that into
mounts for the active isolation mode:

- overlay (root): one overlay for `/` = system root + skeleton, one per workspace mount point.
- userns: the host's `/` cannot be an overlay lower inside a user namespace (its submounts are locked), so
  each top-level system directory without submounts (`/usr`, `/etc`, `/var`, ...) becomes an overlay of its
  own, over a root made of the skeleton alone; device nodes are bound from the host.
- copy: no overlays; the sandbox is a private copy of skeleton + workspaces, with the top-level system
  directories bound read-only (only the workspaces, /tmp, /root, /home and new top-level paths are writable).

The skeleton is a small layer of our own on top of the system root: empty, opaque /proc, /sys, /dev, /tmp and
/run (so the host's contents there never show through), device nodes, and the mount points. Its device nodes
(and the binds standing in for them) only show this process's file tools what commands see: every mount is
`nodev`, and each command gets the host's /dev/null & co. bound afresh (see _jail).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEVICES", "Layout", "OverlayMount", "build_layout", "system_dirs"]

HOST_ROOT = "/"

#: Top-level directories a sandbox gets fresh and empty (opaque over the system root), with their modes.
SPECIAL_DIRS = {"proc": 0o555, "sys": 0o555, "dev": 0o755, "tmp": 0o1777, "run": 0o755}
#: Device nodes every sandbox has: name -> (major, minor).
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1"}
_DEV_LINKS["stderr"] = "/proc/self/fd/2"
#: Top-level host directories never exposed as system directories when the root must be assembled.
_NEVER_SYSTEM = {*SPECIAL_DIRS, "lost+found", "mnt", "media"}
#: Kept writable (and empty) in copy mode instead of being bound read-only from the host.
_COPY_WRITABLE = {"root", "home"}


@dataclass(frozen=True, slots=True)
class OverlayMount:
    point: str
    """Where it appears inside the sandbox: "/" first, then deeper points."""
    lowers: tuple[str, ...]
    """Host directories, bottom first."""


@dataclass(frozen=True, slots=True)
class Layout:
    overlays: tuple[OverlayMount, ...]
    """Overlay modes: the mounts, in mount order. Copy mode: the trees copied into the private root."""
    ro_binds: tuple[tuple[str, str], ...]
    """(host directory, point) bound read-only over the root (copy mode's system directories)."""
    dev_binds: bool
    """Bind /dev/null & co. from the host instead of relying on the skeleton's device nodes."""
    skeleton: str


def _submount_tops() -> set[str]:
    """Top-level names under which (or on which) something is mounted."""
    tops = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4].encode().decode("unicode_escape")
            if target != "/":
                tops.add(target.split("/")[1])
    return tops


def system_dirs(workspace_points: list[str], *, copy: bool) -> list[str]:
    """Top-level directories of the host's `/` to mount one by one when `/` itself cannot be a lower."""
    busy = _submount_tops() | {p.split("/")[1] for p in workspace_points if p != "/"}
    names = []
    for entry in sorted(os.scandir(HOST_ROOT), key=lambda e: e.name):
        if entry.is_symlink() or not entry.is_dir() or entry.name in _NEVER_SYSTEM or entry.name in busy:
            continue
        if copy and entry.name in _COPY_WRITABLE:
            continue
        names.append(entry.name)
    return names


def _mkdir_like(path: Path, like: str | None, default_mode: int = 0o755) -> None:
    """Create `path` with the mode, owner and times of the host directory `like`, when there is one."""
    path.mkdir(exist_ok=True)
    try:
        st = os.stat(like) if like else None
    except OSError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(OSError):
            os.chown(path, st.st_uid, st.st_gid)
        os.chmod(path, stat.S_IMODE(st.st_mode))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        os.chmod(path, default_mode)


def make_skeleton(
    path: Path,
    *,
    system_root: str | None,
    points: list[str],
    system_names: list[str],
    extra_dirs: list[str],
    device_nodes: bool,
    opaque_xattr: str | None,
) -> None:
    """Build the skeleton layer at `path` (see the module docstring)."""
    path.mkdir()
    for name, mode in SPECIAL_DIRS.items():
        d = path / name
        d.mkdir()
        os.chmod(d, mode)
        if opaque_xattr:
            os.setxattr(d, opaque_xattr, b"y")
    for sub, mode in (("shm", 0o1777), ("pts", 0o755)):
        (path / "dev" / sub).mkdir()
        os.chmod(path / "dev" / sub, mode)
    for name, (major, minor) in DEVICES.items():
        node = path / "dev" / name
        if device_nodes:
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(major, minor))
            os.chmod(node, 0o666)
        else:
            node.touch(mode=0o666)  # a mount point for the host's node
    for name, target in _DEV_LINKS.items():
        os.symlink(target, path / "dev" / name)
    # Mount points and their parents, looking like the system's own directories where those exist.
    for point in [*points, *(f"/{n}" for n in [*system_names, *extra_dirs])]:
        parts = [p for p in point.split("/") if p]
        for i in range(1, len(parts) + 1):
            rel = "/".join(parts[:i])
            like = posixpath.join(system_root, rel) if system_root else None
            _mkdir_like(path / rel, like, 0o700 if rel == "root" else 0o755)
    if system_names or extra_dirs:
        # The root is assembled from pieces: the host's top-level symlinks (bin -> usr/bin) come along.
        for entry in os.scandir(HOST_ROOT):
            if entry.is_symlink() and not (path / entry.name).exists():
                os.symlink(os.readlink(entry.path), path / entry.name)
    _mkdir_like(path, system_root or HOST_ROOT)
    _pin_times(path, system_root or HOST_ROOT)


#: The timestamp of skeleton entries the system root lacks: fixed, so `ls -l /` is the same in every process.
_EPOCH_NS = 946_684_800 * 10**9  # 2000-01-01


def _pin_times(skeleton: Path, system_root: str) -> None:
    """Give skeleton entries the times of the system's counterparts, or a fixed time for our own (the
    special directories and anything the system lacks). Children first: creating one touches its parent."""
    for dirpath, dirnames, filenames in os.walk(skeleton, topdown=False):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for full in [*(os.path.join(dirpath, n) for n in [*filenames, *links]), dirpath]:
            rel = os.path.relpath(full, skeleton)
            times = (_EPOCH_NS, _EPOCH_NS)
            if rel.split("/")[0] not in SPECIAL_DIRS:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(system_root, rel))
                    times = (st.st_atime_ns, st.st_mtime_ns)
            os.utime(full, ns=times, follow_symlinks=False)


def build_layout(
    mode: str,
    workspace: dict[str, tuple[str, ...]],
    system: str | None,
    skeleton: Path,
    *,
    opaque_xattr: str | None,
) -> Layout:
    """Make the skeleton at `skeleton` and return the mounts of `mode` (overlay, userns or copy)."""
    points = sorted((p for p in workspace if p != "/"), key=lambda p: (p.count("/"), p))
    root_lowers = workspace.get("/", (system,) if system else ())
    host_system = "/" not in workspace and system is not None and os.path.realpath(system) == HOST_ROOT
    assemble = host_system and mode != "overlay"
    names = system_dirs(points, copy=mode == "copy") if assemble else []
    extra = sorted(_COPY_WRITABLE) if assemble and mode == "copy" else []
    make_skeleton(
        skeleton,
        system_root=root_lowers[-1] if root_lowers else None,
        points=points,
        system_names=names,
        extra_dirs=extra,
        device_nodes=mode == "overlay",
        opaque_xattr=opaque_xattr if mode != "copy" else None,
    )
    sk = str(skeleton)
    overlays: list[OverlayMount] = []
    binds: list[tuple[str, str]] = []
    if assemble:
        overlays.append(OverlayMount("/", (sk,)))
        if mode == "copy":
            binds = [(f"/{n}", f"/{n}") for n in names]
        else:
            overlays += [OverlayMount(f"/{n}", (f"/{n}",)) for n in names]
    else:
        overlays.append(OverlayMount("/", (*root_lowers, sk)))
    overlays += [OverlayMount(p, workspace[p]) for p in points]
    return Layout(tuple(overlays), tuple(binds), dev_binds=mode != "overlay", skeleton=sk)
