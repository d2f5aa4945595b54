"""Snapshots of Docker sandboxes are invisible: tests/test_snapshot_fidelity.py's differential fuzzer, run on
DockerSandboxes.

The same random operations run in a fresh container, uncached, and in one that snapshots after random steps
and goes on either in itself or in a container restored from the snapshot; after each of those steps both look
at everything (`ls -laR`, `stat` of every path, `find`'s order, xattrs, capabilities, `du`) and must print the
same. A `docker commit` failed all of it: it drops sockets and `user.*` xattrs, truncates times to the second,
and a directory written on both sides of a committed layer showed another size, link count and listing order.

The image is the fuzzer's workspace as an image, plus the host's `setfattr`, `getfattr`, `setcap`, `getcap`
(the Debian base has no `attr` or `libcap2-bin`, and the sandboxes have no network to install them).

What a restore does not keep is what it does not keep in a workspace sandbox (inode numbers, change times),
compared where the run did not go through a restore. Not compared at all, because two uncached runs print
other ones too (`test_what_two_fresh_containers_print_differently`): inode numbers and `df` (a container's
files live on the daemon's filesystem, shared with everything on the machine, which hands out inode numbers and
space to all of them), and the times of /dev and /sys (mounts made when a container starts, or the kernel's own
sysfs: clock readings).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

pytest.importorskip("aiodocker", reason="the docker extra is not installed (pip install -e '.[docker]')")

import test_snapshot_fidelity as fidelity
from docker_env import docker_base_fixture, dockerfile_image  # noqa: F401  (docker_base: a fixture)
from shell_oracle import cached_rollouts_wrong, out, run
from tvcache.sandboxes.docker import DockerSandboxes

TOOLS = ["setfattr", "getfattr", "setcap", "getcap"]
#: The fuzzer's workspace (test_snapshot_fidelity.workspace) at /testbed.
BODY = f"""\
COPY {" ".join(TOOLS)} /usr/local/bin/
RUN mkdir -p /testbed/src /testbed/data /testbed/empty && cd /testbed && echo 'the readme' > README \\
    && echo "print('hi')" > src/main.py && echo a > data/a.txt && echo b > data/b.txt && ln README hl1 \\
    && ln -s README sym && mkfifo fifo && chmod 4755 src/main.py && setcap cap_chown+ep data/b.txt
"""
#: Not state of a container (see the module docstring): inode numbers, `df`, the times of /dev and /sys.
SHARED = re.compile(rb"ino=\d+|^\S+ +\d+ root root +\d+ \S+ (?:dev|sys)$|== df.*", re.S | re.M)


@pytest.fixture(scope="session")
def fuzz_image(docker_base: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    context = tmp_path_factory.mktemp("fuzz-image")
    for tool in TOOLS:
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is not installed on the host (apt-get install attr libcap2-bin)")
        shutil.copy(found, context / tool)
        os.utime(context / tool, (0, 0))  # the build is cached by content and times
    return dockerfile_image(docker_base, BODY, context)


def check(image: str, ops: list[tuple[Any, ...]], points: dict[int, str]) -> None:
    async def main() -> None:
        async with DockerSandboxes(image, timeout=60) as boxes:
            uncached = await fidelity.Run(boxes).run(ops, points, snapshot=False)  # type: ignore[arg-type]
            cached_run = fidelity.Run(boxes)  # type: ignore[arg-type]
            cached = await cached_run.run(ops, points, snapshot=True)
        fresh, seen = ([(*a[:4], SHARED.sub(b"", a[4])) for a in answers] for answers in (uncached, cached))
        fidelity.compare(fresh, seen, cached_run.restored, (ops, points))

    run(main())


# -- the findings --------------------------------------------------------------------------------------------


def test_directory_sizes_after_a_snapshot(fuzz_image: str) -> None:
    """Issue 19's finding 3 on Docker: after a commit `stat -c %s /testbed` printed 40 where uncached it printed 60."""
    ops: list[tuple[Any, ...]] = [("mkdir", "d0"), ("write", "d0/n0", "x")]
    check(fuzz_image, ops, {1: "continue"})
    check(fuzz_image, ops, {1: "restore"})


def test_a_directory_written_on_both_sides_of_a_snapshot(fuzz_image: str) -> None:
    """Over a committed layer the directory was a merged one: link count 1, another size, another order."""
    ops: list[tuple[Any, ...]] = [("mkdir", "d0/d1"), ("write", "d0/n0", "x"), ("write", "d0/n1", "y")]
    check(fuzz_image, ops, {1: "restore"})


def test_sockets_xattrs_capabilities_and_times_survive_a_restore(fuzz_image: str) -> None:
    """A commit dropped the socket and the `user.*` xattr and cut the time to the second."""
    ops: list[tuple[Any, ...]] = [
        ("socket", "n0"),
        ("write", "n1", "x"),
        ("chmod", "n1", "4755"),
        ("setcap", "n1"),
        ("xattr", "README", "user.a"),
        ("sparse", "d0/n0"),
    ]
    check(fuzz_image, ops, {5: "restore"})


def test_the_reported_history_through_the_cache(fuzz_image: str) -> None:
    """The reported history through a ToolCache that snapshots on its own: every answer equals the uncached one."""
    history = "mkdir -p /testbed/d && echo x > /testbed/d/x"
    look = "ls -la --full-time /testbed /testbed/d | sed 's/ [0-9:.]* +0000//'; stat -c '%s %h' /testbed /testbed/d"
    plan = [[history, look, "echo y > /testbed/d/y", look], [history, look, "echo z > /testbed/z", look]]

    async def main() -> int:
        async with DockerSandboxes(fuzz_image) as boxes:
            return await cached_rollouts_wrong(boxes, boxes, plan, rounds=3)

    assert run(main()) == 0


def test_what_two_fresh_containers_print_differently(fuzz_image: str) -> None:
    """Why inode numbers and `df` are left out: two fresh containers that ran the same command print other ones when
    anything else on the machine made files on the daemon's filesystem in between (here: 8 MiB and a file)."""
    look = "echo x > /testbed/new && stat -c %i /testbed/new && df --output=used / | tail -1; stat -c %.9Y /dev"

    async def main() -> tuple[str, str]:
        async with DockerSandboxes(fuzz_image) as boxes:
            first = await out(await boxes.create(), look)
            info = await (await boxes.create()).container.show()
            filler = Path(info["GraphDriver"]["Data"]["UpperDir"]).parent.parent / f"tvcache-probe-{os.getpid()}"
            filler.write_bytes(b"\1" * (8 << 20))
            try:
                second = await out(await boxes.create(), look)
            finally:
                filler.unlink()
            return first, second

    first, second = (answer.split() for answer in run(main()))
    assert all(a != b for a, b in zip(first, second, strict=True)), (first, second)


# -- the fuzzer --------------------------------------------------------------------------------------------------


@settings(
    max_examples=max(2, fidelity.EXAMPLES // 2),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(plan=fidelity.plans())
def test_snapshots_are_invisible(fuzz_image: str, plan: tuple[list[tuple[Any, ...]], dict[int, str]]) -> None:
    check(fuzz_image, *plan)
