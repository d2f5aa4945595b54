"""File tools served without starting a shell: read_file, write_file, list_dir.

Paths are resolved as the sandbox would resolve them: relative to the shell's working directory, with
absolute symlinks and `..` confined to the sandbox's root by openat2(RESOLVE_IN_ROOT). They run in this
process through the mounted root, so they cost microseconds instead of a namespace set-up.

They run with this process's privileges, so they touch nothing but regular files and directories: a path is
first opened with O_PATH (which opens nothing), its type checked, and only a regular file is then reopened
for reading or writing through /proc/self/fd, the very inode that was checked. A device node, FIFO or socket
(also behind a symlink) is refused with "Not a regular file", without ever being opened.

Each returns a JSON-able dict: {"content": str}, {"written": int} or {"entries": [names, dirs with "/"]},
or {"error": "<reason>: <path>"} for an ordinary failure (a missing file is an answer, not a sandbox fault).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
from typing import Any

from ._shell import BoundedOutput, truncated_text
from ._syscalls import openat2

__all__ = ["list_dir", "read_file", "write_file"]


def _sandbox_path(cwd: bytes, path: str) -> bytes:
    raw = os.fsencode(path)
    return raw if raw.startswith(b"/") else posixpath.join(cwd, raw)


def _error(exc: OSError, path: str) -> dict[str, Any]:
    return {"error": f"{os.strerror(exc.errno or errno.EIO)}: {path}"}


def _open_root(root: str) -> int:
    return os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


class _NotRegular(Exception):
    def __init__(self, answer: dict[str, Any]):
        self.answer = answer


def _reopen(path_fd: int, path: str, flags: int) -> int:
    """Open the inode behind an O_PATH descriptor with `flags`, if it is a regular file; closes `path_fd`."""
    try:
        mode = os.fstat(path_fd).st_mode
        if stat.S_ISDIR(mode):
            raise _NotRegular({"error": f"Is a directory: {path}"})
        if not stat.S_ISREG(mode):
            raise _NotRegular({"error": f"Not a regular file: {path}"})
        return os.open(f"/proc/self/fd/{path_fd}", flags | os.O_CLOEXEC)
    finally:
        os.close(path_fd)


def read_file(root: str, cwd: bytes, path: str, limit: int) -> dict[str, Any]:
    """The file's text; beyond `limit` bytes its middle is cut out as in bash output."""
    rfd = _open_root(root)
    try:
        fd = _reopen(openat2(rfd, os.fsdecode(_sandbox_path(cwd, path)), os.O_PATH), path, os.O_RDONLY)
    except _NotRegular as refused:
        return refused.answer
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(rfd)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            half = limit // 2
            head = os.pread(fd, half, 0)
            tail = os.pread(fd, limit - half, st.st_size - (limit - half))
            return {"content": truncated_text(head, tail, st.st_size)}
        out = BoundedOutput(limit)
        while chunk := os.read(fd, 1 << 20):
            out.feed(chunk)
        return {"content": out.text()}
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(fd)


def _ensure_parents(rfd: int, parent: bytes) -> None:
    """`mkdir -p` of `parent` inside the root, each step resolved in the root."""
    parts = [p for p in posixpath.normpath(parent).split(b"/") if p]
    prefix = b"/"
    for part in parts:
        here = posixpath.join(prefix, part)
        try:
            os.close(openat2(rfd, os.fsdecode(here), os.O_PATH | os.O_DIRECTORY))
        except FileNotFoundError:
            dfd = openat2(rfd, os.fsdecode(prefix), os.O_PATH | os.O_DIRECTORY)
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=dfd)
            finally:
                os.close(dfd)
        prefix = here


def write_file(root: str, cwd: bytes, path: str, content: str) -> dict[str, Any]:
    target = os.fsdecode(_sandbox_path(cwd, path))
    data = content.encode(errors="surrogateescape")
    rfd = _open_root(root)
    try:
        _ensure_parents(rfd, posixpath.dirname(os.fsencode(target)))
        try:
            fd = _reopen(openat2(rfd, target, os.O_PATH), path, os.O_WRONLY | os.O_TRUNC)
        except FileNotFoundError:
            # Nothing there (or a dangling symlink, whose target it creates, inside the root): a new file,
            # which no process could have made into anything else meanwhile (none runs between calls).
            fd = openat2(rfd, target, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return {"error": f"Not a regular file: {path}"}
    except _NotRegular as refused:
        return refused.answer
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(rfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(fd)
    return {"written": len(data)}


def list_dir(root: str, cwd: bytes, path: str) -> dict[str, Any]:
    rfd = _open_root(root)
    try:
        fd = openat2(rfd, os.fsdecode(_sandbox_path(cwd, path)), os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(rfd)
    try:
        entries = []
        for name in sorted(os.listdir(fd)):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            entries.append(name + "/" if stat.S_ISDIR(st.st_mode) else name)
        return {"entries": entries}
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(fd)
