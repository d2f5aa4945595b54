"""Sandbox backends. `base` holds the protocol they implement, `lifecycle` the open/close/snapshot-record code
they share and `reclaim` the cleanup of what dead processes left; `_`-modules here are parts two backends share.
`python` and `sqlite` are one module each; `workspace`, `docker` and `remote` are packages holding their private
parts."""

from .base import Outcome, Output, Sandbox, SandboxError, Sandboxes

__all__ = ["Outcome", "Output", "Sandbox", "SandboxError", "Sandboxes"]
