"""File tools served without starting a shell: read_file, write_file, list_dir.

Paths are resolved as the sandbox would resolve them: relative to the shell's working directory, with
absolute symlinks and `..` confined to the sandbox's root by openat2(RESOLVE_IN_ROOT). They run in this
process through the mounted root, so they cost microseconds instead of a namespace set-up.

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


def read_file(root: str, cwd: bytes, path: str, limit: int) -> dict[str, Any]:
    """The file's text; beyond `limit` bytes its middle is cut out as in bash output."""
    rfd = _open_root(root)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = openat2(rfd, os.fsdecode(_sandbox_path(cwd, path)), os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(rfd)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return {"error": f"Is a directory: {path}"}
        if not stat.S_ISREG(st.st_mode):
            return {"error": f"Not a regular file: {path}"}  # a device or FIFO could stream forever
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
    target = _sandbox_path(cwd, path)
    data = content.encode(errors="surrogateescape")
    rfd = _open_root(root)
    try:
        _ensure_parents(rfd, posixpath.dirname(target))
        fd = openat2(rfd, os.fsdecode(target), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o644)
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
