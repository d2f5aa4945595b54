"""The in-process copy of a durable store's entries: least recently used first out, bounded by bytes.

Entries never change once recorded (first writer wins), so a copy is never stale and a hit on one needs no
I/O. The bound counts each entry's output, call text and key plus a fixed overhead per item (the objects and
the map slots around them: 342 bytes measured with tracemalloc), so what it reports is what the process
holds for them.
"""

from __future__ import annotations

from collections import OrderedDict

from ..graph import Entry

__all__ = ["DEFAULT_CACHE_MB", "CachedEntry", "EntryCache"]

DEFAULT_CACHE_MB = 64.0
ITEM_OVERHEAD = 350


class CachedEntry:
    __slots__ = ("entry", "hits", "size")

    def __init__(self, entry: Entry, size: int):
        self.entry = entry
        self.size = size
        self.hits = 0  # lookups answered with it since it was cached here, for exports


class EntryCache:
    def __init__(self, max_bytes: float):
        if not max_bytes >= 0:
            raise ValueError(f"a cache bound is >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, CachedEntry] = OrderedDict()

    def get(self, key: bytes) -> CachedEntry | None:
        """The cached entry, now the most recently used one."""
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def peek(self, key: bytes) -> CachedEntry | None:
        """The cached entry, its place in the order untouched."""
        return self._items.get(key)

    def put(self, key: bytes, entry: Entry) -> CachedEntry:
        """Cache `entry` (one larger than the whole bound is not kept), dropping the least recently used ones
        beyond the bound; return its item, to count hits on."""
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
            return item
        item = CachedEntry(entry, len(key) + len(entry.output) + len(entry.call) + ITEM_OVERHEAD)
        if item.size > self.max_bytes:
            return item
        self._items[key] = item
        self.bytes += item.size
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
        return item

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)
