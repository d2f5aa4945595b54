"""The four read-only tools, computed from what `preprocess` left in a sandbox's folder.

Their names, arguments and the shape of their answers follow the tools the published system adapted from
VideoAgent (segment ids of 2-second segments, "There are N segments in total, ranging from 0 to N-1.",
at most 15 captions, visual question answering over the segment and its two neighbours), with the models
replaced by computation on the CPU:

- `segment_localization(query)`: the five segments that best match a text query. The query's words are
  mapped to what the features measure (people, faces, motion or stillness, cuts, brightness, colours,
  "similar to segment N" by thumbnail embedding), plus word overlap with each segment's description.
- `caption_retrieval(start, end)`: the descriptions of segments start..end (at most 15).
- `visual_question_answering(question, segment)`: decodes four frames of segments segment-1..segment+1 from
  the video, runs the people and face detectors and the colour, brightness and motion measures on them, and
  answers the question from those (a description and an answer, like a vision-language model would).
- `object_memory_querying(question)`: counts, lists and first/last appearances of the tracked objects.

Every answer is a pure function of the sandbox's files and the arguments; bad arguments and a sandbox
without a video or without preprocessing get an ordinary answer that says so. The files are only read:
the SQLite file as bytes into an in-memory database, the video by OpenCV's decoder.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
from cv2.typing import MatLike

from .features import COLOURS, clock, colour_shares, describe_motion, detect, light, measure, scene

__all__ = ["READ_ONLY", "Memory", "answer", "localize"]

READ_ONLY = ("segment_localization", "caption_retrieval", "visual_question_answering", "object_memory_querying")
VIDEO = "video.mp4"
FEATURES = "features.sqlite"
MAX_CAPTIONS = 15
TOP = 5

NOT_LOADED = "Error: no video loaded: call load_video(video) first"
NOT_PREPROCESSED = "Error: the video has not been preprocessed: call preprocess() first"

# Query words -> the feature they ask about.
CONCEPTS: dict[str, tuple[str, ...]] = {
    "person": ("person", "people", "persons", "man", "men", "woman", "women", "someone", "pedestrian", "human"),
    "face": ("face", "faces", "head", "talking"),
    "motion": ("motion", "moving", "moves", "move", "fast", "quick", "quickly", "action", "shaking", "busy"),
    "still": ("still", "static", "calm", "quiet", "slow", "stationary"),
    "cut": ("cut", "cuts", "shot", "shots", "transition", "change", "changes"),
    "dark": ("dark", "darkest", "night", "dim", "shadow", "shadows"),
    "bright": ("bright", "brightest", "sunny", "light", "daylight"),
}
# Query words -> the colour family they ask about (besides the families' own names).
SYNONYMS = {"grass": "green", "meadow": "green", "hill": "green", "field": "green", "sky": "blue", "grey": "gray"}


@dataclass(frozen=True)
class Row:
    id: int
    start: float
    end: float
    brightness: float
    motion: float
    cuts: int
    colours: list[tuple[str, float]]
    embedding: npt.NDArray[np.float32]
    people: int
    faces: int
    description: str


@dataclass(frozen=True)
class Memory:
    """A preprocessed video: its segments and tracked objects, read from the features file."""

    segments: list[Row]
    objects: list[tuple[int, str, list[int]]]  # (id, label, segments it appears in)
    video: Path

    @classmethod
    def open(cls, folder: Path) -> Memory | str:
        """The memory in a sandbox's `folder`, or the answer to give when there is none yet."""
        if not (folder / VIDEO).is_file():
            return NOT_LOADED
        if not (folder / FEATURES).is_file():
            return NOT_PREPROCESSED
        return cls.load(folder / FEATURES, folder / VIDEO)

    @classmethod
    def load(cls, path: Path, video: Path) -> Memory:
        """The memory in the features file `path` of `video`."""
        # Read as bytes and opened in memory: SQLite resolves symbolic links in paths itself, which fails on a
        # sandbox root seen through /proc/<pid>/fd/N (a mount held by a descriptor), where plain reads work.
        conn = sqlite3.connect(":memory:")
        conn.deserialize(path.read_bytes())
        try:
            rows = conn.execute(
                "SELECT id, start, end, brightness, motion, cuts, colours, embedding, people, faces, description "
                "FROM segments ORDER BY id"
            ).fetchall()
            seen = conn.execute(
                "SELECT o.id, o.label, a.segment FROM objects o JOIN appearances a ON a.object = o.id "
                "ORDER BY o.id, a.segment"
            ).fetchall()
        finally:
            conn.close()
        segments = [
            Row(
                id=r[0],
                start=r[1],
                end=r[2],
                brightness=r[3],
                motion=r[4],
                cuts=r[5],
                colours=_colours(r[6]),
                embedding=np.frombuffer(r[7], dtype=np.float32),
                people=r[8],
                faces=r[9],
                description=r[10],
            )
            for r in rows
        ]
        objects: dict[int, tuple[str, list[int]]] = {}
        for number, label, segment in seen:
            objects.setdefault(number, (label, []))[1].append(segment)
        return cls(segments, [(n, label, s) for n, (label, s) in objects.items()], video)

    def header(self) -> str:
        n = len(self.segments)
        return f"There are {n} segments in total, ranging from 0 to {n - 1}. "


def _colours(text: str) -> list[tuple[str, float]]:
    return [(str(name), float(share)) for name, share in json.loads(text)]


# -- segment_localization ------------------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+|\d+", text.lower())


def _concepts(words: list[str]) -> set[str]:
    """The features (CONCEPTS' keys) and colour families a text mentions."""
    found = {concept for concept, names in CONCEPTS.items() for w in words if w in names}
    return found | {SYNONYMS.get(w, w) for w in words if SYNONYMS.get(w, w) in COLOURS}


def _share(row: Row, colour: str) -> float:
    return next((share for name, share in row.colours if name == colour), 0.0)


def localize(memory: Memory, query: str) -> list[int]:
    """The ids of the TOP segments that best match `query`, best first (ties: lower id first)."""
    words = _words(query)
    concepts = _concepts(words)
    similar = re.search(r"(?:similar|like|same)\D{0,20}segment\s+(\d+)", query.lower())
    target = int(similar.group(1)) if similar and int(similar.group(1)) < len(memory.segments) else None
    top_motion = max((r.motion for r in memory.segments), default=0.0) or 1.0
    query_words = set(words)
    feature: dict[str, Callable[[Row], float]] = {
        "person": lambda r: min(1.0, r.people),
        "face": lambda r: min(1.0, r.faces),
        "motion": lambda r: r.motion / top_motion,
        "still": lambda r: 1 - r.motion / top_motion,
        "cut": lambda r: min(1.0, r.cuts),
        "dark": lambda r: 1 - r.brightness,
        "bright": lambda r: r.brightness,
    }
    scored = []
    for row in memory.segments:
        score = 0.0
        for concept in concepts:
            score += feature[concept](row) if concept in feature else 2 * _share(row, concept)
        described = set(_words(row.description))
        if query_words:
            score += 0.5 * len(query_words & described) / len(query_words)
        if target is not None and row.id != target:
            score += 2 * float(np.dot(row.embedding, memory.segments[target].embedding))
        scored.append((-round(score, 6), row.id))
    return [segment for _, segment in sorted(scored)[:TOP]]


def segment_localization(memory: Memory, query: str) -> str:
    found = {i: memory.segments[i].description for i in localize(memory, query)}
    return f"{memory.header()}The most relevant segments are: {found}."


# -- caption_retrieval ---------------------------------------------------------------------------------------


def caption_retrieval(memory: Memory, start: int, end: int) -> str:
    last = len(memory.segments) - 1
    start, end = max(start, 0), min(end, last, max(start, 0) + MAX_CAPTIONS - 1)
    if start > end:
        return memory.header() + "Invalid start and end segment IDs!"
    captions = {i: memory.segments[i].description for i in range(start, end + 1)}
    return f"{memory.header()}Caption of segments from {start} to {end} is {captions}"


# -- visual_question_answering -------------------------------------------------------------------------------


def _frames(video: Path, first: float, last: float, count: int = 4) -> list[MatLike]:
    """`count` frames evenly spread over [first, last) seconds of the video."""
    capture = cv2.VideoCapture(str(video))
    try:
        fps = capture.get(cv2.CAP_PROP_FPS) or 25.0
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        begin, end = int(first * fps), max(int(first * fps) + 1, min(total, int(last * fps)))
        frames = []
        for k in range(count):
            capture.set(cv2.CAP_PROP_POS_FRAMES, begin + (end - begin - 1) * k // max(1, count - 1))
            ok, frame = capture.read()
            if ok:
                frames.append(frame)
        return frames
    finally:
        capture.release()


def visual_question_answering(memory: Memory, question: str, segment: int) -> str:
    n = len(memory.segments)
    if not 0 <= segment < n:
        return f"Segment ID {segment} not in range 0-{n - 1}."
    first, last = memory.segments[max(0, segment - 1)], memory.segments[min(n - 1, segment + 1)]
    cv2.setNumThreads(1)
    frames = _frames(memory.video, first.start, last.end)
    if not frames:
        return f"Segment ID {segment}: no frames could be decoded."
    histogram = np.zeros(len(COLOURS))
    brightness, motion, people, faces, with_faces = 0.0, 0.0, 0, 0, 0
    previous = None
    for frame in frames:
        counts, level, _, grey = measure(frame)
        histogram += counts
        brightness += level / len(frames)
        if previous is not None:
            motion += float(cv2.absdiff(grey, previous).mean()) / 255
        previous = grey
        found = detect(frame)
        people = max(people, sum(1 for label, _, _ in found if label == "person"))
        seen = sum(1 for label, _, _ in found if label == "face")
        faces, with_faces = max(faces, seen), with_faces + (seen > 0)
    # Frames here are about 1.5 s apart, ten times the 2/25 s of the captions' measure: scale to compare.
    motion = motion / max(1, len(frames) - 1) / 10
    colours = colour_shares(histogram)
    main = " and ".join(name for name, share in colours[:2] if share >= 0.15) or colours[0][0]
    lit = light(brightness)
    span = f"{clock(first.start)}-{clock(last.end)}"
    description = (
        f"The clip ({span}) shows {scene(brightness)}, mostly {main}, with {describe_motion(motion)}; "
        f"{people or 'no'} {'person' if people == 1 else 'people'} detected"
        f"{f', a face in {with_faces} of {len(frames)} frames' if with_faces else ''}."
    )
    return f"{description} Answer: {_vqa_answer(question, people, faces, colours[0][0], lit, motion)}"


def _vqa_answer(question: str, people: int, faces: int, colour: str, light: str, motion: float) -> str:
    words = _words(question)
    concepts = _concepts(words)
    counting = "many" in words or "number" in words
    if "face" in concepts:
        return str(faces) if counting else ("yes" if faces else "no")
    if "person" in concepts:
        return str(people) if counting else ("yes" if people else "no")
    if "colour" in words or "color" in words or any(c in concepts for c in COLOURS):
        return colour
    if "motion" in concepts or "still" in concepts:
        return describe_motion(motion)
    if "bright" in concepts or "dark" in concepts:
        return light
    return "see the description"


# -- object_memory_querying ----------------------------------------------------------------------------------


def _ranges(segments: list[int]) -> str:
    parts, run = [], [segments[0]]
    for s in segments[1:]:
        if s == run[-1] + 1:
            run.append(s)
        else:
            parts.append(run)
            run = [s]
    parts.append(run)
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in parts)


def object_memory_querying(memory: Memory, question: str) -> str:
    words = _words(question)
    concepts = _concepts(words)
    labels = [label for label in ("person", "face") if label in concepts]
    if not labels:
        return "The object memory only tracks people and faces; it cannot answer that question."
    parts = []
    for label in labels:
        tracked = [(number, segments) for number, found, segments in memory.objects if found == label]
        plural = "people" if label == "person" else "faces"
        if not tracked:
            parts.append(f"No {plural} were detected in the video.")
            continue
        where = sorted({s for _, segments in tracked for s in segments})
        if "first" in words or "last" in words:
            which = where[0] if "first" in words else where[-1]
            time = clock(memory.segments[which].start)
            parts.append(f"The {'first' if 'first' in words else 'last'} {label} appears in segment {which} ({time}).")
        elif "many" in words or "number" in words or "count" in words:
            parts.append(f"The object memory holds {len(tracked)} {plural if len(tracked) != 1 else label}.")
        else:
            listed = "; ".join(f"{label} {number}: segments {_ranges(s)}" for number, s in tracked)
            parts.append(f"{plural.capitalize()} appear in segments {_ranges(where)} ({listed}).")
    return " ".join(parts)


# -- dispatch ------------------------------------------------------------------------------------------------

_ARGS: dict[str, tuple[tuple[str, type], ...]] = {
    "segment_localization": (("query", str),),
    "caption_retrieval": (("start", int), ("end", int)),
    "visual_question_answering": (("question", str), ("segment", int)),
    "object_memory_querying": (("question", str),),
}


def _checked(tool: str, args: Mapping[str, Any] | str) -> dict[str, Any] | str:
    wanted = _ARGS[tool]
    signature = f"{tool}({', '.join(f'{name}: {kind.__name__}' for name, kind in wanted)})"
    if not isinstance(args, Mapping) or set(args) != {name for name, _ in wanted}:
        return f"Error: the arguments must be {signature}"
    for name, kind in wanted:
        value = args[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"Error: the arguments must be {signature}; {name} was {value!r}"
    return dict(args)


def answer(folder: str | Path, tool: str, args: Mapping[str, Any] | str) -> str:
    """The answer of read-only `tool` to `args` on the sandbox folder `folder` (its /testbed)."""
    if tool not in _ARGS:
        raise ValueError(f"{tool!r} is not a read-only video tool")
    checked = _checked(tool, args)
    if isinstance(checked, str):
        return checked
    memory = Memory.open(Path(folder))
    if isinstance(memory, str):
        return memory
    if tool == "segment_localization":
        return segment_localization(memory, checked["query"])
    if tool == "caption_retrieval":
        return caption_retrieval(memory, checked["start"], checked["end"])
    if tool == "visual_question_answering":
        return visual_question_answering(memory, checked["question"], checked["segment"])
    return object_memory_querying(memory, checked["question"])
