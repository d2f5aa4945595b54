"""tvcache: a stateful tool-value cache for RL post-training of tool-using LLM agents.

    import tvcache
    cache = tvcache.ToolCache()
    async with cache.rollout("task-17", sandboxes, tools=tvcache.Tools(read_only={"read_file"})) as r:
        res = await r.call("bash", {"command": "make test"})

Importing this package loads only the core (no servers, no Docker); backends load with their modules.
"""

from typing import Any

from .cache import State, ToolCache
from .calls import ToolCall, Tools, parse_tool_call
from .errors import SandboxBusy, SandboxError, SnapshotGone, StoreError, ToolError, TVCacheError
from .graph import Entry, Scope
from .rollout import Result, Rollout, RolloutStats, current_rollout
from .sandboxes.base import Outcome, Sandbox, Sandboxes
from .stores.base import Store
from .sync import SyncRollout, SyncToolCache
from .version import __version__

__all__ = [
    "DockerSandboxes",
    "Entry",
    "Outcome",
    "PythonSandboxes",
    "RemoteSandboxes",
    "Result",
    "Rollout",
    "RolloutStats",
    "SQLiteSandboxes",
    "Sandbox",
    "SandboxBusy",
    "SandboxError",
    "Sandboxes",
    "Scope",
    "SnapshotGone",
    "State",
    "Store",
    "StoreError",
    "SyncRollout",
    "SyncToolCache",
    "TVCacheError",
    "ToolCache",
    "ToolCall",
    "ToolError",
    "ToolFunctions",
    "Tools",
    "WorkspaceSandboxes",
    "__version__",
    "current_rollout",
    "parse_tool_call",
]

_BACKENDS = {
    "DockerSandboxes": "tvcache.sandboxes.docker",
    "PythonSandboxes": "tvcache.sandboxes.python",
    "RemoteSandboxes": "tvcache.sandboxes.remote",
    "SQLiteSandboxes": "tvcache.sandboxes.sqlite",
    "ToolFunctions": "tvcache.functions",
    "WorkspaceSandboxes": "tvcache.sandboxes.workspace",
}


def __getattr__(name: str) -> Any:
    # Backends load on first use so `import tvcache` stays light.
    if name in _BACKENDS:
        import importlib

        return getattr(importlib.import_module(_BACKENDS[name]), name)
    raise AttributeError(f"module 'tvcache' has no attribute {name!r}")
