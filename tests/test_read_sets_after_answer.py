"""A traced command answers first; what it read is digested after (`Outcome.reads_later`).

Digesting a read set (resolving the paths the tracer saw, hashing the files) is Python work in the cache's
process: on the critical path it cost 15-27% of a short command. The workspace answers as soon as the command
ends and digests while the model generates its next turn. What must hold meanwhile:

- the sandbox runs nothing else until the digest is done, so it digests the files as the command left them;
- closing the sandbox waits for the digest, and a rollout's candidate is kept once it is done (`flush` waits);
- the result is the same as if the digest had been on the critical path.

The digest is held back by a gate around `_reads.read_set` (both tracers end in it): a slow digest under load is
the fault, and holding it is the only way to see what happens during one every time.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tvcache
from test_read_sets import TRACERS, bash, execute, factory, tree, uses
from tvcache.sandboxes.base import settled
from tvcache.sandboxes.workspace import _reads

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="read sets need strace (apt-get install strace)")


@contextlib.contextmanager
def held_digests(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every read set waits (in its thread) until the event is set; set on the way out, so nothing hangs."""
    gate = threading.Event()
    digest = _reads.read_set

    def held(*args: Any) -> Any:
        assert gate.wait(60), "the test never let the digest go"
        return digest(*args)

    monkeypatch.setattr(_reads, "read_set", held)
    try:
        yield gate
    finally:
        gate.set()


@pytest.mark.parametrize("tracer", TRACERS)
def test_the_answer_comes_before_the_read_set_and_the_sandbox_waits_for_it(
    tracer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        with tree({"a": "A\n"}) as base:
            async with factory(base, tracer) as boxes:
                await uses(boxes, tracer)
                fresh = await execute(await boxes.create(), bash("cat /testbed/a"))  # digested before the answer
                box = await boxes.create()
                with held_digests(monkeypatch) as gate:
                    first = await box.execute(bash("cat /testbed/a"))
                    assert first.output == {"output": "A\n", "exit_code": 0}
                    assert first.reads is None and first.reads_later is not None and not first.reads_later.done()
                    change = asyncio.create_task(box.execute(bash("echo B > /testbed/a")))
                    await asyncio.sleep(0.3)
                    # The sandbox holds still for the digest: the change has not run.
                    assert not change.done() and (Path(box.root) / "testbed" / "a").read_text() == "A\n"
                    gate.set()
                    changed = await change
                    whole = await settled(first)
                assert changed.changed and (Path(box.root) / "testbed" / "a").read_text() == "B\n"
                assert whole.reads is not None and whole.reads == fresh.reads  # the files as `cat` left them

    asyncio.run(main())


def test_closing_a_sandbox_waits_for_its_read_set(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        with tree({"a": "A\n"}) as base:
            async with factory(base) as boxes:
                box = await boxes.create()
                with held_digests(monkeypatch) as gate:
                    done = await box.execute(bash("cat /testbed/a"))
                    assert done.reads_later is not None
                    asyncio.get_running_loop().call_later(0.3, gate.set)
                    await box.close()
                    assert done.reads_later.done() and done.reads_later.result() is not None

    asyncio.run(main())


@pytest.mark.parametrize("tracer", TRACERS)
def test_a_rollout_answers_before_its_read_set_and_keeps_it_after(tracer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The call answers while its digest is held; `flush` waits for the candidate, which a rollout in another
    state (a file it made that `cat` never reads) then reuses, with the same answer as executing it."""

    async def main() -> tuple[list[Any], dict[str, Any]]:
        with tree({"a": "A\n"}) as base:
            async with factory(base, tracer) as boxes:
                await uses(boxes, tracer)
                async with tvcache.ToolCache() as cache:
                    with held_digests(monkeypatch) as gate:
                        async with cache.rollout("t", boxes, tools=tvcache.Tools()) as r:
                            first = await asyncio.wait_for(r.call("bash", {"command": "cat /testbed/a"}), 30)
                            assert cache.stats()["read_set_hits"] == 0 and not gate.is_set()
                            gate.set()
                        await cache.flush()
                    async with cache.rollout("t", boxes, tools=tvcache.Tools()) as r:
                        await r.call("bash", {"command": "touch /testbed/b"})
                        second = await r.call("bash", {"command": "cat /testbed/a"})
                    return [first, second], cache.stats()

    (first, second), stats = asyncio.run(main())
    assert first.output == second.output == {"output": "A\n", "exit_code": 0}
    assert not first.hit and second.hit and stats["read_set_hits"] == 1
    assert stats["seconds_background"] > 0  # the digest, counted off the critical path


@pytest.mark.parametrize("tracer", TRACERS)
def test_a_replay_checks_writes_against_the_read_set_that_comes_after(tracer: str) -> None:
    """A rebuilt state is checked against the recorded one where the sandbox vouches for its writes (it reported
    reads; see `live._wrote_otherwise`). A workspace reports them after the answer, so the replay must wait for
    them: else the check never runs. Here the recorded edge is not reproducible (`export X=$RANDOM`: the same
    empty output, another shell state), so its replay must count as a mismatch and detach the rollout, whose next
    answer then comes from its own sandbox (were it not detached, the node would hold the replayed X under the
    recorded state)."""

    async def main() -> tuple[list[Any], dict[str, Any]]:
        with tree({"a": "A\n"}) as base:
            async with factory(base, tracer) as boxes:
                await uses(boxes, tracer)
                async with tvcache.ToolCache(snapshot_budget=0) as cache:  # the state is rebuilt by replaying
                    async with cache.rollout("t", boxes, tools=tvcache.Tools()) as r:
                        await r.call("bash", {"command": "export X=$RANDOM$RANDOM$RANDOM"})
                        first = await r.call("bash", {"command": "echo $X"})
                    async with cache.rollout("t", boxes, tools=tvcache.Tools()) as r:
                        hit = await r.call("bash", {"command": "export X=$RANDOM$RANDOM$RANDOM"})
                        again = await r.call("bash", {"command": "echo $X; true"})  # a miss: rebuilt here
                        last = await r.call("bash", {"command": "echo $X"})
                    return [first, hit, again, last], cache.stats()

    (first, hit, again, last), stats = asyncio.run(main())
    assert hit.hit and not again.hit and not last.hit  # detached: the first rollout's answer is not this state's
    assert last.output == again.output != first.output
    assert (stats["mismatches"], stats["detached"]) == (1, 1)
