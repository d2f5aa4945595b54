"""Tool calls, their canonical keys and digests, and per-tool annotations.

A call's identity is its tool name plus the canonical JSON of its arguments: sorted keys, no insignificant
whitespace, NaN and infinities rejected. Two calls that mean the same thing therefore hash the same in every
process and on every machine, which is what lets rollouts share entries without coordination.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KeyFunction", "ToolCall", "Tools", "canonical_json"]

DIGEST_SIZE = 16

KeyFunction = Callable[[dict[str, Any]], dict[str, Any]]


def _reject(value: object) -> Any:
    raise TypeError(
        f"tool arguments must be JSON values (str, int, float, bool, None, list, dict); "
        f"got {type(value).__name__}: {value!r:.80}"
    )


def canonical_json(value: Any) -> str:
    """The canonical JSON text of `value`: sorted keys, compact, UTF-8, NaN rejected.

    Non-JSON values raise `TypeError` naming the offending type; NaN and infinities raise `ValueError`.
    """
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_reject
        )
    except ValueError as exc:
        raise ValueError(f"tool arguments must not contain NaN or infinity ({exc})") from None


@dataclass(frozen=True, slots=True, init=False)
class ToolCall:
    """One tool call: `tool` with JSON `args`.

    `args` are what the sandbox executes. `key` and `digest` identify the call for caching; they are computed
    from `args` after an optional key function has dropped per-rollout noise (request ids, socket names),
    so two calls that differ only in noise share a cache entry while each sandbox still sees its own args.
    """

    tool: str
    args: dict[str, Any]
    key: str
    digest: bytes

    def __init__(self, tool: str, args: Mapping[str, Any] | None = None, *, key: KeyFunction | None = None):
        if not isinstance(tool, str) or not tool or any(c.isspace() for c in tool):
            raise ValueError(f"a tool name must be a non-empty string without whitespace, got {tool!r}")
        args = {} if args is None else args
        if not isinstance(args, Mapping):
            raise TypeError(f"tool arguments must be a mapping, got {type(args).__name__}")
        plain = dict(args)
        keyed = key(dict(plain)) if key is not None else plain
        text = f"{tool} {canonical_json(keyed)}"
        object.__setattr__(self, "tool", tool)
        object.__setattr__(self, "args", plain)
        object.__setattr__(self, "key", text)
        object.__setattr__(self, "digest", hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).digest())

    def __repr__(self) -> str:
        return f"ToolCall({self.key[:120]!r})"


@dataclass(frozen=True, slots=True)
class Tools:
    """What the cache may assume about tools, by name.

    - `read_only`: calls never change the sandbox state; their results are memos on the state they ran in.
    - `uncacheable`: results must never be reused (the tool reads the clock, the network, randomness);
      such calls always execute, and count as state-changing unless also read-only.
    - `key`: tool name -> function normalising args before hashing (drop request ids and the like).
    """

    read_only: frozenset[str] = field(default_factory=frozenset)
    uncacheable: frozenset[str] = field(default_factory=frozenset)
    key: Mapping[str, KeyFunction] = field(default_factory=dict)

    def __init__(
        self,
        read_only: Iterable[str] = (),
        uncacheable: Iterable[str] = (),
        key: Mapping[str, KeyFunction] | None = None,
    ):
        for name, names in (("read_only", read_only), ("uncacheable", uncacheable)):
            if isinstance(names, str):
                raise TypeError(f"{name} must be a collection of tool names, not the string {names!r}")
        object.__setattr__(self, "read_only", frozenset(read_only))
        object.__setattr__(self, "uncacheable", frozenset(uncacheable))
        object.__setattr__(self, "key", dict(key or {}))

    def call(self, tool: str, args: Mapping[str, Any] | None = None) -> ToolCall:
        return ToolCall(tool, args, key=self.key.get(tool))
