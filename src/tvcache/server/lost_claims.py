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
        # Per lookup id, until when it is kept and the claim it took, or None if it was given back before it came;
        # kept in the order they were made, with one window: the oldest are first, to be dropped.
        self._records: dict[str, tuple[float, Claimed | None]] = {}

    def may_claim(self, lookup: str) -> bool:
        """False for a lookup whose claim was given back before the lookup came."""
        return not self._given_back(lookup)

    def granted(self, lookup: str, claim: Claimed) -> bool:
        """Record the claim `lookup` took; False if it was given back while the store took it (release it now)."""
        if self._given_back(lookup):
            return False
        self._records[lookup] = (time.monotonic() + self._window, claim)
        return True

    def give_back(self, lookup: str) -> Claimed | None:
        """The claim `lookup` took, to be released; None if it took none, or has not come yet (it then will not)."""
        self._expire()
        found = self._records.pop(lookup, None)
        if found is None or found[1] is None:
            self._records[lookup] = (time.monotonic() + self._window, None)
            return None
        return found[1]

    def _given_back(self, lookup: str) -> bool:
        self._expire()
        found = self._records.get(lookup)
        return found is not None and found[1] is None

    def _expire(self) -> None:
        now = time.monotonic()
        while self._records and next(iter(self._records.values()))[0] <= now:
            del self._records[next(iter(self._records))]
