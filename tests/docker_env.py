"""Docker fixtures: a running daemon (started if none answers), the Debian base image (debootstrap + docker import,
cached in ~/.cache/tvcache/), and small task images built FROM it. Tests skip, saying why, only when Docker
cannot run here at all (not installed, or not root to start it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tvcache_bench.docker_setup import DockerUnavailable, debian_base

#: A task image: environment and working directory from the Dockerfile, files over three layers, one of which
#: deletes a file (an OCI whiteout) and replaces a directory (an opaque directory).
TASK_DOCKERFILE = """\
FROM {base}
ENV TASK=demo LANG=C.UTF-8
WORKDIR /testbed
RUN mkdir -p data src && echo 'the readme' > README && echo a > data/a.txt && echo b > data/b.txt \\
    && echo 'print(1)' > src/main.py && echo old > old.txt && mkdir -p replaced && echo x > replaced/x
RUN rm old.txt && rm -rf replaced && mkdir replaced && echo y > replaced/y
"""


@pytest.fixture(scope="session", name="docker_base")
def docker_base_fixture() -> str:
    try:
        return debian_base()
    except DockerUnavailable as exc:
        pytest.skip(f"Docker cannot run here: {exc}")


@pytest.fixture(scope="session", name="task_image")
def task_image_fixture(docker_base: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    context = tmp_path_factory.mktemp("task-image")
    (context / "Dockerfile").write_text(TASK_DOCKERFILE.format(base=docker_base))
    from tvcache.sandboxes.docker import build_image  # the docker extra: only where a test asks for an image

    return asyncio.run(build_image(context))


def docker_root() -> Path:
    """The daemon's data root: where a DockerSandboxes keeps its snapshots unless told another place on its
    filesystem."""
    out = subprocess.run(["docker", "info", "-f", "{{.DockerRootDir}}"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


@pytest.fixture(name="docker_tmp")
def docker_tmp_fixture() -> Iterator[Path]:
    """A directory of the test's own on the daemon's filesystem, for a DockerSandboxes' `tmp`: no other test's
    factory reclaims what dead processes left there."""
    path = docker_root() / f"tvcache-test-tmp-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def labelled(kind: str, run: str) -> list[str]:
    """Ids of the containers, images or networks on the daemon that carry `tvcache.run=<run>`."""
    command = {"container": ["ps", "-aq"], "image": ["images", "-aq"], "network": ["network", "ls", "-q"]}[kind]
    out = subprocess.run(
        ["docker", *command, "--filter", f"label=tvcache.run={run}"], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


class SecondDaemon:
    """A second, private dockerd (own socket, data and exec roots) that a test may stop without touching the
    shared one. It gets the base image from the cached rootfs tarball."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tvcache-dockerd-", dir="/dev/shm"))
        self.exec_root = Path(tempfile.mkdtemp(prefix="tvcd-", dir="/run"))  # short: socket paths are limited
        self.socket = self.exec_root / "docker.sock"
        self.url = f"unix://{self.socket}"
        self.log = open(self.dir / "dockerd.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                "dockerd",
                "--iptables=false",
                "--bridge=none",
                f"--host={self.url}",
                f"--data-root={self.dir / 'data'}",
                f"--exec-root={self.exec_root / 'exec'}",
                f"--pidfile={self.exec_root / 'docker.pid'}",
            ],
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + 60
        while not self._answers():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"second dockerd did not start: {(self.dir / 'dockerd.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def _answers(self) -> bool:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.socket))
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b"OK" in s.recv(1024)
        return False

    def docker(self, *args: str, input_file: Path | None = None) -> str:
        with open(input_file, "rb") if input_file else contextlib.nullcontext() as stdin:  # type: ignore[attr-defined]
            out = subprocess.run(
                ["docker", f"--host={self.url}", *args],
                stdin=stdin,
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            )
        return out.stdout.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def remove(self) -> None:
        self.stop()
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split()[4] for line in f]
        for target in sorted(mounts, key=len, reverse=True):
            if target.startswith((str(self.dir), str(self.exec_root))):
                subprocess.run(["umount", "-l", target], check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.exec_root, ignore_errors=True)


@pytest.fixture(name="second_daemon")
def second_daemon_fixture(docker_base: str) -> Iterator[SecondDaemon]:
    daemon = SecondDaemon()
    try:
        tarball = Path(os.path.expanduser("~/.cache/tvcache/debian-bookworm-minbase.tar"))
        daemon.docker("import", "-", docker_base, input_file=tarball)
        yield daemon
    finally:
        daemon.remove()


def oci_layout_from_save(saved: Path, dest: Path, *, gzip_layers: bool = True) -> Path:
    """An OCI image layout at `dest` made from `docker save` output (Docker 20.10 writes only its own format):
    blobs by digest, gzip-compressed layers, a manifest and an index."""
    import gzip
    import hashlib
    import tarfile

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (dest / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (dest / "blobs" / "sha256" / digest).write_bytes(data)
        return f"sha256:{digest}"

    with tarfile.open(saved) as tar:
        entry = json.load(tar.extractfile("manifest.json"))[0]  # type: ignore[arg-type]
        config = tar.extractfile(entry["Config"]).read()  # type: ignore[union-attr]
        layers = []
        for name in entry["Layers"]:
            raw = tar.extractfile(name).read()  # type: ignore[union-attr]
            data = gzip.compress(raw, 1) if gzip_layers else raw
            media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gzip_layers else "")
            layers.append({"mediaType": media, "digest": put(data), "size": len(data)})
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(config), "size": len(config)},
        "layers": layers,
    }
    body = json.dumps(manifest).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": manifest["mediaType"], "digest": put(body), "size": len(body)}],
    }
    (dest / "index.json").write_text(json.dumps(index))
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return dest


def dockerfile_image(base: str, body: str, tmp: Path) -> str:
    """Build `FROM base` + `body` (cached by content) and return the image id."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "Dockerfile").write_text(f"FROM {base}\n" + textwrap.dedent(body))
    from tvcache.sandboxes.docker import build_image

    return asyncio.run(build_image(tmp))
