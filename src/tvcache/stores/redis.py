"""The shared store on Redis or Redis Cluster: many processes on many machines use one graph.

    RedisStore("redis://127.0.0.1:6379/0")            # one server (rediss:// for TLS)
    RedisStore("redis+cluster://10.0.0.5:7000")       # a cluster, found from any of its nodes

Every method is one Lua script (EVALSHA, falling back to EVAL when the server has not cached it) or one
command, so each step of the per-call algorithm is atomic on the server and costs one round trip. Every key of
a scope carries the hash tag `{scope key}`: a scope lives in one cluster slot, so its scripts run on one node.

Keys of the scope whose key is S, all under the prefix `tvc:{S}:` (`<hex>` is node + digest in hex):

    entries            hash    node + digest -> msgpack Entry; first writer wins (HSETNX)
    hits               hash    node + digest -> how many lookups hit it, for export
    claim:<hex>        string  the token of whoever executes that call now; expires after the claim ttl
    waiters:<hex>      int     how many waiters registered since the claim's last wake-up
    wake:<hex>         list    one element per registered waiter, pushed when the claim ends; expires
    origins            set     the origins that hold snapshots in S
    snap:<origin>      hash    node -> snapshot id
    parent:<origin>    hash    node -> the nearest snapshotted ancestor when the snapshot was added
    used:<origin>      zset    node -> last used (server clock, seconds): LRU order for eviction
    lease:<origin>     zset    node + nonce -> expiry (server clock): a snapshot is leased while one is live
    cands:<digest>     list    msgpack candidates of the call (reuse by what a call read), newest first, bounded
    candidates         set     the names of the scope's candidate lists, for `forget`

and `tvc:tasks`, one hash of every scope's TaskInfo (its own slot; written once per recording rollout).

A waiter does not poll: it registers under `waiters:<hex>` and blocks in BLPOP on `wake:<hex>`, on a
connection of its own (BLPOP holds its connection), for at most the claim's remaining time. Whoever ends the
claim (a record, or a release) pushes one element per registered waiter, so every waiter wakes the moment the
entry lands, and one whose claimant died wakes when the claim expires. The wake list outlives the push by a
few seconds, so a waiter that registered just before the push and blocks just after still finds its element;
a stale element only causes a spurious wake-up, after which the waiter looks again.

All times (lease expiry, last use) come from the server's clock, so machines with skewed clocks agree.
Failures to reach the server raise `StoreError` quickly (a short connect timeout, no client-side retries), so
the cache falls back to executing directly instead of stalling a training step; so do errors the server
answers with and stored values that do not decode.

Redis acknowledges a write before it is on disk unless told otherwise: with its defaults (no AOF, RDB
snapshots now and then) most entries acknowledged since the last snapshot are gone after a crash or a
`kill -9`. Run it with `appendonly yes` and `appendfsync always` (nothing acknowledged is lost) or `everysec`
(about the last second may be). The store warns once, at its first connection, when a server runs without
AOF (and says nothing where `CONFIG GET` is refused, as managed services often do).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol, TypeVar

import msgspec
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import ConnectionPool, SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..graph import MAX_CANDIDATES, Candidate, Entry, decode_candidate, encode_candidate
from .base import Claim, GraphExport, Lease, SnapshotRecord, StoreError, TaskInfo, export_entries

__all__ = ["RedisStore"]

log = logging.getLogger("tvcache")

CONNECT_TIMEOUT = 1.0  # seconds; an unreachable server must fail fast, the cache then executes directly
SOCKET_TIMEOUT = 5.0  # a reply taking longer means the server is stuck: also a failure
GIVE_BACK_PAUSE = 0.5  # seconds between tries to release a claim a failed lookup may have taken
GIVE_BACK_FOR = 600.0  # and for at most this long (a claim may be asked to last years)
WAKE_SECONDS = 10  # how long a wake list outlives its push; far above one round trip
MAX_SECONDS = 10 * 365 * 86400.0  # longer claims and leases are clamped to this: Redis expiries are bounded

T = TypeVar("T")
_Arg = str | bytes | int | float
# What a failing server makes redis-py raise. AttributeError, TypeError and RuntimeError too: after a timeout, its
# asyncio cluster client disconnects its idle connections while another command takes one of them, which then fails
# inside the client (`'NoneType' object has no attribute 'writelines'`; under uvloop, `RuntimeError: unable to
# perform operation on <TCPTransport closed=True ...>`; the standalone client's `_write_ready` TypeError is redis-py
# issue 3546). The store failed, not the caller: the cache goes on without it, as for any store error.
_ERRORS = (RedisError, RedisClusterException, OSError, AttributeError, TypeError, RuntimeError)

_encode = msgspec.msgpack.Encoder().encode
_decode_entry = msgspec.msgpack.Decoder(Entry).decode
_decode_task = msgspec.msgpack.Decoder(TaskInfo).decode


class _Client(Protocol):
    """What this store uses of `redis.asyncio.Redis` and `RedisCluster`."""

    async def execute_command(self, *args: Any, **options: Any) -> Any: ...

    async def aclose(self) -> None: ...


class _Script:
    """A Lua script of `redis_lua/` (package data), after the library files it uses (functions it calls)."""

    def __init__(self, name: str, *libraries: str):
        self.source = "\n".join(_lua(part) for part in (*libraries, name))
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


def _lua(name: str) -> str:
    return (resources.files(__package__) / "redis_lua" / f"{name}.lua").read_text()


# -- scripts: each file says what it takes (KEYS, ARGV) and returns ---------------------------------------------

_LOOKUP = _Script("lookup")
_WAIT = _Script("wait")
_RECORD = _Script("record", "wake")
_RELEASE = _Script("release", "wake")
_REFRESH = _Script("refresh")
_LEASE = _Script("lease", "clock", "snapshot_keys")
_UNLEASE = _Script("unlease", "snapshot_keys")
_ADD_SNAPSHOT = _Script("add_snapshot", "clock", "snapshot_keys")
_DROP_SNAPSHOT = _Script("drop_snapshot", "snapshot_keys")
_SNAPSHOTS = _Script("snapshots", "clock", "snapshot_keys")
_FORGET = _Script("forget", "snapshot_keys")
_EXPORT = _Script("export", "clock", "snapshot_keys")
_ADD_CANDIDATE = _Script("add_candidate")


# -- the store -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Keys:
    """Names of a scope's keys that Python builds (the snapshot scripts name the rest)."""

    prefix: str
    entries: str
    hits: str
    origins: str
    candidates: str


@dataclass(slots=True)
class _Connection:
    loop: asyncio.AbstractEventLoop
    client: _Client
    blocking: _Client  # for BLPOP: no socket timeout, since a wait blocks its connection on purpose
    closer: AsyncGenerator[None, None]
    ready: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _seconds(value: float) -> float:
    return max(0.0, min(value, MAX_SECONDS))


def _ms(seconds: float) -> int:
    """A claim's ttl in whole milliseconds as Redis takes it: at least 1, at most `MAX_SECONDS`."""
    return max(1, round(_seconds(seconds) * 1000))


async def _close_at_loop_end(clients: Sequence[_Client]) -> AsyncGenerator[None, None]:
    """Suspended until closed: by `close()`, or by `asyncio.run` finalizing async generators when its loop
    ends, which closes the connections on the loop that owns them."""
    try:
        yield
    finally:
        for client in clients:
            with contextlib.suppress(*_ERRORS):  # best effort: the server may be gone, why we close
                await client.aclose()


class RedisStore:
    """A `Store` on Redis or Redis Cluster. Connects lazily, on the event loop that first uses it.

    Query parameters of the URL are passed to redis-py (`?socket_timeout=2&socket_connect_timeout=0.5`).
    `prefix` separates unrelated caches sharing one database.
    """

    def __init__(self, url: str, *, prefix: str = "tvc"):
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"a key prefix must not hold braces (they make Redis Cluster hash tags): {prefix!r}")
        self._prefix = prefix
        self._cluster = url.startswith(("redis+cluster://", "rediss+cluster://"))
        if not url.startswith(("redis://", "rediss://", "unix://")) and not self._cluster:
            raise ValueError(
                f"a Redis store URL is redis://host:port/db, rediss://..., unix:///path or redis+cluster://host:port,"
                f" got {url!r}"
            )
        options: dict[str, Any] = {
            "socket_connect_timeout": CONNECT_TIMEOUT,
            "socket_timeout": SOCKET_TIMEOUT,
            **parse_url(url.replace("+cluster://", "://", 1)),
        }
        if self._cluster:
            if options.pop("db", 0):
                raise ValueError(f"a Redis Cluster has only database 0: {url!r}")
            if options.pop("connection_class", None) is SSLConnection:
                options["ssl"] = True
        self._options = options
        self._grace = float(options["socket_timeout"] or SOCKET_TIMEOUT)
        self._where = f"{options.get('host') or options.get('path')}:{options.get('port', '')}"
        self._tasks_key = f"{prefix}:tasks"
        self._connection: _Connection | None = None
        self._durability_checked = False
        self._giving_back: set[asyncio.Task[None]] = set()

    # -- connections -------------------------------------------------------------------------------------

    def _connect(self, socket_timeout: float | None) -> _Client:
        # No client-side retries: a failed step of a rollout is retried by executing directly, and a retried
        # script could apply twice. A dead pooled connection is still replaced, as redis-py checks each one it
        # hands out.
        options = {**self._options, "socket_timeout": socket_timeout, "retry": Retry(NoBackoff(), 0)}
        if self._cluster:
            client: _Client = RedisCluster(**options)
            return client
        return Redis.from_pool(ConnectionPool(**options))

    async def _link(self) -> _Connection:
        """This event loop's connections. redis-py's connections belong to the loop that opened them, and a
        store may outlive a loop (`asyncio.run` per test, per training step): a new loop gets new ones."""
        loop = asyncio.get_running_loop()
        link = self._connection
        if link is None or link.loop is not loop:
            client, blocking = self._connect(self._options["socket_timeout"]), self._connect(None)
            link = self._connection = _Connection(loop, client, blocking, _close_at_loop_end((client, blocking)))
            await anext(link.closer)
        if not link.ready:
            async with link.lock:
                if not link.ready:
                    # A cluster client learns the slot map before its first command: one sent before that goes
                    # to an arbitrary node and is redirected, and redis-py answers a burst of redirections by
                    # rebuilding its connections under the commands in flight.
                    for c in (link.client, link.blocking):
                        if isinstance(c, RedisCluster):
                            await c.initialize()
                    if not self._durability_checked:
                        await self._check_durability(link.client)
                    link.ready = True
        return link

    async def _check_durability(self, client: _Client) -> None:
        """Warn once if a server runs without AOF: it loses acknowledged entries when it dies."""
        options = {"target_nodes": RedisCluster.PRIMARIES} if self._cluster else {}
        try:
            reply = await client.execute_command("CONFIG GET", "appendonly", **options)
        except ResponseError:  # CONFIG is refused or renamed here: nothing to learn, nothing to say
            reply = {}
        except _ERRORS:  # a node unreachable now: the command that follows says so if it matters
            return
        self._durability_checked = True
        replies = reply.values() if self._cluster else [reply]
        if any(_text(r.get("appendonly") or r.get(b"appendonly") or b"") == "no" for r in replies):
            log.warning(
                "redis store at %s: the server runs without AOF (appendonly no), so entries it acknowledged are"
                " lost if it crashes or is killed; run it with appendonly yes and appendfsync always or everysec",
                self._where,
            )

    def _error(self, exc: BaseException) -> StoreError:
        return StoreError(f"redis store at {self._where}: {type(exc).__name__}: {exc}")

    def _scope(self, scope_key: str) -> _Keys:
        # Built on every call, not kept: a long-lived store would otherwise hold one per scope it ever saw.
        if not scope_key or "{" in scope_key or "}" in scope_key:
            raise ValueError(f"a scope key must be non-empty and hold no braces: {scope_key!r}")
        prefix = f"{self._prefix}:{{{scope_key}}}:"
        return _Keys(prefix, prefix + "entries", prefix + "hits", prefix + "origins", prefix + "candidates")

    async def _eval(self, script: _Script, keys: Sequence[_Arg], args: Sequence[_Arg]) -> Any:
        try:
            client = (await self._link()).client
            try:
                return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            except NoScriptError:  # a restarted or new server: EVAL caches the script there
                return await client.execute_command("EVAL", script.source, len(keys), *keys, *args)
        except _ERRORS as exc:
            raise self._error(exc) from exc

    async def _command(self, *args: _Arg) -> Any:
        try:
            return await (await self._link()).client.execute_command(*args)
        except _ERRORS as exc:
            raise self._error(exc) from exc

    async def _block(self, key: str, seconds: float) -> None:
        """Wait up to `seconds` for an element on the wake list `key`."""
        seconds = max(seconds, 0.001)  # BLPOP with timeout 0 would block forever
        try:
            # The local deadline only catches a server that stopped answering: BLPOP's own timeout ends a
            # normal wait.
            blocking = (await self._link()).blocking
            await asyncio.wait_for(blocking.execute_command("BLPOP", key, f"{seconds:.3f}"), seconds + self._grace)
        except (*_ERRORS, TimeoutError) as exc:
            raise self._error(exc) from exc

    # -- entries and claims ------------------------------------------------------------------------------

    async def lookup(self, scope_key: str, node: bytes, digest: bytes, claim: float = 0.0) -> Entry | Claim | None:
        keys = self._scope(scope_key)
        field = node + digest
        claim_ms = _ms(claim) if claim > 0 else 0
        token = secrets.token_hex(8) if claim_ms else ""
        try:
            found = await self._eval(
                _LOOKUP, (keys.entries, keys.hits, f"{keys.prefix}claim:{field.hex()}"), (field, claim_ms, token)
            )
        except BaseException as exc:
            if token and _may_have_run(exc):  # then it may have taken the claim
                task = asyncio.get_running_loop().create_task(self._give_back(scope_key, node, digest, token, claim))
                self._giving_back.add(task)
                task.add_done_callback(self._giving_back.discard)
            raise
        if isinstance(found, bytes):
            return self._entry(found)
        if found is None:
            return None
        return Claim(token if found == 1 else None)

    async def _give_back(self, scope_key: str, node: bytes, digest: bytes, token: str, ttl: float) -> None:
        """Release the claim a failed lookup may have taken, so that others making the call need not wait out its
        ttl. First a round trip on the claim's key: a lookup the server still holds (it was stuck, or the answer
        was lost on the way) is done by then, so the release cannot overtake it. Tried until the claim would have
        expired anyway (at most `GIVE_BACK_FOR`); the release does nothing to a claim that is not ours."""
        claim = f"{self._scope(scope_key).prefix}claim:{(node + digest).hex()}"
        deadline = time.monotonic() + min(ttl, GIVE_BACK_FOR)
        while time.monotonic() < deadline:
            try:
                await self._command("PTTL", claim)
                await self.release(scope_key, node, digest, token)
                return
            except StoreError:
                await asyncio.sleep(GIVE_BACK_PAUSE)

    async def wait(self, scope_key: str, node: bytes, digest: bytes, timeout: float) -> Entry | None:
        keys = self._scope(scope_key)
        field = node + digest
        name = field.hex()
        claim, waiters, wake = (f"{keys.prefix}{kind}:{name}" for kind in ("claim", "waiters", "wake"))
        deadline = time.monotonic() + timeout
        while True:
            found = await self._eval(_WAIT, (keys.entries, claim, waiters), (field, WAKE_SECONDS))
            if isinstance(found, bytes):
                return self._entry(found)
            left = deadline - time.monotonic()
            if found is None or left <= 0:
                return None
            # Woken by a record, a release or the claim's expiry, look again: a refreshed claim is waited on
            # anew, and a spurious wake-up (a stale element) costs one round trip.
            await self._block(wake, min(left, found / 1000 + 0.002))

    async def record(
        self, scope_key: str, node: bytes, digest: bytes, entry: Entry, token: str | None, *, reused: bool = False
    ) -> Entry:
        keys = self._scope(scope_key)
        field = node + digest
        name = field.hex()
        earlier = await self._eval(
            _RECORD,
            (keys.entries, f"{keys.prefix}claim:{name}", f"{keys.prefix}waiters:{name}", f"{keys.prefix}wake:{name}"),
            (field, _encode(entry), WAKE_SECONDS),
        )
        return entry if earlier is None else self._entry(earlier)

    async def release(self, scope_key: str, node: bytes, digest: bytes, token: str) -> None:
        prefix, name = self._scope(scope_key).prefix, (node + digest).hex()
        await self._eval(
            _RELEASE,
            (f"{prefix}claim:{name}", f"{prefix}waiters:{name}", f"{prefix}wake:{name}"),
            (token, WAKE_SECONDS),
        )

    async def refresh(self, scope_key: str, node: bytes, digest: bytes, token: str, ttl: float) -> bool:
        claim = f"{self._scope(scope_key).prefix}claim:{(node + digest).hex()}"
        return bool(await self._eval(_REFRESH, (claim,), (token, _ms(ttl))))

    def _entry(self, blob: bytes) -> Entry:
        return self._decode(_decode_entry, blob, "entry")

    def _decode(self, decode: Callable[[bytes], T], blob: bytes, what: str) -> T:
        try:
            return decode(blob)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise StoreError(f"redis store at {self._where}: a corrupt {what}: {exc}") from exc

    # -- candidates (reuse by what a call read) ------------------------------------------------------------

    async def add_candidate(self, scope_key: str, digest: bytes, candidate: Candidate) -> None:
        keys = self._scope(scope_key)
        cands = f"{keys.prefix}cands:{digest.hex()}"
        await self._eval(_ADD_CANDIDATE, (cands, keys.candidates), (encode_candidate(candidate), MAX_CANDIDATES))

    async def candidates(self, scope_key: str, digest: bytes) -> list[Candidate]:
        cands = f"{self._scope(scope_key).prefix}cands:{digest.hex()}"
        blobs = await self._command("LRANGE", cands, 0, MAX_CANDIDATES - 1)
        return [self._decode(decode_candidate, blob, "candidate") for blob in blobs]

    # -- snapshots ---------------------------------------------------------------------------------------

    async def lease(self, scope_key: str, origin: str, path: Sequence[bytes], ttl: float) -> Lease | None:
        if not path:
            return None
        keys = self._scope(scope_key)
        nonce = secrets.token_hex(8)
        found = await self._eval(_LEASE, (keys.origins,), (keys.prefix, origin, _seconds(ttl), nonce, *path))
        if found is None:
            return None
        node, snapshot_id = found
        # The token names what it leases, so `unlease(scope_key, token)` needs no table to find it.
        return Lease(node, self._decode(bytes.decode, snapshot_id, "snapshot id"), f"{nonce}{node.hex()}{origin}")

    async def unlease(self, scope_key: str, token: str) -> None:
        nonce, node, origin = token[:16], token[16:48], token[48:]
        try:
            member = bytes.fromhex(node) + nonce.encode()
        except ValueError:
            return  # not a token of ours: nothing is leased under it
        keys = self._scope(scope_key)
        await self._eval(_UNLEASE, (keys.origins,), (keys.prefix, origin, member))

    async def add_snapshot(
        self, scope_key: str, origin: str, path: Sequence[bytes], snapshot_id: str, budget: int
    ) -> list[str]:
        if not path:
            raise ValueError("add_snapshot needs the path to the snapshot's node, root first")
        keys = self._scope(scope_key)
        doomed = await self._eval(_ADD_SNAPSHOT, (keys.origins,), (keys.prefix, origin, budget, snapshot_id, *path))
        return [self._decode(bytes.decode, sid, "snapshot id") for sid in doomed]

    async def drop_snapshot(self, scope_key: str, origin: str, node: bytes, snapshot_id: str) -> None:
        keys = self._scope(scope_key)
        await self._eval(_DROP_SNAPSHOT, (keys.origins,), (keys.prefix, origin, node, snapshot_id))

    async def snapshots(self, scope_key: str, origin: str | None = None) -> list[SnapshotRecord]:
        keys = self._scope(scope_key)
        rows = await self._eval(
            _SNAPSHOTS, (keys.origins,), (keys.prefix,) if origin is None else (keys.prefix, origin)
        )
        return self._records(rows)

    # -- tasks and export --------------------------------------------------------------------------------

    async def register(self, info: TaskInfo) -> None:
        await self._command("HSETNX", self._tasks_key, info.scope_key, _encode(info))

    async def tasks(self) -> list[TaskInfo]:
        return [self._decode(_decode_task, blob, "task") for blob in await self._command("HVALS", self._tasks_key)]

    async def export(self, scope_key: str, limit: int = 10_000) -> GraphExport:
        keys = self._scope(scope_key)
        # The task registry lives in its own slot, so it is asked alongside, not inside, the scope's script.
        info, (truncated, rows, snapshots) = await asyncio.gather(
            self._command("HGET", self._tasks_key, scope_key),
            self._eval(_EXPORT, (keys.origins, keys.entries, keys.hits), (keys.prefix, max(0, limit))),
        )
        try:
            entries = export_entries((f[:16], f[16:], self._entry(blob), int(hits)) for f, blob, hits in rows)
        except ValueError as exc:
            raise StoreError(f"redis store at {self._where}: a corrupt hit count: {exc}") from exc
        task = self._decode(_decode_task, info, "task") if info is not None else None
        return GraphExport(task, entries, self._records(snapshots), bool(truncated))

    async def forget(self, scope_key: str) -> None:
        """Delete a scope's entries, hit counts, snapshot records and its name: for scopes nobody will use
        again (a changed environment gets a new scope_key, so the old one only takes memory). The caller deletes
        the snapshots themselves from its sandboxes first (see `snapshots`)."""
        keys = self._scope(scope_key)
        await asyncio.gather(
            self._eval(_FORGET, (keys.origins, keys.entries, keys.hits, keys.candidates), (keys.prefix,)),
            self._command("HDEL", self._tasks_key, scope_key),
        )

    async def ping(self) -> None:
        """PING (every primary of a cluster): a server that is down, refuses our password or is stuck past the
        socket timeout raises `StoreError`."""
        options = {"target_nodes": RedisCluster.PRIMARIES} if self._cluster else {}
        try:
            await (await self._link()).client.execute_command("PING", **options)
        except _ERRORS as exc:
            raise self._error(exc) from exc

    def _records(self, rows: Sequence[Sequence[Any]]) -> list[SnapshotRecord]:
        try:
            return [
                SnapshotRecord(origin.decode(), node, sid.decode(), parent or None, float(used), bool(leased))
                for origin, node, sid, parent, used, leased in rows
            ]
        except (ValueError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
            raise StoreError(f"redis store at {self._where}: a corrupt snapshot record: {exc}") from exc

    async def close(self) -> None:
        for task in list(self._giving_back):  # what they would release expires in its own time
            task.cancel()
        link, self._connection = self._connection, None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if link is not None and link.loop is running:
            await link.closer.aclose()
        # Connections of another loop are closed when that loop ends (see `_close_at_loop_end`).


def _may_have_run(exc: BaseException) -> bool:
    """Whether a command that failed so may have run on the server all the same: it was cancelled, or its answer
    did not come in time. (Not a refused connection: then a server that is down gets no more tries.)"""
    return isinstance(exc, asyncio.CancelledError) or isinstance(exc.__cause__, RedisTimeoutError)


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
