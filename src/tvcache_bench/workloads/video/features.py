"""`preprocess`: a video's 2-second segments and their features, computed for real, into one SQLite file.

This is the expensive, state-changing step of the video workload. It decodes every frame of the video with
OpenCV and computes, per 2-second segment:

- a colour histogram (8 hue families plus black, gray and white, over every second frame at 96x54),
  mean brightness, and motion energy (mean absolute difference of consecutive sampled frames, ignoring the
  jump across a cut);
- shot cuts (a large jump between consecutive 4x4x4 colour histograms);
- a thumbnail embedding of the segment's middle frame (16x9 pixels in CIE Lab, centred, unit length);
- people (OpenCV's HOG people detector) and faces (its Haar frontal-face cascade) on the middle frame;
- a one-line text description of the segment, written from those features.

Detections are linked across neighbouring segments into tracked objects (the object memory). Everything goes
into one SQLite file (`SCHEMA`), written next to the target and renamed over it, so a reader sees the old
file or the new one, never half of one.

The module runs in two places: imported by the workload (to compute task answers uncached), and as a script
inside a sandbox (`python features.py VIDEO DB`), which is how the `preprocess` tool runs. So it imports only
the standard library, numpy and OpenCV, and its output is a pure function of the video: no times, no paths
that differ between sandboxes.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
from cv2.typing import MatLike

__all__ = [
    "ANSWERED_ERROR",
    "COLOURS",
    "SCHEMA",
    "SEGMENT_SECONDS",
    "PreprocessError",
    "Segment",
    "clock",
    "colour_classes",
    "colour_shares",
    "describe_motion",
    "detect",
    "light",
    "measure",
    "preprocess",
    "scene",
]

SEGMENT_SECONDS = 2.0
ANSWERED_ERROR = 3  # the script's exit status when its output is an answer saying what is wrong (no video)
SAMPLE_EVERY = 2  # frames: colour, brightness and motion look at every second frame
SMALL = (96, 54)  # the size those sampled frames are reduced to
THUMB = (16, 9)  # the thumbnail embedding's size
CUT = 0.6  # L1 distance between consecutive 4x4x4 colour histograms (0..2) above which a cut is declared

#: Colour families: 8 hue ranges (degrees, the first wrapping through 0) and 3 achromatic ones.
HUES = (
    ("red", 345, 15),
    ("orange", 15, 45),
    ("yellow", 45, 70),
    ("green", 70, 165),
    ("cyan", 165, 195),
    ("blue", 195, 255),
    ("purple", 255, 290),
    ("pink", 290, 345),
)
COLOURS = (*(name for name, _, _ in HUES), "black", "gray", "white")

# Motion energy (mean absolute grey-level change between frames 2/25 s apart, 0..1) -> words.
MOTION_WORDS = ((0.012, "almost no motion"), (0.03, "slow motion"), (0.06, "moderate motion"))
FAST = "fast motion"

SCHEMA = """
CREATE TABLE video (frames INTEGER, fps REAL, width INTEGER, height INTEGER, seconds REAL, segments INTEGER,
                    shots INTEGER);
CREATE TABLE segments (id INTEGER PRIMARY KEY, start REAL, end REAL, brightness REAL, motion REAL, cuts INTEGER,
                       colours TEXT, embedding BLOB, people INTEGER, faces INTEGER, description TEXT);
CREATE TABLE detections (segment INTEGER, label TEXT, x INTEGER, y INTEGER, w INTEGER, h INTEGER, score REAL);
CREATE TABLE objects (id INTEGER PRIMARY KEY, label TEXT, first_segment INTEGER, last_segment INTEGER,
                      appearances INTEGER);
CREATE TABLE appearances (object INTEGER, segment INTEGER, x INTEGER, y INTEGER, w INTEGER, h INTEGER);
"""


class PreprocessError(Exception):
    """The video cannot be preprocessed (missing, unreadable, empty); the message says why."""


Box = tuple[int, int, int, int]
Frame = MatLike


@dataclass
class Segment:
    id: int
    start: float
    end: float
    histogram: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros(len(COLOURS)))
    brightness_sum: float = 0.0
    motion_sum: float = 0.0
    motion_pairs: int = 0
    samples: int = 0
    cuts: int = 0
    keyframe: Frame | None = None
    embedding: npt.NDArray[np.float32] | None = None
    detections: list[tuple[str, Box, float | None]] = field(default_factory=list)

    @property
    def brightness(self) -> float:
        return self.brightness_sum / self.samples if self.samples else 0.0

    @property
    def motion(self) -> float:
        return self.motion_sum / self.motion_pairs if self.motion_pairs else 0.0

    def count(self, label: str) -> int:
        return sum(1 for found, _, _ in self.detections if found == label)


# -- per-frame measurements ---------------------------------------------------------------------------------


def colour_classes(hsv: Frame) -> npt.NDArray[np.intp]:
    """Each pixel's colour family, as an index into COLOURS."""
    pixels = np.asarray(hsv)
    hue = pixels[..., 0].astype(np.int32) * 2  # OpenCV keeps hue in 0..179
    sat, val = pixels[..., 1], pixels[..., 2]
    classes = np.zeros(hue.shape, dtype=np.intp)
    for index, (_, low, high) in enumerate(HUES):
        inside = (hue >= low) | (hue < high) if low > high else (hue >= low) & (hue < high)
        classes[inside] = index
    grey = sat < 48
    classes[grey] = COLOURS.index("gray")
    classes[grey & (val > 190)] = COLOURS.index("white")
    classes[val < 48] = COLOURS.index("black")
    return classes


def measure(frame: Frame) -> tuple[npt.NDArray[np.intp], float, Frame, Frame]:
    """One frame reduced to SMALL: its colour-family pixel counts, mean brightness (0..1), the reduced frame
    and its grey version (for motion)."""
    small = cv2.resize(frame, SMALL, interpolation=cv2.INTER_AREA)
    hsv = cv2.cvtColor(small, cv2.COLOR_BGR2HSV)
    counts = np.bincount(colour_classes(hsv).ravel(), minlength=len(COLOURS))
    return counts, float(hsv[..., 2].mean()) / 255, small, cv2.cvtColor(small, cv2.COLOR_BGR2GRAY)


def _layout(frame: Frame) -> npt.NDArray[np.float32]:
    """A normalised 4x4x4 BGR histogram, for cut detection."""
    hist = cv2.calcHist([frame], [0, 1, 2], None, [4, 4, 4], [0, 256, 0, 256, 0, 256]).ravel()
    total = float(hist.sum())
    return (hist / total if total else hist).astype(np.float32)


def _embedding(frame: Frame) -> npt.NDArray[np.float32]:
    lab = cv2.cvtColor(cv2.resize(frame, THUMB, interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2LAB)
    vector = lab.astype(np.float32).ravel()
    vector -= vector.mean()
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


_detectors = threading.local()  # OpenCV's detectors are not safe to share between threads: one set per thread


def detect(frame: Frame) -> list[tuple[str, Box, float | None]]:
    """People (HOG, with the detector's confidence) and faces (Haar cascade) in one frame, in a fixed order."""
    if not hasattr(_detectors, "hog"):
        hog = cv2.HOGDescriptor()
        hog.setSVMDetector(np.array(cv2.HOGDescriptor.getDefaultPeopleDetector(), dtype=np.float32))
        cascades = os.path.join(os.path.dirname(cv2.__file__), "data")  # cv2.data.haarcascades, typed
        faces = cv2.CascadeClassifier(os.path.join(cascades, "haarcascade_frontalface_default.xml"))
        if faces.empty():
            raise PreprocessError("OpenCV's frontal-face cascade is missing from this installation")
        _detectors.hog, _detectors.faces = hog, faces
    hog, faces = _detectors.hog, _detectors.faces
    found: list[tuple[str, Box, float | None]] = []
    rects, weights = hog.detectMultiScale(frame, winStride=(8, 8), padding=(8, 8), scale=1.05)
    for rect, weight in zip(rects, np.ravel(weights), strict=True):
        if float(weight) >= 0.5:
            x, y, w, h = (int(v) for v in rect)
            found.append(("person", (x, y, w, h), round(float(weight), 3)))
    grey = cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)
    for rect in faces.detectMultiScale(grey, scaleFactor=1.1, minNeighbors=5, minSize=(24, 24)):
        x, y, w, h = (int(v) for v in rect)
        found.append(("face", (x, y, w, h), None))
    return sorted(found, key=lambda d: (d[0], d[1]))


# -- the pass over the video --------------------------------------------------------------------------------


def _frames(capture: cv2.VideoCapture) -> Iterator[Frame]:
    while True:
        ok, frame = capture.read()
        if not ok:
            return
        yield frame


def _measure(path: str) -> tuple[dict[str, Any], list[Segment]]:
    """Decode the whole video once and measure every segment."""
    if not os.path.isfile(path):
        raise PreprocessError("no video loaded: call load_video(video) first")
    capture = cv2.VideoCapture(path)
    if not capture.isOpened():
        raise PreprocessError(f"{os.path.basename(path)} is not a video OpenCV can decode")
    try:
        fps = capture.get(cv2.CAP_PROP_FPS) or 25.0
        per_segment = max(1, round(fps * SEGMENT_SECONDS))
        segments: list[Segment] = []
        previous_grey: Frame | None = None
        previous_layout: npt.NDArray[np.float32] | None = None
        frames = 0
        width = height = 0
        for index, frame in enumerate(_frames(capture)):
            frames = index + 1
            height, width = frame.shape[:2]
            number = index // per_segment
            if number == len(segments):
                if segments:
                    _finish(segments[-1])
                segments.append(Segment(number, number * per_segment / fps, number * per_segment / fps))
            segment = segments[-1]
            segment.end = (index + 1) / fps
            if index - number * per_segment <= per_segment // 2:
                segment.keyframe = frame  # ends as the middle frame, or the last of a short final segment
            if index % SAMPLE_EVERY:
                continue
            counts, brightness, small, grey = measure(frame)
            segment.histogram += counts
            segment.brightness_sum += brightness
            segment.samples += 1
            layout = _layout(small)
            if previous_layout is not None and previous_grey is not None:
                if float(np.abs(layout - previous_layout).sum()) > CUT:
                    segment.cuts += 1
                else:
                    segment.motion_sum += float(cv2.absdiff(grey, previous_grey).mean()) / 255
                    segment.motion_pairs += 1
            previous_grey, previous_layout = grey, layout
        if not segments:
            raise PreprocessError(f"{os.path.basename(path)} has no frames")
        _finish(segments[-1])
    finally:
        capture.release()
    shots = 1 + sum(s.cuts for s in segments)
    info = {"frames": frames, "fps": fps, "width": width, "height": height, "seconds": frames / fps}
    info.update(segments=len(segments), shots=shots)
    return info, segments


def _finish(segment: Segment) -> None:
    """Per-segment work on the middle frame, then drop the frame."""
    frame = segment.keyframe
    if frame is not None:
        segment.embedding = _embedding(frame)
        segment.detections = detect(frame)
    segment.keyframe = None


# -- words ----------------------------------------------------------------------------------------------


def clock(seconds: float) -> str:
    """0:04 style."""
    whole = round(seconds)
    return f"{whole // 60}:{whole % 60:02d}"


def colour_shares(histogram: npt.NDArray[np.float64] | list[float]) -> list[tuple[str, float]]:
    """Colour families with their share of the pixels, largest first (ties by name), shares to 2 decimals."""
    values = [float(v) for v in histogram]
    total = sum(values) or 1.0
    shares = [(name, round(v / total, 2)) for name, v in zip(COLOURS, values, strict=True)]
    return sorted((s for s in shares if s[1] > 0), key=lambda s: (-s[1], s[0]))


def describe_motion(motion: float) -> str:
    for limit, words in MOTION_WORDS:
        if motion < limit:
            return words
    return FAST


def light(brightness: float) -> str:
    """Brightness (0..1) in a word."""
    if brightness < 0.3:
        return "dark"
    if brightness < 0.45:
        return "dim"
    return "bright" if brightness > 0.65 else "evenly lit"


def scene(brightness: float) -> str:
    """'a dark scene', 'an evenly lit scene'."""
    lit = light(brightness)
    return f"{'an' if lit[0] in 'aeiou' else 'a'} {lit} scene"


def _people(people: int, faces: int) -> str:
    parts = []
    if people:
        parts.append("a person in view" if people == 1 else f"{people} people in view")
    if faces:
        parts.append("a face visible" if faces == 1 else f"{faces} faces visible")
    return "; ".join(parts) if parts else "no one detected"


def _describe(segment: Segment, colours: list[tuple[str, float]], revisits: int | None) -> str:
    main = [name for name, share in colours[:2] if share >= 0.15] or [colours[0][0]]
    hues = " and ".join(main)
    text = f"{clock(segment.start)}-{clock(segment.end)}: {scene(segment.brightness)}, mostly {hues}, "
    text += f"with {describe_motion(segment.motion)}; "
    if segment.cuts == 1:
        text += "a new shot begins; "
    elif segment.cuts > 1:
        text += f"{segment.cuts} cuts; "
    text += _people(segment.count("person"), segment.count("face"))
    if revisits is not None:
        text += f"; the same view as segment {revisits}"
    return text


def _revisits(segments: list[Segment]) -> list[int | None]:
    """For each segment, the earliest segment at least 3 before it that looks the same (thumbnail cosine
    similarity >= 0.97), if any: edited footage comes back to earlier shots."""
    out: list[int | None] = []
    for i, segment in enumerate(segments):
        found = None
        if segment.embedding is not None:
            for j in range(0, i - 2):
                other = segments[j].embedding
                if other is not None and float(np.dot(segment.embedding, other)) >= 0.97:
                    found = j
                    break
        out.append(found)
    return out


# -- object memory -------------------------------------------------------------------------------------------


def _same_object(a: Box, b: Box) -> bool:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    dx = (ax + aw / 2) - (bx + bw / 2)
    dy = (ay + ah / 2) - (by + bh / 2)
    return math.hypot(dx, dy) <= 0.6 * max(aw, ah, bw, bh)


def _tracks(segments: list[Segment]) -> list[tuple[str, list[tuple[int, Box]]]]:
    """Link detections of one label across segments (at most one segment apart, centres close relative to
    the box size) into objects: greedy, in segment order, so the result is deterministic."""
    tracks: list[tuple[str, list[tuple[int, Box]]]] = []
    for segment in segments:
        taken: set[int] = set()
        for label, box, _ in segment.detections:
            match = None
            for t, (tracked, seen) in enumerate(tracks):
                last_segment, last_box = seen[-1]
                near = 0 < segment.id - last_segment <= 2 and _same_object(last_box, box)
                if near and t not in taken and tracked == label:
                    match = t
                    break
            if match is None:
                tracks.append((label, [(segment.id, box)]))
                taken.add(len(tracks) - 1)
            else:
                tracks[match][1].append((segment.id, box))
                taken.add(match)
    return tracks


# -- the SQLite file ------------------------------------------------------------------------------------------


def _write(db: str, info: dict[str, Any], segments: list[Segment]) -> None:
    directory = os.path.dirname(os.path.abspath(db))
    partial = os.path.join(directory, f".{os.path.basename(db)}.partial")
    if os.path.exists(partial):
        os.unlink(partial)
    conn = sqlite3.connect(partial)
    try:
        conn.executescript(SCHEMA)
        conn.execute(
            "INSERT INTO video VALUES (?, ?, ?, ?, ?, ?, ?)",
            (info["frames"], info["fps"], info["width"], info["height"], info["seconds"], len(segments), info["shots"]),
        )
        for segment, revisits in zip(segments, _revisits(segments), strict=True):
            colours = colour_shares(segment.histogram)
            embedding = segment.embedding.tobytes() if segment.embedding is not None else b""
            conn.execute(
                "INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    segment.id,
                    round(segment.start, 3),
                    round(segment.end, 3),
                    round(segment.brightness, 4),
                    round(segment.motion, 5),
                    segment.cuts,
                    json.dumps(colours),
                    embedding,
                    segment.count("person"),
                    segment.count("face"),
                    _describe(segment, colours, revisits),
                ),
            )
            conn.executemany(
                "INSERT INTO detections VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(segment.id, label, *box, score) for label, box, score in segment.detections],
            )
        for number, (label, seen) in enumerate(_tracks(segments)):
            conn.execute(
                "INSERT INTO objects VALUES (?, ?, ?, ?, ?)", (number, label, seen[0][0], seen[-1][0], len(seen))
            )
            conn.executemany("INSERT INTO appearances VALUES (?, ?, ?, ?, ?, ?)", [(number, s, *b) for s, b in seen])
        conn.commit()
    finally:
        conn.close()
    os.replace(partial, db)


def preprocess(video: str, db: str) -> str:
    """Measure `video` and write its segments, detections and object memory to the SQLite file `db`;
    return a one-paragraph summary (the tool's output). Raises PreprocessError for a missing or bad video."""
    cv2.setNumThreads(1)  # the same results in every process, and no oversubscription of shared cores
    info, segments = _measure(video)
    _write(db, info, segments)
    people = sum(1 for s in segments if s.count("person"))
    faces = sum(1 for s in segments if s.count("face"))
    objects = _tracks(segments)
    kinds = sorted({label for label, _ in objects})
    memory = ", ".join(_count(sum(1 for label, _ in objects if label == k), f"{k} track") for k in kinds) or "empty"
    return (
        f"Preprocessed {os.path.basename(video)}: {info['seconds']:.1f} s, {info['width']}x{info['height']} at "
        f"{info['fps']:g} fps, {_count(len(segments), 'segment')} of {SEGMENT_SECONDS:g} s (ids 0 to "
        f"{len(segments) - 1}), {_count(info['shots'], 'shot')}. People detected in {_count(people, 'segment')}, "
        f"faces in {faces}. Object memory: {memory}."
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def main(argv: list[str]) -> int:
    """`python features.py VIDEO DB`: the `preprocess` tool as it runs inside a sandbox."""
    if len(argv) != 2:
        print("usage: features.py VIDEO DB", file=sys.stderr)
        return 2
    try:
        print(preprocess(argv[0], argv[1]))
    except PreprocessError as exc:
        print(f"Error: {exc}")
        return ANSWERED_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
