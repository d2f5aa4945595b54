"""Reuse by what a call read: the second phase of a lookup, after the exact history missed.

A read-only call's result depends only on what it read. A sandbox that observes its reads reports them
(`Outcome.reads`: state keys, such as a table or a file, to the digests it saw), and the cache keeps the result
as a *candidate* for the call, shared by every rollout of the scope however it reached its state. A rollout
whose exact lookup missed takes the call's candidates and asks, for each, whether every key it read has the
same digest in the rollout's own state now; the first that matches is the answer, and is recorded as a memo on
the rollout's node, so the next identical call there is an exact hit.

The rollout knows its state's content without a sandbox: the starting state's digests come from the sandbox
factory (`BaseDigests.base_digests`), and every state-changing call it passed (executed or hit) recorded what it
wrote (`Entry.writes`). `Writes` folds those into one map; a call whose writes are unknown makes the state
unknown, and from there on the rollout uses exact history only, as does a factory that cannot tell its starting
state's digests. Only calls observed to leave the state untouched (`changed is False`) become candidates: a call
that writes nothing cannot have written what it read, so there is no hazard to detect.

Soundness rests on the sandbox: a key's digest must change whenever what a read of it can see changes, and
`reads` must be None whenever the call saw anything it cannot name.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from .graph import MAX_READS, Candidate
from .sandboxes.base import BaseDigests, Outcome, Sandboxes

__all__ = ["MAX_READS", "Candidate", "Writes", "base_digests_of", "candidate_of", "choose"]


def candidate_of(outcome: Outcome, output: bytes, seconds: float, call: str) -> Candidate | None:
    """The candidate an execution makes, or None: it failed, changed (or may have changed) the state, or its
    reads were not all observed (or too many to be worth checking)."""
    reads = outcome.reads
    if outcome.error or outcome.changed is not False or reads is None or len(reads) > MAX_READS:
        return None
    return Candidate(dict(reads), output, seconds, call)


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
        else:
            self.known.update(writes)


async def choose(candidates: Sequence[Candidate], state: Mapping[str, str], base: BaseDigests) -> Candidate | None:
    """The first candidate (newest first) whose every read has the same digest in the state `state` (the
    rollout's writes) over the factory's starting state `base`; None if none does."""
    if not candidates:
        return None
    missing: Collection[str] = {key for c in candidates for key in c.reads if key not in state}
    starting = await base.base_digests(missing) if missing else {}
    for candidate in candidates:
        if all(_digest(key, state, starting) == seen for key, seen in candidate.reads.items()):
            return candidate
    return None


def _digest(key: str, state: Mapping[str, str], starting: Mapping[str, str]) -> str | None:
    found = state.get(key)
    if found is None:
        found = starting.get(key)
    return found if isinstance(found, str) else None  # a key the factory did not answer matches nothing
