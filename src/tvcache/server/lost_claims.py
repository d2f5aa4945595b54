"""Claims whose lookup's answer a client never got, given back by the id the client chose for that lookup.

A claiming lookup can be run by the server while its answer is lost on the way: the client timed out, or its
caller was cancelled. The claim is then taken and nobody knows its token, so everyone else making that call would
wait out the claim's ttl before executing it. A client names each claiming lookup with an id of its own, and gives
back the claim of a lookup whose answer it did not get by that id (`give_back`). The give-back may reach the server
before the lookup does (another connection, a server that was stuck): the id is then remembered, and that lookup,
when it comes, does not claim.

Both records last `WINDOW` seconds, longer than a client tries to give a claim back; a later give-back finds
nothing, and the claim expires on its own as before. Several servers behind one balancer do not share these
records: a give-back that reaches another server than its lookup does nothing.
"""

from __future__ import annotations

import time

__all__ = ["WINDOW", "LostClaims"]

WINDOW = 120.0

Claimed = tuple[str, bytes, bytes, str]
"""(scope key, node, digest, token) of a claim, what `Store.release` takes."""


class LostClaims:
    def __init__(self, window: float = WINDOW):
        self._window = window
        # Both in the order they were made, with the same window: the oldest are first, to be dropped.
        self._granted: dict[str, tuple[float, Claimed]] = {}
        self._given_back: dict[str, float] = {}

    def may_claim(self, lookup: str) -> bool:
        """False for a lookup whose claim was given back before the lookup came."""
        self._expire()
        return lookup not in self._given_back

    def granted(self, lookup: str, claim: Claimed) -> bool:
        """Record the claim `lookup` took; False if it was given back while the store took it (release it now)."""
        self._expire()
        if lookup in self._given_back:
            return False
        self._granted[lookup] = (time.monotonic() + self._window, claim)
        return True

    def give_back(self, lookup: str) -> Claimed | None:
        """The claim `lookup` took, to be released; None if it took none, or has not come yet (it then will not)."""
        self._expire()
        found = self._granted.pop(lookup, None)
        if found is None:
            self._given_back[lookup] = time.monotonic() + self._window
            return None
        return found[1]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._granted and next(iter(self._granted.values()))[0] <= now:
            del self._granted[next(iter(self._granted))]
        while self._given_back and next(iter(self._given_back.values())) <= now:
            del self._given_back[next(iter(self._given_back))]
