"""The cache server's short way for a request that comes whole (`run._protocol`, `JSONApi.start`): served without
the ASGI cycle, it must answer exactly what the general way answers, refuse what it refuses, keep pipelined
answers in order, and finish a handler that has to wait once. A real `tvcache serve` on loopback, raw sockets:
whether a request comes whole is decided by how the test sends it (in one write, or its body a moment later)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import uvicorn

from server_helpers import Server, free_port, request
from tvcache.graph import Entry
from tvcache.server.app import CacheApp, create_app
from tvcache.server.run import _protocol
from tvcache.stores.memory import MemoryStore

TOKEN = "correct-horse-battery-staple"
KEY = "ab" * 16
NODE = b"\x01" * 16


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def lookup(digest: bytes, token: str | None = None, path: str = "/v1/lookup") -> tuple[bytes, bytes]:
    """A lookup's request head and body, as a client sends them."""
    body = msgspec.json.encode({"scope_key": KEY, "node": b64(NODE), "digest": b64(digest)})
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode(), body


def responses(sock: socket.socket, count: int) -> list[bytes]:
    """The next `count` responses on `sock`, each whole (head and body), without their Date header."""
    data, out = b"", []
    while len(out) < count:
        head, sep, rest = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: (\d+)", head)
        if sep and length and len(rest) >= int(length[1]):
            size = int(length[1])
            out.append(re.sub(rb"(?im)^date: [^\r]*\r\n", b"", head) + sep + rest[:size])
            data = rest[size:]
            continue
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {len(out)} of {count} responses"
        data += chunk
    return out


def record(server: Server, digest: bytes, output: bytes) -> None:
    entry = {"kind": "edge", "output": b64(output), "seconds": 2.0, "call": "c"}
    status, body = request(
        server, "POST", "/v1/record", {"scope_key": KEY, "node": b64(NODE), "digest": b64(digest), "entry": entry}
    )
    assert status == 200, body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    with Server(tmp_path_factory.mktemp("short"), "memory://", TOKEN) as server:
        record(server, b"\x02" * 16, b"the output")
        yield server


@pytest.mark.parametrize("digest", [b"\x02" * 16, b"\x03" * 16], ids=["hit", "miss"])
def test_a_lookup_that_comes_whole_gets_the_bytes_of_one_whose_body_comes_later(server: Server, digest: bytes) -> None:
    head, body = lookup(digest, TOKEN)
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(head + body)  # whole: the short way
        [short] = responses(sock, 1)
        sock.sendall(head)  # the body a moment later: the general way reads it
        time.sleep(0.2)
        sock.sendall(body)
        [general] = responses(sock, 1)
    assert short == general
    assert short.startswith(b"HTTP/1.1 200 OK\r\n")
    assert (b64(b"the output").encode() in short) == (digest == b"\x02" * 16)


@pytest.mark.parametrize(
    ("change", "status"),
    [
        ({"token": None}, 401),
        ({"token": "wrong"}, 401),
        ({"content_type": "text/plain"}, 415),
        ({"body": b'{"scope_key": 1}'}, 400),
        ({"body": b"not json"}, 400),
    ],
    ids=["no token", "wrong token", "not JSON", "invalid request", "invalid JSON"],
)
def test_what_the_general_way_refuses_the_short_way_refuses(
    server: Server, change: dict[str, object], status: int
) -> None:
    token = change.get("token", TOKEN)
    head, body = lookup(b"\x02" * 16, token if isinstance(token, str) else None)
    if "content_type" in change:
        head = head.replace(b"application/json", str(change["content_type"]).encode())
    if "body" in change:
        body = change["body"]  # type: ignore[assignment]
        head = re.sub(rb"Content-Length: \d+", b"Content-Length: %d" % len(body), head)
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(head + body)
        [answer] = responses(sock, 1)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]


def test_pipelined_requests_are_answered_in_order_behind_a_wait(server: Server) -> None:
    """A lookup sent behind a wait on the same connection is answered after it, though it could be at once."""
    wait = msgspec.json.encode({"scope_key": KEY, "node": b64(NODE), "digest": b64(b"\x04" * 16), "timeout": 0.5})
    wait_head = (
        f"POST /v1/wait HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(wait)}\r\n\r\n"
    ).encode()
    hit, miss = lookup(b"\x02" * 16, TOKEN), lookup(b"\x03" * 16, TOKEN)
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(b"".join((*hit, wait_head, wait, *miss, *hit)))
        answers = [a.partition(b"\r\n\r\n")[2] for a in responses(sock, 4)]
    replies = [msgspec.json.decode(a) for a in answers]
    assert replies[1] is None  # the wait, ended by its timeout
    assert [r.get("entry") and r["entry"]["output"] for r in (replies[0], replies[2], replies[3])] == [
        b64(b"the output"),
        None,
        b64(b"the output"),
    ]


class WaitingStore(MemoryStore):
    """An in-process store whose reads wait on the event loop once (as a store reading a file in a thread would):
    its lookups start on the short way and must be finished by the general way."""

    async def _get(self, scope_key: str, node: bytes, digest: bytes, hit: bool) -> Entry | None:
        await asyncio.sleep(0.01)
        return await super()._get(scope_key, node, digest, hit)


@contextlib.asynccontextmanager
async def serving(
    store: MemoryStore, keep_alive: float = 75.0, port: int | None = None
) -> AsyncIterator[tuple[CacheApp, int]]:
    """`store`'s app on uvicorn with the server's connection protocol, in this event loop: its port."""
    app = create_app(store)
    port = port or free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=_protocol(app, 15.0, 100), timeout_keep_alive=keep_alive
    )
    served = uvicorn.Server(config)
    task = asyncio.create_task(served.serve())
    while not served.started:  # noqa: ASYNC110  (uvicorn has no event for it)
        await asyncio.sleep(0.01)
    try:
        yield app, port
    finally:
        served.should_exit = True
        await task


async def ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, digest: bytes) -> bytes:
    """One lookup on an open connection: the reply's body."""
    writer.write(b"".join(lookup(digest)))
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: (\d+)", head)
    assert length is not None, head
    return await reader.readexactly(int(length[1]))


def test_a_handler_that_has_to_wait_is_finished_once_by_the_general_way() -> None:
    async def main() -> tuple[list[bytes], int, int]:
        store = WaitingStore()
        await store.record(KEY, NODE, b"\x02" * 16, Entry("edge", b"the output", 2.0, "c"), None)
        async with serving(store) as (app, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answers = [await ask(reader, writer, digest) for digest in (b"\x02" * 16, b"\x03" * 16, b"\x02" * 16)]
            writer.close()
        return answers, app.counters.lookups, app.counters.hits

    answers, lookups, hits = asyncio.run(main())
    assert [msgspec.json.decode(a).get("entry") is not None for a in answers] == [True, False, True]
    assert msgspec.json.decode(answers[0])["entry"]["output"] == b64(b"the output")
    assert (lookups, hits) == (3, 2)  # each handler ran once, though begun on one way and finished on the other


def test_keep_alive_closes_a_connection_idle_since_a_short_answer_and_only_such_a_one() -> None:
    """The short way's keep-alive deadline is one lazy timer per connection: a connection asked every 0.3 s for
    twice the keep-alive stays open, and once idle for longer than the keep-alive it is closed."""

    async def main() -> tuple[int, bytes]:
        async with serving(MemoryStore(), keep_alive=1.0) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            answered = 0
            for _ in range(7):
                await ask(reader, writer, b"\x03" * 16)
                answered += 1
                await asyncio.sleep(0.3)
            closed = await asyncio.wait_for(reader.read(), 30)  # b"" once the server hangs up
            writer.close()
        return answered, closed

    answered, closed = asyncio.run(main())
    assert (answered, closed) == (7, b"")


def test_the_short_way_serves_the_memory_store_only(tmp_path: Path) -> None:
    """A store whose operations wait (SQLite reads in a thread) is not begun outside a task."""
    assert create_app(MemoryStore()).eager
    from tvcache.stores.sqlite import SQLiteStore

    assert not create_app(SQLiteStore(str(tmp_path / "c.db"))).eager


def test_with_access_logs_on_every_lookup_is_logged(tmp_path: Path) -> None:
    """`--access-log` logs each request from uvicorn's request cycle: a lookup that comes whole takes it too."""
    with Server(tmp_path, "memory://", None, "--access-log") as logged:
        with socket.create_connection((logged.host, logged.port), timeout=30) as sock:
            for _ in range(3):
                sock.sendall(b"".join(lookup(b"\x03" * 16)))
                responses(sock, 1)
        deadline = time.monotonic() + 10
        while logged.log().count("POST /v1/lookup") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert logged.log().count("POST /v1/lookup") == 3, logged.log()[-2000:]
