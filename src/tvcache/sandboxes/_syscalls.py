"""Thin ctypes wrappers for the Linux system calls the workspace sandboxes need and Python does not expose.

- The new mount API (`fsopen`/`fsconfig`/`fsmount`/`move_mount`): an overlay gets its lower layers one
  `lowerdir+` call at a time, so a deep stack is not limited by the 4 KiB option page of mount(2).
- `open_tree` + `mount_setattr` for read-only bind mounts that also work inside a user namespace.
- `mount(2)`/`umount2(2)` for the rest (tmpfs, moves), and as the fallback where `lowerdir+` is unknown
  (kernels < 6.8).

Every mount made here is `nosuid,nodev`: a device node or set-uid file in a layer is inert.
- `openat2(RESOLVE_IN_ROOT)`: open a path as a sandbox sees it, absolute symlinks and `..` included, without
  ever leaving the sandbox's root.

The numbers of system calls added since Linux 5.1 are the same on every architecture.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

from ._threads import in_own_thread

__all__ = [
    "MNT_DETACH",
    "MS_BIND",
    "MS_NODEV",
    "MS_NOSUID",
    "MS_PRIVATE",
    "MS_REC",
    "RESOLVE_IN_ROOT",
    "TMPFS_MAGIC",
    "bind_mount",
    "filesystem_type",
    "mount",
    "new_netns",
    "openat2",
    "overlay_mount",
    "setns",
    "tmpfs_mount",
    "umount",
    "unshare",
]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_FSOPEN = 430
_SYS_FSCONFIG = 431
_SYS_FSMOUNT = 432
_SYS_OPENAT2 = 437
_SYS_MOUNT_SETATTR = 442

_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_FSOPEN_CLOEXEC = 0x1
_FSCONFIG_SET_FLAG = 0
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_FSMOUNT_CLOEXEC = 0x1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_OPEN_TREE_CLONE = 0x1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_MOUNT_ATTR_RDONLY = 0x1
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
TMPFS_MAGIC = 0x01021994


def _raise(what: str, detail: str = "") -> None:
    err = ctypes.get_errno()
    message = f"{what}: {os.strerror(err)}"
    raise OSError(err, message + (f" ({detail})" if detail else ""))


def filesystem_type(path: str) -> int:
    """statfs's `f_type` of the filesystem holding `path` (a magic number such as TMPFS_MAGIC): the first field of
    struct statfs on every Linux ABI, a long."""
    buf = ctypes.create_string_buffer(256)  # larger than struct statfs anywhere
    if _libc.statfs(os.fsencode(path), buf) != 0:
        _raise("statfs", path)
    return ctypes.c_long.from_buffer(buf).value


def _syscall(number: int, *args: object) -> int:
    return int(_libc.syscall(ctypes.c_long(number), *args))


def _context_log(fd: int) -> str:
    """The messages a filesystem context logged (why fsconfig refused an option), joined."""
    lines = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        lines.append(data.decode(errors="replace").strip())
    return "; ".join(lines)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else os.fsencode(s) for s in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        _raise(f"mount {fstype or ''} {source or ''} on {target}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    if _libc.umount2(os.fsencode(target), flags) != 0:
        _raise(f"umount {target}")


def _move_mount(mount_fd: int, target: str) -> None:
    res = _syscall(
        _SYS_MOVE_MOUNT,
        ctypes.c_int(mount_fd),
        ctypes.c_char_p(b""),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(os.fsencode(target)),
        ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
    )
    if res < 0:
        _raise(f"move_mount onto {target}")


class LowerdirPlusUnsupported(OSError):
    """The kernel's overlayfs does not know `lowerdir+` (before Linux 6.8): use mount(2) instead."""


def overlay_mount(target: str, lowers: list[str], upper: str, work: str, options: dict[str, str | None]) -> None:
    """Mount an overlay on `target` with the new mount API. `lowers` are topmost first.

    `options` are extra fsconfig keys: a string value, or None for a flag such as `userxattr`.
    Raises `LowerdirPlusUnsupported` when the kernel predates `lowerdir+`.
    """
    fd = _syscall(_SYS_FSOPEN, ctypes.c_char_p(b"overlay"), ctypes.c_uint(_FSOPEN_CLOEXEC))
    if fd < 0:
        if ctypes.get_errno() in (38, 19):  # ENOSYS, ENODEV: no new mount API or no overlayfs
            raise LowerdirPlusUnsupported(ctypes.get_errno(), "fsopen(overlay) is not available")
        _raise("fsopen overlay")
    try:

        def config(key: str, value: str | None) -> None:
            if value is None:
                args: tuple[object, ...] = (ctypes.c_uint(_FSCONFIG_SET_FLAG), key.encode(), None)
            else:
                args = (ctypes.c_uint(_FSCONFIG_SET_STRING), key.encode(), os.fsencode(value))
            if _syscall(_SYS_FSCONFIG, ctypes.c_int(fd), *args, ctypes.c_int(0)) < 0:
                errno = ctypes.get_errno()
                log = _context_log(fd)
                if key == "lowerdir+" and errno == 22 and ("Unknown parameter" in log or not log):
                    raise LowerdirPlusUnsupported(errno, f"overlayfs: {log}")
                _raise(f"overlay option {key}={value}", log)

        for lower in lowers:
            config("lowerdir+", lower)
        config("upperdir", upper)
        config("workdir", work)
        for key, value in options.items():
            config(key, value)
        if _syscall(_SYS_FSCONFIG, ctypes.c_int(fd), ctypes.c_uint(_FSCONFIG_CMD_CREATE), None, None, 0) < 0:
            _raise(f"overlay on {target}", _context_log(fd))
        attrs = ctypes.c_uint(_MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV)
        mfd = _syscall(_SYS_FSMOUNT, ctypes.c_int(fd), ctypes.c_uint(_FSMOUNT_CLOEXEC), attrs)
        if mfd < 0:
            _raise(f"fsmount overlay for {target}", _context_log(fd))
        try:
            _move_mount(mfd, target)
        finally:
            os.close(mfd)
    finally:
        os.close(fd)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def bind_mount(source: str, target: str, *, readonly: bool) -> None:
    """Bind `source` (one mount, not its submounts) onto `target`, `nosuid,nodev`, optionally read-only.

    open_tree + mount_setattr sets flags on the new mount alone, which unlike a MS_REMOUNT also works in a
    user namespace (where the source's locked flags must otherwise be repeated exactly).
    """
    fd = _syscall(
        _SYS_OPEN_TREE,
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(os.fsencode(source)),
        ctypes.c_uint(_OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC),
    )
    if fd < 0:
        _raise(f"open_tree {source}")
    try:
        attr = _MountAttr(attr_set=_MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | (_MOUNT_ATTR_RDONLY if readonly else 0))
        res = _syscall(
            _SYS_MOUNT_SETATTR,
            ctypes.c_int(fd),
            ctypes.c_char_p(b""),
            ctypes.c_uint(_AT_EMPTY_PATH),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        )
        if res < 0:
            _raise(f"set the flags of a bind of {source}")
        _move_mount(fd, target)
    finally:
        os.close(fd)


def tmpfs_mount(target: str, *, size: int | None, inodes: int | None) -> None:
    """A private tmpfs on `target`, holding at most `size` bytes and `inodes` files (None: no limit)."""
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={size or 0},nr_inodes={inodes or 0}")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = RESOLVE_IN_ROOT) -> int:
    """openat2(2): open `path` relative to `dirfd`; with RESOLVE_IN_ROOT, `dirfd` acts as "/"."""
    how = _OpenHow(flags=flags | os.O_CLOEXEC, mode=mode, resolve=resolve | RESOLVE_NO_MAGICLINKS)
    fd = _syscall(
        _SYS_OPENAT2,
        ctypes.c_int(dirfd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


_CLONE_NEWNET = 0x40000000
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
CLONE_FS = 0x200
CLONE_NEWNS = 0x20000
CLONE_NEWNET = _CLONE_NEWNET


def setns(fd: int, nstype: int) -> None:
    """Move the calling thread into the namespace `fd` refers to."""
    if _libc.setns(fd, nstype) != 0:
        _raise(f"setns({nstype:#x})")


def unshare(flags: int) -> None:
    """Give the calling thread namespaces (or attributes) of its own."""
    if _libc.unshare(flags) != 0:
        _raise(f"unshare({flags:#x})")


_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def new_netns() -> int:
    """A new network namespace with loopback up, as an open file descriptor (which keeps it alive).

    A thread may switch network namespaces on its own, so a short-lived thread makes the namespace and
    leaves the rest of the process where it was; a failure cannot strand any other thread.
    """

    def work() -> int:
        if _libc.unshare(_CLONE_NEWNET) != 0:
            _raise("unshare(CLONE_NEWNET)")
        _loopback_up()
        return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    return in_own_thread(work, "tvcache-netns")
