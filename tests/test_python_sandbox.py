"""The in-process Python sandbox backend.

The state here is a small key-value store with a few tools, read and write; correctness is checked against
the oracle the cache relies on: a fresh sandbox executing the same history.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tvcache
from sandbox_oracle import check_snapshots_against_fresh_replay
from tvcache import ToolCall
from tvcache.sandboxes.base import Outcome, Output, Sandbox, SandboxError, Sandboxes
from tvcache.sandboxes.python import PythonSandboxes


class Store:
    """A tiny stateful service: keys and values, and a log of writes."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {"a": 1, "b": 2}
        self.writes: list[str] = []


def run_store(store: Store, call: ToolCall) -> Output:
    args = call.args
    if call.tool == "get":
        return store.data.get(args["key"])
    if call.tool == "keys":
        return sorted(store.data)
    if call.tool == "items":
        return {"items": [[k, v] for k, v in sorted(store.data.items())], "writes": len(store.writes)}
    if call.tool == "set":
        store.data[args["key"]] = args["value"]
        store.writes.append(args["key"])
        return "ok"
    if call.tool == "incr":
        if args["key"] not in store.data:
            return f"error: no key {args['key']}"  # a failed write: nothing changes
        store.data[args["key"]] += args.get("by", 1)
        store.writes.append(args["key"])
        return store.data[args["key"]]
    if call.tool == "delete":
        existed = store.data.pop(args["key"], None) is not None
        return "deleted" if existed else "missing"
    if call.tool == "boom":
        store.data["half"] = 1  # changes the state, then fails
        raise RuntimeError("boom")
    raise ValueError(f"unknown tool {call.tool}")


def boxes(**kwargs: Any) -> PythonSandboxes[Store]:
    return PythonSandboxes(Store, run_store, "store-v1", **kwargs)


def call(tool: str, **args: Any) -> ToolCall:
    return ToolCall(tool, args)


def test_outputs_and_observed_changes() -> None:
    async def main() -> None:
        factory = boxes()
        assert isinstance(factory, Sandboxes) and factory.fingerprint == "store-v1"
        box = await factory.create()
        assert isinstance(box, Sandbox)
        assert await box.execute(call("get", key="a")) == Outcome(1, changed=False)
        assert await box.execute(call("keys")) == Outcome(["a", "b"], changed=False)
        assert await box.execute(call("set", key="c", value=3)) == Outcome("ok", changed=True)
        assert await box.execute(call("incr", key="zz")) == Outcome("error: no key zz", changed=False)
        assert await box.execute(call("incr", key="c", by=2)) == Outcome(5, changed=True)
        assert await box.execute(call("delete", key="nope")) == Outcome("missing", changed=False)
        assert await box.execute(call("delete", key="a")) == Outcome("deleted", changed=True)
        assert await box.execute(call("items")) == Outcome({"items": [["b", 2], ["c", 5]], "writes": 2}, False)

    asyncio.run(main())


def test_async_run_functions_are_awaited_and_serialised() -> None:
    async def run(store: Store, c: ToolCall) -> Output:
        value = store.data.get("n", 0)
        await asyncio.sleep(0.001)  # another call on this sandbox must not interleave here
        if c.tool == "bump":
            store.data["n"] = value + 1
        return store.data.get("n", 0)

    async def main() -> None:
        factory = PythonSandboxes(Store, run, "async-store")
        box = await factory.create()
        outcomes = await asyncio.gather(*(box.execute(call("bump")) for _ in range(10)))
        assert sorted(o.output for o in outcomes) == list(range(1, 11))  # type: ignore[type-var]
        assert all(o.changed for o in outcomes)
        assert await box.execute(call("read")) == Outcome(10, changed=False)

    asyncio.run(main())


def test_a_user_changed_function_replaces_pickling() -> None:
    seen: list[tuple[str, Output]] = []

    def changed(c: ToolCall, output: Output) -> bool | None:
        seen.append((c.tool, output))
        if c.tool == "items":
            return None  # cannot tell
        return c.tool in {"set", "incr", "delete"} and not str(output).startswith(("error", "missing"))

    class Unpicklable(Store):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()

    async def main() -> None:
        with pytest.raises(TypeError, match="cannot be pickled"):
            await PythonSandboxes(Unpicklable, run_store, "u").create()
        factory = PythonSandboxes(Unpicklable, run_store, "u", changed=changed)
        box = await factory.create()
        assert (await box.execute(call("incr", key="zz"))).changed is False
        assert (await box.execute(call("incr", key="a"))).changed is True
        assert (await box.execute(call("items"))).changed is None
        assert seen[0] == ("incr", "error: no key zz")

    asyncio.run(main())


def test_snapshots_are_deep_copies_and_restores_are_independent() -> None:
    async def main() -> None:
        factory = boxes()
        a = await factory.create()
        await a.execute(call("set", key="x", value=10))
        snap = await a.snapshot()
        await a.execute(call("set", key="x", value=11))  # after the snapshot: must not leak
        b = await factory.restore(snap)
        c = await factory.restore(snap)
        await b.execute(call("incr", key="x", by=100))  # and vice versa
        assert (await a.execute(call("get", key="x"))).output == 11
        assert (await b.execute(call("get", key="x"))).output == 110
        assert (await c.execute(call("get", key="x"))).output == 10
        # Nested objects are copied too: the writes log of each restore is its own.
        assert (await c.execute(call("items"))).output == {"items": [["a", 1], ["b", 2], ["x", 10]], "writes": 1}
        assert (await (await factory.create()).execute(call("get", key="x"))).output is None

    asyncio.run(main())


def test_deleted_and_unknown_snapshots_cannot_be_restored() -> None:
    async def main() -> None:
        factory, other = boxes(), boxes()
        box = await factory.create()
        snap = await box.snapshot()
        assert factory.snapshot_count == 1
        await factory.delete(snap)
        await factory.delete(snap)  # twice is harmless
        assert factory.snapshot_count == 0
        with pytest.raises(SandboxError, match="does not exist"):
            await factory.restore(snap)
        theirs = await (await other.create()).snapshot()
        with pytest.raises(SandboxError, match="does not exist"):
            await factory.restore(theirs)
        await other.close()
        assert other.snapshot_count == 0
        with pytest.raises(SandboxError, match="closed"):
            await other.create()

    asyncio.run(main())


class Sealed:
    """A value whose pickled state does not load back (as a sqlite3 connection's authorizer can refuse the
    ATTACH that `deserialize` runs): it pickles, so calls are observed, but no copy of it can be made."""

    def __init__(self) -> None:
        self.n = 0

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise RuntimeError("sealed")


class SealedStore(Store):
    def __init__(self) -> None:
        super().__init__()
        self.sealed = Sealed()


def run_slowly(store: Store, call: ToolCall) -> Output:
    time.sleep(0.02)  # rebuilding a state by replay costs something, so the cache wants snapshots
    return run_store(store, call)


def test_a_state_that_cannot_be_copied_is_kept_live_and_never_snapshotted(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        factory = PythonSandboxes(SealedStore, run_store, "sealed-v1")
        box = await factory.create()
        await box.execute(call("set", key="x", value=1))
        with pytest.raises(SandboxError, match=r"cannot snapshot a SealedStore: copy.deepcopy failed \(RuntimeError"):
            await box.snapshot()
        assert factory.snapshot_count == 0
        assert (await box.execute(call("get", key="x"))).output == 1  # the sandbox is as it was, and answers

        # Through the cache: rollouts that share a prefix, then diverge, so it tries to snapshot the shared state.
        # It keeps the live sandbox (no rebuild by replay) and stops trying, and every answer is the oracle's.
        plans = [[("set", "x", 1), ("set", "y", 2), ("set", "z", i), ("get", "z", 0)] for i in range(4)]
        async with tvcache.ToolCache() as cache:
            for plan in plans:
                sandboxes = PythonSandboxes(SealedStore, run_slowly, "sealed-v1")
                async with cache.rollout("t", sandboxes, tvcache.Tools(read_only=["get"])) as r:
                    oracle = SealedStore()
                    for tool, key, value in plan:
                        args = {"key": key, "value": value} if tool == "set" else {"key": key}
                        assert (await r.call(tool, args)).output == run_store(oracle, call(tool, **args))
            assert cache.stats()["snapshots"] == 0

    with caplog.at_level(logging.WARNING, logger="tvcache"):
        asyncio.run(main())
    assert "cannot snapshot a SealedStore" in caplog.text and "takes no more snapshots" in caplog.text
    assert "rebuilt" not in caplog.text


def test_exceptions_propagate_and_the_next_call_measures_afresh() -> None:
    async def main() -> None:
        box = await boxes().create()
        await box.execute(call("get", key="a"))  # the digest of the initial state is now remembered
        with pytest.raises(RuntimeError, match="boom"):
            await box.execute(call("boom"))
        # "boom" changed the state before failing; a read afterwards must not be compared with the old digest.
        assert await box.execute(call("get", key="half")) == Outcome(1, changed=False)
        await box.close()
        with pytest.raises(SandboxError, match="closed"):
            await box.execute(call("get", key="a"))

    asyncio.run(main())


def test_outputs_are_private_copies_and_must_be_json() -> None:
    def leaky(store: Store, c: ToolCall) -> Any:
        if c.tool == "alias":
            return store.writes  # the live list inside the state
        if c.tool == "write":
            store.writes.append("w")
            return "ok"
        return {1: (1, 2)} if c.tool == "tuple" else object()

    async def main() -> None:
        box = await PythonSandboxes(Store, leaky, "leaky").create()
        first = await box.execute(call("alias"))
        await box.execute(call("write"))
        assert first.output == []  # a later write did not reach into the earlier output
        assert (await box.execute(call("tuple"))).output == {"1": [1, 2]}  # as a JSON store hands it back
        with pytest.raises(TypeError, match="must return"):
            await box.execute(call("object"))

    asyncio.run(main())


def test_bad_arguments_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        PythonSandboxes(Store, run_store, "")
    with pytest.raises(TypeError, match="callables"):
        PythonSandboxes(Store, "run", "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="changed"):
        PythonSandboxes(Store, run_store, "x", changed=True)  # type: ignore[arg-type]


# The oracle: any mix of snapshots, restores and rewinds behaves like a fresh sandbox replaying the history.

operation = st.one_of(
    st.builds(lambda k: call("get", key=k), st.sampled_from("abcx")),
    st.just(call("keys")),
    st.just(call("items")),
    st.builds(lambda k, v: call("set", key=k, value=v), st.sampled_from("abcx"), st.integers(-3, 3)),
    st.builds(lambda k, by: call("incr", key=k, by=by), st.sampled_from("abcx"), st.integers(-2, 2)),
    st.builds(lambda k: call("delete", key=k), st.sampled_from("abcx")),
)
step = st.one_of(
    operation.map(lambda c: ("call", c)),
    st.just(("restore", 0)),
    st.integers(0, 5).map(lambda i: ("rewind", i)),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(step, max_size=40))
def test_restored_sandboxes_match_a_fresh_replay(steps: list[tuple[str, Any]]) -> None:
    async def main() -> None:
        await check_snapshots_against_fresh_replay(boxes(), steps)

    asyncio.run(main())
