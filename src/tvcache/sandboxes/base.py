"""The sandbox protocol: what the cache needs from a sandbox backend.

A `Sandboxes` factory makes sandboxes that all start in the same state (identified by `fingerprint`), saves
immutable snapshots of them and restores those. A `Sandbox` executes tool calls. Every method is async so a
backend can run its work in threads, subprocesses or over the network without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import errno
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from ..calls import ToolCall
from ..errors import SandboxBusy, SandboxError, SnapshotGone, ToolError

__all__ = [
    "BELOW",
    "BaseDigests",
    "Outcome",
    "Output",
    "Sandbox",
    "SandboxBusy",
    "SandboxError",
    "Sandboxes",
    "SnapshotGone",
    "ToolError",
    "no_room",
    "refusal",
    "settled",
]

#: A tool's output: text, bytes, or a JSON value (dicts, lists, numbers, ...).
Output = str | bytes | int | float | bool | None | list[Any] | dict[str, Any]


#: The prefix of a write key that clears what was below a path (see `Outcome`).
BELOW = "below:"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one execution produced.

    `changed` is what the sandbox observed: False when the call provably left the state untouched, True when
    it changed it, None when the sandbox cannot tell (the cache then assumes it changed). `error` marks a
    failure of the sandbox or tool itself (crash, timeout), which is never cached; an ordinary failing
    command (a non-zero exit, an SQL syntax error) is a normal, cacheable output.

    `reads` and `writes` are for reuse by what a call read (two-phase lookup), from sandboxes that observe them:
    keys name pieces of state in the sandbox kind's own terms (a file, a directory listing, a table), values are
    content digests, "" for absent. `reads` holds everything the call observed, or is None when it could not all
    be observed (then the result is reused only by exact history); `writes` holds the new digest of everything a
    state-changing call changed, or None when unknown. A key `BELOW + p` in `writes` (value "") says that every key
    of a path strictly below `p` that `writes` does not name is absent now (`p` was removed, replaced or renamed).

    A state-changing call with `reads` (not None) and `writes` may be reused in another state too: the sandbox
    vouches that `reads` are the digests as they were before the call, and that `writes` are what executing it in
    any state with those digests writes (its effect depends on nothing unobserved: no clock, no randomness). A
    sandbox that cannot vouch for that gives `reads` None for a state-changing call. (The cache takes the digest of
    a key the call both read and wrote from its own record of the state before the call, not from the sandbox.)

    `reads_later`: a sandbox may answer before it has worked out what the call read (a workspace digests the files
    a traced command read after answering, while the model generates its next turn). Then `reads` is None and
    `reads_later` is a future of what `reads` would have been; the sandbox runs nothing else until it is done.
    `settled(outcome)` waits for it and gives the outcome whole.

    `cpu_seconds` is the CPU time the call's processes used, where the sandbox measures it (a workspace or Docker
    command: its sandbox's or container's cgroup), else None; a measurement, so outcomes compare without it.
    """

    output: Output
    changed: bool | None = None
    error: bool = False
    reads: Mapping[str, str] | None = None
    writes: Mapping[str, str] | None = None
    cpu_seconds: float | None = field(default=None, compare=False)
    reads_later: asyncio.Future[Mapping[str, str] | None] | None = field(default=None, compare=False, repr=False)


async def settled(outcome: Outcome) -> Outcome:
    """`outcome` with its read set in `reads`, once the sandbox has worked it out (see `Outcome.reads_later`).
    Waiting is shielded: a cancelled waiter leaves the sandbox's work to end on its own."""
    later = outcome.reads_later
    if later is None:
        return outcome
    return replace(outcome, reads=await asyncio.shield(later), reads_later=None)


def refusal(output: Output) -> Outcome:
    """The answer to a call a sandbox cannot run as given (an unknown tool, arguments of the wrong shape or type, a
    NUL byte where the system takes none): `output` says why, in the sandbox's own form of an error, and the call is
    marked failed, so it is not cached, and unchanged, so the rollout and its sandbox carry on. A model's bad call
    is an answer it can learn from, not a crash."""
    return Outcome(output, changed=False, error=True)


@runtime_checkable
class Sandbox(Protocol):
    """A live sandbox: one environment that executes tool calls in its own state."""

    async def execute(self, call: ToolCall) -> Outcome:
        """Run one call in this sandbox's state: its output, whether it changed the state (None: not observed),
        and whether the tool failed (a timeout, a limit hit). Raises `SandboxError` when the machinery fails."""
        ...

    async def snapshot(self) -> str:
        """Save the current state as an immutable snapshot and return its id; the sandbox stays usable."""
        ...

    async def close(self) -> None:
        """End the sandbox and free what it holds (its snapshots stay, held by the factory)."""
        ...


@runtime_checkable
class Sandboxes(Protocol):
    """A sandbox factory: makes sandboxes in a task's starting state and restores the snapshots they took. The
    cache knows a factory by the object itself (its snapshots can only be restored through it)."""

    @property
    def fingerprint(self) -> str:
        """Identifies the starting state: a content hash of the base directory, database or image."""
        ...

    async def create(self) -> Sandbox:
        """A new sandbox in the starting state."""
        ...

    async def restore(self, snapshot_id: str) -> Sandbox:
        """A new sandbox in the snapshot's state; raises `SnapshotGone` if the snapshot no longer exists (any
        other exception is taken as a failure that may pass, and the snapshot is kept for a while; one for want of
        room, see `no_room`, does not count against it at all)."""
        ...

    async def delete(self, snapshot_id: str) -> None:
        """Forget a snapshot and free what it holds (the cache's eviction calls it)."""
        ...


@runtime_checkable
class BaseDigests(Protocol):
    """What a factory whose sandboxes report `Outcome.reads` adds so that results are reused by what they read
    (optional: without it, exact history only)."""

    async def base_digests(self, keys: Collection[str]) -> Mapping[str, str]:
        """The digest of each of `keys` in the starting state, in the terms of `Outcome.reads` ("" for absent).
        A key left out matches nothing."""
        ...


def no_room(exc: BaseException) -> bool:
    """Whether `exc` was caused by a full disk or quota (ENOSPC, EDQUOT; SQLite's "database or disk is full"),
    anywhere in its chain of causes: the machine, which may pass, not the sandbox or the snapshot. The cache does
    not count a restore that failed so against the snapshot, and tries a snapshot that failed so again later; a
    backend raises its `SandboxError` `from` the error to say so."""
    sqlite = sys.modules.get("sqlite3")  # not imported yet: no error of SQLite's to find, and none to import
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if sqlite is not None and isinstance(cause, sqlite.Error) and getattr(cause, "sqlite_errorcode", 0) == 13:
            return True  # SQLITE_FULL
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False
