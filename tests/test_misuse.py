"""API misuse never poisons the cache: overlapping calls on one rollout, calls after close, corrupt stored
entries, recycled factory objects, backends that cannot snapshot, and a misconfigured store."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import kv
import tvcache
from faults import FaultySandboxes, FlakyStore
from tvcache.graph import Entry
from tvcache.stores import StoreError
from tvcache.stores.memory import MemoryStore


def slow(args: dict[str, Any], delay: float = 0.03) -> dict[str, Any]:
    return dict(args, delay=delay)


def test_overlapping_calls_on_one_rollout_run_in_order_and_never_poison() -> None:
    async def main() -> None:
        boxes = kv.sandboxes()
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                # A read issued together with a slow write: unserialised, the read was looked up at the root
                # while the write ran, then ran after it, recording the written value as a memo of the root.
                results = await asyncio.gather(
                    r.call("append", slow({"key": "a", "value": "x"})), r.call("read", slow({"key": "a"}))
                )
            assert [res.output for res in results] == [1, "x"]  # as if issued one after the other
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                assert (await r.call("read", {"key": "a"})).output == "<missing>"
                assert (await r.call("append", {"key": "a", "value": "x"})).output == 1
                read = await r.call("read", {"key": "a"})
                assert (read.output, read.source) == ("x", "memo")

    asyncio.run(main())


def test_a_closed_rollout_refuses_calls_and_leaks_no_sandbox() -> None:
    async def main() -> None:
        boxes = FaultySandboxes(kv.sandboxes())
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                await r.call("write", {"key": "a", "value": "x"})
            with pytest.raises(RuntimeError, match="closed"):
                await r.call("write", {"key": "b", "value": "y"})
            with pytest.raises(RuntimeError, match="closed"):
                async with r.sandbox():
                    pass
        assert not boxes.open
        assert boxes.created == 1

    asyncio.run(main())


def test_an_entry_that_does_not_decode_counts_as_a_store_error_and_the_call_executes() -> None:
    async def main() -> None:
        store = MemoryStore()
        boxes = kv.sandboxes()
        async with tvcache.ToolCache(store=store) as cache:
            scope = cache.scope("t", boxes)
            write = kv.TOOLS.call("write", {"key": "a", "value": "x"})
            # What a buggy client could record through POST /v1/record: bytes that are no msgpack value.
            await store.record(scope.key, scope.root, write.digest, Entry("edge", b"\xc1\xc1", 0.1), None)
            async with cache.rollout("t", boxes, kv.TOOLS) as r:
                assert (await r.call("write", {"key": "a", "value": "x"})).output == "ok"
                assert (await r.call("read", {"key": "a"})).output == "x"
            assert cache.stats()["store_errors"] == 1
            async with cache.rollout("t", boxes, kv.TOOLS) as r:  # the cursor moved right: the read hits below
                await r.call("write", {"key": "a", "value": "x"})
                assert (await r.call("read", {"key": "a"})).source == "memo"

    asyncio.run(main())


def test_a_recycled_factory_object_never_inherits_an_old_ones_origin() -> None:
    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            seen: dict[int, str] = {}
            reused = 0
            for _ in range(200):
                boxes = kv.sandboxes()
                origin = cache._ctx.factories[boxes].origin
                if id(boxes) in seen:
                    reused += 1  # CPython hands a collected object's id to a new one...
                    assert seen[id(boxes)] != origin  # ...but the new factory gets its own origin
                seen[id(boxes)] = origin
                del boxes  # freed at once (no cycles), so the next factory often gets its id
            assert reused > 0, "no id was reused: this test did not exercise the collision"
            assert len(set(seen.values())) == len(seen)

    asyncio.run(main())


class NoSnapshots(FaultySandboxes):
    """A backend whose snapshots always fail: with an error it did not expect (`OSError`), or saying with
    `SandboxError` that the sandbox is as it was (no room for a layer)."""

    def __init__(self, inner: Any, error: type[Exception]):
        super().__init__(inner)
        self.error = error

    async def create(self) -> Any:
        box = await super().create()

        async def refuse() -> str:
            raise self.error("no space left on device")

        box.snapshot = refuse
        return box


@pytest.mark.parametrize("error", [OSError, tvcache.SandboxError])
def test_a_sandbox_that_cannot_snapshot_stops_trying_instead_of_replaying_everything(error: type[Exception]) -> None:
    async def main() -> None:
        boxes = NoSnapshots(kv.sandboxes(), error)
        async with tvcache.ToolCache() as cache, cache.rollout("t", boxes, kv.TOOLS) as r:
            for i in range(12):  # slow writes: every state is worth a snapshot
                await r.call("write", slow({"key": "a", "value": str(i)}, 0.01))
            assert (await r.call("read", {"key": "a"})).output == "11"
            # An unexpected failure closes the sandbox (it may be half-saved) and the next call replays the
            # history; after a couple the rollout stops snapshotting, so replays stay a handful, not ~66. A
            # SandboxError keeps the sandbox and stops at once: nothing to replay.
            assert cache.stats()["replays"] <= (5 if error is OSError else 0)
        assert not boxes.open

    asyncio.run(main())


def test_fail_fast_raises_store_errors_and_check_store_refuses_to_start() -> None:
    async def main() -> None:
        store = FlakyStore(MemoryStore())
        store.down = True
        async with (
            tvcache.ToolCache(store=store, on_store_error="raise") as cache,
            cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r,
        ):
            with pytest.raises(StoreError, match="connection refused"):
                await r.call("write", {"key": "a", "value": "x"})
        async with tvcache.ToolCache(store=FlakyStore(MemoryStore()), check_store=True) as cache:
            cache.store.down = True  # type: ignore[attr-defined]
            with pytest.raises(StoreError, match="does not answer"):
                async with cache.rollout("t", kv.sandboxes(), kv.TOOLS):
                    pass
            cache.store.down = False  # type: ignore[attr-defined]
            async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                assert (await r.call("read", {"key": "a"})).output == "<missing>"

    asyncio.run(main())


def test_store_failures_are_summarised_not_logged_per_call(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        store = FlakyStore(MemoryStore())
        store.down = True
        async with tvcache.ToolCache(store=store) as cache:
            async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                for i in range(50):
                    await r.call("write", {"key": "a", "value": str(i)})
            assert cache.stats()["store_errors"] >= 50
            store.down = False
            async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                await r.call("read", {"key": "a"})

    with caplog.at_level(logging.WARNING, logger="tvcache"):
        asyncio.run(main())
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tvcache"]
    assert len(lines) == 2, lines  # the first failure, then the store's return (the 30 s summary never came)
    assert "calls run without the cache" in lines[0] and "answers again" in lines[1]


def test_integers_past_64_bits_in_args_are_cached_like_any_other() -> None:
    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            for source in ("executed", "edge"):
                async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:
                    res = await r.call("write", {"key": "a", "value": "x", "n": 2**70})
                    assert (res.output, res.source) == ("ok", source)

    asyncio.run(main())


def test_arguments_of_the_wrong_kind_are_refused_at_once_with_what_was_meant() -> None:
    """A store URL passed as `store=`, a factory left out, a list of tool names for `tools`: each used to be
    accepted and fail later, deep inside, as an AttributeError on the first call (or at close)."""
    with pytest.raises(TypeError, match=r"pass a URL as the first argument: ToolCache\('sqlite:///r.db'\)"):
        tvcache.ToolCache(store="sqlite:///r.db")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="store must be a tvcache Store"):
        tvcache.ToolCache(store={})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a store URL is a string"):
        tvcache.ToolCache(5)  # type: ignore[arg-type]

    async def main() -> None:
        async with tvcache.ToolCache() as cache:
            with pytest.raises(TypeError, match="sandboxes must be a sandbox factory"):
                await cache.open("t", None)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=r"tools must be a tvcache\.Tools"):
                await cache.open("t", kv.sandboxes(), ["read"])  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="sandboxes must be a sandbox factory"):
                await cache.prefetch(["t"], "not a factory")  # type: ignore[arg-type]
            async with cache.rollout("t", kv.sandboxes(), kv.TOOLS) as r:  # and nothing was left half-made
                assert (await r.call("write", {"key": "a", "value": "x"})).output is not None
            assert cache.stats()["calls"] == 1

    asyncio.run(main())
