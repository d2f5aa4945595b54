"""Sandboxes over in-process Python objects.

`PythonSandboxes(make, run, fingerprint)` turns any Python object into a sandbox: `make()` builds a fresh state
object, `run(obj, call)` executes one tool call against it and returns the output. `run` may be a plain
function, which runs on the event loop's thread and so should be quick, or a coroutine function (for slow
work: await it, or hand it to `asyncio.to_thread` inside). A snapshot is a deep copy kept by the factory; a
restore hands out a deep copy of that, so snapshots stay immutable whatever later calls do to restored objects.

Whether a call changed the state is observed, by default, by comparing a digest of `pickle.dumps(obj)` taken
before and after the call. That costs one serialisation of the whole state per call (each call's "after"
digest is the next call's "before"), which is cheap for the small states this backend is meant for (a dict
of records, a simulated API). A state that pickles differently without a real change (a set rebuilt in
another order) only costs cache hits, never correctness: it is reported as changed.

Where pickling is too slow or impossible, pass `changed(call, output) -> bool | None`. It sees what a user
can reason about without copying the state: the call and the answer it got ("`book_*` tools change the state
unless they answered with an error"). A function over the state itself would need a copy of the state from
before every call, which is exactly the cost it is meant to avoid. Returning None means "cannot tell", and
the cache then assumes the call changed the state.

**What a call read.** `ObservedPythonSandboxes` adds reuse by what a call read (`tvcache.reads`) for tools that
say what they touched: `run` returns `Observed(output, reads, writes)`, naming the pieces of state (keys of the
user's choosing, such as `"users/mia_1"`) the call read and wrote, and `digest(state, key)` gives a key's content
digest in a state ("" for absent). The sandbox reports each read key's digest (a key it may write counts as read:
whether the call changes anything depends on it) and, for a call that changed the state, each written key's new
one; the starting state's digests are those of a fresh `make()`. This is the tool's
promise, as `read_only` is: the call's output and writes must depend on nothing but the keys it names (no clock,
no randomness, no state outside them), and `digest` must change whenever a key's content does. A run that returns
a plain output is reused by exact history only.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import pickle
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..calls import ToolCall
from .base import Outcome, Output, SandboxError
from .lifecycle import ManagedSandbox, ManagedSandboxes

__all__ = [
    "ChangedFunction",
    "DigestFunction",
    "Observed",
    "ObservedPythonSandboxes",
    "PythonSandbox",
    "PythonSandboxes",
    "RunFunction",
]

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Observed:
    """What a `run` of `ObservedPythonSandboxes` returns: the output, and the keys of the state the call read and
    wrote (see the module docstring)."""

    output: Output
    reads: Collection[str]
    writes: Collection[str] = ()


#: Executes one call against a state object; may be a plain function or a coroutine function.
RunFunction = Callable[[S, ToolCall], Output | Observed | Awaitable[Output | Observed]]
#: Tells from a call and its output whether the call changed the state (None: cannot tell).
ChangedFunction = Callable[[ToolCall, Output], bool | None]
#: A key's content digest in a state ("" when absent).
DigestFunction = Callable[[S, str], str]


class PythonSandboxes(ManagedSandboxes["PythonSandbox[S]", S], Generic[S]):
    """A factory of sandboxes that are in-process Python objects.

    `fingerprint` names the starting state `make()` builds (e.g. a hash of the data it loads): cached results
    are only shared between factories with the same fingerprint, so change it whenever `make` or `run`
    changes behaviour. Closing the factory drops its snapshots and closes its sandboxes.
    """

    kind = "py"

    def __init__(
        self,
        make: Callable[[], S],
        run: RunFunction[S],
        fingerprint: str,
        *,
        changed: ChangedFunction | None = None,
    ) -> None:
        if not callable(make) or not callable(run):
            raise TypeError("make and run must be callables: make() -> state, run(state, call) -> output")
        if changed is not None and not callable(changed):
            raise TypeError("changed must be a callable changed(call, output) -> bool | None, or None")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"fingerprint must be a non-empty string, got {fingerprint!r}")
        super().__init__()
        self._make = make
        self._run = run
        self._changed = changed
        self._fingerprint = fingerprint
        self._key_digest: DigestFunction[S] | None = None  # set by ObservedPythonSandboxes

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    async def create(self) -> PythonSandbox[S]:
        self._check_open()
        obj = self._make()
        if self._changed is None:
            # Fail here, with a clear message, rather than reporting "cannot tell" on every call.
            try:
                pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise TypeError(
                    f"make() returned an object that cannot be pickled ({type(exc).__name__}: {exc}); "
                    "make it picklable or pass changed=..."
                ) from exc
        return PythonSandbox(self, obj)

    async def restore(self, snapshot_id: str) -> PythonSandbox[S]:
        return PythonSandbox(self, copy.deepcopy(self._lookup(snapshot_id)))

    async def delete(self, snapshot_id: str) -> None:
        # Deleting twice is harmless: eviction and cleanup may race.
        self._forget(snapshot_id)


class ObservedPythonSandboxes(PythonSandboxes[S]):
    """`PythonSandboxes` whose `run` says what each call read and wrote (`Observed`), and `digest(state, key)` the
    content digest of a key: results are also reused by what the calls read (see the module docstring)."""

    def __init__(
        self,
        make: Callable[[], S],
        run: RunFunction[S],
        fingerprint: str,
        *,
        digest: DigestFunction[S],
        changed: ChangedFunction | None = None,
    ) -> None:
        if not callable(digest):
            raise TypeError("digest must be a callable digest(state, key) -> str")
        super().__init__(make, run, fingerprint, changed=changed)
        self._key_digest = digest
        self._start: S | None = None  # a fresh state, made on the first question about the starting state

    async def base_digests(self, keys: Collection[str]) -> Mapping[str, str]:
        if self._start is None:
            self._start = self._make()
        start, digest = self._start, self._key_digest
        assert digest is not None
        return {key: digest(start, key) for key in keys}


class PythonSandbox(ManagedSandbox, Generic[S]):
    """One live state object. Calls on it run one at a time, in the order they arrive: an async `run` yields
    to the loop mid-call, and a second call (or a snapshot) must not see, or measure, a state half-way
    through the first."""

    def __init__(self, factory: PythonSandboxes[S], obj: S) -> None:
        super().__init__(factory)
        self._factory = factory
        self._obj = obj
        # Digest of the state as it is now, or None when it must be recomputed (start, after a failed call).
        self._digest: bytes | None = None

    @property
    def state(self) -> S:
        """The live state object (for inspection; changing it behind the cache's back breaks its results)."""
        self._check_open()
        return self._obj

    async def execute(self, call: ToolCall) -> Outcome:
        async with self._turn():
            return await self._execute(call)

    async def _execute(self, call: ToolCall) -> Outcome:
        user_changed = self._factory._changed
        before = None if user_changed is not None else self._current_digest()
        try:
            result = self._factory._run(self._obj, call)
            if inspect.isawaitable(result):
                result = await result
        except BaseException:
            # The call may have changed the state half-way: measure it afresh next time.
            self._digest = None
            raise
        observed = result if isinstance(result, Observed) else None
        output = _as_output(result if observed is None else observed.output, call)
        if user_changed is not None:
            changed = user_changed(call, output)
        else:
            self._digest = after = _digest(self._obj)
            changed = None if before is None or after is None else before != after
        digest = self._factory._key_digest
        if observed is None or digest is None:
            return Outcome(output, changed=changed)
        # A call reads what it may write: whether it changes anything at all depends on it (writing a value that
        # is already there is a call that changed nothing, and only where the value is there). Keys are digested
        # after the call: those it did not write are as they were; for those it did, the cache takes the digest
        # before the call from its own record of the state.
        reads = {key: digest(self._obj, key) for key in (*observed.reads, *observed.writes)}
        writes = None if changed is False else {key: reads[key] for key in observed.writes}
        return Outcome(output, changed=changed, reads=reads, writes=writes)

    async def snapshot(self) -> str:
        async with self._turn():
            try:
                copied = copy.deepcopy(self._obj)
            except Exception as exc:
                # A copy is made from the state, which stays as it was: the sandbox can go on answering (so a
                # SandboxError, on which the cache keeps it and asks for no more snapshots), and the user learns
                # which class refused. The usual cause: a __setstate__ that fails on its own pickled state.
                raise SandboxError(
                    f"cannot snapshot a {type(self._obj).__name__}: copy.deepcopy failed "
                    f"({type(exc).__name__}: {exc}); its __deepcopy__, or __reduce__ and __setstate__, must rebuild "
                    "the state from a copy"
                ) from exc
            return self._factory._keep(copied)

    async def _release(self) -> None:
        self._obj = None  # type: ignore[assignment]  # release the state; a closed sandbox refuses calls

    def _current_digest(self) -> bytes | None:
        if self._digest is None:
            self._digest = _digest(self._obj)
        return self._digest


def _digest(obj: object) -> bytes | None:
    """blake2b of the pickled object, or None when it cannot be pickled (then nobody can tell)."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None
    return hashlib.blake2b(data, digest_size=16).digest()


def _as_output(result: Any, call: ToolCall) -> Output:
    """Check that `run` returned an Output; give lists and dicts back as a store would.

    A list or dict goes through a JSON round trip: the caller gets a private copy, never an alias of the
    state that a later call could mutate, in the same shape (tuples as lists, string keys) a hit from a
    serialising store will have, so a miss and a hit look alike.
    """
    if result is None or isinstance(result, str | bytes | bool | int | float):
        return result
    if isinstance(result, list | dict):
        try:
            return json.loads(json.dumps(result))  # type: ignore[no-any-return]
        except (TypeError, ValueError) as exc:
            raise TypeError(f"run() returned a {type(result).__name__} that is not JSON for {call!r}: {exc}") from exc
    raise TypeError(
        f"run() must return str, bytes, None, a number, or a JSON list/dict; got {type(result).__name__} for {call!r}"
    )
