"""Walks of trees a sandbox wrote, safe against the sandbox: iterative, and relative to directory descriptors.

Upper dirs, copies and layers hold whatever a command made: trees deeper than any recursion limit, paths longer
than PATH_MAX, directories swapped for symlinks while they are read. So a walk here

- keeps its own stack (no recursion): any depth works;
- names every entry by a descriptor of its directory plus one component (`openat`, `fstatat` with
  AT_SYMLINK_NOFOLLOW, O_NOFOLLOW): no path is ever resolved from the root, so PATH_MAX does not matter and no
  symlink is ever followed, wherever the sandbox put one;
- checks that each directory it opens is the one it stat'ed (device and inode): a directory swapped between the
  two calls is a `TreeChanged` error, never a walk of something else.

At most `_OPEN_DEPTH` directories of the walk's path are open at once; deeper ancestors are closed, and
reopened through ".." when the walk climbs back, again checked by device and inode.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Sequence

__all__ = ["OPEN_DIR", "Skip", "TreeChanged", "Walk", "open_below", "remove_tree"]

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Directories of the walk's path kept open (per tree); far below any descriptor limit.
_OPEN_DEPTH = 64


def open_below(root: int, parts: Sequence[str]) -> int:
    """A new descriptor of the directory at `parts` below the directory descriptor `root`, each component opened
    relative to the one before without following a symlink: any depth, any path length."""
    fd = os.open(".", OPEN_DIR, dir_fd=root)
    for name in parts:
        try:
            inner = os.open(name, OPEN_DIR, dir_fd=fd)
        finally:
            os.close(fd)
        fd = inner
    return fd


class TreeChanged(OSError):
    """A directory was not what it was a moment before: something changed the tree during the walk."""

    def __init__(self, what: str):
        super().__init__(errno.ESTALE, f"the tree changed during the walk: {what}")


class Skip(Exception):
    """Raised by `Walk.on_dir`: leave that directory out (not entered, no `after_dir`)."""


def _id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _Frame:
    """One directory of the walk's path, in every tree walked in step."""

    __slots__ = ("fds", "ids", "name", "st", "todo")

    def __init__(self, fds: list[int], ids: list[tuple[int, int]], name: str, st: os.stat_result, todo: list[str]):
        self.fds, self.ids, self.name, self.st, self.todo = fds, ids, name, st, todo


class Walk:
    """A depth-first walk of the tree at the directory descriptor `roots[0]`, with the trees at `roots[1:]`
    (a copy's destination, say) walked in step: each directory the walk enters is opened in every tree, so
    `on_dir` must have made it there.

    Subclasses say what happens to each entry; the walk calls, with `fds` the current directory's descriptors:

    - `on_dir(fds, name, st)` before it enters the directory `name` (in listing order, see `order`), which it
      leaves out if that raises `Skip`;
    - `on_other(fds, name, st)` for any other entry;
    - `after_dir(fds, name, st, inner)` once the directory's contents are done (`inner`: its descriptors).

    The root descriptors stay the caller's. `parts` is the names of the current path below the roots.
    """

    def __init__(self, roots: Sequence[int]):
        self.roots = list(roots)
        self._stack: list[_Frame] = []

    @property
    def parts(self) -> list[str]:
        return [frame.name for frame in self._stack[1:]]

    def order(self, names: list[str]) -> list[str]:
        """The order to visit a directory's entries in (listed as the filesystem lists them)."""
        return names

    def on_dir(self, fds: list[int], name: str, st: os.stat_result) -> None:
        pass

    def on_other(self, fds: list[int], name: str, st: os.stat_result) -> None:
        pass

    def after_dir(self, fds: list[int], name: str, st: os.stat_result, inner: list[int]) -> None:
        pass

    def run(self) -> None:
        root_st = os.fstat(self.roots[0])
        ids = [_id(os.fstat(fd)) for fd in self.roots]
        self._stack = [_Frame(self.roots, ids, "", root_st, self._todo(self.roots[0]))]
        try:
            while self._stack:
                self._step()
        finally:
            for frame in self._stack[1:]:
                _close(frame.fds)
            self._stack = []

    def _todo(self, fd: int) -> list[str]:
        return self.order(os.listdir(fd))[::-1]  # popped from the end

    def _step(self) -> None:
        top = self._stack[-1]
        if not top.todo:
            self._stack.pop()
            if self._stack:
                parent = self._stack[-1]
                try:
                    if parent.fds[0] < 0:
                        self._reopen(parent, top)
                    self.after_dir(parent.fds, top.name, top.st, top.fds)
                finally:
                    _close(top.fds)
            return
        name = top.todo.pop()
        st = os.stat(name, dir_fd=top.fds[0], follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            self.on_other(top.fds, name, st)
            return
        try:
            self.on_dir(top.fds, name, st)
        except Skip:
            return
        fds: list[int] = []
        try:
            for fd in top.fds:
                fds.append(os.open(name, OPEN_DIR, dir_fd=fd))
            ids = [_id(os.fstat(fd)) for fd in fds]
            if ids[0] != _id(st):
                raise TreeChanged(f"{name!r} was replaced while it was entered")
            todo = self._todo(fds[0])
        except BaseException:
            _close(fds)
            raise
        self._stack.append(_Frame(fds, ids, name, st, todo))
        if len(self._stack) > _OPEN_DEPTH + 1:
            _close(self._stack[-_OPEN_DEPTH - 1].fds)  # reopened through ".." on the way back

    def _reopen(self, parent: _Frame, child: _Frame) -> None:
        fds: list[int] = []
        try:
            for fd, want in zip(child.fds, parent.ids, strict=True):
                fds.append(os.open("..", OPEN_DIR, dir_fd=fd))
                if _id(os.fstat(fds[-1])) != want:
                    raise TreeChanged(f"the parent of {child.name!r} moved")
        except BaseException:
            _close(fds)
            raise
        parent.fds = fds


def _close(fds: list[int]) -> None:
    for i, fd in enumerate(fds):
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            fds[i] = -1


class _Remover(Walk):
    def on_other(self, fds: list[int], name: str, st: os.stat_result) -> None:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=fds[0])

    def after_dir(self, fds: list[int], name: str, st: os.stat_result, inner: list[int]) -> None:
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=fds[0])


def remove_tree(path: str | os.PathLike[str], on_error: Callable[[OSError], None] | None = None) -> None:
    """Delete the tree at `path` (a directory, or anything else), whatever its depth or shape; never raises
    (an error goes to `on_error`, and what could not be deleted stays)."""
    try:
        try:
            fd = os.open(path, OPEN_DIR)
        except NotADirectoryError:
            os.unlink(path)
            return
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink: remove the link, never what it points to
                os.unlink(path)
                return
            raise
        try:
            _Remover([fd]).run()
        finally:
            os.close(fd)
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if on_error is not None:
            on_error(exc)
