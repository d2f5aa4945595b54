"""File tools served without starting a shell: read_file, write_file, list_dir.

Paths are resolved as the sandbox would resolve them: relative to the shell's working directory, with
absolute symlinks and `..` confined to the sandbox's root by openat2(RESOLVE_IN_ROOT). They run in this
process through the mounted root, so they cost microseconds instead of a namespace set-up.

They run with this process's privileges, so they touch nothing but regular files and directories: a path is
first opened with O_PATH (which opens nothing), its type checked, and only a regular file is then reopened
for reading or writing through /proc/self/fd, the very inode that was checked. A device node, FIFO or socket
(also behind a symlink) is refused with "Not a regular file", without ever being opened.

Each returns a JSON-able dict: {"content": str}, {"written": int} or {"entries": [names, dirs with "/"]} (with
{"omitted": N} when N more entries did not fit in `max_output`),
or {"error": "<reason>: <path>"} for an ordinary failure (a missing file is an answer, not a sandbox fault).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import stat
from typing import Any

from ..calls import ToolCall
from ._shell import BoundedOutput, bounded_text
from ._syscalls import openat2
from .base import Outcome, refusal

__all__ = ["TOOLS", "checked_args", "list_dir", "read_file", "write_file"]

#: The tools of a shell sandbox (workspace, docker): a shell command and the three file tools.
TOOLS = ("bash", "read_file", "write_file", "list_dir")
_ARGS = {"bash": ("command",), "read_file": ("path",), "write_file": ("path", "content"), "list_dir": ("path",)}


def checked_args(call: ToolCall, backend: str) -> dict[str, Any] | Outcome:
    """The call's args, if it is one of TOOLS with its string arguments; else the refusal the model gets (an
    `{"error": ...}` answer, the same every time, that leaves the sandbox as it was)."""
    if call.tool not in TOOLS:
        return refusal({"error": f"{backend} sandboxes have the tools {', '.join(TOOLS)}; got {call.tool!r}"})
    args = call.args
    if not isinstance(args, dict):
        return refusal({"error": f"{call.tool} takes a JSON object of arguments, got the text {call.key[:200]}"})
    for key in _ARGS[call.tool]:
        value = args.get(key)
        if not isinstance(value, str):
            return refusal({"error": f"{call.tool} needs a string argument {key!r}, got args {call.key[:200]}"})
        if "\0" in value and key != "content":  # a file may hold NUL bytes; a command line or a path cannot
            return refusal({"error": f"{call.tool}: {key!r} contains a NUL byte, which a {key} cannot hold"})
        try:  # surrogateescape: a non-UTF-8 file name as os.listdir gives it stands for its own bytes
            value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as exc:  # half a surrogate pair ("\ud800" in the model's JSON) has no bytes
            return refusal(
                {"error": f"{call.tool}: {key!r} contains {exc.object[exc.start]!r}, which has no UTF-8 form"}
            )
    return args


def _sandbox_path(cwd: bytes, path: str) -> str:
    raw = os.fsencode(path)
    return os.fsdecode(raw if raw.startswith(b"/") else posixpath.join(cwd, raw))


def _error(exc: OSError, path: str) -> dict[str, Any]:
    return {"error": f"{os.strerror(exc.errno or errno.EIO)}: {_shown(path)}"}


def _shown(path: str) -> str:
    """The path as an error names it: a long one (a model can send megabytes) by its start and end, so the answer
    stays within max_output."""
    return path if len(path) <= 200 else f"{path[:100]}[... {len(path) - 200} characters ...]{path[-100:]}"


def _open_root(root: str) -> int:
    return os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


class _Answer(Exception):
    """An ordinary failure, answered to the caller as {"error": ...}."""

    def __init__(self, answer: dict[str, Any]):
        self.answer = answer


def _check_regular(fd: int, path: str) -> None:
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):
        raise _Answer({"error": f"Is a directory: {_shown(path)}"})
    if not stat.S_ISREG(mode):
        raise _Answer({"error": f"Not a regular file: {_shown(path)}"})


def _open_file(root: str, cwd: bytes, path: str, flags: int, *, create: bool = False) -> int:
    """Open the regular file at `path` in the sandbox (made, with its parents, when `create` and missing);
    raises _Answer for anything else there."""
    target = _sandbox_path(cwd, path)
    rfd = _open_root(root)
    try:
        if create:
            _ensure_parents(rfd, posixpath.dirname(os.fsencode(target)))
        try:
            path_fd = openat2(rfd, target, os.O_PATH)
        except FileNotFoundError:
            if not create:
                raise
            # Nothing there (or a dangling symlink, whose target it creates, inside the root): a new file,
            # which no process could have made into anything else meanwhile (none runs between calls).
            fd = openat2(rfd, target, flags | os.O_CREAT | os.O_NONBLOCK, 0o644)
            try:
                _check_regular(fd, path)
            except BaseException:
                os.close(fd)
                raise
            return fd
        try:
            _check_regular(path_fd, path)
            return os.open(f"/proc/self/fd/{path_fd}", flags | os.O_CLOEXEC)  # the very inode checked
        finally:
            os.close(path_fd)
    except OSError as exc:
        raise _Answer(_error(exc, path)) from exc
    finally:
        os.close(rfd)


def read_file(root: str, cwd: bytes, path: str, limit: int) -> dict[str, Any]:
    """The file's text; beyond `limit` bytes its middle is cut out as in bash output."""
    try:
        fd = _open_file(root, cwd, path, os.O_RDONLY)
    except _Answer as failed:
        return failed.answer
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            half = limit // 2
            head = os.pread(fd, half, 0)
            tail = os.pread(fd, limit - half, st.st_size - (limit - half))
            return {"content": bounded_text(head, tail, st.st_size, limit)}
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
    data = content.encode(errors="surrogateescape")
    try:
        fd = _open_file(root, cwd, path, os.O_WRONLY | os.O_TRUNC, create=True)
    except _Answer as failed:
        return failed.answer
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(fd)
    return {"written": len(data)}


def list_dir(root: str, cwd: bytes, path: str, limit: int) -> dict[str, Any]:
    """The directory's entries, sorted, directories with a "/": as many as fit in `limit` bytes of JSON, and
    `"omitted": N` when N more did not."""
    rfd = _open_root(root)
    try:
        fd = openat2(rfd, _sandbox_path(cwd, path), os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(rfd)
    try:
        with os.scandir(fd) as it:  # the type from the listing itself: no stat per entry
            names = sorted(e.name + "/" if e.is_dir(follow_symlinks=False) else e.name for e in it)
    except OSError as exc:
        return _error(exc, path)
    finally:
        os.close(fd)
    size = len('{"entries": [], "omitted": 0000000000}')
    for i, name in enumerate(names):
        size += len(json.dumps(name)) + 2
        if size > limit:
            return {"entries": names[:i], "omitted": len(names) - i}
    return {"entries": names}
