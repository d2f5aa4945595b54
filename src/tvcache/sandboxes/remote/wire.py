"""The sandbox server's wire format, shared by the client (`tvcache.sandboxes.remote`) and the server
(`tvcache.server.sandbox_app`, where the operations are listed), which imports it from here: the client never
loads the server.

Every operation is one `POST /v1/<op>` (or a GET without arguments) with a JSON body; the reply is JSON, and
a refusal is a 4xx or 5xx with `{"error": "..."}`.
An execute that asks for `reads_later` is answered before its read set is digested (`Outcome.reads_later`);
`POST /v1/reads` then waits for the read set and returns it once (null: it could not be made).
Tool outputs travel as `graph.encode_output` blobs (msgpack, base64 in JSON), so a remote sandbox answers
with exactly the str, bytes or JSON value a local one would. Ids are made by the server: a sandbox id is
random; a snapshot id starts with the id of the server process holding it (`<server>.<random>`), so a client
knows where to restore it, and an id from a server that has since restarted names no live server.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ...jsonhttp import ErrorReply

__all__ = [
    "BaseDigestsRequest",
    "CreateRequest",
    "ErrorReply",
    "ExecuteReply",
    "ExecuteRequest",
    "InfoReply",
    "Listing",
    "ReadsRequest",
    "RenewRequest",
    "SandboxReply",
    "SandboxRequest",
    "SnapshotReply",
    "SnapshotRequest",
    "server_of",
]

MAX_RENEW = 100_000
MAX_KEYS = 100_000  # state keys in one base_digests request

ServerId = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{12}$", description="a sandbox server process's id")]
SandboxId = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{24}$", description="a live sandbox, made by the server")]
SnapshotId = Annotated[
    str,
    msgspec.Meta(
        pattern="^[0-9a-f]{12}\\.[0-9a-f]{16}$",
        description="a snapshot: the id of the server process holding it, a dot, a random part",
    ),
]
PendingId = Annotated[
    str, msgspec.Meta(pattern="^[0-9a-f]{16}$", description="a read set the server is still digesting, or holds")
]
Fingerprint = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024, pattern="^\\S+$", description="no whitespace")]


def server_of(snapshot_id: str) -> str:
    """The id of the server process holding a snapshot."""
    return snapshot_id.partition(".")[0]


# Requests refuse unknown fields: a misspelt argument must not be silently ignored.
class CreateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`fingerprint`: the starting state the client expects; a server serving another one refuses (409)."""

    fingerprint: Fingerprint


class SandboxRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sandbox: SandboxId


class SnapshotRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    snapshot: SnapshotId


# Sent without its default, so a request that does not opt in is one an older server (which refuses unknown
# fields) takes: a client opts in only for a sandbox whose server said it can (`SandboxReply.reads_later`).
class ExecuteRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    sandbox: SandboxId
    tool: ToolName
    args: Annotated[
        dict[str, Any] | str,
        msgspec.Meta(description="the call's arguments: a JSON object, or text that is not one (see ToolCall)"),
    ]
    reads_later: Annotated[
        bool,
        msgspec.Meta(
            description="answer without waiting for the read set where the sandbox digests it after answering; "
            "the reply's `reads_pending` then names it for /v1/reads"
        ),
    ] = False


class ReadsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A read set an execute left pending (`ExecuteReply.reads_pending`): waits until it is digested."""

    sandbox: SandboxId
    pending: PendingId


class RenewRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sandboxes: Annotated[list[SandboxId], msgspec.Meta(max_length=MAX_RENEW)]


class SandboxReply(msgspec.Struct, frozen=True):
    """A new live sandbox, and how many the server now holds (for placing the next one). `reads_later`: its
    server takes `ExecuteRequest.reads_later` (an older server sends no such field)."""

    sandbox: SandboxId
    live: int
    reads_later: bool = False


class SnapshotReply(msgspec.Struct, frozen=True):
    snapshot: SnapshotId


class ExecuteReply(msgspec.Struct, frozen=True):
    """`graph.Outcome` on the wire; `output` is its `encode_output` blob."""

    output: Annotated[bytes, msgspec.Meta(description="the tool output as tvcache's msgpack encoding, base64")]
    changed: bool | None
    error: bool
    reads: dict[str, str] | None = None  # what the call read, by state key (reuse by what a call read)
    writes: dict[str, str] | None = None  # what it wrote
    reads_pending: PendingId | None = None  # asked for `reads_later`: the read set to fetch from /v1/reads


class BaseDigestsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    keys: Annotated[list[Annotated[str, msgspec.Meta(max_length=8192)]], msgspec.Meta(max_length=MAX_KEYS)]


class InfoReply(msgspec.Struct, frozen=True):
    server: ServerId
    fingerprint: str
    backend: str
    timeout: float  # seconds after which the server gives up on a call (and closes its sandbox)
    lease: float  # seconds an unused sandbox lives before the server closes it
    live: int
    snapshots: int
    max_sandboxes: int
    version: str


class SandboxInfo(msgspec.Struct, frozen=True):
    sandbox: str
    age: float
    idle: float
    executions: int
    busy: bool


class SnapshotInfo(msgspec.Struct, frozen=True):
    snapshot: str
    age: float
    idle: float
    restores: int


class Listing(msgspec.Struct, frozen=True):
    sandboxes: list[SandboxInfo]
    snapshots: list[SnapshotInfo]
