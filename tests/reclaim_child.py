"""A process that makes what one part of tvcache makes and says where it is, for test_reclaim to kill.

    python reclaim_child.py KIND ARGS...

Before each step it prints the step's name on a line of its own (flushed), so the test can SIGKILL it at that
point of create, snapshot, restore or close (or, after a random delay, inside the step). After the last step it
holds everything open until killed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from tvcache import ToolCall


def at(step: str) -> None:
    print(step, flush=True)


async def cycle(boxes: Any, first: ToolCall, second: ToolCall) -> None:
    """Create, change, snapshot, restore, change again, close: the lifecycle every sandbox kind goes through."""
    at("create")
    box = await boxes.create()
    await box.execute(first)
    at("snapshot")
    snapshot = await box.snapshot()
    at("restore")
    other = await boxes.restore(snapshot)
    await other.execute(second)
    at("close")
    await other.close()
    await box.close()


def sql(query: str) -> ToolCall:
    return ToolCall("sql", {"query": query})


def bash(command: str) -> ToolCall:
    return ToolCall("bash", {"command": command})


def unpack(layer: Path, cache: Path) -> None:
    from tvcache.sandboxes import images

    with open(layer, "rb") as source:
        at("unpack")
        images.unpack_layer(source, "sha256:" + "0" * 64, cache)


async def main(kind: str, args: list[str]) -> None:
    boxes: Any
    if kind == "sqlite":
        from tvcache.sandboxes.sqlite import SQLiteSandboxes

        boxes = SQLiteSandboxes(args[0], tmp=args[1])
        await cycle(boxes, sql("CREATE TABLE t (x)"), sql("INSERT INTO t VALUES (1)"))
    elif kind == "workspace":
        from tvcache.sandboxes.workspace import WorkspaceSandboxes

        boxes = WorkspaceSandboxes(args[0], tmp=args[1])
        await cycle(boxes, bash("echo one > a; sleep 0.05"), bash("echo two >> a; sleep 0.05"))
    elif kind == "sqlite+workspace":  # both, in their default tmp unless given one
        from tvcache.sandboxes.sqlite import SQLiteSandboxes
        from tvcache.sandboxes.workspace import WorkspaceSandboxes

        tables = SQLiteSandboxes(args[0], tmp=args[2] if len(args) > 2 else None)
        trees = WorkspaceSandboxes(args[1], tmp=args[2] if len(args) > 2 else None)
        await cycle(tables, sql("CREATE TABLE t (x)"), sql("INSERT INTO t VALUES (1)"))
        await cycle(trees, bash("echo one > a"), bash("echo two >> a"))
    elif kind == "docker":
        from tvcache.sandboxes.docker import DockerSandboxes

        boxes = DockerSandboxes(args[0], tmp=args[1])
        await cycle(boxes, bash("echo one > a"), bash("echo two >> a"))
    elif kind == "docker-snapshot":
        from tvcache.sandboxes.docker import DockerSandboxes

        # Left at the end: one snapshot's files in tmp, no container.
        boxes = DockerSandboxes(args[0], tmp=args[1])
        box = await boxes.create()
        await box.execute(bash("echo one > a"))
        await box.snapshot()
        await box.close()
    elif kind == "video":
        from tvcache_bench.workloads.video import clips
        from tvcache_bench.workloads.video.sandbox import VideoSandboxes

        at("build")
        catalogue = clips.build((clips.VideoSpec("alpha", 2, 11, "bunny"),), Path(args[0]))
        boxes = VideoSandboxes(catalogue, timeout=60, tmp=args[1])
        await cycle(boxes, ToolCall("load_video", {"video": "alpha"}), ToolCall("preprocess", {}))
    elif kind == "unpack":
        await asyncio.to_thread(unpack, Path(args[0]), Path(args[1]))
    elif kind == "debootstrap":
        from tvcache_bench import docker_setup

        at("build")
        docker_setup._rootfs_tarball()
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    at("idle")
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
