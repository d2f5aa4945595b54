"""The HTTP API's wire format, shared by the client (`tvcache.stores.http`) and the server (`tvcache.server`).

Every store method is one `POST /v1/<method>` whose JSON body is the method's arguments, and whose JSON
reply is what the method returns. Bytes (node ids, digests, outputs) travel as base64 strings, msgspec's
JSON encoding of `bytes`. The constraints below are enforced by msgspec while decoding, before the store
sees anything, so a malformed request is refused whole and changes nothing; they also become the OpenAPI
document, so what is documented is exactly what is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from ..graph import MAX_READS, Candidate, Entry, Kind
from ..jsonhttp import ErrorReply
from .base import Claim, GraphExport, Lease, SnapshotRecord, TaskInfo

__all__ = [
    "ENDPOINTS",
    "HEALTHZ",
    "AddCandidateRequest",
    "AddSnapshotRequest",
    "CandidatesRequest",
    "DropSnapshotRequest",
    "Endpoint",
    "ErrorReply",
    "ExportRequest",
    "GiveBackRequest",
    "LeaseRequest",
    "LookupReply",
    "LookupRequest",
    "RecordRequest",
    "RefreshRequest",
    "RegisterRequest",
    "ReleaseRequest",
    "SnapshotsRequest",
    "StatsReply",
    "UnleaseRequest",
    "WaitRequest",
    "WireCandidate",
    "WireEntry",
    "operation",
]

MAX_WAIT = 3600.0  # seconds one wait request may block
MAX_TTL = 7 * 86400.0
MAX_PATH = 100_000  # nodes in a lease or snapshot path: deeper than any rollout
MAX_EXPORT = 100_000
MAX_COUNT = 1_000_000  # snapshots in one budget

ScopeKey = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$", description="a task's root node id, in hex")]
# 16 bytes in base64 are 22 characters, the last carrying 2 data bits, then "==". The pattern makes the
# documented schema as strict as the decoder: a 24-character string of other bytes is not a valid id.
_B64_16 = {"pattern": "^[A-Za-z0-9+/]{21}[AQgw]==$"}
_B64 = {"pattern": "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"}
NodeId = Annotated[
    bytes,
    msgspec.Meta(min_length=16, max_length=16, description="a 16-byte node id, base64", extra_json_schema=_B64_16),
]
Digest = Annotated[
    bytes,
    msgspec.Meta(min_length=16, max_length=16, description="a 16-byte call digest, base64", extra_json_schema=_B64_16),
]
Token = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
LookupId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=128,
        description="an id the client chose for a claiming lookup, to give its claim back by (`give_back`) if the "
        "answer never reaches it",
    ),
]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_TTL)]
Path = Annotated[list[NodeId], msgspec.Meta(max_length=MAX_PATH, description="node ids, root first")]
# JSON Schema calls 3.0 an integer too, so counts are numbers that must be whole; handlers take int() of them.
Count = Annotated[float, msgspec.Meta(ge=0, le=MAX_COUNT, multiple_of=1)]
MAX_STATE_KEYS = 100_000  # keys one edge may write
StateKey = Annotated[str, msgspec.Meta(max_length=8192, description="a piece of sandbox state: a file, a table")]
StateDigest = Annotated[str, msgspec.Meta(max_length=256, description="its content digest, empty for absent")]
StateWrites = Annotated[
    dict[StateKey, StateDigest],
    msgspec.Meta(max_length=MAX_STATE_KEYS, description="what a state-changing call wrote: state key -> new digest"),
]


class WireEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`graph.Entry` as a JSON object. (Entry itself encodes as an array, which OpenAPI tools handle badly.)"""

    kind: Kind
    output: Annotated[bytes, msgspec.Meta(description="the encoded tool output, base64", extra_json_schema=_B64)]
    seconds: Annotated[float, msgspec.Meta(ge=0, le=1e9, description="how long the execution took")]
    call: Annotated[str, msgspec.Meta(max_length=4096, description="the call's key, cut short, for people")] = ""
    writes: StateWrites | None = None

    @classmethod
    def of(cls, entry: Entry) -> WireEntry:
        return cls(entry.kind, entry.output, entry.seconds, entry.call, entry.writes)

    def entry(self) -> Entry:
        return Entry(self.kind, self.output, self.seconds, self.call, self.writes)


class WireCandidate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`reads.Candidate` as a JSON object: a result, the digests of what it read and, for a state-changing call,
    of what it wrote."""

    reads: Annotated[
        dict[StateKey, StateDigest],
        msgspec.Meta(max_length=MAX_READS, description="what the call read: state key -> digest seen"),
    ]
    output: Annotated[bytes, msgspec.Meta(description="the encoded tool output, base64", extra_json_schema=_B64)]
    seconds: Annotated[float, msgspec.Meta(ge=0, le=1e9, description="how long the execution took")]
    call: Annotated[str, msgspec.Meta(max_length=4096, description="the call's key, cut short, for people")] = ""
    writes: StateWrites | None = None

    @classmethod
    def of(cls, candidate: Candidate) -> WireCandidate:
        return cls(candidate.reads, candidate.output, candidate.seconds, candidate.call, candidate.writes)

    def candidate(self) -> Candidate:
        return Candidate(self.reads, self.output, self.seconds, self.call, self.writes)


# Requests refuse unknown fields: a misspelt argument must not be silently ignored.
class LookupRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    # (Defaults are not sent: a server older than `lookup` refuses the field, even as null.)
    scope_key: ScopeKey
    node: NodeId
    digest: Digest
    claim: Seconds = 0.0
    lookup: LookupId | None = None


class GiveBackRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lookup: LookupId


class WaitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    node: NodeId
    digest: Digest
    timeout: Annotated[float, msgspec.Meta(ge=0, le=MAX_WAIT)]


class RecordRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    node: NodeId
    digest: Digest
    entry: WireEntry
    token: Token | None = None
    reused: Annotated[bool, msgspec.Meta(description="a result reused by what the call read: a read-set hit")] = False


class AddCandidateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    digest: Digest
    candidate: WireCandidate


class CandidatesRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    digest: Digest


class ReleaseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    node: NodeId
    digest: Digest
    token: Token


class RefreshRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    node: NodeId
    digest: Digest
    token: Token
    ttl: Seconds


class LeaseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    origin: Name
    path: Path
    ttl: Seconds


class UnleaseRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    token: Token


class AddSnapshotRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    origin: Name
    path: Annotated[list[NodeId], msgspec.Meta(min_length=1, max_length=MAX_PATH)]
    snapshot_id: Name
    budget: Count


class DropSnapshotRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    origin: Name
    node: NodeId
    snapshot_id: Name


class SnapshotsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    origin: Name | None = None


class RegisterRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    namespace: Text
    task: Text
    fingerprint: Text


class ExportRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    scope_key: ScopeKey
    limit: Annotated[float, msgspec.Meta(ge=0, le=MAX_EXPORT, multiple_of=1)] = 10_000


class LookupReply(msgspec.Struct, frozen=True, omit_defaults=True):
    """A hit carries `entry`; a miss asked to claim carries `claim`; a plain miss carries neither."""

    entry: WireEntry | None = None
    claim: Claim | None = None


class Totals(msgspec.Struct, frozen=True):
    """A server's counts since it started. `hits` are lookups answered from an entry at once; `waited_hits`
    waits that ended with the entry another client recorded (also answers without executing); `misses` are
    lookups that found no entry, including those that then waited. `read_set_hits` are misses then answered by a
    result recorded in another state that read the same (counted in `hits` too)."""

    lookups: int
    hits: int
    misses: int
    claims: int
    records: int
    releases: int
    waits: int
    waited_hits: int
    evictions: int
    seconds_saved: float
    errors: int
    read_set_hits: int = 0


class TaskTotals(msgspec.Struct, frozen=True):
    lookups: int
    hits: int
    records: int
    seconds_saved: float


class Series(msgspec.Struct, frozen=True):
    """Cumulative totals sampled about once a second, oldest first; rates are differences. `hits` counts
    waited hits too: both are calls answered without executing."""

    t: list[float]
    lookups: list[int]
    hits: list[int]
    records: list[int]
    waits: list[int]
    evictions: list[int]
    seconds_saved: list[float]


class StatsReply(msgspec.Struct, frozen=True):
    started: float
    uptime: float
    store: str
    totals: Totals
    tasks: dict[str, TaskTotals]
    series: Series


class HealthReply(msgspec.Struct, frozen=True):
    status: str


@dataclass(frozen=True)
class Endpoint:
    """One operation of the API: what it reads, what it answers, and what it is for (the OpenAPI text)."""

    name: str
    method: str
    path: str
    request: type[msgspec.Struct] | None
    reply: Any
    summary: str
    auth: bool = True


def operation(name: str, request: type[msgspec.Struct] | None, reply: Any, summary: str) -> Endpoint:
    """`/v1/<name>`: a POST of `request`, or a GET where there is none."""
    return Endpoint(name, "POST" if request is not None else "GET", f"/v1/{name}", request, reply, summary)


#: Both servers' liveness probe (the cache server's also answers 503 when its store does not).
HEALTHZ = Endpoint("healthz", "GET", "/healthz", None, HealthReply, "Liveness: 200 while the server runs.", auth=False)


ENDPOINTS: list[Endpoint] = [
    operation("lookup", LookupRequest, LookupReply, "Look an entry up; on a miss with `claim` > 0, also claim it."),
    operation(
        "wait", WaitRequest, WireEntry | None, "Block until the entry is recorded (it) or its claim ends (null)."
    ),
    operation("record", RecordRequest, WireEntry, "Store an entry unless one exists, release the claim; the winner."),
    operation("release", ReleaseRequest, None, "Give a claim up without an entry; waiters wake and retry."),
    operation(
        "give_back",
        GiveBackRequest,
        None,
        "Release the claim a lookup whose answer was lost took, by the lookup's id (also if it has not come yet).",
    ),
    operation("refresh", RefreshRequest, bool, "Extend a claim; false if it was lost."),
    operation("add_candidate", AddCandidateRequest, None, "Keep a result with what it read and wrote (bounded)."),
    operation("candidates", CandidatesRequest, list[WireCandidate], "A call's kept results, newest first."),
    operation("lease", LeaseRequest, Lease | None, "Lease the origin's deepest snapshot on a path."),
    operation("unlease", UnleaseRequest, None, "End a lease."),
    operation("add_snapshot", AddSnapshotRequest, list[str], "Attach a snapshot, evict; ids the caller must delete."),
    operation("drop_snapshot", DropSnapshotRequest, None, "Forget a snapshot whose restore failed."),
    operation("snapshots", SnapshotsRequest, list[SnapshotRecord], "A task's snapshots, of one origin or all."),
    operation("register", RegisterRequest, None, "Name a task, for people. Idempotent."),
    operation("tasks", None, list[TaskInfo], "Every named task."),
    operation("export", ExportRequest, GraphExport, "A task's graph with hit counts, for dashboards."),
    Endpoint("stats", "GET", "/v1/stats", None, StatsReply, "Server counters and their time series."),
    HEALTHZ,
]
