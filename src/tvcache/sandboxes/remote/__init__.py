"""Sandboxes on other machines: the `Sandboxes` protocol over one or more `tvcache sandbox-server`s.

    boxes = tvcache.RemoteSandboxes(["http://10.0.0.5:8471", "http://10.0.0.6:8471"], token="s3cret")
    async with cache.rollout("task-17", boxes) as r:
        await r.call("bash", {"command": "make test"})

**Placement.** A new sandbox goes to the least-loaded server (by the count of live sandboxes its last answer
reported, plus the ones placed there since), ties broken at random so workers spread out. A restore goes to the
server holding the snapshot: a snapshot id starts with the id of the server process that made it.

**Origin.** `origin` is the same in every process given the same list of URLs, so the cache lets any worker
restore a snapshot any other worker made. Give every worker the same list.

**Losing a server.** A call in a sandbox of a server that cannot be reached raises `SandboxError` (the cache
never records it; the rollout's next call rebuilds its sandbox elsewhere). A server that failed to answer is
tried last for the next `RETRY_AFTER` seconds. A restore of a snapshot whose server is gone, or has restarted
(a new process id), raises `SandboxError` at once, so the cache drops that snapshot and takes another route.
A create fails over to the other servers and raises only when none can make a sandbox.

**Bounds.** Each call has a deadline: the server's call timeout (from `/v1/info`) plus a margin, so a host that
hangs cannot hang its rollouts. The server bounds outputs (16 MiB encoded); this side refuses any larger reply.
Sandboxes held here have their leases renewed in the background; those of a process that died are closed by
their server when the lease runs out.

The client is a pooled aiohttp session per event loop (`pip install 'tvcache[client]'`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import hashlib
import logging
import random
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from ...calls import ToolCall
from ...extras import require
from ...graph import decode_output
from ..base import Outcome, SandboxBusy, SandboxError, SnapshotGone, ToolError
from .wire import (
    BaseDigestsRequest,
    CreateRequest,
    ExecuteReply,
    ExecuteRequest,
    InfoReply,
    ReadsRequest,
    RenewRequest,
    SandboxReply,
    SandboxRequest,
    SnapshotReply,
    SnapshotRequest,
    server_of,
)

require("client", "tvcache.RemoteSandboxes", "aiohttp")

from yarl import URL  # noqa: E402  (after the check that names the extra to install)

from ...jsonhttp import Invalid, JSONClient, Refused, Unreachable, parse_url  # noqa: E402

__all__ = ["RemoteSandbox", "RemoteSandboxes"]

log = logging.getLogger("tvcache")

T = TypeVar("T")

RETRY_AFTER = 5.0  # seconds a server that failed to answer is tried last
MARGIN = 5.0  # an execute's deadline: the server's own (its call timeout and a grace), and this
MAX_REPLY = 64 << 20  # a 16 MiB output is ~22 MB as base64
DEFAULT_CALL_TIMEOUT = 600.0  # until a server has told its own
PROBE_TIMEOUT = 10.0  # the constructor's blocking question to each server


class _Unreachable(SandboxError):
    """The server did not answer (refused, reset, timed out)."""


class _Refused(SandboxError):
    """The server answered with an error status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Server:
    """One sandbox server as this client knows it."""

    def __init__(self, url: str):
        self.url = url
        self.paths = {name: URL(f"{url}/v1/{name}") for name in _OPERATIONS}
        self.id: str | None = None  # the server process's id, once it told us
        self.timeout = DEFAULT_CALL_TIMEOUT
        self.lease: float | None = None
        self.load = 0  # live sandboxes it reported, plus those placed since
        self.down_until = 0.0
        self.held: set[str] = set()  # ids of the sandboxes this client holds there
        # Those of them still referenced here: closing the factory closes these objects, which wait for their
        # read sets still being fetched.
        self.boxes: weakref.WeakValueDictionary[str, RemoteSandbox] = weakref.WeakValueDictionary()

    def learn(self, info: InfoReply) -> None:
        self.id, self.timeout, self.lease, self.load = info.server, info.timeout, info.lease, info.live


class RemoteSandboxes:
    """A sandbox factory whose sandboxes live on `tvcache sandbox-server`s; see the module docstring.

    `urls`: one server or a list (`http://host:port`; a token may be given as `http://:TOKEN@host:port`).
    `token`: the servers' bearer token (default: from the URLs or the TVCACHE_TOKEN variable).
    `timeout`: seconds for the operations other than execute (create, restore, snapshot, ...);
    `connect_timeout`: seconds to open a connection.

    The constructor asks every server what it serves (a blocking request each, in parallel, for at most 10 s:
    construct it before a busy event loop depends on it) and raises `SandboxError` if none answers, `ValueError`
    if they serve different starting states.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        token: str | None = None,
        *,
        timeout: float = 60.0,
        connect_timeout: float = 2.0,
    ):
        given = [urls] if isinstance(urls, str) else list(urls)
        if not given:
            raise ValueError("RemoteSandboxes needs at least one sandbox server URL")
        parsed = [parse_url(u, "a sandbox server") for u in given]
        self.urls = sorted({url for url, _ in parsed})
        token = token or next((t for _, t in parsed if t), None)
        self._client = JSONClient(token, timeout=timeout, connect_timeout=connect_timeout, max_reply=MAX_REPLY)
        # The same list of servers gives the same origin in every process: snapshots are shared between them.
        self.origin = "remote:" + hashlib.blake2b("\n".join(self.urls).encode(), digest_size=12).hexdigest()
        self._servers = [_Server(url) for url in self.urls]
        self._by_id: dict[str, _Server] = {}
        self._fingerprint = ""
        self._first_probe(min(timeout, PROBE_TIMEOUT))
        self._heartbeat: asyncio.Task[None] | None = None
        self._last_probe = time.monotonic()
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteSandboxes({self.urls!r})"

    # -- the Sandboxes protocol --------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    async def create(self) -> RemoteSandbox:
        """A sandbox on the least-loaded server that will make one."""
        self._check_open()
        failures = []
        now = time.monotonic()
        # Least loaded first, servers that failed lately last; ties at random, so workers do not all pick one.
        order = sorted(self._servers, key=lambda s: (s.down_until > now, s.load, random.random()))
        for server in order:
            server.load += 1
            try:
                reply: SandboxReply = await self._call(server, "create", CreateRequest(self._fingerprint), SandboxReply)
            except SandboxError as exc:
                server.load -= 1
                if isinstance(exc, _Refused) and exc.status == 409:
                    log.error("%s; leaving it out", exc)
                    server.down_until = float("inf")
                failures.append(str(exc))
                continue
            server.load = reply.live
            return self._hold(server, reply)
        raise SandboxError("no sandbox server could make a sandbox: " + "; ".join(failures))

    async def restore(self, snapshot_id: str) -> RemoteSandbox:
        """A sandbox in the snapshot's state, on the server holding it; `SnapshotGone` if it is gone."""
        self._check_open()
        server = await self._holder(snapshot_id)
        if server.down_until > time.monotonic():
            raise SandboxError(f"snapshot {snapshot_id} is on {server.url}, which did not answer lately")
        try:
            reply: SandboxReply = await self._call(server, "restore", SnapshotRequest(snapshot_id), SandboxReply)
        except _Refused as exc:
            if exc.status == 429:  # the holder is full: the snapshot is still there for a later restore
                raise SandboxBusy(str(exc)) from exc
            raise
        server.load = reply.live
        return self._hold(server, reply)

    async def base_digests(self, keys: Collection[str]) -> Mapping[str, str]:
        """The starting state's digests (reuse by what a call read), from a server that answers: every server
        starts from the same state. None from the server (its backend cannot tell them) matches nothing."""
        now = time.monotonic()
        failures = []
        for server in sorted(self._servers, key=lambda s: s.down_until > now):
            try:
                found: dict[str, str] | None = await self._call(
                    server, "base_digests", BaseDigestsRequest(list(keys)), dict[str, str] | None
                )
            except SandboxError as exc:
                failures.append(str(exc))
                continue
            return found or {}
        raise SandboxError("no sandbox server told the starting state's digests: " + "; ".join(failures))

    async def delete(self, snapshot_id: str) -> None:
        try:
            server = await self._holder(snapshot_id)
        except SandboxError:
            return  # its server is gone, and the snapshot with it
        await self._call(server, "delete", SnapshotRequest(snapshot_id), None)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {self!r} is closed; make a new one")

    async def close(self) -> None:
        """Close the sandboxes this object still holds, each after its read sets still being fetched (as closing
        one does), stop renewing leases, close the connections. Idempotent; afterwards `create` and `restore` raise
        `RuntimeError`."""
        self._closed = True
        for server in self._servers:
            for sandbox in list(server.held):
                await (server.boxes.get(sandbox) or RemoteSandbox(self, server, sandbox)).close()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        await self._client.close()

    async def __aenter__(self) -> RemoteSandboxes:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- servers -----------------------------------------------------------------------------------------

    def _first_probe(self, timeout: float) -> None:
        with concurrent.futures.ThreadPoolExecutor(len(self._servers)) as pool:
            answers = list(pool.map(lambda s: self._info_blocking(s, timeout), self._servers))
        infos = {s.url: a for s, a in zip(self._servers, answers, strict=True) if isinstance(a, InfoReply)}
        if not infos:
            raise SandboxError("no sandbox server answered: " + "; ".join(str(a) for a in answers))
        fingerprints = {info.fingerprint for info in infos.values()}
        if len(fingerprints) > 1:
            raise ValueError(f"the sandbox servers serve different starting states (fingerprints): {infos}")
        self._fingerprint = fingerprints.pop()
        for server, answer in zip(self._servers, answers, strict=True):
            if isinstance(answer, InfoReply):
                self._learn(server, answer)
            else:
                log.warning("sandbox server %s did not answer (%s); trying it later", server.url, answer)
                server.down_until = time.monotonic() + RETRY_AFTER

    def _info_blocking(self, server: _Server, timeout: float) -> InfoReply | str:
        request = urllib.request.Request(str(server.paths["info"]), headers=self._client.headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                info: InfoReply = msgspec.json.decode(response.read(MAX_REPLY), type=InfoReply)
                return info
        except urllib.error.HTTPError as exc:
            return f"{server.url} answered {exc.code}: {exc.read(500).decode(errors='replace')}"
        except (OSError, msgspec.DecodeError) as exc:
            return f"{server.url}: {exc}"

    def _learn(self, server: _Server, info: InfoReply) -> None:
        if info.fingerprint != self._fingerprint:
            log.error("sandbox server %s now serves another starting state; leaving it out", server.url)
            server.down_until = float("inf")
            return
        server.learn(info)
        self._by_id[info.server] = server

    async def _holder(self, snapshot_id: str) -> _Server:
        """The server holding a snapshot: known from the id's prefix, or from asking the servers again (one
        that was down when this client started, or has since restarted, has an id not seen yet)."""
        server = self._by_id.get(server_of(snapshot_id))
        if server is None and time.monotonic() - self._last_probe > RETRY_AFTER:
            self._last_probe = time.monotonic()
            for other in self._servers:
                try:
                    self._learn(other, await self._call(other, "info", None, InfoReply))
                except SandboxError:
                    continue
            server = self._by_id.get(server_of(snapshot_id))
        if server is None:
            raise SnapshotGone(f"snapshot {snapshot_id} was made by a sandbox server process that is gone")
        return server

    def _hold(self, server: _Server, reply: SandboxReply) -> RemoteSandbox:
        sandbox = reply.sandbox
        server.held.add(sandbox)
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.get_running_loop().create_task(self._renew_leases())
        box = server.boxes[sandbox] = RemoteSandbox(self, server, sandbox, reply.reads_later)
        # One dropped without close() is no longer renewed: its server closes it when the lease runs out.
        weakref.finalize(box, server.held.discard, sandbox)
        return box

    async def _renew_leases(self) -> None:
        """Renew the leases of the sandboxes held here, so the servers do not close those that sit unused for
        a while (warm sandboxes, a rollout waiting for its model); stop when none are held."""
        while any(s.held for s in self._servers):
            leases = [s.lease for s in self._servers if s.lease]
            await asyncio.sleep(min(leases, default=60.0) / 4)
            for server in self._servers:
                if server.held:
                    try:
                        gone = await self._call(server, "renew", RenewRequest(sorted(server.held)), list[str])
                    except SandboxError as exc:
                        log.debug("renewing leases on %s failed: %s", server.url, exc)
                        continue
                    server.held.difference_update(gone)

    # -- HTTP ----------------------------------------------------------------------------------------------

    async def _call(
        self, server: _Server, name: str, request: msgspec.Struct | None, reply: Any, deadline: float | None = None
    ) -> Any:
        client = self._client
        try:
            answer = await client.call(
                server.paths[name], request, reply, client.deadline(deadline) if deadline else None
            )
        except Unreachable as exc:
            server.down_until = time.monotonic() + RETRY_AFTER
            raise _Unreachable(f"sandbox server {server.url} failed on {name}: {exc}") from exc
        except Refused as exc:
            server.down_until = 0.0
            message = f"sandbox server {server.url} answered {name} with {exc.status}: {exc.message}"
            if name == "execute" and exc.status in (400, 422):
                raise ToolError(exc.message) from None  # refused before it ran; the message is for the model
            if name == "restore" and exc.status == 404:
                raise SnapshotGone(message) from None
            if exc.status == 507:  # no room on the server: its OSError, for `no_room` here as there
                raise _Refused(exc.status, message) from OSError(errno.ENOSPC, exc.message)
            raise _Refused(exc.status, message) from None
        except Invalid as exc:
            raise SandboxError(f"sandbox server {server.url} sent an invalid {name} reply: {exc}") from exc
        server.down_until = 0.0
        return answer


class RemoteSandbox:
    """One live sandbox on a sandbox server.

    Where its server can (`SandboxReply.reads_later`), it answers as soon as the backend does, before the backend
    has digested what the call read: the outcome's `reads_later` is a task that fetches the read set (`/v1/reads`),
    or gives None if it is lost (the server restarted, the sandbox closed), which only costs reuse by what the call
    read. The server's backend runs nothing else in the sandbox until the digest is done."""

    def __init__(self, factory: RemoteSandboxes, server: _Server, sandbox: str, reads_later: bool = False):
        self._factory = factory
        self._server = server
        self.id = sandbox
        self._reads_later = reads_later
        self._fetching: set[asyncio.Task[Mapping[str, str] | None]] = set()

    @property
    def server(self) -> str:
        return self._server.url

    async def execute(self, call: ToolCall) -> Outcome:
        server = self._server
        deadline = server.timeout + MARGIN
        request = ExecuteRequest(self.id, call.tool, call.args, self._reads_later)
        reply: ExecuteReply = await self._factory._call(server, "execute", request, ExecuteReply, deadline)
        later = None
        if reply.reads_pending is not None:
            later = asyncio.get_running_loop().create_task(self._fetch_reads(reply.reads_pending))
            self._fetching.add(later)
            later.add_done_callback(self._fetching.discard)
        output = decode_output(reply.output)
        return Outcome(output, reply.changed, reply.error, reply.reads, reply.writes, reads_later=later)

    async def _fetch_reads(self, pending: str) -> Mapping[str, str] | None:
        server = self._server
        try:
            reads: dict[str, str] | None = await self._factory._call(
                server, "reads", ReadsRequest(self.id, pending), dict[str, str] | None, server.timeout + MARGIN
            )
        except (SandboxError, RuntimeError) as exc:  # RuntimeError: this client was closed meanwhile
            log.debug("the read set of a call in sandbox %s is lost: %s", self.id, exc)
            return None
        return reads

    async def snapshot(self) -> str:
        reply: SnapshotReply = await self._factory._call(
            self._server, "snapshot", SandboxRequest(self.id), SnapshotReply
        )
        self._factory._by_id.setdefault(server_of(reply.snapshot), self._server)
        return reply.snapshot

    async def close(self) -> None:
        """Close it on its server; a server that cannot be reached has lost it, or closes it when its lease ends."""
        server = self._server
        if self.id not in server.held:
            return
        server.held.discard(self.id)
        server.load = max(0, server.load - 1)
        if self._fetching:  # its read sets first, as a local sandbox's close waits for its digest
            await asyncio.wait(list(self._fetching))
        try:
            await self._factory._call(server, "close", SandboxRequest(self.id), None)
        except SandboxError as exc:
            log.debug("closing sandbox %s failed: %s", self.id, exc)

    def __repr__(self) -> str:
        return f"RemoteSandbox({self.id} on {self._server.url})"


_OPERATIONS = ("create", "restore", "execute", "reads", "snapshot", "close", "delete", "renew", "info", "base_digests")
