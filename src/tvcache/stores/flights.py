"""In-process single flight: who is executing which `(node, call)` right now, and who waits for it.

Claims expire so that a claimant that died (another process, a cancelled task that never released) cannot
block its key forever; a waiter wakes at the expiry at the latest and retries the claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

from ..graph import Entry
from .base import Claim

__all__ = ["EmbeddedEntries", "Flights"]


class _Flight:
    __slots__ = ("done", "expiry", "token")

    def __init__(self, token: str, expiry: float):
        self.token = token
        self.expiry = expiry
        self.done = asyncio.Event()


class Flights:
    def __init__(self) -> None:
        self._flights: dict[bytes, _Flight] = {}

    def claim(self, key: bytes, ttl: float) -> str | None:
        now = time.monotonic()
        flight = self._flights.get(key)
        if flight is not None and flight.expiry > now:
            return None
        if flight is not None:  # expired: wake its waiters, they will find ours
            flight.done.set()
        token = secrets.token_hex(8)
        self._flights[key] = _Flight(token, now + ttl)
        return token

    def refresh(self, key: bytes, token: str, ttl: float) -> bool:
        flight = self._flights.get(key)
        if flight is None or flight.token != token:
            return False
        flight.expiry = time.monotonic() + ttl
        return True

    def finish(self, key: bytes, token: str | None) -> None:
        """End the flight (recorded or released). Any recorded entry also ends other claimants' waits."""
        flight = self._flights.get(key)
        if flight is not None and (token is None or flight.token == token or flight.expiry <= time.monotonic()):
            del self._flights[key]
            flight.done.set()

    async def wait(self, key: bytes, timeout: float) -> None:
        flight = self._flights.get(key)
        if flight is None:
            return
        # Wake at the claim's expiry at the latest, so a dead claimant is taken over; a refreshed claim is
        # re-read on the next wait.
        limit = min(timeout, max(0.0, flight.expiry - time.monotonic()) + 0.001)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(flight.done.wait(), limit)

    def __len__(self) -> int:
        return len(self._flights)


class EmbeddedEntries:
    """The entry half of the Store interface for stores living in this process (memory, SQLite): lookups,
    single flight by `Flights`, first-writer-wins records. Subclasses say how to get and put an entry."""

    def __init__(self) -> None:
        self._flights = Flights()

    async def _get(self, scope_key: str, node: bytes, digest: bytes, hit: bool) -> Entry | None:
        """The entry, if recorded; `hit` counts a lookup answered with it, for exports."""
        raise NotImplementedError

    async def _put(self, scope_key: str, node: bytes, digest: bytes, entry: Entry) -> Entry:
        """Store `entry` unless one exists; return the one stored."""
        raise NotImplementedError

    async def lookup(self, scope_key: str, node: bytes, digest: bytes, claim: float = 0.0) -> Entry | Claim | None:
        entry = await self._get(scope_key, node, digest, True)
        if entry is not None:
            return entry
        if claim <= 0:
            return None
        return Claim(self._flights.claim(node + digest, claim))

    async def wait(self, scope_key: str, node: bytes, digest: bytes, timeout: float) -> Entry | None:
        await self._flights.wait(node + digest, timeout)
        return await self._get(scope_key, node, digest, False)

    async def record(
        self, scope_key: str, node: bytes, digest: bytes, entry: Entry, token: str | None, *, reused: bool = False
    ) -> Entry:
        winner = await self._put(scope_key, node, digest, entry)
        self._flights.finish(node + digest, None)  # any entry ends the flight, whoever claimed it
        return winner

    async def release(self, scope_key: str, node: bytes, digest: bytes, token: str) -> None:
        self._flights.finish(node + digest, token)

    async def refresh(self, scope_key: str, node: bytes, digest: bytes, token: str, ttl: float) -> bool:
        return self._flights.refresh(node + digest, token, ttl)
