"""Why Docker snapshots freeze a container's cgroup themselves rather than `docker pause` it (a diagnosis).

`python -m tvcache_bench.micro.docker_freeze [CONTAINERS] [ROUNDS]` starts CONTAINERS containers of the Debian
base image (16 by default) and, in each at once, ROUNDS times (60): stops its processes and lets them go again,
then runs `true` in it with the daemon's exec, as a snapshot and the next call do. Once through the daemon
(`docker pause`, `docker unpause`), once through the container's cgroup2 `cgroup.freeze` (what
`DockerSandboxes` does; see tvcache.sandboxes.docker._cgroup). It prints, for each way, how many execs the daemon
refused, how many pauses or unpauses failed, and how many containers still refused an exec 2 s later.

Measured here (Docker 20.10, 2 cores, a test suite running beside it): the daemon's way refused 450 of 960 execs
("is paused, unpause the container before exec") and left 6 of the 16 containers refusing every exec for good; the
freeze, none of 960. The daemon's pause state also follows the runtime's events, which come late under load (see
_cgroup).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiodocker

from tvcache.sandboxes._cgroup2 import frozen
from tvcache.sandboxes.docker._cgroup import group_of

from ..docker_setup import debian_base

__all__ = ["main"]


@contextlib.asynccontextmanager
async def _paused(container: Any) -> AsyncIterator[None]:
    await container.pause()
    try:
        yield
    finally:
        await container.unpause()


async def _churn(docker: aiodocker.Docker, image: str, rounds: int, way: str, counts: collections.Counter[str]) -> None:
    container = await docker.containers.run({"Image": image, "Cmd": ["sleep", "infinity"], "NetworkDisabled": True})
    try:
        group = group_of(await container.show())
        if group is None:
            raise SystemExit("this container's cgroup2 group is not visible here: the freeze cannot be compared")
        stop: Callable[[], contextlib.AbstractAsyncContextManager[None]] = (
            (lambda: _paused(container)) if way == "docker pause" else (lambda: frozen(group, "docker"))
        )
        for _ in range(rounds):
            try:
                async with stop():
                    pass
            except aiodocker.DockerError:
                counts["pause or unpause failed"] += 1
            try:
                await container.exec(["true"])
                counts["exec answered"] += 1
            except aiodocker.DockerError:
                counts["exec refused"] += 1
        await asyncio.sleep(2)
        try:
            await container.exec(["true"])
        except aiodocker.DockerError:
            counts["containers refusing execs 2 s later"] += 1
    finally:
        with contextlib.suppress(aiodocker.DockerError):
            await container.unpause()
        await container.delete(force=True)


async def run(containers: int, rounds: int) -> dict[str, collections.Counter[str]]:
    image = await asyncio.to_thread(debian_base)
    results = {}
    async with aiodocker.Docker() as docker:
        for way in ("docker pause", "cgroup freeze"):
            counts: collections.Counter[str] = collections.Counter()
            await asyncio.gather(*(_churn(docker, image, rounds, way, counts) for _ in range(containers)))
            results[way] = counts
    return results


def main(argv: list[str] | None = None) -> None:
    args = [int(a) for a in (sys.argv[1:] if argv is None else argv)]
    containers, rounds = (args + [16, 60][len(args) :])[:2]
    for way, counts in asyncio.run(run(containers, rounds)).items():
        print(f"{way}: {containers * rounds} execs; " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
