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

__all__ = ["EDGE", "MEMO", "Entry", "Kind", "Scope", "child_id", "decode_output", "encode_output"]

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
    """

    kind: Kind
    output: bytes
    seconds: float
    call: str = ""  # the call's key, cut short: for people reading the graph, never for lookups


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode_output(output: Any) -> bytes:
    try:
        return _encoder.encode(output)
    except TypeError as exc:
        raise TypeError(f"a tool output must be str, bytes or a JSON value: {exc}") from None


def decode_output(blob: bytes) -> Any:
    return _decoder.decode(blob)
