"""The video sandboxes: a folder per rollout in a `WorkspaceSandboxes`, and the six tools on it.

Why a workspace. The published system ran the video tools in a per-task folder sandbox: `load_video` copies
a clip into the folder, `preprocess` writes its results next to it, and the analysis tools read them. Kernel
overlayfs makes that folder cheap to snapshot and to fork (milliseconds, whatever the video's size), and the
preprocessed files live in the sandbox's state, so a restored snapshot carries them: a rollout that misses
on an analysis call after `preprocess` resumes from a snapshot instead of decoding the video again.

Each sandbox sees `/testbed` (its folder, empty at first), `/videos` (the catalogue, read-only) and
`/opt/tvcache-video/features.py` (the preprocessing runner), on top of the host's root, with no network; and
this process's Python, wherever it lives (a venv under /tmp too: see `interpreter`):

- `load_video(video)`: `cp /videos/<video>.mp4 /testbed/video.mp4` and the removal of any older features,
  run by bash in the sandbox. A name not in the catalogue gets an answer listing the videos, and changes
  nothing.
- `preprocess()`: `python -S -B /opt/tvcache-video/features.py /testbed/video.mp4 /testbed/features.sqlite` in
  the sandbox: the real decoding and feature extraction, seconds per minute of video (see `features`).
- the four read-only tools (`analysis`) run in this process, on a worker thread, reading the sandbox's
  folder through its mounted root: a process per call would cost more than most of the analyses.

Whether a call changed the state is what the workspace observes for the two commands (its upper dir); the
read-only tools only read files (the SQLite file as bytes into memory), so they report no change. A command
that fails for another reason than a missing video (the interpreter is not visible in the sandbox, a
timeout) is a sandbox failure (`error=True`), never a cacheable answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cv2

from tvcache.calls import ToolCall
from tvcache.sandboxes.base import Outcome, SandboxError
from tvcache.sandboxes.reclaim import scratch_dir
from tvcache.sandboxes.workspace import WorkspaceSandbox, WorkspaceSandboxes

from . import analysis, features
from .clips import Catalogue
from .interpreter import sandboxed_python

__all__ = ["TOOLS", "VideoSandbox", "VideoSandboxes"]

TOOLS = ("load_video", "preprocess", *analysis.READ_ONLY)
WORKDIR = "/testbed"
RUNNER = "/opt/tvcache-video"
_VERSION = "tvcache-video-sandbox/1"


class VideoSandboxes:
    """Sandboxes for the video tools over one catalogue (a `Sandboxes` factory)."""

    def __init__(self, catalogue: Catalogue, *, timeout: float = 600.0, tmp: str | None = None):
        self.catalogue = catalogue
        self._scratch = scratch_dir("video", tmp)
        try:
            folder, runner = self._scratch / "folder", self._scratch / "runner"
            folder.mkdir()
            runner.mkdir()
            shutil.copy2(features.__file__, runner / "features.py")
            self._python = sandboxed_python()
            base = {WORKDIR: str(folder), "/videos": str(catalogue.directory), RUNNER: str(runner)}
            base.update(self._python.mounts)
            self._inner = WorkspaceSandboxes(base, network=False, timeout=timeout, tmp=tmp)
        except BaseException:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise
        # What an answer depends on: the tools' code, the videos (their manifest holds each one's sha256) and
        # the OpenCV that decodes them. Not the scratch paths, so every process computes the same fingerprint.
        h = hashlib.blake2b(digest_size=16)
        for part in (_VERSION, cv2.__version__):
            h.update(part.encode() + b"\0")
        for path in (
            Path(__file__),
            Path(features.__file__),
            Path(analysis.__file__),
            catalogue.directory / "catalogue.json",
        ):
            h.update(path.read_bytes() + b"\0")
        self._fingerprint = h.hexdigest()

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def mode(self) -> str:
        """The workspace isolation in use (overlay, userns or copy)."""
        return self._inner.mode

    async def create(self) -> VideoSandbox:
        return VideoSandbox(await self._inner.create(), self.catalogue, self._python.command)

    async def restore(self, snapshot_id: str) -> VideoSandbox:
        return VideoSandbox(await self._inner.restore(snapshot_id), self.catalogue, self._python.command)

    async def delete(self, snapshot_id: str) -> None:
        await self._inner.delete(snapshot_id)

    async def close(self) -> None:
        try:
            await self._inner.close()
        finally:
            shutil.rmtree(self._scratch, ignore_errors=True)


class VideoSandbox:
    def __init__(self, box: WorkspaceSandbox, catalogue: Catalogue, python: str):
        self._box = box
        self._catalogue = catalogue
        self._python = python
        self._lock = asyncio.Lock()  # an analysis reads the mounted folder, which a snapshot remounts

    @property
    def folder(self) -> Path:
        """The sandbox's /testbed as this process sees it."""
        return Path(self._box.root + WORKDIR)

    async def execute(self, call: ToolCall) -> Outcome:
        async with self._lock:
            if call.tool in analysis.READ_ONLY:
                output = await asyncio.to_thread(analysis.answer, self.folder, call.tool, call.args)
                return Outcome(output, changed=False)
            if call.tool == "load_video":
                return await self._load(call.args)
            if call.tool == "preprocess":
                return await self._preprocess(call.args)
            return Outcome(f"Error: unknown tool {call.tool!r}; the tools are {', '.join(TOOLS)}", changed=False)

    async def _load(self, args: Mapping[str, Any] | str) -> Outcome:
        video = args.get("video") if isinstance(args, Mapping) and set(args) == {"video"} else None
        if not isinstance(video, str):
            return Outcome("Error: the arguments must be load_video(video: str)", changed=False)
        name = video.removesuffix(".mp4")
        info = self._catalogue.info.get(name)
        if info is None:
            listed = ", ".join(f"{n}.mp4" for n in self._catalogue.names)
            return Outcome(f"Error: there is no video named {video!r}; the videos are {listed}", changed=False)
        command = f"cp /videos/{name}.mp4 {WORKDIR}/{analysis.VIDEO} && rm -f {WORKDIR}/{analysis.FEATURES}"
        outcome = await self._bash(command)
        if outcome.error:
            return outcome
        return Outcome(
            f"Loaded {name}.mp4 into the sandbox: {info['seconds']:.1f} s of video ({info['frames']} frames). "
            "Call preprocess() before analysing it.",
            outcome.changed,
        )

    async def _preprocess(self, args: Mapping[str, Any] | str) -> Outcome:
        if args not in ({}, ""):
            return Outcome("Error: preprocess() takes no arguments", changed=False)
        video, db = f"{WORKDIR}/{analysis.VIDEO}", f"{WORKDIR}/{analysis.FEATURES}"
        # stderr (OpenCV and FFmpeg chatter) is kept in a shell variable, not a file, so it adds nothing to the
        # sandbox's state, and shown only when the runner fails.
        run = f"{self._python} {RUNNER}/features.py {video} {db}"
        answered = features.ANSWERED_ERROR
        command = f'{{ err=$({run} 2>&1 >&3); }} 3>&1; s=$?; [ $s = 0 ] || [ $s = {answered} ] || echo "$err"; exit $s'
        return await self._bash(command, answers=(0, answered))

    async def _bash(self, command: str, answers: tuple[int, ...] = (0,)) -> Outcome:
        """Run `command` in the sandbox; its stdout is the answer when it exits with one of `answers`
        (the runner exits ANSWERED_ERROR for "no video loaded"), anything else is a failure of the sandbox."""
        outcome = await self._box.execute(ToolCall("bash", {"command": command}))
        result = outcome.output
        if not isinstance(result, dict):
            raise SandboxError(f"a workspace bash call answered {result!r}")
        text = str(result.get("output", "")).strip()
        if outcome.error or result.get("exit_code") not in answers:
            why = result.get("error") or f"exit code {result.get('exit_code')}"
            return Outcome(f"Error: the command failed in the sandbox ({why}): {text[-2000:]}", None, True)
        return Outcome(text, outcome.changed)

    async def snapshot(self) -> str:
        async with self._lock:
            return await self._box.snapshot()

    async def close(self) -> None:
        await self._box.close()
