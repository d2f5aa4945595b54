"""The tool-call graph: content-addressed state nodes and the entries recorded on them. Pure, no I/O.

A node is a sandbox state. The root is a fresh sandbox of a scope; a call that changed the state leads to the
child `H(parent, call digest)`. Because ids are chained hashes with a fixed seed, every process and machine
computes the same id for the same history without coordination, and two histories share a node exactly when
they agree on every state-changing call.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from .calls import DIGEST_SIZE, canonical_json

__all__ = [
    "EDGE",
    "MAX_CANDIDATES",
    "MAX_READS",
    "MEMO",
    "Candidate",
    "Entry",
    "Kind",
    "Scope",
    "child_id",
    "decode_candidate",
    "decode_output",
    "encode_candidate",
    "encode_output",
]

Kind = Literal["edge", "memo"]
EDGE: Kind = "edge"
MEMO: Kind = "memo"

_SEED = b"tvcache/graph/v1"


@dataclass(frozen=True, slots=True)
class Scope:
    """The rollouts that start from one sandbox state: `(namespace, task, fingerprint)`.

    `key` is the hex id of the root node; stores file everything of a task under it.
    """

    namespace: str
    task: str
    fingerprint: str

    @property
    def root(self) -> bytes:
        text = canonical_json([self.namespace, self.task, self.fingerprint])
        return hashlib.blake2b(text, digest_size=DIGEST_SIZE, key=_SEED).digest()

    @property
    def key(self) -> str:
        return self.root.hex()


def child_id(parent: bytes, digest: bytes) -> bytes:
    """The node a state-changing call with `digest` leads to from `parent`."""
    return hashlib.blake2b(parent + digest, digest_size=DIGEST_SIZE, key=_SEED).digest()


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """What the cache holds for `(node, call digest)`.

    `output` is the encoded result (see `encode_output`): storing bytes keeps entries immutable, so a caller
    that mutates a returned dict cannot corrupt the cache, and every store can hold them as they are.
    `seconds` is how long the execution took: the time a hit saves and the cost of replaying an edge.
    `writes` (edges only) is what the call changed, as its sandbox observed it (`Outcome.writes`: state keys to
    their new digests), or None when unknown: a rollout that passes the edge, executing it or hitting it, knows
    its state's content from it (reuse by what a call read, `reads.py`).
    """

    kind: Kind
    output: bytes
    seconds: float
    call: str = ""  # the call's key, cut short: for people reading the graph, never for lookups
    writes: dict[str, str] | None = None


#: Candidates kept per call and scope, newest first: a hot call read in many states cannot grow without limit.
MAX_CANDIDATES = 8
#: A call that read more keys than this is not kept as a candidate (a `find /`): checking it would cost more
#: than it saves, and its record would be large in every store.
MAX_READS = 4096


class Candidate(msgspec.Struct, frozen=True, array_like=True):
    """A call's result with what it read (`tvcache.reads`): `reads` maps state keys to the digests the call saw,
    as they were before it ran. `writes` is None for a read-only call; for a state-changing one it is what the
    call wrote (state keys to their new digests), which a rollout reusing it applies to its state. Stores keep a
    call's newest `MAX_CANDIDATES`."""

    reads: dict[str, str]
    output: bytes
    seconds: float
    call: str = ""  # the call's key, cut short, for people
    writes: dict[str, str] | None = None


_candidate_encoder = msgspec.msgpack.Encoder(order="sorted")
_candidate_decoder = msgspec.msgpack.Decoder(Candidate)


def encode_candidate(candidate: Candidate) -> bytes:
    """Canonical bytes (keys sorted): two records of the same result and reads are the same bytes."""
    return _candidate_encoder.encode(candidate)


def decode_candidate(blob: bytes) -> Candidate:
    return _candidate_decoder.decode(blob)


# A str with a lone surrogate (what `os.fsdecode` makes of a file name that is not UTF-8) has no UTF-8 form, so
# msgpack cannot hold it as a string: it travels as an extension type, its bytes encoded with surrogatepass; a
# dict with such a key (an extension value cannot be a key) travels as its list of pairs.
_SURROGATE_STR = 1
_SURROGATE_KEYED_DICT = 2


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _SURROGATE_STR:
        return bytes(data).decode("utf-8", "surrogatepass")
    if code == _SURROGATE_KEYED_DICT:
        return dict(_decoder.decode(data))
    raise ValueError(f"unknown msgpack extension type {code} in a cached output")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def _tag_surrogates(value: Any) -> Any:
    kind = type(value)
    if kind is str:
        try:
            value.encode()
        except UnicodeEncodeError:
            return msgspec.msgpack.Ext(_SURROGATE_STR, value.encode("utf-8", "surrogatepass"))
        return value
    if kind is list or kind is tuple:
        return [_tag_surrogates(item) for item in value]
    if kind is dict:
        pairs = [(_tag_surrogates(k), _tag_surrogates(v)) for k, v in value.items()]
        if any(type(k) is msgspec.msgpack.Ext for k, _ in pairs):
            return msgspec.msgpack.Ext(_SURROGATE_KEYED_DICT, _encoder.encode(pairs))
        return dict(pairs)
    return value


def encode_output(output: Any) -> bytes:
    try:
        return _encoder.encode(output)
    except UnicodeEncodeError:  # rare: only then walk the output
        return _encoder.encode(_tag_surrogates(output))
    except TypeError as exc:
        raise TypeError(f"a tool output must be str, bytes or a JSON value: {exc}") from None


def decode_output(blob: bytes) -> Any:
    return _decoder.decode(blob)
