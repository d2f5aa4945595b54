"""Sandbox backends. Each module holds one backend; `base` holds the protocol they implement."""

from .base import Outcome, Output, Sandbox, SandboxError, Sandboxes

__all__ = ["Outcome", "Output", "Sandbox", "SandboxError", "Sandboxes"]
