"""Tool calls, their canonical keys and digests, and per-tool annotations.

A call's identity is its tool name plus the canonical JSON of its arguments: sorted keys, no insignificant
whitespace, NaN and infinities rejected. Two calls that mean the same thing therefore hash the same in every
process and on every machine, which is what lets rollouts share entries without coordination.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = ["Args", "KeyFunction", "ToolCall", "Tools", "canonical_json", "parse_arguments", "parse_tool_call"]

DIGEST_SIZE = 16

KeyFunction = Callable[[dict[str, Any]], dict[str, Any]]

#: A call's arguments as a tool receives them: a JSON object, or the raw text a model emitted when that text
#: was not a JSON object (see `parse_arguments`).
Args = dict[str, Any] | str


_encode = msgspec.json.Encoder(order="sorted").encode


def _check(value: Any) -> None:
    """Reject what has no single JSON text: NaN, infinities, non-string keys, sets and other objects.

    msgspec would encode some of those (a set in iteration order, which differs between processes), so the
    canonical form checks first; exact type tests keep this cheap on the hit path."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return
    if kind is float:
        if value != value or value in (math.inf, -math.inf):
            raise ValueError(f"tool arguments must not contain NaN or infinity, got {value!r}")
        return
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(f"tool argument keys must be strings (JSON objects), got {type(key).__name__} {key!r}")
            _check(item)
        return
    if kind is list or kind is tuple:
        for item in value:
            _check(item)
        return
    raise TypeError(
        f"tool arguments must be JSON values (str, int, float, bool, None, list, dict); "
        f"got {kind.__name__}: {value!r:.80}"
    )


def canonical_json(value: Any) -> bytes:
    """The canonical JSON of `value`: sorted keys, compact, UTF-8. Lists and tuples are both arrays.

    Non-JSON values raise `TypeError` naming the offending type; NaN and infinities raise `ValueError`.
    """
    _check(value)
    try:
        return _encode(value)
    except OverflowError:  # msgspec stops at 64-bit integers; JSON has no limit, and the standard library
        pass  # writes the same text
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in a model's JSON) has no UTF-8 form
        pass
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        # Escaped instead: still one JSON text per value (a JSON text decodes to exactly one value), so no
        # other call can share the key.
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_arguments(text: str) -> Args:
    """Arguments as chat models emit them, a JSON string: the object it encodes, or else the text itself.

    Models emit malformed JSON now and then; such a call is keyed by its raw text and reaches the tool unchanged,
    so it gets the tool's own error message every time, from the cache or not. Only a JSON object counts as
    arguments (a number, a list, `null` or an empty string stay text), so `"{}"` and `""` are different calls.
    """
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except ValueError:  # JSONDecodeError, NaN or Infinity, or nesting too deep
        return text
    except RecursionError:
        return text
    return value if type(value) is dict else text


def parse_tool_call(obj: Any) -> tuple[str, Args]:
    """`(tool, args)` of a tool call in the form a chat API returns it, for `Rollout.call(*parse_tool_call(c))`.

    Accepts OpenAI chat-completions tool calls (`{"type": "function", "function": {"name", "arguments"}}`, or
    the SDK's objects with `.function.name` / `.function.arguments`), OpenAI Responses function calls
    (`{"type": "function_call", "name", "arguments"}`), Anthropic `tool_use` blocks (`{"type": "tool_use",
    "name", "input"}`) and plain `{"name", "arguments"}` mappings. String arguments go through `parse_arguments`.
    Per-call ids (`id`, `call_id`) are left out: they differ between rollouts and must not split cache entries.
    """

    def field(source: Any, name: str) -> Any:
        return source.get(name) if isinstance(source, Mapping) else getattr(source, name, None)

    function = field(obj, "function")
    source = function if function is not None else obj
    name = field(source, "name")
    if not isinstance(name, str):
        raise TypeError(f"not a tool call (no tool name): {obj!r:.200}")
    args = field(source, "arguments")
    if args is None:
        args = field(source, "input")  # Anthropic
    if args is None:
        return name, {}
    if isinstance(args, str):
        return name, parse_arguments(args)
    if isinstance(args, Mapping):
        return name, dict(args)
    raise TypeError(f"tool call {name!r}: arguments must be a JSON string or an object, got {type(args).__name__}")


@dataclass(frozen=True, slots=True, init=False)
class ToolCall:
    """One tool call: `tool` with JSON `args`.

    `args` are what the sandbox executes: a dict, or a str when they were given as text that is not a JSON object
    (see `parse_arguments`; a JSON string that encodes an object is parsed, so `'{"a": 1}'` and `{"a": 1}` are the
    same call). `key` and `digest` identify the call for caching; they are computed from `args` after an optional
    key function has dropped per-rollout noise (request ids, socket names), so two calls that differ only in noise
    share a cache entry while each sandbox still sees its own args.
    """

    tool: str
    args: Args
    canonical: bytes  # UTF-8 "tool {canonical json of the keyed args}" (or "tool \"raw text\"")
    digest: bytes

    def __init__(self, tool: str, args: Mapping[str, Any] | str | None = None, *, key: KeyFunction | None = None):
        if tool not in _checked_names:
            _check_name(tool)
        plain: Args
        if args is None:
            plain = {}
        elif isinstance(args, str):
            plain = parse_arguments(args)
        elif isinstance(args, Mapping):
            plain = dict(args)
        else:
            raise TypeError(f"tool arguments must be a mapping or a JSON string, got {type(args).__name__}")
        keyed = key(dict(plain)) if key is not None and isinstance(plain, dict) else plain
        canonical = b"%s %s" % (tool.encode(), canonical_json(keyed))
        object.__setattr__(self, "tool", tool)
        object.__setattr__(self, "args", plain)
        object.__setattr__(self, "canonical", canonical)
        object.__setattr__(self, "digest", hashlib.blake2b(canonical, digest_size=DIGEST_SIZE).digest())

    @property
    def key(self) -> str:
        """The call's identity as text: the tool name, a space, and the canonical JSON of its (keyed) args."""
        return self.canonical.decode()

    def label(self, limit: int = 200) -> str:
        """The call for people reading a graph: like `key`, but each long string value is shortened (its start,
        then "…") so that every argument shows, rather than the first long one filling the whole budget."""
        if len(self.canonical) <= limit:
            return self.key
        args = self.args
        if isinstance(args, str):
            return f"{self.tool} {_short(args, limit)!r}"
        per_value = max(24, limit // max(1, len(args)))
        shown = {k: _short(v, per_value) if isinstance(v, str) else v for k, v in args.items()}
        return _short(f"{self.tool} {canonical_json(shown).decode()}", limit)

    def __repr__(self) -> str:
        return f"ToolCall({self.key[:120]!r})"


_checked_names: set[str] = set()


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_name(tool: object) -> None:
    if not isinstance(tool, str) or not tool or any(c.isspace() for c in tool):
        raise ValueError(f"a tool name must be a non-empty string without whitespace, got {tool!r}")
    if len(_checked_names) < 10_000:  # remember the few real tool names, not every mistake
        _checked_names.add(tool)


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

    def call(self, tool: str, args: Mapping[str, Any] | str | None = None) -> ToolCall:
        """The `ToolCall` of `tool` with `args`, keyed by the tool's key function if it has one."""
        return ToolCall(tool, args, key=self.key.get(tool))
