"""The one way in to the Docker daemon for heavy operations: container creation and removal.

A daemon asked for hundreds of containers at once does not get faster: it thrashes (locks, cgroup and mount
set-up, overlay mounts), and past some point requests start failing with timeouts. The published system hit
that with hundreds of concurrent forks. So every heavy operation passes through one pipeline per factory that
runs at most `concurrency` of them at a time (the saturation point measured by `tvcache bench docker`) and
retries the failures a loaded daemon gives (5xx answers, dropped connections) with exponential backoff and
jitter. An operation must be safe to retry: creation removes a half-made container before it tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiodocker
import aiohttp

from ..base import SandboxError

__all__ = ["Pipeline", "describe", "inspect_image", "is_transient"]

T = TypeVar("T")

RETRIES = 6
FIRST_BACKOFF = 0.05
#: A daemon request may wait this long (a loaded daemon takes seconds, a hung one forever), and so may a pipeline's
#: operation. One that times out is not retried: asked again, a hung daemon takes as long each time. Streams (a
#: command's output, a build, `docker save`) have no such limit: aiodocker exempts them.
REQUEST_TIMEOUT = 300.0


def client(url: str | None) -> aiodocker.Docker:
    """An aiodocker client whose requests fail after `REQUEST_TIMEOUT`: aiodocker's own wait forever, so a daemon
    that accepts connections and never answers hung the factory's constructor and every call on it."""
    return aiodocker.Docker(url=url, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT))


def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying: the daemon was overloaded or the connection dropped, not a bad request, and not a
    daemon that stopped answering (see `REQUEST_TIMEOUT`)."""
    if isinstance(exc, TimeoutError):
        return False
    if isinstance(exc, aiodocker.DockerError):
        return exc.status >= 500 and "No such" not in str(exc.message)
    return isinstance(exc, aiohttp.ClientError | ConnectionError)


def describe(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):  # (a missing socket: DockerError 900)
        return f"the Docker daemon is unreachable ({exc})"
    if isinstance(exc, aiodocker.DockerError) and exc.status == 900:  # aiodocker's "cannot connect"
        return f"the Docker daemon is unreachable ({exc.message})"
    if isinstance(exc, aiodocker.DockerError):
        return f"the Docker daemon answered {exc.status}: {exc.message}"
    if isinstance(exc, TimeoutError):
        return f"the Docker daemon did not answer in {REQUEST_TIMEOUT:g} s"
    return f"{type(exc).__name__}: {exc}"


async def inspect_image(docker: aiodocker.Docker, image: str) -> dict[str, Any]:
    """The daemon's record of `image`; ValueError if it has none, SandboxError if the daemon fails."""
    try:
        return await docker.images.inspect(image)
    except aiodocker.DockerError as exc:
        if exc.status == 404:
            raise ValueError(f"no image {image!r} on the Docker daemon (build, load or import it first)") from exc
        raise SandboxError(f"docker: inspecting image {image!r} failed: {describe(exc)}") from exc
    except Exception as exc:
        raise SandboxError(f"docker: inspecting image {image!r} failed: {describe(exc)}") from exc


class Pipeline:
    """At most `concurrency` heavy daemon operations at once (None: no limit); transient failures retried up to
    `retries` times (0 only to measure a bare daemon)."""

    def __init__(self, concurrency: int | None, retries: int = RETRIES):
        if concurrency is not None and not (isinstance(concurrency, int) and concurrency >= 1):
            raise ValueError(f"create_concurrency must be a positive int or None, got {concurrency!r}")
        self.concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency) if concurrency is not None else None
        self.max_retries = retries
        self.retries = 0
        """How many operations were retried (a sign the cap is above the daemon's saturation point)."""

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        if self._slots is None:
            yield
        else:
            async with self._slots:
                yield

    async def run(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op` in a slot; retry transient failures; raise SandboxError saying `what` failed and why."""
        for attempt in range(self.max_retries + 1):
            try:
                async with self._slot():
                    return await asyncio.wait_for(op(), REQUEST_TIMEOUT)
            except Exception as exc:
                if attempt == self.max_retries or not is_transient(exc):
                    raise SandboxError(f"docker: {what} failed: {describe(exc)}") from exc
                self.retries += 1
                await asyncio.sleep(FIRST_BACKOFF * 2**attempt * (0.5 + random.random()))
        raise AssertionError("unreachable")
