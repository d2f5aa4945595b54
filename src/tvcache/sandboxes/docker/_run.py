"""Labels naming the run that created each container, image and network, and the removal of a run's leftovers.

Everything a `DockerSandboxes` creates carries the label `tvcache.run=<run id>`, and `tvcache.owner=<host> <pid>
<start time> <pid namespace>` naming the process. Closing the factory removes its run; a process that died without
closing leaves its run behind, and the next factory on the same daemon reaps every run whose owner on this host is
gone (the pid no longer exists, or now belongs to a process started at another time). An owner in another PID
namespace is not judged: containers of one Kubernetes pod share a hostname and may share a daemon, but each has
pids of its own, which mean other processes (or none) here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from typing import Any

import aiodocker

from ..reclaim import owner_alive, pid_namespace, process_start_time

__all__ = ["RUN_LABEL", "dead_runs", "new_run", "reap_dead_runs", "remove_run"]

RUN_LABEL = "tvcache.run"
OWNER_LABEL = "tvcache.owner"


def new_run() -> dict[str, str]:
    """The labels of a new run of this process."""
    owner = f"{socket.gethostname()} {os.getpid()} {process_start_time(os.getpid())} {pid_namespace()}"
    return {RUN_LABEL: f"tvcache-{os.getpid()}-{secrets.token_hex(4)}", OWNER_LABEL: owner}


def _owner_gone(owner: str) -> bool:
    fields = owner.split(" ")
    if len(fields) not in (3, 4) or not fields[1].isdigit():
        return False  # not ours to judge
    host, pid, start, *namespace = fields  # labels before the namespace was added have none
    return host == socket.gethostname() and not owner_alive(int(pid), start, *namespace)


async def dead_runs(docker: aiodocker.Docker) -> list[tuple[str, str, int]]:
    """The runs on this daemon whose owner process on this host is gone, as (run, owner pid, bytes): the
    containers' writable layers plus the run's images (an image's layers it shares with another count too)."""
    owners: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for item in await docker.containers.list(all=True, size="true", filters={"label": [RUN_LABEL]}):
        labels = item["Labels"] or {}
        owners[labels[RUN_LABEL]] = labels.get(OWNER_LABEL, "")
        written = item["SizeRw"] if "SizeRw" in item else 0  # noqa: SIM401 - a DockerContainer has no .get; 0 is omitted
        sizes[labels[RUN_LABEL]] = sizes.get(labels[RUN_LABEL], 0) + written
    for image in await docker.images.list(all=True, filters={"label": [RUN_LABEL]}):
        labels = image.get("Labels") or {}
        owners[labels[RUN_LABEL]] = labels.get(OWNER_LABEL, "")
        sizes[labels[RUN_LABEL]] = sizes.get(labels[RUN_LABEL], 0) + (image.get("Size") or 0)
    for network in await docker.networks.list(filters={"label": [RUN_LABEL]}):
        labels = network.get("Labels") or {}
        owners[labels[RUN_LABEL]] = labels.get(OWNER_LABEL, "")
    dead = [(run, owner.split(" ")[1], sizes.get(run, 0)) for run, owner in owners.items() if _owner_gone(owner)]
    return dead


async def reap_dead_runs(docker: aiodocker.Docker) -> int:
    """Remove the runs on this daemon whose owner process on this host is gone; returns how many."""
    dead = await dead_runs(docker)
    for run, _, _ in dead:
        await remove_run(docker, run)
    return len(dead)


async def remove_run(docker: aiodocker.Docker, run: str) -> None:
    """Remove every container, image and network labelled with `run`: containers first (they hold images and
    networks), then images newest first (a child before its parent)."""
    selector = {"label": [f"{RUN_LABEL}={run}"]}
    for item in await docker.containers.list(all=True, filters=selector):
        with contextlib.suppress(aiodocker.DockerError):
            await docker.containers.container(item["Id"]).delete(force=True, v=True)
    # Newest first puts a child before its parent; commits within one second may still come out of order,
    # so a parent that still had a child is tried again in the next pass.
    images: list[dict[str, Any]] = await docker.images.list(all=True, filters=selector)
    pending = sorted((i for i in images), key=lambda i: i.get("Created", 0), reverse=True)
    while pending:
        left = []
        for image in pending:
            try:
                await docker.images.delete(image["Id"], force=True, noprune=True)
            except aiodocker.DockerError as exc:
                if exc.status == 409:
                    left.append(image)
        if len(left) == len(pending):
            break
        pending = left
    for network in await docker.networks.list(filters=selector):
        with contextlib.suppress(aiodocker.DockerError):
            await (await docker.networks.get(network["Id"])).delete()
