"""Docker sandboxes and images as workspace layers, on a real Docker daemon with images built here.

The oracle for every cached or forked answer is a fresh container of the same image executing the same
history uncached. Fault tests kill containers from outside and stop a (second, private) daemon mid-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiodocker", reason="the docker extra is not installed (pip install -e '.[docker]')")

# docker_base, task_image and second_daemon are fixtures, asked for by name below.
import aiodocker

import bad_calls
import tvcache
from docker_env import (  # noqa: F401
    SecondDaemon,
    docker_base_fixture,
    docker_tmp_fixture,
    dockerfile_image,
    labelled,
    oci_layout_from_save,
    second_daemon_fixture,
    task_image_fixture,
)
from pidns import IN_A_PID_NAMESPACE
from sandbox_oracle import check_snapshots_against_fresh_replay
from shell_oracle import Listener, bash, cached_rollouts_wrong, out, random_command, rollout_plan, run, uncached
from tvcache import SandboxError, ToolCall
from tvcache.sandboxes import docker as docker_module
from tvcache.sandboxes import images
from tvcache.sandboxes._cgroup2 import frozen, is_frozen
from tvcache.sandboxes.base import no_room
from tvcache.sandboxes.docker import DockerSandbox, DockerSandboxes, _pipeline, build_image
from tvcache.sandboxes.docker._cgroup import group_of
from tvcache.sandboxes.workspace import WorkspaceSandboxes

# -- tools and state ----------------------------------------------------------------------------------------


def test_tools_state_and_observed_changes(task_image: str) -> None:
    async def main() -> None:
        async with DockerSandboxes(task_image, max_output=200) as boxes:
            box = await boxes.create()
            assert await out(box, "pwd; echo $TASK; cat README; ls -A") == (
                "/testbed\ndemo\nthe readme\nREADME\ndata\nreplaced\nsrc\n"
            )
            # stdout and stderr interleaved as written; the exit code is the command's.
            result = await bash(box, "echo one; echo two >&2; echo three; exit 3")
            assert result == {"output": "one\ntwo\nthree\n", "exit_code": 3}
            # Read-only commands are memos without annotation; writes, cd and export are not.
            reads = await box.execute(ToolCall("bash", {"command": "cat data/a.txt; ls /tmp"}))
            assert reads.changed is False
            for command in ("echo new > data/c.txt", "cd data", "export V=1", "unset V", "rm c.txt"):
                assert (await box.execute(ToolCall("bash", {"command": command}))).changed is True, command
            assert (await box.execute(ToolCall("bash", {"command": "ls"}))).changed is False
            # The middle of a long output is cut, with a marker saying how much.
            long = await out(box, "seq 1 1000")
            assert long.startswith("1\n2\n") and long.endswith("999\n1000\n") and "bytes of output omitted" in long
            # File tools, relative to the shell's working directory (data now).
            write = await box.execute(ToolCall("write_file", {"path": "sub/new.txt", "content": "hello"}))
            assert write.output == {"written": 5} and write.changed is True
            read = await box.execute(ToolCall("read_file", {"path": "/testbed/data/sub/new.txt"}))
            assert read.output == {"content": "hello"} and read.changed is False
            assert (await box.execute(ToolCall("list_dir", {"path": "."}))).output == {
                "entries": ["a.txt", "b.txt", "sub/"]
            }
            missing = await box.execute(ToolCall("read_file", {"path": "nope"}))
            assert missing.output == {"error": "No such file or directory: nope"}
            assert await out(box, "cat sub/new.txt; echo; hostname") == "hello\nsandbox\n"

    run(main())


def test_cwd_env_and_files_carry_into_forks(task_image: str) -> None:
    async def main() -> None:
        async with DockerSandboxes(task_image) as boxes:
            box = await boxes.create()
            await bash(box, "mkdir -p /work && cd /work && export A='x y' && unset TASK && echo 1 > f")
            snap = await box.snapshot()
            await bash(box, "echo 2 > f && cd / && export A=changed")
            fork = await boxes.restore(snap)
            assert await out(fork, 'pwd; echo "$A"; echo ${TASK-unset}; cat f') == "/work\nx y\nunset\n1\n"
            assert await out(box, 'pwd; echo "$A"; cat /work/f') == "/\nchanged\n2\n"
            # A snapshot of a sandbox that changed nothing since its image restores to the image's files.
            again = await boxes.restore(await (await boxes.create()).snapshot())
            assert await out(again, "pwd; ls") == "/testbed\nREADME\ndata\nreplaced\nsrc\n"

    run(main())


def test_timeout_kills_the_command_and_keeps_the_container(task_image: str) -> None:
    async def main() -> None:
        async with DockerSandboxes(task_image, timeout=2) as boxes:
            box = await boxes.create()
            await bash(box, "cd data")
            outcome = await box.execute(ToolCall("bash", {"command": "echo started; sleep 60 & sleep 50; echo no"}))
            assert outcome.error and outcome.changed is None
            assert isinstance(outcome.output, dict) and outcome.output["output"] == "started\n"
            assert "timed out after 2 s" in outcome.output["error"]
            # Usable, in the state before the failed call, with nothing of it left running.
            procs = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done 2>/dev/null"
            assert await out(box, f"pwd; {procs} | grep -c '^sleep'") == "/testbed/data\n0\n"

    run(main())


def test_commands_report_the_cpu_their_processes_used(task_image: str) -> None:
    """`cpu_seconds` of a command is its container's cgroup2 `usage_usec` across the call: a fixed busy loop (about
    0.3 s of CPU) shows it, `true` and a sleep barely register; CPU time, unlike wall time, hardly moves with load."""
    burn = "i=0; while ((i < 300000)); do ((i++)); done"

    async def cpu(box: DockerSandbox, command: str) -> float:
        outcome = await box.execute(ToolCall("bash", {"command": command}))
        assert not outcome.error and outcome.cpu_seconds is not None, command
        return outcome.cpu_seconds

    async def main() -> None:
        async with DockerSandboxes(task_image) as boxes:
            box = await boxes.create()
            idle = await cpu(box, "true")
            assert 0 < idle < 0.1  # two bash starts and the wrapper's clean-up
            assert await cpu(box, "sleep 0.3") < 0.1  # waiting is not CPU
            busy = await cpu(box, burn)
            assert busy > 0.15 and busy > 5 * idle
            fork = await boxes.restore(await box.snapshot())  # a restored container's group is found too
            assert await cpu(fork, burn) > 5 * await cpu(fork, "true")
            # File tools run in this process, not in the container: nothing of the container's to measure.
            read = await box.execute(ToolCall("read_file", {"path": "README"}))
            assert read.output == {"content": "the readme\n"} and read.cpu_seconds is None
            # Only a group named after the container counts: another process's pid (as a remote or rootless
            # daemon's would be here) or another container's id gives no figure rather than someone else's CPU.
            info = box._info
            assert group_of(info) is not None
            assert group_of({**info, "State": {**info["State"], "Pid": os.getpid()}}) is None
            assert group_of({**info, "Id": fork.id}) is None

    run(main())


# -- isolation -------------------------------------------------------------------------------------------


def test_network_only_when_asked(task_image: str) -> None:
    listener = Listener()
    interfaces = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort"
    # Loopback works inside: a server there (perl, the base image has no python) is reachable there.
    loopback = textwrap.dedent("""\
        perl -MIO::Socket::INET -e '$s = IO::Socket::INET->new(LocalAddr => "127.0.0.1:8765", Listen => 1,
            ReuseAddr => 1) or die; print "up\\n"; STDOUT->flush; $c = $s->accept; print $c "inner\\n"' &
        sleep 0.5; exec 3<>/dev/tcp/127.0.0.1/8765 && head -1 <&3""")

    async def main() -> None:
        async with DockerSandboxes(task_image) as boxes:
            box = await boxes.create()
            connect = f"exec 3<>/dev/tcp/127.0.0.1/{listener.port} && head -1 <&3"
            assert (await bash(box, connect))["exit_code"] != 0  # the host's loopback is not its loopback
            assert await out(box, interfaces) == "lo\n"
            assert await out(box, loopback) == "up\ninner\n"
        async with DockerSandboxes(task_image, network=True) as boxes:
            first, second = await boxes.create(), await boxes.create()
            assert await out(first, interfaces) == "eth0\nlo\n"
            assert await out(second, interfaces) == "eth0\nlo\n"
            # Both sandboxes share one pooled network: one network for the run, not one per sandbox.
            assert len(labelled("network", boxes.run)) == 1
        assert labelled("network", boxes.run) == []

    try:
        run(main())
    finally:
        listener.sock.close()


def test_rm_rf_fork_bombs_and_leftover_processes_stay_inside(task_image: str) -> None:
    async def main() -> None:
        async with DockerSandboxes(task_image, max_processes=64, timeout=20) as boxes:
            box, neighbour = await boxes.create(), await boxes.create()
            await bash(box, "echo kept > data/c.txt")
            snap = await box.snapshot()
            await bash(box, "rm -rf --no-preserve-root / 2>/dev/null; echo gone")
            broken = await box.execute(ToolCall("bash", {"command": "ls /testbed"}))
            assert broken.error and "exec failed" in str(broken.output)  # its bash is gone: nothing to exec
            assert await out(neighbour, "cat data/a.txt README") == "a\nthe readme\n"
            assert await out(await boxes.restore(snap), "cat data/c.txt") == "kept\n"
            bomb = await neighbour.execute(ToolCall("bash", {"command": "b() { b | b & }; b; sleep 2; echo done"}))
            assert isinstance(bomb.output, dict) and "Resource temporarily unavailable" in bomb.output["output"]
            # Background processes end with their command: nothing runs between calls.
            await bash(neighbour, "sleep 4321 & disown; (setsid sleep 4321 &); echo started")
            procs = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done 2>/dev/null"
            assert await out(neighbour, procs + " | grep -c '^sleep 432[1]'") == "0\n"

    run(main())
    assert not [p for p in Path("/proc").glob("[0-9]*") if b"4321" in _cmdline(p)]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


# -- the oracle invariant ------------------------------------------------------------------------------


def test_cache_results_equal_fresh_containers(task_image: str) -> None:
    async def main() -> int:
        async with DockerSandboxes(task_image) as boxes, DockerSandboxes(task_image) as oracle:
            return await cached_rollouts_wrong(boxes, oracle, rollout_plan(7, 4, 6), rounds=2)

    assert run(main()) == 0


def test_from_image_results_equal_fresh_containers(task_image: str) -> None:
    async def main() -> int:
        async with await WorkspaceSandboxes.from_image(task_image) as boxes, DockerSandboxes(task_image) as oracle:
            return await cached_rollouts_wrong(boxes, oracle, rollout_plan(11, 5, 8), rounds=2)

    assert run(main()) == 0


def test_snapshots_restores_and_rewinds_equal_a_fresh_replay(task_image: str) -> None:
    rng = random.Random(3)
    steps: list[tuple[str, Any]] = []
    for _ in range(14):
        kind = rng.choice(["call", "call", "call", "restore", "rewind"])
        steps.append((kind, ToolCall("bash", {"command": random_command(rng)}) if kind == "call" else rng.randrange(9)))

    async def main() -> None:
        async with DockerSandboxes(task_image) as boxes:
            await check_snapshots_against_fresh_replay(boxes, steps)

    run(main())


def test_a_chain_of_snapshots_stays_the_images_layers_plus_one(task_image: str) -> None:
    """Every container is the image's layers, Docker's init layer and one upper dir, however many snapshots and
    restores led to it: as an uncached one is (commits stacked a layer each, up to Docker's limit of 125)."""

    async def main() -> None:
        async with DockerSandboxes(task_image) as boxes:
            box = await boxes.create()
            layers = len((await box.container.show())["GraphDriver"]["Data"]["LowerDir"].split(":"))
            history = []
            for i in range(6):
                history.append(f"echo {i} >> log; cd /tmp/w{i} 2>/dev/null || mkdir /tmp/w{i}; rm -f data/a.txt")
                await bash(box, history[-1])
                box = await boxes.restore(await box.snapshot())
                assert len((await box.container.show())["GraphDriver"]["Data"]["LowerDir"].split(":")) == layers
            got = await out(box, "pwd; cat log; ls -A data /tmp")
            expected = (await uncached(boxes, [*history, "pwd; cat log; ls -A data /tmp"]))[-1]["output"]
            assert got == expected == "/testbed\n0\n1\n2\n3\n4\n5\n/tmp:\nw0\nw1\nw2\nw3\nw4\nw5\n\ndata:\nb.txt\n"

    run(main())


# -- scale: the creation pipeline ------------------------------------------------------------------------


def test_64_concurrent_creates_and_forks_succeed_and_leave_nothing(task_image: str) -> None:
    async def main() -> str:
        boxes = DockerSandboxes(task_image)
        parent = await boxes.create()
        await bash(parent, "echo forked > data/f")
        snap = await parent.snapshot()
        created = await asyncio.gather(*(boxes.create() for _ in range(64)))
        forks = await asyncio.gather(*(boxes.restore(snap) for _ in range(64)))
        answers = await asyncio.gather(*(out(box, "cat data/f 2>&1 | head -c 6; echo") for box in forks))
        assert set(answers) == {"forked\n"}
        assert len({box.id for box in [*created, *forks]}) == 128
        assert len(labelled("container", boxes.run)) == 129
        await boxes.close()
        return boxes.run

    run_id = run(main())
    assert labelled("container", run_id) == labelled("image", run_id) == labelled("network", run_id) == []


# -- faults --------------------------------------------------------------------------------------------


def test_container_killed_mid_call_is_an_error_and_the_rollout_goes_on(task_image: str) -> None:
    async def main() -> None:
        async with (
            DockerSandboxes(task_image) as boxes,
            tvcache.ToolCache() as cache,
            cache.rollout("t", boxes) as r,
        ):
            await r.call("bash", {"command": "echo 1 > n"})
            victim = next(iter(boxes._live))
            assert isinstance(victim, DockerSandbox)

            async def kill_soon() -> None:
                await asyncio.sleep(1.0)
                await asyncio.to_thread(subprocess.run, ["docker", "kill", victim.id], check=True)

            killer = asyncio.ensure_future(kill_soon())
            with pytest.raises(SandboxError, match="container stopped"):
                await r.call("bash", {"command": "echo 2 >> n; sleep 30; echo 3 >> n"})
            await killer
            # Nothing was cached for the killed call; the rollout continues in a rebuilt container.
            assert (await r.call("bash", {"command": "cat n"})).output == {"output": "1\n", "exit_code": 0}

    run(main())


def test_daemon_stopped_mid_run_gives_clear_errors(second_daemon: SecondDaemon, docker_base: str) -> None:
    async def main() -> None:
        boxes = DockerSandboxes(docker_base, docker_url=second_daemon.url, timeout=30)
        async with tvcache.ToolCache() as cache:
            async with cache.rollout("t", boxes) as r:
                assert (await r.call("bash", {"command": "echo 1 > /n; cat /n"})).output["output"] == "1\n"
                call = asyncio.ensure_future(r.call("bash", {"command": "sleep 20; echo late"}))
                await asyncio.sleep(1.0)
                await asyncio.to_thread(second_daemon.stop)
                with pytest.raises(SandboxError, match="docker"):
                    await call
                with pytest.raises(SandboxError, match=r"unreachable|docker"):
                    await r.call("bash", {"command": "cat /n"})
            assert cache.stats()["hits"] == 0  # nothing after the stop was answered from a wrong state
        await boxes.close()

    run(main())


def test_a_hung_daemon_fails_calls_after_the_request_timeout_without_retries(
    second_daemon: SecondDaemon, docker_base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon stopped with SIGSTOP accepts connections and never answers: hung, not dead. aiodocker's requests
    wait forever by default, so a factory made then never returned, and the pipeline retried each operation that
    timed out six more times. Now a request fails after `REQUEST_TIMEOUT` (1 s here) with an error that says so,
    once."""
    boxes = DockerSandboxes(docker_base, docker_url=second_daemon.url, timeout=30)

    async def main() -> None:
        async with tvcache.ToolCache() as cache, cache.rollout("t", boxes) as r:
            assert (await r.call("bash", {"command": "echo up"})).output["output"] == "up\n"
        monkeypatch.setattr(_pipeline, "REQUEST_TIMEOUT", 1.0)
        second_daemon.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(SandboxError, match=r"did not answer in 1 s"):
                await boxes.create()  # a container: through the pipeline
            assert boxes.retries == 0
            with pytest.raises(SandboxError, match=r"did not answer in 1 s"):
                await asyncio.to_thread(DockerSandboxes, docker_base, docker_url=second_daemon.url)  # a new client
        finally:
            second_daemon.proc.send_signal(signal.SIGCONT)
        box = await boxes.create()  # the daemon answers again, and so does the factory
        assert (await box.execute(ToolCall("bash", {"command": "echo back"}))).output["output"] == "back\n"
        await boxes.close()

    run(main())


# -- cleanup --------------------------------------------------------------------------------------------


def test_close_removes_everything_and_deleting_a_snapshot_removes_its_files(task_image: str) -> None:
    async def main() -> tuple[str, Path]:
        boxes = DockerSandboxes(task_image, network=True)
        box = await boxes.create()
        await bash(box, "echo 1 > one")
        first = await box.snapshot()
        child = await boxes.restore(first)
        await bash(child, "echo 2 > two")
        second = await child.snapshot()
        layers = boxes._layers
        assert len(list(layers.iterdir())) == 2
        await boxes.delete(first)  # `child` goes on without it
        assert len(list(layers.iterdir())) == 1
        assert await out(child, "cat one two") == "1\n2\n"
        assert await out(await boxes.restore(second), "cat one two") == "1\n2\n"
        with pytest.raises(tvcache.SnapshotGone):
            await boxes.restore(first)
        assert labelled("container", boxes.run) and labelled("network", boxes.run)
        await boxes.close()
        with pytest.raises(SandboxError, match="closed"):
            await boxes.create()
        return boxes.run, layers

    run_id, layers = run(main())
    assert labelled("container", run_id) == labelled("image", run_id) == labelled("network", run_id) == []
    assert not layers.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs of its own (needs root)")
def test_a_restore_with_no_room_for_the_snapshot_fails_as_a_sandbox_error(
    task_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore copies the snapshot into the new container's upper dir, on the daemon's data root: a full disk
    there fails as `SandboxError` (the pipeline that starts containers wraps every failure), with the new
    container removed, and a restore once there is room works.
    The daemon's data root is shared, so the disk that fills is a small tmpfs of the test's own, mounted over the
    new container's directory (in place of its upper dir) for the copy alone: a real ENOSPC, from the real copy."""
    fill = docker_module._fill

    def fill_on_a_full_disk(layer: str, upper: str) -> None:
        container_dir = Path(upper).parent
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tvcache-test", str(container_dir)], check=True)
        try:
            (container_dir / "diff").mkdir()
            with open(container_dir / "filler", "wb") as filler, contextlib.suppress(OSError):
                while True:
                    filler.write(b"x" * 4096)
                    filler.flush()
            fill(layer, upper)
        finally:
            subprocess.run(["umount", "-l", str(container_dir)], check=True)

    async def main() -> None:
        async with DockerSandboxes(task_image) as boxes:
            box = await boxes.create()
            await out(box, "head -c 100000 /dev/urandom > f; echo x > g")
            snap = await box.snapshot()
            containers = labelled("container", boxes.run)
            with monkeypatch.context() as patch:
                patch.setattr(docker_module, "_fill", fill_on_a_full_disk)
                with pytest.raises(SandboxError, match=r"docker: starting a container .* No space left on device") as e:
                    await boxes.restore(snap)
                assert no_room(e.value)  # so the cache keeps the snapshot and takes another route
            assert labelled("container", boxes.run) == containers
            assert await out(await boxes.restore(snap), "cat g; wc -c < f") == "x\n100000\n"

    run(main())


def test_a_killed_process_is_reaped_by_the_next_start(task_image: str) -> None:
    crash = textwrap.dedent(f"""\
        import asyncio, os, sys
        from tvcache import ToolCall
        from tvcache.sandboxes.docker import DockerSandboxes
        async def main():
            boxes = DockerSandboxes({task_image!r}, network=True)
            box = await boxes.create()
            await box.execute(ToolCall("bash", {{"command": "echo x > x"}}))
            await boxes.restore(await box.snapshot())
            print(boxes.run, boxes._layers, flush=True)
            sys.stdin.readline()  # alive until its leftovers are seen: a dead run's may go to any factory starting
            os._exit(1)  # no cleanup at all
        asyncio.run(main())
        """)
    args = [sys.executable, "-c", crash]
    with subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout and child.stdin and child.stderr
        run_id, layers = child.stdout.readline().split() or ["", ""]
        there = bool(run_id and labelled("container", run_id) and Path(layers).is_dir())
        with contextlib.suppress(BrokenPipeError):  # it may have died already, before printing
            child.stdin.write("die\n")
            child.stdin.flush()
        assert child.wait(timeout=120) == 1, child.stderr.read()
    assert there, child.stderr.read()

    async def next_start() -> None:
        async with DockerSandboxes(task_image) as boxes:
            await boxes.create()

    run(next_start())
    assert labelled("container", run_id) == labelled("image", run_id) == labelled("network", run_id) == []
    assert not Path(layers).exists()


def test_a_live_owner_in_another_pid_namespace_keeps_its_run(task_image: str) -> None:
    """Containers of one Kubernetes pod share a hostname (and may share a daemon) but not a PID namespace: an owner
    there has a pid that names another process here, or none. Its run must survive this process's reaping: it was
    taken for dead (a pid 1 started at another time) and its live containers removed."""
    if shutil.which("unshare") is None or subprocess.run([*IN_A_PID_NAMESPACE, "true"]).returncode:
        pytest.skip("unshare cannot make a PID namespace here")
    owner = textwrap.dedent(f"""\
        import asyncio, os, sys
        from tvcache import ToolCall
        from tvcache.sandboxes.docker import DockerSandboxes
        async def main():
            async with DockerSandboxes({task_image!r}) as boxes:
                box = await boxes.create()
                print(os.getpid(), boxes.run, flush=True)
                await asyncio.to_thread(sys.stdin.readline)  # alive until the test is done
                print((await box.execute(ToolCall("bash", {{"command": "echo alive"}}))).output["output"], flush=True)
        asyncio.run(main())
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [*IN_A_PID_NAMESPACE, sys.executable, "-c", owner]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        pid, run_id = proc.stdout.readline().split()
        assert pid == "1" and labelled("container", run_id)  # its pid is 1 there: here, another process's

        async def next_start() -> None:
            async with DockerSandboxes(task_image) as boxes:
                await boxes.create()

        run(next_start())
        assert labelled("container", run_id)
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "alive\n"
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait()


# -- images, builds, errors ------------------------------------------------------------------------------


def test_build_is_cached_by_content(docker_base: str, tmp_path: Path) -> None:
    image = dockerfile_image(docker_base, "RUN echo built > /built\nCOPY . /context\n", tmp_path / "ctx")
    # As a set: the daemon lists images built in the same second in no stable order.
    started = set(subprocess.check_output(["docker", "images", "-q", "--no-trunc"], text=True).split())
    assert run(build_image(tmp_path / "ctx")) == image  # no second build
    assert set(subprocess.check_output(["docker", "images", "-q", "--no-trunc"], text=True).split()) == started
    (tmp_path / "ctx" / "extra.txt").write_text("changes the context\n")
    assert run(build_image(tmp_path / "ctx")) != image

    async def main() -> None:
        async with await DockerSandboxes.build(tmp_path / "ctx") as boxes:
            assert await out(await boxes.create(), "cat /built") == "built\n"

    run(main())
    with pytest.raises(ValueError, match="no Dockerfile"):
        run(build_image(tmp_path))


def test_from_image_reads_daemon_layers_docker_save_and_oci_layouts(task_image: str, tmp_path: Path) -> None:
    listing = "pwd; echo $TASK; ls -A . replaced; cat README"
    expected = "/testbed\ndemo\n.:\nREADME\ndata\nreplaced\nsrc\n\nreplaced:\ny\nthe readme\n"

    async def answer(image: Any) -> tuple[str, tuple[str, ...]]:
        root = await images.image_root(image)
        async with await WorkspaceSandboxes.from_image(image) as boxes:
            return await out(await boxes.create(), listing), root.layers

    got, layers = run(answer(task_image))
    root = subprocess.check_output(["docker", "info", "-f", "{{.DockerRootDir}}"], text=True).strip()
    assert got == expected and all(layer.startswith(f"{root}/overlay2/") for layer in layers)  # used in place
    saved = tmp_path / "image.tar"
    subprocess.run(["docker", "save", "-o", str(saved), task_image], check=True)
    cache = tmp_path / "layers"
    images_cache, images.LAYER_CACHE = images.LAYER_CACHE, cache
    try:
        got, layers = run(answer(saved))
        assert got == expected and all(layer.startswith(str(cache)) for layer in layers)
        whiteouts = [p for layer in layers for p in Path(layer).rglob("*") if p.name.startswith(".wh.")]
        assert whiteouts == []  # converted to overlayfs whiteouts
        oci = oci_layout_from_save(saved, tmp_path / "oci")
        assert run(answer(oci))[0] == expected
    finally:
        images.LAYER_CACHE = images_cache


def test_from_image_streams_docker_save_without_layer_dirs(task_image: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(images, "_layer_dirs", lambda info: None)  # as on a daemon without overlay2
    root = run(images.image_root(task_image))
    assert all("/layers/" in layer for layer in root.layers)
    assert root.env["TASK"] == "demo" and root.cwd == "/testbed"


def test_bad_input_gets_clear_errors(task_image: str, docker_base: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no image"):
        DockerSandboxes("tvcache-no-such-image:latest")
    with pytest.raises(ValueError, match="timeout"):
        DockerSandboxes(task_image, timeout=0)
    with pytest.raises(SandboxError, match="unreachable"):
        DockerSandboxes(task_image, docker_url="unix:///nonexistent/docker.sock")
    user_image = dockerfile_image(docker_base, "RUN useradd -m agent\nUSER agent\n", tmp_path / "user")
    with pytest.raises(ValueError, match="runs as user 'agent'"):
        run(WorkspaceSandboxes.from_image(user_image))
    with pytest.raises(ValueError, match="does not exist"):
        run(WorkspaceSandboxes.from_image(tmp_path / "missing"))

    async def main() -> None:
        async with DockerSandboxes(user_image) as boxes:
            box = await boxes.create()
            assert await out(box, "whoami; pwd") == "agent\n/\n"
            with pytest.raises(SandboxError, match="does not exist"):
                await boxes.restore("nope")

    run(main())


def test_a_models_bad_calls_are_answers_and_the_container_goes_on(task_image: str) -> None:
    async def main() -> None:
        async with DockerSandboxes(task_image) as boxes:
            await bad_calls.check(boxes, bad_calls.SHELL, *bad_calls.SHELL_STATE)

    run(main())


def test_snapshots_live_on_the_daemons_filesystem(task_image: str, docker_tmp: Path) -> None:
    """A copy keeps each directory's listing order only from and to one filesystem: with snapshots in /var/tmp
    (ext4 here) and the daemon's data on tmpfs, a directory restored from a snapshot listed in another order than
    uncached (`ls -f`: "sock x e" for "sock e x"). So `tmp` is the data root by default; one elsewhere is refused."""
    elsewhere = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        if elsewhere.stat().st_dev != docker_tmp.stat().st_dev:
            with pytest.raises(ValueError, match="daemon's filesystem"):
                DockerSandboxes(task_image, tmp=elsewhere)
    finally:
        elsewhere.rmdir()
    look = "mkdir -p d && echo > d/x && mkdir d/e; echo > d/y; ls -f d"

    async def main() -> None:
        for tmp in (None, docker_tmp):
            async with DockerSandboxes(task_image, tmp=tmp) as boxes:
                assert Path(os.path.commonpath([boxes._layers, docker_tmp.parent])) == docker_tmp.parent
                box = await boxes.create()
                expected = await out(box, look)
                other = await boxes.restore(await box.snapshot())
                assert await out(other, "ls -f d") == expected
                assert await out(other, "echo > d/z; ls -f d") == await out(box, "echo > d/z; ls -f d")

    run(main())


def test_fingerprint_is_the_image_and_the_settings(task_image: str, docker_base: str) -> None:
    def fingerprint(image: str, **kw: Any) -> str:
        boxes = DockerSandboxes(image, **kw)
        try:
            return boxes.fingerprint
        finally:
            run(boxes.close())

    same = fingerprint(task_image)
    assert fingerprint(task_image) == same
    assert fingerprint(task_image, network=True) != same
    assert fingerprint(task_image, env={"X": "1"}) != same
    assert fingerprint(docker_base) != same


def test_a_missing_file_of_the_factory_is_not_called_an_unreachable_daemon() -> None:
    """A snapshot's layer removed behind the factory's back fails its copy with FileNotFoundError, which the
    messages called "the Docker daemon is unreachable"; a missing daemon socket is aiodocker's error 900."""
    lost = _pipeline.describe(FileNotFoundError(2, "No such file or directory", "/layers/7"))
    assert "unreachable" not in lost and "/layers/7" in lost, lost

    async def no_socket() -> str:
        docker = _pipeline.client("unix:///nonexistent/docker.sock")
        try:
            await docker.images.inspect("tvcache-anything")
        except Exception as exc:
            return _pipeline.describe(exc)
        finally:
            await docker.close()
        raise AssertionError("a daemon answered on a socket that does not exist")

    assert "the Docker daemon is unreachable" in asyncio.run(no_socket())


@pytest.mark.parametrize("how", ["failed", "cancelled"])
def test_a_pause_that_froze_the_container_and_then_failed_is_undone(task_image: str, how: str) -> None:
    """Where the container's cgroup is not on this machine, a snapshot pauses it through the daemon while it
    copies its files. A pause request that froze the container and then failed (a retried request, a timeout) or
    whose snapshot was cancelled meanwhile left it frozen, and every later exec got "is paused". The daemon freezing
    and then the request failing cannot be caused on demand: the test wraps the real pause, after it took effect,
    with the failure or a cancellation (a stand-in), and forgets the container's cgroup (as there)."""

    async def main() -> None:
        async with DockerSandboxes(task_image) as boxes:
            box = await boxes.create()
            box._group = None
            await bash(box, "echo one > /testbed/f")
            real = box.container.pause

            async def pause_then_fail() -> None:
                await real()
                if how == "cancelled":
                    raise asyncio.CancelledError
                raise aiodocker.DockerError(409, {"message": "stand-in: the request failed after the pause"})

            box.container.pause = pause_then_fail
            with pytest.raises(SandboxError if how == "failed" else asyncio.CancelledError):
                await box.snapshot()
            box.container.pause = real
            assert await out(box, "cat /testbed/f") == "one\n"  # not frozen: the exec runs
            await boxes.restore(await box.snapshot())  # and the next snapshot works

    run(main())


def test_snapshots_of_many_containers_at_once_never_leave_one_refusing_commands(task_image: str) -> None:
    """A snapshot used to pause the container through the daemon. Under load the daemon then refused the next exec
    ("is paused, unpause the container before exec") after the unpause had returned: its record of a pause also
    follows the runtime's pause and resume events, which come late, and a late "paused" undid the unpause (two CI
    runs failed so; see `python -m tvcache_bench.micro.docker_freeze`). Snapshots now freeze the container's
    cgroup, which the daemon never hears of: many containers snapshotting at once, each running a command right
    after every snapshot, all answer."""

    async def churn(boxes: DockerSandboxes, index: int) -> list[str]:
        box = await boxes.create()
        assert box._group is not None  # the freeze this test is about, not the daemon's pause
        answers = []
        for round in range(12):
            await box.snapshot()
            answers.append(await out(box, f"echo {index}-{round} >> log; wc -l < log"))
        return answers

    async def main() -> None:
        async with DockerSandboxes(task_image, create_concurrency=16) as boxes:
            results = await asyncio.gather(*(churn(boxes, i) for i in range(12)))
        assert results == [[f"{r + 1}\n" for r in range(12)]] * 12

    run(main())


def test_a_snapshot_freezes_the_containers_processes_and_thaws_them_also_when_cancelled(task_image: str) -> None:
    """Every process of the container stops for the copy and runs again after it, the daemon none the wiser (it
    still calls the container running, not paused), and a snapshot cancelled while frozen thaws it once the copy
    under way has ended, which leaves nothing behind. The writer is started with the daemon's exec directly: a
    sandbox's own commands end with everything they start."""

    async def main() -> None:
        async with DockerSandboxes(task_image) as boxes:
            box = await boxes.create()
            assert box._group is not None and box._upper is not None
            # 3,000 files make a copy last long enough for the cancellation below to catch it at it. (Made first:
            # a sandbox's command ends with every process in the container, the writer too.)
            await bash(box, "mkdir /many && for i in $(seq 3000); do echo $i > /many/$i; done")
            writer = await box.container.exec(["bash", "-c", "while :; do echo x >> /grows; done"])
            await writer.start(detach=True)
            grows = Path(box._upper, "grows")

            async def size_after(seconds: float) -> int:
                await asyncio.sleep(seconds)
                return (await asyncio.to_thread(grows.stat)).st_size

            await size_after(0.3)
            async with frozen(box._group, "test"):
                still = await size_after(0.0)
                assert await size_after(0.3) == still
                assert (await box.container.show())["State"]["Paused"] is False
            assert await size_after(0.3) > still

            snapshot = asyncio.ensure_future(box.snapshot())
            while not await asyncio.to_thread(os.listdir, boxes._layers):  # noqa: ASYNC110 (the copy has begun)
                await asyncio.sleep(0.001)
            assert is_frozen(box._group)
            snapshot.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await snapshot
            assert (box._group / "cgroup.freeze").read_text() == "0\n"
            assert list(boxes._layers.iterdir()) == []  # the copy under way ended, and went
            before = await size_after(0.0)
            assert await size_after(0.3) > before

    run(main())
