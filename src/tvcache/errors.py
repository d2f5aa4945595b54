"""The exceptions a caller of tvcache sees, the same whichever backend and store run underneath.

    TVCacheError
    ├── ToolError      a sandbox refused a call before it ran (unknown tool, arguments it does not take):
    │                  nothing changed. `Rollout.call` answers it with an error result (`Error: ...`), as
    │                  built-in sandboxes answer a bad call, and the rollout goes on. Also a ValueError.
    ├── SandboxError   the sandbox machinery failed (not the tool): a sandbox died, a server went away
    │   ├── SandboxBusy    the backend cannot do it now (at capacity); nothing is lost
    │   └── SnapshotGone   the snapshot asked for no longer exists (deleted, lost with its host)
    └── StoreError     the cache store failed: unreachable, timed out, refused, or holding bad data

A tool that runs and fails (a non-zero exit, a timeout) is not an exception: it is a result with `error=True`
or an ordinary output. Misuse of the API (a closed cache, a call inside the rollout's own `sandbox()` block)
raises `RuntimeError` saying what to do instead.
"""

from __future__ import annotations

__all__ = ["SandboxBusy", "SandboxError", "SnapshotGone", "StoreError", "TVCacheError", "ToolError"]


class TVCacheError(Exception):
    """Base of every exception tvcache raises for a failure (not for misuse of its API)."""


class ToolError(TVCacheError, ValueError):
    """A sandbox refused a tool call before it ran: the tool does not exist, or does not take these arguments.
    Nothing changed in the sandbox; a rollout answers the call with an error result and goes on."""


class SandboxError(TVCacheError, RuntimeError):
    """A sandbox backend failed (not the tool: the machinery around it)."""


class SandboxBusy(SandboxError):
    """The backend cannot do it now (at capacity, overloaded), but nothing is lost: the snapshot asked for still
    exists. The cache then takes another route without forgetting the snapshot, as it does for other failures."""


class SnapshotGone(SandboxError):
    """The snapshot asked for does not exist (any more): deleted, never made here, or lost with its host. The
    cache drops it from the graph; any other failure to restore it may be transient, and it is kept."""


class StoreError(TVCacheError, RuntimeError):
    """The store could not do what was asked: unreachable, timed out, refused (a wrong token, a locked
    database), or holding data that does not decode. Every failure of a store surfaces as this; any other
    exception from a store method is a bug."""
