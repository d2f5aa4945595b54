"""Sandbox backends. Each public module holds one backend; `base` holds the protocol they implement and
`lifecycle` the open/close/snapshot-record code they share; `_`-modules are the backends' private parts."""

from .base import Outcome, Output, Sandbox, SandboxError, Sandboxes

__all__ = ["Outcome", "Output", "Sandbox", "SandboxError", "Sandboxes"]
