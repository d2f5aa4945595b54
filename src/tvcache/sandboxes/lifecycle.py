"""The lifecycle every sandbox backend shares, written once: open and closed, snapshot records, cleanup.

A backend subclasses `ManagedSandboxes` for its factory and `ManagedSandbox` for its sandboxes and writes only
what is its own:

    class MySandboxes(ManagedSandboxes["MySandbox", MySnapshot]):
        kind = "mine"                                   # names snapshot ids and error messages

        def __init__(self, ...):
            super().__init__()
            self._dir = make_private_dir()
            self._cleanup_with(shutil.rmtree, self._dir, True)   # also runs if the factory is collected

        async def create(self) -> MySandbox:
            self._check_open()
            return await MySandbox(self, ...).started()

        async def restore(self, snapshot_id: str) -> MySandbox:
            record = self._lookup(snapshot_id)          # SandboxError if unknown or deleted
            ...

        async def delete(self, snapshot_id: str) -> None:
            record = self._forget(snapshot_id)          # None if already gone: deleting twice is harmless
            ...

    class MySandbox(ManagedSandbox):
        async def execute(self, call):
            async with self._turn():                    # one operation at a time; SandboxError once closed
                ...

        async def snapshot(self) -> str:
            async with self._turn():
                return self._factory._keep(record)      # a new id, unguessable by other factories

        async def _release(self) -> None:               # frees what the sandbox holds; called once
            ...

What the base provides:

- Factories: `_check_open()`; `close()` (idempotent: closes the factory's live sandboxes, calls `_close()`,
  then runs the cleanup registered with `_cleanup_with`, which also runs when the factory is garbage
  collected or the interpreter exits); `async with`; the snapshot table (`_keep`, `_lookup`, `_forget`,
  `snapshot_count`), whose ids carry a random token, so an id recorded by another factory or an earlier
  process (a durable cache) never names a snapshot of this one by accident.
- Sandboxes: `_turn()`, an async context manager that serialises operations and refuses them once closed;
  `_after_answer(work)`, for work an operation leaves to run after it answered (a read set to digest): the next
  operation, and `close()`, wait for it first, so the sandbox holds still until it is done;
  `close()` (idempotent: marks the sandbox closed at once, calls `_interrupt()` to stop what is running, waits
  for the running operation to end, then calls `_release()` once). The factory holds its live sandboxes
  until they are closed (their mounts, files and layer references need an explicit release), so closing
  the factory closes every sandbox its callers forgot.
- Ownership stays with the process that made the factory. A forked child (a worker pool, a daemonising library)
  holds a copy of the factory and of its cleanup, which would otherwise run at the child's exit or when it closes
  its copy, and remove the parent's live sandboxes; in the child, `close()` only marks the copy closed and the
  cleanup does nothing. The child is told by the forks its process has seen (tvcache._owner), not by its pid: a
  container's first process (pid 1) may fork a child into a PID namespace of its own, whose pid is 1 too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from types import TracebackType
from typing import Any, ClassVar, Generic, Self, TypeVar

from .._owner import forks, inherited
from .base import SandboxError, SnapshotGone

__all__ = ["ManagedSandbox", "ManagedSandboxes"]

BoxT = TypeVar("BoxT", bound="ManagedSandbox")
RecordT = TypeVar("RecordT")
T = TypeVar("T")


class ManagedSandboxes(Generic[BoxT, RecordT]):
    """The shared half of a sandbox factory; see the module docstring."""

    #: A short name for the backend: the prefix of snapshot ids and the subject of error messages.
    kind: ClassVar[str] = "sandbox"

    def __init__(self) -> None:
        self._closed = False
        self._live: set[BoxT] = set()
        self._snapshots: dict[str, RecordT] = {}
        self._token = secrets.token_hex(6)
        self._ids = itertools.count(1)
        self._finalizer: weakref.finalize[..., Any] | None = None
        self._owner = forks()  # the process owning everything the factory makes (see the module docstring)

    # -- lifecycle -----------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"this {type(self).__name__} is closed")

    def _cleanup_with(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` when the factory closes, is collected or the interpreter exits (once; replaces
        an earlier registration). `fn` must not refer to the factory, or it would never be collected."""
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _in_process, self._owner, fn, *args)

    def _copied_by_fork(self) -> bool:
        return inherited(self._owner)

    async def close(self) -> None:
        """Close every live sandbox of this factory, drop its snapshots and remove what it created; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._copied_by_fork():
            return
        try:
            for box in list(self._live):
                with contextlib.suppress(Exception):
                    await box.close()
            await self._close()
            self._snapshots.clear()
        finally:
            if self._finalizer is not None:
                await asyncio.to_thread(self._finalizer)

    async def _close(self) -> None:
        """Release the factory's own resources beyond the cleanup function (snapshot records, helpers)."""
        return None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- snapshot records ----------------------------------------------------------------------------------

    @property
    def snapshot_count(self) -> int:
        """How many snapshots the factory holds (for tests and monitoring)."""
        return len(self._snapshots)

    def _new_id(self) -> str:
        """A fresh snapshot id (for a backend that names the snapshot's files before it keeps the record)."""
        return f"{self.kind}-{self._token}-{next(self._ids)}"

    def _keep(self, record: RecordT, snapshot_id: str | None = None) -> str:
        """Store a snapshot record under `snapshot_id` (default: a new id) and return the id."""
        self._check_open()
        snapshot_id = snapshot_id or self._new_id()
        self._snapshots[snapshot_id] = record
        return snapshot_id

    def _lookup(self, snapshot_id: str) -> RecordT:
        self._check_open()
        try:
            return self._snapshots[snapshot_id]
        except KeyError:
            raise SnapshotGone(f"snapshot {snapshot_id!r} does not exist (deleted, or never made here)") from None

    def _forget(self, snapshot_id: str) -> RecordT | None:
        return self._snapshots.pop(snapshot_id, None)


def _in_process(owner: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run a factory's cleanup only in the process that made the factory: a forked child inherits the finalizer
    (run by its atexit handlers or when it drops its copy) but not the sandboxes, which its parent still uses."""
    if not inherited(owner):
        fn(*args)


class ManagedSandbox:
    """The shared half of a live sandbox; see the module docstring."""

    def __init__(self, factory: ManagedSandboxes[Any, Any]) -> None:
        self._factory_base = factory
        self._lock = asyncio.Lock()
        self._closed = False
        self._after: asyncio.Task[Any] | None = None
        factory._live.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("this sandbox is closed")

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """Hold the sandbox for one operation: operations run one at a time, and none after close."""
        async with self._lock:
            self._check_open()
            await self._settle()
            yield

    def _after_answer(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `work` after the operation under way answers, before the next one (or the release) starts: for
        what must see the sandbox as the operation left it, but need not delay its answer. `work` should not
        raise: nobody but the sandbox is sure to wait for it."""
        task = asyncio.get_running_loop().create_task(work)
        self._after = task
        return task

    async def _settle(self) -> None:
        """Wait for the work the last operation left (see `_after_answer`); a cancelled waiter leaves it running."""
        after, self._after = self._after, None
        if after is not None and not after.cancelled():
            try:
                await asyncio.shield(after)
            except asyncio.CancelledError:
                self._after = after  # the work goes on: whoever holds the sandbox next waits for it
                raise
            except Exception:  # its own waiter (the read set's candidate) sees it
                pass

    async def close(self) -> None:
        """Stop what runs, wait for it, and release everything the sandbox holds; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._factory_base._copied_by_fork():
            return
        self._interrupt()
        try:
            async with self._lock:
                await self._settle()
                await self._release()
        finally:
            self._factory_base._live.discard(self)

    def _interrupt(self) -> None:
        """Make a running operation end soon (called by close before it waits for the operation)."""
        return None

    async def _release(self) -> None:
        """Free what the sandbox holds (files, connections, mounts); called once, with no operation running."""
        return None
