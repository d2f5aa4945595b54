"""A remote workspace answers before its read set is digested, as a local one does (`Outcome.reads_later`).

The sandbox server replies to an execute as soon as its backend answers, with the id of a read set still being
digested; the client's `Outcome.reads_later` is a task that fetches it (`/v1/reads`), so the cache above it is
the same as over a local workspace. What must hold:

- the answer does not wait for the digest, and the read set fetched after is the one the backend digested: the
  same as an old client gets inline, even when the next command (which changes what the first read) races it;
- a rollout through `ToolCache` keeps the candidate once the read set comes, for a read-set hit after `flush`;
- closing a sandbox waits for its read set; pending read sets are dropped when fetched, when their sandbox
  closes, and past a bound per sandbox;
- a client that does not ask (an old client) gets the read set inline; a cancelled fetch breaks nothing.

The server runs on loopback in a thread of this process over a real traced workspace factory, so that
`held_digests` (a gate around `_reads.read_set` in this process) holds its digests: the only way to see every
time what happens while one is under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import uvicorn

import tvcache
from server_helpers import free_port
from test_read_sets import TRACERS, bash, factory, tree, uses
from test_read_sets_after_answer import held_digests
from tvcache.sandboxes.base import settled
from tvcache.sandboxes.remote import RemoteSandboxes
from tvcache.sandboxes.remote.wire import ExecuteRequest, SandboxReply
from tvcache.server.sandbox_app import SandboxApp
from tvcache.server.sandbox_pool import MAX_PENDING_READS

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="read sets need strace (apt-get install strace)")

CAT = {"command": "cat /testbed/a"}


@contextlib.contextmanager
def served(base: Path, tracer: str) -> Iterator[tuple[str, SandboxApp]]:
    """A sandbox server of a workspace factory over `base` traced with `tracer`, on loopback in a thread with its
    own event loop: its URL and app (the app's shutdown closes the factory)."""
    port = free_port()
    ready = threading.Event()
    held: dict[str, Any] = {}

    async def serve() -> None:
        boxes = factory(base, tracer)
        await uses(boxes, tracer)
        app = SandboxApp(boxes)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_level="warning"))
        held.update(app=app, server=server, loop=asyncio.get_running_loop())
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():  # noqa: ASYNC110  (uvicorn has no event for it)
            await asyncio.sleep(0.02)
        ready.set()
        await serving

    def run() -> None:
        try:
            asyncio.run(serve())
        finally:
            ready.set()  # a server that failed to start fails the test at once

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(120) and "server" in held and held["server"].started, "the sandbox server did not start"
    try:
        yield f"http://127.0.0.1:{port}", held["app"]
    finally:
        held["loop"].call_soon_threadsafe(setattr, held["server"], "should_exit", True)
        thread.join(60)


async def post(url: str, op: str, body: dict[str, Any]) -> tuple[int, Any]:
    """One raw request, as a client of any version may send it: (status, decoded JSON)."""
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/{op}", json=body) as response:
        return response.status, await response.json()


async def inline_reads(url: str) -> dict[str, str]:
    """The read set of `cat /testbed/a` in a new sandbox, asked as an old client asks: no opt-in, inline."""
    status, made = await post(url, "create", {"fingerprint": (await get(url, "info"))["fingerprint"]})
    assert status == 200, made
    status, reply = await post(url, "execute", {"sandbox": made["sandbox"], "tool": "bash", "args": CAT})
    assert status == 200 and reply["reads"] is not None, reply
    assert reply.get("reads_pending") is None
    await post(url, "close", {"sandbox": made["sandbox"]})
    return dict(reply["reads"])


async def get(url: str, op: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/{op}") as response:
        return await response.json()


@contextlib.asynccontextmanager
async def remote(url: str) -> AsyncIterator[tvcache.RemoteSandboxes]:
    boxes = await asyncio.to_thread(tvcache.RemoteSandboxes, url)  # its constructor blocks on a probe
    async with boxes:
        yield boxes


@contextlib.asynccontextmanager
async def remote_box(tracer: str = "strace") -> AsyncIterator[tuple[Any, str, SandboxApp, dict[str, str]]]:
    """A remote sandbox on a server of its own over a base holding /testbed/a; the server's URL and app; and the
    read set of `cat /testbed/a` as an older client gets it, inline."""
    with tree({"a": "A\n"}) as base, served(base, tracer) as (url, app):
        inline = await inline_reads(url)
        async with remote(url) as boxes:
            yield await boxes.create(), url, app, inline


async def cat(box: Any) -> tvcache.Outcome:
    """`cat /testbed/a` in `box`: its answer, which comes with a read set to fetch."""
    answer: tvcache.Outcome = await asyncio.wait_for(box.execute(bash(CAT["command"])), 30)
    assert answer.output == {"output": "A\n", "exit_code": 0} and answer.reads is None
    assert answer.reads_later is not None
    return answer


def delay_fetches(monkeypatch: pytest.MonkeyPatch, until: asyncio.Event | None = None) -> None:
    """The client's read-set requests leave late (a slow network): 0.3 s late, or once `until` is set."""
    call = RemoteSandboxes._call

    async def delayed(self: RemoteSandboxes, server: Any, name: str, *args: Any) -> Any:
        if name == "reads":
            await (until.wait() if until is not None else asyncio.sleep(0.3))
        return await call(self, server, name, *args)

    monkeypatch.setattr(RemoteSandboxes, "_call", delayed)


@pytest.mark.parametrize("tracer", TRACERS)
def test_the_remote_answer_comes_before_the_read_set_which_is_the_backends(
    tracer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer arrives while the backend's digest is held (before this change the server waited for it); the
    next command, sent at once, changes the file the first one read, yet the fetched read set is the inline one:
    the sandbox ran nothing until the digest was done."""

    async def main() -> None:
        async with remote_box(tracer) as (box, _, _, inline):
            with held_digests(monkeypatch) as gate:
                first = await cat(box)
                assert first.reads_later is not None and not first.reads_later.done()
                change = asyncio.create_task(box.execute(bash("echo B > /testbed/a")))
                await asyncio.sleep(0.3)  # the change reaches the server while the digest is held
                gate.set()
                changed = await asyncio.wait_for(change, 30)
                whole = await asyncio.wait_for(settled(first), 30)
            assert changed.changed
            after = await settled(await box.execute(bash(CAT["command"])))
            assert after.output == {"output": "B\n", "exit_code": 0}
        assert whole.reads == inline and inline  # same keys, same digests: the files as `cat` left them
        assert after.reads != inline

    asyncio.run(main())


@pytest.mark.parametrize("tracer", TRACERS)
def test_a_rollout_over_a_remote_workspace_answers_first_and_keeps_its_read_set(
    tracer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call answers while its digest is held; the rollout ends (closing its sandbox) before the read set
    comes, and `flush` waits for the candidate, which a rollout in another state then reuses."""

    async def main() -> tuple[list[Any], dict[str, Any]]:
        with tree({"a": "A\n"}) as base, served(base, tracer) as (url, app):
            async with remote(url) as boxes, tvcache.ToolCache() as cache:
                with held_digests(monkeypatch) as gate:
                    async with cache.rollout("t", boxes, tools=tvcache.Tools()) as r:
                        first = await asyncio.wait_for(r.call("bash", CAT), 30)
                        assert not gate.is_set()
                        gate.set()
                    await cache.flush()
                async with cache.rollout("t", boxes, tools=tvcache.Tools()) as r:
                    await r.call("bash", {"command": "touch /testbed/b"})
                    second = await r.call("bash", CAT)
                await cache.flush()
            assert app.pool.pending_reads == 0
            return [first, second], cache.stats()

    (first, second), stats = asyncio.run(main())
    assert first.output == second.output == {"output": "A\n", "exit_code": 0}
    assert not first.hit and second.hit and stats["read_set_hits"] == 1


def test_closing_a_remote_sandbox_waits_for_its_read_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closed right after the answer, as a rollout that ends may be, before its read set is even asked for (the
    request is delayed here, as a slow network may: the close would reach the server first and drop it): the read
    set still comes, as a local sandbox's close waits for its digest."""
    delay_fetches(monkeypatch)

    async def main() -> None:
        async with remote_box() as (box, _, app, inline):
            with held_digests(monkeypatch) as gate:
                done = await cat(box)
                asyncio.get_running_loop().call_later(0.3, gate.set)
                await asyncio.wait_for(box.close(), 30)
                assert done.reads_later is not None and done.reads_later.done()
                assert done.reads_later.result() == inline
            assert app.pool.pending_reads == 0

    asyncio.run(main())


def test_pending_read_sets_are_dropped_once_fetched_on_close_and_past_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is left behind: a fetched read set is gone (a second fetch is a 404), one never fetched goes with
    its sandbox, and a sandbox keeps at most MAX_PENDING_READS (the oldest go first)."""

    async def main() -> None:
        with tree({"a": "A\n"}) as base, served(base, "strace") as (url, app):
            inline = await inline_reads(url)
            _, made = await post(url, "create", {"fingerprint": (await get(url, "info"))["fingerprint"]})
            sandbox = made["sandbox"]
            assert made["reads_later"] is True  # the server says it can send read sets after the answer
            asked = {"sandbox": sandbox, "tool": "bash", "args": CAT, "reads_later": True}
            with held_digests(monkeypatch) as gate:
                status, reply = await asyncio.wait_for(post(url, "execute", asked), 30)
                assert status == 200 and reply["reads"] is None and reply["reads_pending"], reply
                gate.set()
            fetch = {"sandbox": sandbox, "pending": reply["reads_pending"]}
            assert await post(url, "reads", fetch) == (200, inline)
            status, gone = await post(url, "reads", fetch)
            assert status == 404 and "no pending read set" in gone["error"]
            assert app.pool.pending_reads == 0

            ids = []
            for _ in range(MAX_PENDING_READS + 2):
                status, reply = await post(url, "execute", asked)
                ids.append(reply["reads_pending"])
            assert app.pool.pending_reads == MAX_PENDING_READS
            assert (await post(url, "reads", {"sandbox": sandbox, "pending": ids[0]}))[0] == 404
            assert await post(url, "reads", {"sandbox": sandbox, "pending": ids[-1]}) == (200, inline)
            assert app.pool.pending_reads == MAX_PENDING_READS - 1
            assert (await post(url, "close", {"sandbox": sandbox}))[0] == 200
            assert app.pool.pending_reads == 0
            assert (await post(url, "reads", {"sandbox": sandbox, "pending": ids[-2]}))[0] == 404

    asyncio.run(main())


def test_a_cancelled_fetch_leaves_the_sandbox_and_the_server_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client cancels its read-set task while the server waits for the digest (it hangs up); the sandbox then
    runs the next command and gives its read set, and closing it leaves nothing pending."""

    async def main() -> None:
        async with remote_box() as (box, _, app, inline):
            with held_digests(monkeypatch) as gate:
                first = await cat(box)
                assert first.reads_later is not None
                await asyncio.sleep(0.3)  # the fetch is waiting in the server
                first.reads_later.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await first.reads_later
                gate.set()
            again = await cat(box)
            assert (await asyncio.wait_for(settled(again), 30)).reads == inline
            await box.close()
            assert app.pool.pending_reads == 0

    asyncio.run(main())


def test_a_lost_read_set_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server dropped the pending read set (its sandbox was closed under the client, as an expired lease or a
    restart would): the fetch gives None, so the call is reused by exact history only, never by a wrong read set."""
    closed = asyncio.Event()
    delay_fetches(monkeypatch, closed)

    async def main() -> None:
        async with remote_box() as (box, url, _, _):
            done = await cat(box)
            assert (await post(url, "close", {"sandbox": box.id}))[0] == 200
            closed.set()
            assert (await asyncio.wait_for(settled(done), 30)).reads is None

    asyncio.run(main())


class OldExecuteRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`ExecuteRequest` as servers before `reads_later` decode it."""

    sandbox: str
    tool: str
    args: dict[str, Any] | str


def test_a_client_asks_for_later_read_sets_only_of_a_server_that_takes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that does not say it takes `reads_later` (an older one: its SandboxReply has no such field) gets
    requests it can decode, and answers with the read set inline."""
    plain = msgspec.json.encode(ExecuteRequest("0" * 24, "bash", CAT))
    assert msgspec.json.decode(plain, type=OldExecuteRequest) == OldExecuteRequest("0" * 24, "bash", CAT)
    with pytest.raises(msgspec.ValidationError, match="unknown field `reads_later`"):
        msgspec.json.decode(msgspec.json.encode(ExecuteRequest("0" * 24, "bash", CAT, True)), type=OldExecuteRequest)

    create = SandboxApp._create

    async def as_old(self: SandboxApp, req: Any, receive: Any) -> SandboxReply:
        made = await create(self, req, receive)
        return SandboxReply(made.sandbox, made.live)  # no reads_later: what an older server's reply decodes as

    monkeypatch.setattr(SandboxApp, "_create", as_old)

    async def main() -> None:
        with tree({"a": "A\n"}) as base, served(base, "strace") as (url, _):
            inline = await inline_reads(url)
            async with remote(url) as boxes:
                done = await (await boxes.create()).execute(bash(CAT["command"]))
                assert done.reads_later is None and done.reads == inline

    asyncio.run(main())
