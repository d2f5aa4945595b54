"""Multiple-choice questions about the videos, answered by the uncached pipeline.

Each task is one question with five choices (0 to 4, as in EgoSchema and the published agent's prompt). The
correct choice is computed from the features `preprocess` extracts, by running the very same code once per
video, uncached, outside any sandbox (`reference`): the answer is what a rollout that called the tools right
could have found. Kinds:

- `motion`: which fifth of the video has the most motion; `light`: which fifth is the brightest;
- `colour`: which colour family dominates the whole video;
- `people`: in how many segments a person or a face is detected; `shots`: how many shots the video has;
- `face`: when a face is first visible (or never);
- `compare-motion`, `compare-people`: which of two videos has more motion, or more segments with people.

The comparison tasks load two videos in one rollout, which is what makes a cache keyed on (tool, args) give
the first video's answers about the second.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import analysis, features
from .clips import Catalogue
from .features import COLOURS, clock

__all__ = ["COMPARISONS", "KINDS", "Task", "features_dir", "make_task", "reference"]

KINDS = ("motion", "light", "colour", "people", "shots", "face")
COMPARISONS = ("compare-motion", "compare-people")
CHOICES = 5


@dataclass(frozen=True, slots=True)
class Task:
    id: str  # "motion/street-02": what the cache scopes by
    kind: str
    videos: tuple[str, ...]  # names in the catalogue, in the order the question names them
    question: str
    choices: tuple[str, ...]
    answer: int  # index into choices

    def prompt(self) -> str:
        options = " ".join(f"({i}) {c}" for i, c in enumerate(self.choices))
        return f"{self.question} {options}"


def reference(catalogue: Catalogue, name: str) -> analysis.Memory:
    """The features of video `name`, computed once by the uncached pipeline and kept next to the catalogue."""
    directory = features_dir(catalogue)
    directory.mkdir(exist_ok=True)
    path = directory / f"{name}.sqlite"
    if not path.is_file():
        features.preprocess(str(catalogue.path(name)), str(path))
    return analysis.Memory.load(path, catalogue.path(name))


def make_task(kind: str, videos: Sequence[str], memories: Sequence[analysis.Memory], seed: int = 0) -> Task:
    """The question of `kind` about `videos` (one, or two for a comparison), with shuffled choices."""
    rng = random.Random(f"{seed}/{kind}/{'+'.join(videos)}")
    files = [f"{v}.mp4" for v in videos]
    if kind in COMPARISONS:
        if len(videos) != 2:
            raise ValueError(f"a {kind} task compares two videos, got {list(videos)}")
        first, second = (_motion(m) if kind == "compare-motion" else _people(m) for m in memories)
        about = "more motion overall" if kind == "compare-motion" else "people or faces in more of its segments"
        choices = (*files, "both about the same", "neither of them", "they cannot be compared")
        answer = 0 if first > second * 1.05 else 1 if second > first * 1.05 else 2
        question = f"Which of the two videos, {files[0]} or {files[1]}, has {about}?"
        return Task(f"{kind}/{'+'.join(videos)}", kind, tuple(videos), question, choices, answer)
    if len(videos) != 1:
        raise ValueError(f"a {kind} task is about one video, got {list(videos)}")
    memory = memories[0]
    if kind in ("motion", "light"):
        parts = [list(p) for p in np.array_split(np.arange(len(memory.segments)), CHOICES) if len(p)]
        rows = memory.segments
        measure = [np.mean([rows[i].motion if kind == "motion" else rows[i].brightness for i in p]) for p in parts]
        labels = [f"from {clock(rows[p[0]].start)} to {clock(rows[p[-1]].end)}" for p in parts]
        what = "is there the most motion" if kind == "motion" else "is the picture the brightest"
        correct = labels[int(np.argmax(measure))]
        return _task(kind, files, f"In which part of {files[0]} {what}?", correct, labels, rng)
    if kind == "colour":
        totals = dict.fromkeys(COLOURS, 0.0)
        for row in memory.segments:
            for name, share in row.colours:
                totals[name] += share * (row.end - row.start)
        correct = max(COLOURS, key=lambda c: (totals[c], c))
        return _task(kind, files, f"Which colour dominates {files[0]}?", correct, list(COLOURS), rng)
    if kind in ("people", "shots"):
        value = _people(memory) if kind == "people" else 1 + sum(r.cuts for r in memory.segments)
        spread = sorted({max(0 if kind == "people" else 1, value + d) for d in range(-6, 7)} - {value})
        numbers = [value, *rng.sample(spread, CHOICES - 1)]
        question = (
            f"In how many of the 2-second segments of {files[0]} is a person or a face detected?"
            if kind == "people"
            else f"How many shots (continuous takes between cuts) does {files[0]} have?"
        )
        return _task(kind, files, question, str(value), [str(n) for n in numbers], rng, numeric=True)
    if kind == "face":
        seen = [r for r in memory.segments if r.faces]
        times = [clock(r.start) for r in memory.segments]
        correct = f"at {clock(seen[0].start)}" if seen else "never"
        others = [f"at {t}" for t in dict.fromkeys(times) if f"at {t}" != correct]
        return _task(kind, files, f"When is a face first visible in {files[0]}?", correct, [*others, "never"], rng)
    raise ValueError(f"unknown task kind {kind!r}; the kinds are {', '.join(KINDS + COMPARISONS)}")


def _task(
    kind: str, files: list[str], question: str, correct: str, pool: list[str], rng: random.Random, numeric: bool = False
) -> Task:
    """The correct choice and up to four others from `pool`, shuffled (numbers: in increasing order)."""
    others = [c for c in pool if c != correct]
    choices = [correct, *rng.sample(others, min(CHOICES - 1, len(others)))]
    if numeric:
        choices.sort(key=int)
    else:
        rng.shuffle(choices)
    name = files[0].removesuffix(".mp4")
    return Task(f"{kind}/{name}", kind, (name,), question, tuple(choices), choices.index(correct))


def _motion(memory: analysis.Memory) -> float:
    return float(np.mean([r.motion for r in memory.segments]))


def _people(memory: analysis.Memory) -> int:
    return sum(1 for r in memory.segments if r.people or r.faces)


def features_dir(catalogue: Catalogue) -> Path:
    """Where `reference` keeps the features: beside the catalogue, not in it, so no sandbox sees them, and
    named for the preprocessing code, so a change to it computes them afresh."""
    code = hashlib.blake2b(Path(features.__file__).read_bytes(), digest_size=6).hexdigest()
    return catalogue.directory.with_name(f"{catalogue.directory.name}-features-{code}")
