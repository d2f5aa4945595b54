"""Docker for the tests and `tvcache bench docker`: a daemon, and a Debian image built here (no registry needed).

- `ensure_daemon()` returns once a Docker daemon answers, starting `dockerd --iptables=false --bridge=none` in
  the background if none does (as root; it starts in about a second), with its data on tmpfs, where container
  creation measured 1.2-1.5x faster than on this machine's disk (as .ci/run does).
- `debian_base()` returns `tvcache-test/debian:bookworm`: a `debootstrap --variant=minbase` root (about
  150 MB) imported with `docker import`. The root's tarball is cached in ~/.cache/tvcache/, so only the first
  run on a machine spends the half minute debootstrap takes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tvcache.sandboxes.reclaim import die_with_parent, scratch_dir

__all__ = ["BASE_IMAGE", "CACHE", "DockerUnavailable", "debian_base", "ensure_daemon"]

BASE_IMAGE = "tvcache-test/debian:bookworm"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvcache"
MIRROR = "http://deb.debian.org/debian"
DATA_ROOT = "/dev/shm/tvcache-docker"


class DockerUnavailable(RuntimeError):
    """Docker cannot run on this machine; the message says why."""


def _docker(*args: str, input_file: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    stdin = open(input_file, "rb") if input_file is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.run(["docker", *args], stdin=stdin, capture_output=True, text=True, timeout=timeout)
    finally:
        if input_file is not None:
            stdin.close()  # type: ignore[union-attr]


def _answers() -> bool:
    try:
        return _docker("version", "--format", "{{.Server.Version}}", timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_daemon(timeout: float = 60.0) -> None:
    """Make sure a Docker daemon answers; start one if needed. Raises DockerUnavailable saying why not."""
    if shutil.which("docker") is None:
        raise DockerUnavailable("the docker client is not installed (apt-get install docker.io)")
    if _answers():
        return
    if shutil.which("dockerd") is None:
        raise DockerUnavailable("no Docker daemon answers and dockerd is not installed (apt-get install docker.io)")
    if os.geteuid() != 0:
        raise DockerUnavailable("no Docker daemon answers, and starting one needs root")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "dockerd.log", "ab") as log:
        subprocess.Popen(
            ["dockerd", "--iptables=false", "--bridge=none", f"--data-root={DATA_ROOT}"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # outlives this process: later test runs reuse it
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _answers():
            return
        time.sleep(0.2)
    tail = (CACHE / "dockerd.log").read_text(errors="replace")[-2000:]
    raise DockerUnavailable(f"dockerd did not answer within {timeout:g} s; its log ends:\n{tail}")


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One process at a time builds a cached artefact."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _rootfs_tarball() -> Path:
    tarball = CACHE / "debian-bookworm-minbase.tar"
    if tarball.exists():
        return tarball
    if shutil.which("debootstrap") is None:
        raise DockerUnavailable("debootstrap is not installed (apt-get install debootstrap)")
    work = scratch_dir("debootstrap", "/var/tmp")
    try:
        root = work / "root"
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", str(root), MIRROR],
            capture_output=True,
            text=True,
            timeout=900,
            preexec_fn=die_with_parent,  # killed with us: the next build reclaims this scratch
        )
        if proc.returncode != 0:
            raise DockerUnavailable(f"debootstrap failed: {(proc.stdout + proc.stderr)[-2000:]}")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / junk).glob("*"):
                if entry.is_file():
                    entry.unlink()
        partial = work / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], check=True)
        os.replace(partial, tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tarball


def debian_base() -> str:
    """The Debian base image on the daemon (imported from the cached rootfs tarball if missing)."""
    ensure_daemon()
    with _locked("debian-base"):
        if _docker("image", "inspect", BASE_IMAGE).returncode == 0:
            return BASE_IMAGE
        tarball = _rootfs_tarball()
        proc = _docker("import", "-", BASE_IMAGE, input_file=tarball, timeout=600)
        if proc.returncode != 0:
            raise DockerUnavailable(f"docker import of {tarball} failed: {proc.stderr.strip()}")
    return BASE_IMAGE
