"""Docker sandboxes: every sandbox is a container of one image, and a snapshot is a copy of its writable layer.

    boxes = DockerSandboxes("my-task:latest", timeout=60)        # or: await DockerSandboxes.build("task/")
    box = await boxes.create()
    await box.execute(ToolCall("bash", {"command": "cd /app && make test"}))
    snap = await box.snapshot()                                  # a copy of the container's files
    other = await boxes.restore(snap)                            # a new container of the image with those files

Use these for tasks that need what only a daemon gives (exact Docker semantics, services, several processes
you talk to over a network); for a single-container task, `WorkspaceSandboxes.from_image(image)` runs the same
image's layers as overlay lower layers and forks a hundred times faster (see images.py).

**Tools** as in `WorkspaceSandboxes`, with the same outputs: `bash {"command"}` -> `{"output", "exit_code"}`
(stdout and stderr interleaved, the middle cut past `max_output`), `read_file`, `write_file`, `list_dir`. The
working directory and exported variables carry over from call to call and into snapshots (see _exec).
Commands run as the image's `User`, starting in its `WorkingDir` with its `Env` (plus `env`). Every command
ends with the processes it started: nothing runs between calls, as nothing can be in a snapshot. The file
tools work in this process through the container's merged directory (the daemon must be local, with the
overlay2 storage driver, as it is by default; elsewhere they raise and `bash` still works).

**State.** What a snapshot holds is the container's filesystem (its diff against the image) plus the shell's
working directory and exports. Not part of it, as Docker mounts them apart: /dev (read-only here but for its
devices; /dev/shm and /dev/mqueue are emptied after every command), /proc, /sys, and /etc/hosts,
/etc/hostname and /etc/resolv.conf (read-only here). PIDs and SysV IPC objects are not state either. The
hostname is `sandbox` in every container.

**Changed or not** is observed: the container's upper directory (its diff) is listed after each call (path,
inode, size, mtime, ctime, mode; an empty one in microseconds), so a call that wrote nothing and left the
working directory and exports alone is a memo without annotation.

**CPU.** Each command's `Outcome.cpu_seconds` is the CPU time the container's processes used during it, read
from the container's cgroup2 `cpu.stat` before and after (see _cgroup); None where that group is not on this machine
(a remote or rootless daemon).

**Snapshots are invisible**: a restored container shows exactly the files the container that took the snapshot
showed, as a fresh container that ran the same calls would. So a snapshot is not a `docker commit`: a commit
packs the diff into a tar (losing sockets, `user.*` xattrs and sub-second times) and stacks it as a new image
layer, over which overlayfs shows another size, link count and listing order for every directory written on
both sides of it. A snapshot copies the container's upper dir (its writable layer) instead, with the
workspace's copy (`_layers.copy_layer`: relative to directory descriptors, never following a symlink, so a
racing command cannot get host files into it) while the container's processes are frozen (see _cgroup), into
`tmp` (by default the daemon's data root: a copy keeps each directory's listing order only from and to one
filesystem); a restore creates a container of the image and copies the snapshot into its empty upper dir before
starting it, so every container is the image's layers plus one upper dir, as an uncached one is. Snapshots
need the container's files on this machine (a local daemon with the overlay2 storage driver); elsewhere
`snapshot()` raises SandboxError and the cache replays from a fresh container.

**Scale.** Container creation and removal go through one pipeline per factory that runs at most
`create_concurrency` of them at once (the daemon's measured saturation point: more at once only makes each
slower, and far more makes them fail) and retries what a loaded daemon rejects (see _pipeline). A
sandbox has no network (only loopback) unless `network=True`; networked sandboxes share a pool of bridge
networks, created as needed, at most 200 containers each, instead of a network per sandbox.

**Timeouts.** A call running past `timeout` seconds is killed with everything it started, and gives
`Outcome(error=True)` with the output so far; the container stays usable. A container that dies (killed from
outside, the daemon stopped) raises SandboxError from the call that finds it, and so does a request the daemon has
not answered in `_pipeline.REQUEST_TIMEOUT` (a hung daemon).

**Cleanup.** Containers, images and networks carry labels naming the run and the process (see _run).
`close()` removes them all, also after errors, and so does the garbage collector or the interpreter's exit
for a factory never closed; the next factory on the daemon reaps what a killed process left behind.

**Fingerprint.** The image id and every setting that can change an output (environment, user, working
directory, network, limits, `max_output`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import stat
import tarfile
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ...extras import require

try:
    import aiodocker
except ImportError:
    require("docker", "a Docker sandbox", "aiodocker")  # raises MissingExtra: the extra to install, in one line
    raise

from ...calls import ToolCall
from .. import _fastpaths as fast
from .._cgroup2 import frozen, usage_seconds
from .._fdtree import remove_tree
from .._layers import copy_layer, relisted
from .._shell import ShellState, unfinished
from .._threads import in_own_thread, to_thread_to_the_end
from ..base import Outcome, SandboxError
from ..lifecycle import ManagedSandbox, ManagedSandboxes
from ..reclaim import scratch_dir
from ._cgroup import can_freeze, group_of
from ._exec import kill_everything, run_bash
from ._pipeline import Pipeline, client, describe, inspect_image
from ._run import RUN_LABEL, new_run, reap_dead_runs, remove_run

__all__ = ["CREATE_CONCURRENCY", "TOOLS", "DockerSandbox", "DockerSandboxes", "build_image"]

TOOLS = fast.TOOLS
#: Heavy daemon operations at once: where `tvcache bench docker` saw the daemon's creations per second stop
#: growing with concurrency on a 2-core machine (see the README); more in flight only makes each one slower.
CREATE_CONCURRENCY = 16
BUILD_REPO = "tvcache-build"
#: PID 1 of every container: a shell blocked reading its (open, never written) stdin. A bash as PID 1 reaps
#: orphans, and `kill -9 -1` inside the container cannot touch it.
KEEPER = "while :; do read -r _ || sleep 1; done"
#: Mounted read-only: Docker's own mounts, which a snapshot does not capture (writing them would be state that
#: no snapshot carries). Device nodes stay writable on a read-only /dev. The rest is Docker's default list.
READONLY_PATHS = [
    "/dev",
    "/etc/hosts",
    "/etc/hostname",
    "/etc/resolv.conf",
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
]
PER_NETWORK = 200
_FINGERPRINT_VERSION = "tvcache-docker/2"  # 2: snapshots copy upper dirs (commits changed what a call saw)

T = TypeVar("T")


def _blocking(job: Callable[[aiodocker.Docker], Awaitable[T]], url: str | None) -> T:
    """Run `job` with a client of its own on an event loop of its own: for the few daemon requests that sync
    code needs (the constructor resolving the image, finalizers), wherever it is called from."""

    async def main() -> T:
        async with client(url) as docker:
            return await job(docker)

    return in_own_thread(lambda: asyncio.run(main()), "tvcache-docker")


def _env_list(env: Mapping[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    layer: str | None
    """A copy of the container's upper dir (None: the image as it is)."""
    state: ShellState
    times: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Access and modification times of what Docker made for the container (see `_made_by_docker`)."""


class _Networks:
    """Bridge networks shared by networked sandboxes, at most PER_NETWORK containers each."""

    def __init__(self, labels: dict[str, str]):
        self._labels = labels
        self._users: dict[str, int] = {}
        self._lock = asyncio.Lock()

    async def acquire(self, docker: aiodocker.Docker, pipeline: Pipeline) -> str:
        async with self._lock:
            for name, users in self._users.items():
                if users < PER_NETWORK:
                    self._users[name] += 1
                    return name
            name = f"{self._labels[RUN_LABEL]}-net{len(self._users)}"
            config = {"Name": name, "Driver": "bridge", "Labels": self._labels, "CheckDuplicate": True}
            await pipeline.run("creating a network", lambda: docker.networks.create(config))
            self._users[name] = 1
            return name

    def release(self, name: str) -> None:
        self._users[name] -= 1


def _cleanup_run(url: str | None, run: str, layers: Path) -> None:
    """Remove a factory's run and its snapshots, blocking: for a factory that was never closed, or whose close
    could not."""
    with contextlib.suppress(Exception):
        _blocking(lambda docker: remove_run(docker, run), url)
    remove_tree(layers)


class DockerSandboxes(ManagedSandboxes["DockerSandbox", _Snapshot]):
    """A factory of Docker sandboxes of one image; see the module docstring.

    - `image`: a tag or image id on the daemon (no registry is contacted).
    - `network`: False gives containers no network but loopback; True attaches them to a pooled bridge network.
    - `timeout`: seconds per tool call; `max_output`: bytes of output kept per call.
    - `workdir`: the shell's first working directory (default: the image's WorkingDir, else /).
    - `env`: variables added to the image's environment.
    - `max_processes`: processes a container may run at once (its pids limit); `memory` (bytes) and `cpus`
      (a fraction of cores) cap it when given.
    - `create_concurrency`: heavy daemon operations at once (None: no limit; only for measuring one).
    - `tmp`: where snapshots live: the daemon's data root (the default) or another directory on its filesystem.
    - `docker_url`: the daemon (default: $DOCKER_HOST, else the local socket).
    """

    kind = "docker"

    def __init__(
        self,
        image: str,
        *,
        network: bool = False,
        timeout: float = 120.0,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        max_output: int = 1 << 16,
        max_processes: int = 4096,
        memory: int | None = None,
        cpus: float | None = None,
        create_concurrency: int | None = CREATE_CONCURRENCY,
        tmp: str | os.PathLike[str] | None = None,
        docker_url: str | None = None,
    ):
        if not isinstance(image, str) or not image:
            raise TypeError(f"image must be an image name or id, got {image!r}")
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if not (isinstance(max_output, int) and max_output >= 64):
            raise ValueError(f"max_output must be an int >= 64, got {max_output!r}")
        if not (isinstance(max_processes, int) and max_processes >= 8):
            raise ValueError(f"max_processes must be an int >= 8, got {max_processes!r}")
        if memory is not None and not (isinstance(memory, int) and memory >= 6 << 20):
            raise ValueError(f"memory must be a number of bytes >= 6 MiB, got {memory!r}")
        if cpus is not None and not (isinstance(cpus, int | float) and cpus > 0):
            raise ValueError(f"cpus must be a positive number, got {cpus!r}")
        if tmp is not None and not os.path.isdir(tmp):
            raise ValueError(f"tmp directory {os.fspath(tmp)!r} does not exist")
        if workdir is not None and not workdir.startswith("/"):
            raise ValueError(f"workdir must be an absolute path, got {workdir!r}")
        super().__init__()
        self.image = image
        self.network = network
        self.timeout = float(timeout)
        self.max_output = max_output
        self.max_processes = max_processes
        self.memory = memory
        self.cpus = cpus
        self.docker_url = docker_url
        self._pipeline = Pipeline(create_concurrency)
        info, root = _blocking(lambda docker: _image_and_root(docker, image), docker_url)
        if tmp is None:
            tmp = root if root is not None else ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        elif root is not None and os.stat(tmp).st_dev != os.stat(root).st_dev:
            raise ValueError(
                f"tmp {os.fspath(tmp)!r} must be on the Docker daemon's filesystem (that of its data root {root!r}, "
                "the default): a copy keeps each directory's listing order only from and to one filesystem"
            )
        config = info.get("Config") or {}
        self.image_id: str = info["Id"]
        self.user: str = config.get("User") or ""
        self.cwd = workdir or config.get("WorkingDir") or "/"
        image_env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
        self.env = {**image_env, **(env or {})}
        self._labels = new_run()
        self._layers = scratch_dir("docker-snapshots", tmp)
        self._networks = _Networks(self._labels)
        self._docker: aiodocker.Docker | None = None
        self._initial: ShellState | None = None
        self._spare: DockerSandbox | None = None
        self._setup_lock = asyncio.Lock()
        self._fingerprint: str | None = None
        self._cleanup_with(_cleanup_run, docker_url, self._labels[RUN_LABEL], self._layers)

    # -- the Sandboxes protocol --------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            settings = (
                self.image_id,
                sorted(self.env.items()),
                self.user,
                self.cwd,
                self.network,
                self.max_output,
                self.max_processes,
                self.memory,
                self.cpus,
            )
            h = hashlib.blake2b(f"{_FINGERPRINT_VERSION}\0{settings!r}".encode(), digest_size=16)
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def run(self) -> str:
        """The label value naming everything this factory created (`tvcache.run=<run>`)."""
        return self._labels[RUN_LABEL]

    @property
    def retries(self) -> int:
        """Daemon operations retried after a transient failure so far."""
        return self._pipeline.retries

    async def create(self) -> DockerSandbox:
        self._check_open()
        await self._ensure_setup()
        if self._spare is not None:
            box, self._spare = self._spare, None
            return box
        assert self._initial is not None
        return await self._start(_Snapshot(None, self._initial))

    async def restore(self, snapshot_id: str) -> DockerSandbox:
        return await self._start(self._lookup(snapshot_id))

    async def delete(self, snapshot_id: str) -> None:
        snap = self._forget(snapshot_id)
        if snap is not None and snap.layer is not None:
            await asyncio.to_thread(remove_tree, snap.layer)

    async def close(self) -> None:
        """Remove every container, image and network this factory created (containers concurrently)."""
        if not self.closed:
            await asyncio.gather(*(box.close() for box in list(self._live)), return_exceptions=True)
        await super().close()

    async def _close(self) -> None:
        if self._docker is None:
            return
        try:
            await remove_run(self._docker, self.run)
            await asyncio.to_thread(remove_tree, self._layers)
            if self._finalizer is not None:
                self._finalizer.detach()  # done; if not (the daemon was down), the finalizer tries again
        except Exception:
            pass
        finally:
            await self._docker.close()

    def __repr__(self) -> str:
        return f"DockerSandboxes({self.image!r}, run={self.run!r})"

    @classmethod
    async def build(cls, context_dir: str | os.PathLike[str], **options: Any) -> DockerSandboxes:
        """Sandboxes of the image the Dockerfile in `context_dir` builds (built once, cached by content)."""
        image = await build_image(context_dir, docker_url=options.get("docker_url"))
        return await asyncio.to_thread(lambda: cls(image, **options))

    # -- internals -------------------------------------------------------------------------------------

    def _client(self) -> aiodocker.Docker:
        if self._docker is None:
            self._docker = client(self.docker_url)
        return self._docker

    async def _ensure_setup(self) -> None:
        """First use: reap dead runs, and learn the initial shell state from a first container (kept as the
        first sandbox `create` hands out)."""
        async with self._setup_lock:
            if self._initial is not None:
                return
            docker = self._client()
            await self._pipeline.run("reaping the runs of dead processes", lambda: reap_dead_runs(docker))
            box = await self._start(_Snapshot(None, ShellState(cwd=os.fsencode(self.cwd))))
            try:
                result = await box._bash(":")
                if not result.finished or result.exit_code != 0 or result.state.exports is None:
                    raise SandboxError(
                        f"a first command in a new container of {self.image!r} failed (the image needs bash): "
                        f"{result.output.strip()[:500]!r}"
                    )
            except BaseException:
                await box.close()
                raise
            self._initial = box._state = result.state
            self._spare = box

    async def _start(self, snap: _Snapshot) -> DockerSandbox:
        self._check_open()
        docker = self._client()
        network = await self._networks.acquire(docker, self._pipeline) if self.network else None
        host_config: dict[str, Any] = {
            "NetworkMode": network or "none",
            "ReadonlyPaths": READONLY_PATHS,
            "PidsLimit": self.max_processes,
            "LogConfig": {"Type": "none", "Config": {}},
        }
        if self.memory is not None:
            host_config["Memory"] = self.memory
        if self.cpus is not None:
            host_config["NanoCpus"] = int(self.cpus * 1e9)
        config: dict[str, Any] = {
            "Image": self.image_id,
            "Entrypoint": ["bash", "-c", KEEPER],
            "Cmd": [],
            "Env": _env_list(self.env),
            "User": self.user,
            "Hostname": "sandbox",
            "OpenStdin": True,
            "StopSignal": "SIGKILL",  # nothing inside needs a graceful stop; a daemon shutdown waits for none
            "Labels": self._labels,
            "HostConfig": host_config,
        }

        async def create_and_start() -> dict[str, Any]:
            container = await docker.containers.create(config)
            try:
                if snap.layer is not None:  # the snapshot's files, in the upper dir before it is mounted
                    upper = _local_dir(await container.show(), "UpperDir")
                    if upper is None:
                        raise SandboxError("docker: the new container's upper dir is not on this machine")
                    await asyncio.to_thread(_fill, snap.layer, upper)
                await container.start()
                info: dict[str, Any] = await container.show()
                if snap.times:
                    await asyncio.to_thread(_set_times, info, snap.times)
            except BaseException:
                with contextlib.suppress(Exception):
                    await container.delete(force=True)
                raise
            return info

        try:
            info = await self._pipeline.run(f"starting a container of {self.image[:40]}", create_and_start)
        except BaseException:
            if network is not None:
                self._networks.release(network)
            raise
        box = DockerSandbox(self, docker.containers.container(info["Id"]), info, snap, network)
        await box._observe()  # a restored upper dir's listing, so the first call is not taken for a change
        return box

    async def _copy_out(self, container: Any, upper: str, group: Path | None) -> str:
        """Copy the upper dir of `container` into a new snapshot layer, with its processes frozen: through its
        cgroup2 `group` (see _cgroup) where it is on this machine and ours to write, else through the daemon's pause."""
        dest, name = str(self._layers / self._new_id()), container.id[:12]
        async with (
            frozen(group, f"docker: container {name}")
            if group is not None and can_freeze(group)
            else self._paused(container)
        ):
            try:  # a cancelled copy ends first: frozen still, and before what it made goes
                await to_thread_to_the_end(copy_layer, upper, dest)
            except BaseException as exc:
                await asyncio.to_thread(remove_tree, dest)
                if isinstance(exc, OSError):  # TreeChanged: something changed the files under the copy
                    raise SandboxError(f"docker: copying container {name}'s files failed: {exc}") from exc
                raise
        return dest

    @contextlib.asynccontextmanager
    async def _paused(self, container: Any) -> AsyncIterator[None]:
        """The container paused by the daemon. Under load the daemon can refuse an exec right after the unpause
        returned ("is paused"; see _cgroup), so this is only where the container's cgroup cannot be frozen here."""
        name, paused = container.id[:12], False
        try:
            await self._pipeline.run(f"pausing container {name}", container.pause)
            paused = True
            yield
        finally:
            # Also after a pause that failed, timed out or was cancelled: the daemon may have frozen the container
            # all the same, and a frozen container refuses every later exec ("is paused"). Unpausing one that is not
            # paused fails (409), which then says nothing.
            try:
                await asyncio.shield(self._pipeline.run(f"unpausing container {name}", container.unpause))
            except SandboxError:
                if paused:
                    raise


async def _image_and_root(docker: aiodocker.Docker, image: str) -> tuple[dict[str, Any], str | None]:
    """The daemon's record of `image`, and its data root if that is a directory on this machine."""
    info = await inspect_image(docker, image)
    try:
        root = (await docker.system.info()).get("DockerRootDir")
    except Exception:  # an old or odd daemon: snapshots then live in /dev/shm
        root = None
    local = isinstance(root, str) and await asyncio.to_thread(os.path.isdir, root)
    return info, root if local else None


def _local_dir(info: dict[str, Any], which: str) -> str | None:
    """The container's overlay2 `UpperDir` or `MergedDir` when it is on this machine, else None."""
    driver = info.get("GraphDriver") or {}
    path = (driver.get("Data") or {}).get(which)
    return path if driver.get("Name") == "overlay2" and path and os.path.isdir(path) else None


def _made_by_docker(info: dict[str, Any]) -> dict[str, str]:
    """What Docker makes for each container when it creates and starts it, with that moment's times: its init
    layer (/.dockerenv, /etc, /etc/hostname, /dev/console, ...) and the files it binds at /etc/hosts, /etc/hostname
    and /etc/resolv.conf; as {key: host path}. A container restored from a snapshot gets the times these had in
    the container that took it, as though it had been made then, as an uncached one was (its /dev, /proc and /sys
    are mounts made at its start: those times it cannot keep)."""
    made = {key: info[key] for key in ("HostsPath", "HostnamePath", "ResolvConfPath") if info.get(key)}
    init = (((info.get("GraphDriver") or {}).get("Data") or {}).get("LowerDir") or "").split(":")[0]
    if init.endswith("-init/diff") and os.path.isdir(init):  # Docker's own layer: the sandbox cannot write it
        for dirpath, dirnames, filenames in os.walk(init):
            for name in [".", *dirnames, *filenames]:
                path = os.path.normpath(os.path.join(dirpath, name))
                made["init:" + os.path.relpath(path, init)] = path
    return made


def _times_of(info: dict[str, Any]) -> dict[str, tuple[int, int]]:
    times = {}
    for key, path in _made_by_docker(info).items():
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            times[key] = (st.st_atime_ns, st.st_mtime_ns)
    return times


def _set_times(info: dict[str, Any], times: Mapping[str, tuple[int, int]]) -> None:
    for key, path in _made_by_docker(info).items():
        if key in times:
            with contextlib.suppress(OSError):
                os.utime(path, ns=times[key], follow_symlinks=False)


def _fill(layer: str, upper: str) -> None:
    """Make the empty upper dir `upper` of a container not yet started a copy of the snapshot `layer`."""
    os.rmdir(upper)  # copy_layer makes its destination, and gives it the times and mode of the layer's root
    copy_layer(layer, upper)


class DockerSandbox(ManagedSandbox):
    """One container; made by `DockerSandboxes.create()` or `.restore()`."""

    def __init__(
        self, factory: DockerSandboxes, container: Any, info: dict[str, Any], snap: _Snapshot, net: str | None
    ):
        super().__init__(factory)
        self._f = factory
        self.container = container
        self._state = snap.state
        self._network = net
        self._info = info
        self._upper = _local_dir(info, "UpperDir")
        self._merged = _local_dir(info, "MergedDir")
        self._group = group_of(info)
        self._cpu_stat = None if self._group is None else self._group / "cpu.stat"
        self._listing: str | None = None
        """The upper dir's listing at the last look; None while it is empty."""
        self._dead: str | None = None
        self._running: asyncio.Task[Any] | None = None

    @property
    def id(self) -> str:
        return str(self.container.id)

    # -- tools -------------------------------------------------------------------------------------------

    async def _bash(self, command: str) -> Any:
        async def kill() -> None:
            try:
                await kill_everything(self.container)
            except Exception as exc:
                self._dead = f"killing a timed-out command failed: {describe(exc)}"

        try:
            return await run_bash(
                self.container,
                command,
                self._state,
                user=self._f.user,
                timeout=self._f.timeout,
                max_output=self._f.max_output,
                on_timeout=kill,
            )
        except SandboxError:
            raise
        except Exception as exc:  # the daemon's errors, a broken connection, a stream cut short
            await self._check_alive()
            raise SandboxError(f"docker: running a command failed: {describe(exc)}") from exc

    async def _check_alive(self, settle: float = 0.0) -> None:
        """Raise SandboxError (and remember why) when the container is no longer running. With `settle`, keep
        looking that long: a container killed from outside takes the daemon a moment to report."""
        deadline = asyncio.get_running_loop().time() + settle
        while self._dead is None:
            try:
                info = await self.container.show()
                state = info.get("State") or {}
                if not state.get("Running"):
                    why = "it was OOM-killed" if state.get("OOMKilled") else f"exit code {state.get('ExitCode')}"
                    self._dead = f"the container stopped ({why})"
            except Exception as exc:
                self._dead = f"the container cannot be inspected: {describe(exc)}"
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.1)
        if self._dead is not None:
            raise SandboxError(f"docker sandbox {self.id[:12]} is unusable: {self._dead}")

    async def execute(self, call: ToolCall) -> Outcome:
        tool, args = call.tool, fast.checked_args(call, "docker")
        if isinstance(args, Outcome):
            return args
        async with self._turn():
            if self._dead is not None:
                raise SandboxError(f"docker sandbox {self.id[:12]} is unusable: {self._dead}")
            state = self._state
            cpu = None
            if tool == "bash":
                used = usage_seconds(self._cpu_stat)
                result = await self._bash(args["command"])
                if used is not None and (now := usage_seconds(self._cpu_stat)) is not None:
                    cpu = now - used
                if result.timed_out:
                    return unfinished(result.output, f"timed out after {self._f.timeout:g} s")
                if not result.finished:
                    await self._check_alive(settle=2.0)  # raises if the container died under the command
                    return unfinished(result.output, "the command's shell was killed (by the command itself?)")
                output: dict[str, Any] = {"output": result.output, "exit_code": result.exit_code}
                state = result.state
            else:
                output = self._file_tool(tool, args)
            changed = await self._observe()
            if state != self._state:
                changed = True
            self._state = state
            return Outcome(output, changed, cpu_seconds=cpu)

    def _file_tool(self, tool: str, args: dict[str, Any]) -> dict[str, Any]:
        root = self._merged
        if root is None:
            raise SandboxError(
                f"{tool} needs the container's files on this machine (a local daemon with the overlay2 "
                "storage driver); use bash instead"
            )
        if tool == "read_file":
            output = fast.read_file(root, self._state.cwd, args["path"], self._f.max_output)
        elif tool == "write_file":
            output = fast.write_file(root, self._state.cwd, args["path"], args["content"])
        else:
            output = fast.list_dir(root, self._state.cwd, args["path"], self._f.max_output)
        if not os.path.ismount(root):  # the container went away under us: the answer may be about nothing
            self._dead = "its filesystem was unmounted (the container stopped)"
            raise SandboxError(f"docker sandbox {self.id[:12]} is unusable: {self._dead}")
        return output

    async def _observe(self) -> bool | None:
        """Did the container's filesystem change since the last look? None: cannot tell (no local upper dir)."""
        if self._upper is None:
            return None
        changed, self._listing = await relisted(self._upper, self._listing)
        return changed

    # -- snapshots and lifetime -------------------------------------------------------------------------

    async def snapshot(self) -> str:
        async with self._turn():
            await self._check_alive()
            if self._upper is None:
                raise SandboxError(
                    "docker: snapshots need the container's files on this machine (a local daemon with the overlay2 "
                    "storage driver)"
                )
            # Even an empty upper dir is copied: its root's times are what `stat /` shows.
            layer = await self._f._copy_out(self.container, self._upper, self._group)
            times = await asyncio.to_thread(_times_of, self._info)
            return self._f._keep(_Snapshot(layer, self._state, times))

    def _interrupt(self) -> None:
        # Closing while a command runs: end it now rather than wait for its timeout.
        if self._lock.locked() and self._dead is None:
            self._running = asyncio.ensure_future(kill_everything(self.container))

    async def _release(self) -> None:
        f = self._f
        if f._spare is self:
            f._spare = None
        if self._running is not None:  # the kill `_interrupt` started: the container goes anyway
            with contextlib.suppress(Exception):
                await self._running
        try:
            with contextlib.suppress(SandboxError):
                await f._pipeline.run(
                    f"removing container {self.id[:12]}", lambda: self.container.delete(force=True, v=True)
                )
        finally:
            if self._network is not None:
                f._networks.release(self._network)


# -- building images ---------------------------------------------------------------------------------------


def _context_digest(root: Path) -> str:
    """A content hash of a build context: every path, type, mode, symlink target and file content."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        st = path.lstat()
        h.update(f"{rel}\0{st.st_mode:o}\0".encode(errors="surrogateescape"))
        if stat.S_ISLNK(st.st_mode):
            h.update(os.fsencode(os.readlink(path)))
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        h.update(b"\n")
    return h.hexdigest()


def _context_tar(root: Path) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(root, arcname=".")
    buffer.seek(0)
    return buffer


async def build_image(context_dir: str | os.PathLike[str], *, docker_url: str | None = None) -> str:
    """Build the Dockerfile in `context_dir` once and return the image id. The image is tagged
    `tvcache-build:<content hash of the context>`, so an unchanged context is never built again (across
    processes too) and a changed one always is. `.dockerignore` is not read: the whole directory is sent."""
    root = Path(context_dir)
    if not (root / "Dockerfile").is_file():
        raise ValueError(f"{os.fspath(context_dir)!r} has no Dockerfile")
    digest = await asyncio.to_thread(_context_digest, root)
    tag = f"{BUILD_REPO}:{digest[:24]}"
    async with client(docker_url) as docker:
        try:
            return str((await docker.images.inspect(tag))["Id"])
        except aiodocker.DockerError as exc:
            if exc.status != 404:
                raise SandboxError(f"docker: inspecting {tag} failed: {describe(exc)}") from exc
        context = await asyncio.to_thread(_context_tar, root)
        try:
            await docker.images.build(fileobj=context, encoding="identity", tag=tag, rm=True, forcerm=True)
        except aiodocker.DockerError as exc:
            raise SandboxError(f"docker: building {os.fspath(context_dir)!r} failed: {exc.message}") from exc
        return str((await docker.images.inspect(tag))["Id"])
