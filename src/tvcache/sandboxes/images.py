"""Images as overlay layers: a Docker or OCI image's own layers become the read-only lower layers of workspace
sandboxes, so an image-based task forks in milliseconds with no daemon on the hot path.

    boxes = await WorkspaceSandboxes.from_image("my-task:latest")       # a daemon's image
    boxes = await WorkspaceSandboxes.from_image("/data/task-oci")       # an OCI layout, or a `docker save` tar

Where the layers come from:

1. A daemon image with the overlay2 storage driver, on this machine: the daemon's own layer directories
   (`GraphDriver.Data`, `LowerDir` and `UpperDir`), used in place, with no copy. They already serve as
   read-only lower layers for the daemon's containers; the image must not be removed while sandboxes use it.
2. Otherwise (another storage driver, a remote daemon, an OCI layout directory, a `docker save` or OCI
   archive): each layer tarball, read from the archive or streamed by `docker save`, is unpacked once into
   `~/.cache/tvcache/layers/<diff id>/` (GNU tar, owners, modes and xattrs kept) and its OCI whiteouts are
   converted to overlayfs ones: `.wh.NAME` becomes a 0/0 character device NAME, `.wh..wh..opq` the
   directory's `trusted.overlay.opaque` mark. Layers are shared by every image that has them.

The image's config gives the sandbox its start: `Env` (plus HOME and Docker's default PATH where absent) its
exported environment and `WorkingDir` (default /) its working directory. Commands run as root, so an image
whose `User` is anyone else is refused rather than run as the wrong user. Unpacking, mknod and the trusted
xattrs need root, as the workspace's overlay mode does.

What differs from `DockerSandboxes` on the same image (both are deterministic; they are not identical): the
workspace's /dev, /proc, /tmp and /run are its own (/tmp and /run start empty even where the image has files
there), the hostname is the host's, and each command runs in fresh namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ..extras import require
from .base import SandboxError
from .reclaim import scratch, scratch_dir

if TYPE_CHECKING:
    from .workspace import WorkspaceSandboxes

__all__ = ["ImageRoot", "image_root", "unpack_layer", "workspace_from_image"]

LAYER_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvcache" / "layers"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OPAQUE_XATTR = "trusted.overlay.opaque"
_ROOT_USERS = {"", "root", "0", "root:root", "0:0", "root:0", "0:root"}


@dataclass(frozen=True, slots=True)
class ImageRoot:
    """What a workspace sandbox needs from an image."""

    layers: tuple[str, ...]
    """Directories usable as overlayfs lower layers, bottom first."""
    env: dict[str, str]
    cwd: str
    user: str
    image_id: str


def _config_start(config: dict[str, Any]) -> tuple[dict[str, str], str, str]:
    """(env, cwd, user) from an image config's `config` section."""
    env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("HOME", "/root")
    return env, config.get("WorkingDir") or "/", config.get("User") or ""


# -- unpacking layer tarballs -------------------------------------------------------------------------------


def _convert_whiteouts(root: Path) -> None:
    """OCI whiteouts (`.wh.NAME`, `.wh..wh..opq`) to overlayfs ones, in place."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            if not name.startswith(".wh."):
                continue
            marker = os.path.join(dirpath, name)
            os.unlink(marker)
            if name == ".wh..wh..opq":
                os.setxattr(dirpath, OPAQUE_XATTR, b"y", follow_symlinks=False)
            else:
                target = os.path.join(dirpath, name[len(".wh.") :])
                if os.path.lexists(target):
                    shutil.rmtree(target) if os.path.isdir(target) else os.unlink(target)
                os.mknod(target, stat.S_IFCHR, os.makedev(0, 0))


def _tar_flags(head: bytes) -> list[str]:
    if head.startswith(b"\x1f\x8b"):
        return ["--gzip"]
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return ["--zstd"]
    return []


def unpack_layer(source: IO[bytes], diff_id: str, cache: Path | None = None) -> Path:
    """The directory holding the layer tarball `source` unpacked (once per `diff_id`, cached in `cache`, by
    default LAYER_CACHE), whiteouts converted. Safe against concurrent unpacking by other processes: the first
    rename wins."""
    cache = cache or LAYER_CACHE
    dest = cache / diff_id.replace(":", "-")
    if dest.is_dir():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    work = scratch_dir("unpack", cache)
    try:
        tree = work / "layer"
        tree.mkdir()
        head = source.read(4)
        argv = ["tar", "-x", "-f", "-", "-C", str(tree), "--numeric-owner", "--same-owner", "-p"]
        argv += ["--xattrs", "--xattrs-include=*", *_tar_flags(head)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdin is not None and proc.stderr is not None
        try:
            proc.stdin.write(head)
            shutil.copyfileobj(source, proc.stdin, 1 << 20)
        except BrokenPipeError:
            pass
        finally:
            proc.stdin.close()
        err = proc.stderr.read().decode(errors="replace")
        if proc.wait() != 0:
            raise SandboxError(f"unpacking layer {diff_id} failed: {err.strip()[-1000:]}")
        _convert_whiteouts(tree)
        with contextlib.suppress(OSError):  # another process finished first: keep theirs
            os.rename(tree, dest)
        if not dest.is_dir():
            raise SandboxError(f"unpacking layer {diff_id} left no directory at {dest}")
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- image archives: OCI layouts and `docker save` ---------------------------------------------------------


class _Archive:
    """Files of an OCI layout or `docker save` output, from a directory or a tar archive."""

    def __init__(self, path: Path):
        self.path = path
        self._tar = None if path.is_dir() else tarfile.open(path)  # noqa: SIM115 - closed by close()

    def exists(self, name: str) -> bool:
        if self._tar is None:
            return (self.path / name).is_file()
        try:
            self._tar.getmember(name)
            return True
        except KeyError:
            return False

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        if self._tar is None:
            with open(self.path / name, "rb") as f:
                yield f
            return
        member = self._tar.extractfile(self._tar.getmember(name))
        if member is None:
            raise SandboxError(f"{name} in {self.path} is not a file")
        with member:
            yield member

    def json(self, name: str) -> Any:
        with self.open(name) as f:
            return json.load(f)

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()


def _blob(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return f"blobs/{algorithm}/{hexdigest}"


def _oci_manifest(archive: _Archive) -> tuple[str, list[str]]:
    """(config file, layer files bottom first) of the first linux/amd64 (or only) image of an OCI layout."""
    index = archive.json("index.json")
    while True:
        manifests = index.get("manifests") or []
        if not manifests:
            raise SandboxError(f"{archive.path}: the OCI index lists no image")
        chosen = next(
            (m for m in manifests if (m.get("platform") or {}).get("architecture") in ("amd64", None)),
            manifests[0],
        )
        document = archive.json(_blob(chosen["digest"]))
        if "layers" in document:
            return _blob(document["config"]["digest"]), [_blob(layer["digest"]) for layer in document["layers"]]
        index = document  # a nested index: descend


def _read_archive(path: Path) -> ImageRoot:
    archive = _Archive(path)
    try:
        if archive.exists("manifest.json"):  # `docker save` (also written by newer Dockers next to index.json)
            entry = archive.json("manifest.json")[0]
            config_name, layer_names = entry["Config"], list(entry["Layers"])
        elif archive.exists("index.json"):
            config_name, layer_names = _oci_manifest(archive)
        else:
            raise SandboxError(f"{path} is neither an OCI image layout nor `docker save` output")
        config = archive.json(config_name)
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(layer_names):
            raise SandboxError(f"{path}: the config names {len(diff_ids)} layers, the manifest {len(layer_names)}")
        layers = []
        for name, diff_id in zip(layer_names, diff_ids, strict=True):
            with archive.open(name) as source:
                layers.append(str(unpack_layer(source, diff_id)))
        env, cwd, user = _config_start(config.get("config") or {})
        digest = "sha256:" + config_name.rsplit("/", 1)[-1].removesuffix(".json")
        return ImageRoot(tuple(layers), env, cwd, user, digest)
    finally:
        archive.close()


# -- daemon images -----------------------------------------------------------------------------------------


async def _from_daemon(image: str, docker_url: str | None) -> ImageRoot:
    require("docker", "an image on a Docker daemon", "aiodocker")
    from .docker._pipeline import client, inspect_image

    async with client(docker_url) as docker:
        info = await inspect_image(docker, image)  # ValueError also when `image` was meant as a missing path
        env, cwd, user = _config_start(info.get("Config") or {})
        dirs = await asyncio.to_thread(_layer_dirs, info)
        if dirs is not None:
            return ImageRoot(dirs, env, cwd, user, info["Id"])
        # No layer directories here: stream `docker save` to a file and unpack its layers.
        with scratch("image-save", "/var/tmp") as tmp:
            archive = Path(tmp) / "image.tar"
            out = await asyncio.to_thread(open, archive, "wb")
            try:
                async with docker.images.export_image(info["Id"]) as stream:
                    async for chunk in stream.iter_chunked(1 << 20):
                        await asyncio.to_thread(out.write, chunk)
            finally:
                out.close()
            root = await asyncio.to_thread(_read_archive, archive)
        return ImageRoot(root.layers, env, cwd, user, info["Id"])


def _layer_dirs(info: dict[str, Any]) -> tuple[str, ...] | None:
    """The image's overlay2 layer directories, bottom first, if the daemon uses overlay2 and they are here."""
    driver = info.get("GraphDriver") or {}
    data = driver.get("Data") or {}
    dirs = [*reversed([d for d in (data.get("LowerDir") or "").split(":") if d]), data.get("UpperDir") or ""]
    if driver.get("Name") == "overlay2" and all(os.path.isdir(d) for d in dirs):
        return tuple(dirs)
    return None


async def image_root(image: str | os.PathLike[str], *, docker_url: str | None = None) -> ImageRoot:
    """The layers and start of `image`: a path to an OCI layout or image archive, else a daemon image name."""
    path = Path(image)
    is_path = await asyncio.to_thread(path.exists)
    if isinstance(image, os.PathLike) or is_path:
        if not is_path:
            raise ValueError(f"image path {os.fspath(image)!r} does not exist")
        return await asyncio.to_thread(_read_archive, path)
    return await _from_daemon(str(image), docker_url)


async def workspace_from_image(
    image: str | os.PathLike[str], *, docker_url: str | None = None, **options: Any
) -> WorkspaceSandboxes:
    """Workspace sandboxes whose root filesystem is `image` (see the module docstring). `options` go to
    `WorkspaceSandboxes` (network, timeout, tmp, ...); `env` and `cwd` there replace the image's."""
    from .workspace import WorkspaceSandboxes

    root = await image_root(image, docker_url=docker_url)
    if root.user not in _ROOT_USERS:
        raise ValueError(
            f"image {os.fspath(image)!r} runs as user {root.user!r}, and workspace sandboxes run commands as root: "
            "use DockerSandboxes for it"
        )
    options.setdefault("env", root.env)
    options.setdefault("cwd", root.cwd)
    return await asyncio.to_thread(lambda: WorkspaceSandboxes({"/": list(root.layers)}, **options))
