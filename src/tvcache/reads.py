"""Reuse by what a call read: the second phase of a lookup, after the exact history missed.

A call's result depends only on what it read. A sandbox that observes its reads reports them (`Outcome.reads`:
state keys, such as a table or a file, to the digests it saw), and the cache keeps the result as a *candidate* for
the call, shared by every rollout of the scope however it reached its state. A rollout whose exact lookup missed
takes the call's candidates and asks, for each, whether every key it read has the same digest in the rollout's own
state now; the first that matches is the answer, and is recorded on the rollout's node, so the next identical call
there is an exact hit.

A read-only candidate is recorded as a memo. A state-changing one (its `writes` known) is recorded as an edge: the
rollout moves to the child node, as if it had executed the call, and its state's content becomes the current one
with the candidate's writes applied. A sandbox reports reads for a state-changing call only when it vouches that
its writes are what any execution over the same read digests writes (see `Outcome`), and the digest of a key the
call both read and wrote is taken from the rollout's own state before the call, never from the sandbox, which may
have looked after the call (a hazard: a call that writes what it read). A rollout that later rebuilds such a state
in a sandbox re-executes the call, and a sandbox that then reports other writes than the recorded ones shows the
state is not the one the graph says: the rollout detaches (`live.LiveSandbox`), as on any replay that differs.

The rollout knows its state's content without a sandbox: the starting state's digests come from the sandbox
factory (`BaseDigests.base_digests`), and every state-changing call it passed (executed or hit) recorded what it
wrote (`Entry.writes`). `Writes` folds those into one map; a call whose writes are unknown makes the state
unknown, and from there on the rollout uses exact history only, as does a factory that cannot tell its starting
state's digests. A write set's key `below:<p>` (`BELOW`) says that every key of a path strictly below `p` that the
write set does not name is absent ("") now: `p` was removed, replaced or renamed, so nothing that was below it,
in the starting state or written since, is there any more.

Soundness rests on the sandbox: a key's digest must change whenever what a read of it can see changes, and
`reads` must be None whenever the call saw anything it cannot name.
"""

from __future__ import annotations

import posixpath
from collections.abc import Collection, Mapping, Sequence

from .graph import MAX_READS, Candidate
from .sandboxes.base import BELOW, BaseDigests, Outcome, Sandboxes

__all__ = [
    "BELOW",
    "MAX_READS",
    "Candidate",
    "Writes",
    "base_digests_of",
    "candidate_of",
    "choose",
    "digest_in",
    "digests",
]


async def candidate_of(
    outcome: Outcome,
    output: bytes,
    seconds: float,
    call: str,
    *,
    edge: bool,
    before: Mapping[str, str] | None,
    base: BaseDigests,
) -> Candidate | None:
    """The candidate an execution makes, or None: it failed, its reads were not all observed (or too many to be
    worth checking), or it changed the state without saying what it wrote. `edge`: the call is recorded as a
    state-changing one; `before` is the rollout's state (its writes over `base`) before the call, None if unknown."""
    reads = outcome.reads
    if outcome.error or reads is None or len(reads) > MAX_READS:
        return None
    if not edge:
        return Candidate(dict(reads), output, seconds, call) if outcome.changed is False else None
    writes = outcome.writes
    if writes is None or before is None:
        return None
    # A key it read and wrote: what it read is the state's before the call, whatever the sandbox saw after.
    hazards = [key for key in writes if key in reads]
    seen = await digests(hazards, before, base)
    if len(seen) < len(hazards):
        return None  # a key whose digest before the call nobody can tell
    return Candidate({**reads, **seen}, output, seconds, call, dict(writes))


def base_digests_of(sandboxes: Sandboxes) -> BaseDigests | None:
    """The factory, if it can tell its starting state's digests (the optional `BaseDigests` protocol)."""
    return sandboxes if isinstance(sandboxes, BaseDigests) else None


class Writes:
    """A rollout's state as content: the last digest written to each key by the edges it passed, or unknown
    (`known` is None) once one of them wrote what its sandbox could not observe."""

    __slots__ = ("known",)

    def __init__(self) -> None:
        self.known: dict[str, str] | None = {}

    def apply(self, writes: Mapping[str, str] | None) -> None:
        """Pass an edge that wrote `writes` (None: unknown)."""
        if self.known is None:
            return
        if writes is None:
            self.known = None
            return
        gone = tuple(_path(key).rstrip("/") + "/" for key in writes if key.startswith(BELOW))
        if gone:
            for old in [k for k in self.known if k.partition(":")[2].startswith(gone) and k not in writes]:
                del self.known[old]
        self.known.update(writes)


async def choose(candidates: Sequence[Candidate], state: Mapping[str, str], base: BaseDigests) -> Candidate | None:
    """The first candidate (newest first) whose every read has the same digest in the state `state` (the
    rollout's writes) over the factory's starting state `base`; None if none does."""
    if not candidates:
        return None
    now = await digests({key for c in candidates for key in c.reads}, state, base)
    for candidate in candidates:
        if all(now.get(key) == seen for key, seen in candidate.reads.items()):
            return candidate
    return None


async def digests(keys: Collection[str], state: Mapping[str, str], base: BaseDigests) -> dict[str, str]:
    """The digest of each of `keys` in the state `state` (a rollout's writes) over the factory's starting state;
    a key neither holds (the factory did not answer) is left out, and matches nothing."""
    gone = _gone(state)
    known = {key: digest_in(key, state, {}, gone) for key in keys}  # what the rollout's writes tell
    missing = [key for key, digest in known.items() if digest is None]
    starting = await base.base_digests(missing) if missing else {}
    found = {}
    for key, digest in known.items():
        if digest is None:
            digest = starting.get(key)
        if isinstance(digest, str):
            found[key] = digest
    return found


def digest_in(
    key: str, state: Mapping[str, str], starting: Mapping[str, str], gone: Collection[str] | None = None
) -> str | None:
    """The digest of `key` in the state `state` (a rollout's writes) over the starting state's digests `starting`;
    None if neither tells it. `gone`: `_gone(state)`, for a caller that asks of many keys."""
    digest = state.get(key)
    if digest is None:
        digest = "" if _cleared(key, _gone(state) if gone is None else gone) else starting.get(key)
    return digest if isinstance(digest, str) else None


def _path(key: str) -> str:
    return key.partition(":")[2]


def _gone(state: Mapping[str, str]) -> frozenset[str]:
    """The paths whose contents a write set declared gone (`BELOW`): usually none, and then no key's parents are
    walked (that walk was most of a second-phase lookup's time, over the thousands of keys candidates read)."""
    return frozenset(_path(key) for key in state if key.startswith(BELOW))


def _cleared(key: str, gone: Collection[str]) -> bool:
    """Is `key` below one of the paths `gone`?"""
    path = _path(key)
    if not gone or not path.startswith("/"):
        return False
    # Linux reads any number of leading slashes as one; posixpath keeps two ("//" is its own dirname: the walk up
    # below would never reach "/").
    path = "/" + path.lstrip("/")
    # A normalised path's parent is what precedes its last slash: the same as posixpath.dirname, several times
    # faster over a deep tree's keys (thousands of levels each). Anything else takes dirname.
    normal = "//" not in path and not path.endswith("/")
    while path != "/":
        path = (path[: path.rfind("/")] or "/") if normal else posixpath.dirname(path)
        if path in gone:
            return True
    return False
