"""A seeded stochastic policy that writes the rollouts: the published agent loop's shape, without the model.

The published video agent (VideoAgent's tools, trained with GRPO, 8 rollouts per question, at most 5 turns)
always loads the video, preprocesses it, then calls analysis tools in batches and answers. Its rollouts of
one question agree early and drift apart later, repeat each other's calls in other orders, and sometimes
repeat their own. This policy draws rollouts of that shape:

- `load_video(video)`, then `preprocess()`; now and then (`PREMATURE`) an analysis call squeezed in between,
  as an agent that skipped a step does (it gets an answer saying so);
- one to five analysis calls from the task's pool: calls that help with the question (queries worded as an
  agent would, segment ids taken from what `segment_localization` returns for them, caption ranges) and
  generic ones (`caption_retrieval(0, 10)` most of all). A task draws a canonical sequence once; a rollout
  follows it step by step with probability `FOLLOW[i]` and then draws its own calls, sometimes one it made
  already (`REPEAT`), and shuffles its calls with probability `REORDER`: the same read-only calls in another
  order, which is where a cache that matches only exact prefixes loses its hits;
- for a comparison, the same for each video in turn, the second block often repeating the first one's calls
  (`SAME_CALLS`), and the order of the videos swapped in some rollouts (`SWAP`);
- an answer: the correct choice with a probability that grows with the helpful calls made, else another.

Everything comes from `random.Random` seeded by (seed, task, rollout), so a seed gives the same rollouts in
every process. The answer is not a tool call; it is kept in the trace's `source`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...traces import Trace, TraceCall
from . import analysis
from .tasks import Task

__all__ = ["FOLLOW", "Call", "pool", "rollouts"]

FOLLOW = (0.9, 0.8, 0.7, 0.6, 0.5)  # P(keep following the task's canonical calls at analysis step i)
LENGTHS = (0.15, 0.3, 0.25, 0.2, 0.1)  # P(1..5 analysis calls)
PREMATURE = 0.06
REPEAT = 0.15
REORDER = 0.3
SAME_CALLS = 0.6
SWAP = 0.2


@dataclass(frozen=True, slots=True)
class Call:
    tool: str
    args: dict[str, Any]
    weight: float
    helpful: bool  # does it help with this question (for the answer's odds)

    def trace(self) -> TraceCall:
        return TraceCall(self.tool, dict(self.args))


def _caption(start: int, end: int, weight: float, helpful: bool) -> Call:
    return Call("caption_retrieval", {"start": start, "end": end}, weight, helpful)


def _localize(query: str, weight: float, helpful: bool = True) -> Call:
    return Call("segment_localization", {"query": query}, weight, helpful)


def _ask(question: str, segments: Sequence[int], weight: float, helpful: bool = True) -> list[Call]:
    return [Call("visual_question_answering", {"question": question, "segment": s}, weight, helpful) for s in segments]


def _memory(question: str, weight: float, helpful: bool = True) -> Call:
    return Call("object_memory_querying", {"question": question}, weight, helpful)


def pool(kind: str, memory: analysis.Memory) -> list[Call]:
    """The calls an agent might make about one video for a question of `kind`."""
    n = len(memory.segments)
    pages = [_caption(k, k + 14, 1.0, kind in ("shots", "motion", "light")) for k in range(0, n, 15)]
    calls = [_caption(0, 10, 3.0, True), *pages, _localize("a new shot begins", 0.5, kind == "shots")]

    def top(query: str, k: int) -> list[int]:
        return analysis.localize(memory, query)[:k]

    if kind in ("motion", "compare-motion"):
        calls += [_localize("fast motion", 3.0), _localize("the camera moves quickly", 1.0)]
        calls += _ask("is there a lot of motion here", top("fast motion", 3), 2.0)
    elif kind == "light":
        calls += [_localize("a bright scene", 3.0), _localize("a dark scene", 1.0)]
        calls += _ask("is this scene bright or dark", top("a bright scene", 3), 2.0)
    elif kind == "colour":
        calls += _ask("what colour dominates this scene", sorted({0, n // 2, n - 1}), 2.0)
        calls += [_localize("mostly green", 1.0), _localize("mostly blue", 1.0)]
    elif kind in ("people", "compare-people"):
        calls += [
            _memory("in which segments do people appear?", 3.0),
            _memory("how many people are there in the video?", 2.0),
            _memory("in which segments do faces appear?", 2.0),
            _localize("a person", 1.0),
        ]
        calls += _ask("how many people are in this segment", top("a person", 2), 1.0)
    elif kind == "shots":
        calls += [_localize("a new shot begins", 3.0)]
        calls += _ask("is there a cut in this part", top("a new shot begins", 2), 1.0)
    elif kind == "face":
        calls += [_memory("when does a face first appear?", 3.0), _localize("a face", 2.0)]
        calls += _ask("is there a face in this segment", top("a face", 2), 1.0)
    else:
        raise ValueError(f"no call pool for task kind {kind!r}")
    return calls


def _draw(rng: random.Random, calls: Sequence[Call], avoid: Call | None = None) -> Call:
    options = [c for c in calls if c != avoid] or list(calls)
    return rng.choices(options, weights=[c.weight for c in options])[0]


def _sequence(rng: random.Random, calls: Sequence[Call]) -> list[Call]:
    """A canonical sequence: 1 to 5 distinct calls, weighted."""
    length = rng.choices(range(1, 6), weights=LENGTHS)[0]
    out: list[Call] = []
    while len(out) < min(length, len(calls)):
        call = _draw(rng, [c for c in calls if c not in out])
        out.append(call)
    return out


def _analyses(rng: random.Random, canonical: list[Call], calls: Sequence[Call]) -> list[Call]:
    """One rollout's analysis calls: the canonical ones while it follows them, then its own."""
    length = len(canonical) if rng.random() < 0.6 else rng.choices(range(1, 6), weights=LENGTHS)[0]
    out: list[Call] = []
    following = True
    for i in range(length):
        if following and i < len(canonical) and rng.random() < FOLLOW[min(i, len(FOLLOW) - 1)]:
            out.append(canonical[i])
            continue
        following = False
        out.append(rng.choice(out) if out and rng.random() < REPEAT else _draw(rng, calls, out[-1] if out else None))
    if len(out) > 1 and rng.random() < REORDER:
        rng.shuffle(out)
    return out


def rollouts(task: Task, memories: Sequence[analysis.Memory], count: int = 8, seed: int = 0) -> list[Trace]:
    """`count` rollouts of `task`; `memories` are the reference features of its videos (for the pools)."""
    if count < 1:
        raise ValueError(f"rollouts per task must be at least 1, got {count}")
    pools = [pool(task.kind, m) for m in memories]
    plan = random.Random(f"{seed}/{task.id}")
    canonical = [_sequence(plan, p) for p in pools]
    if len(pools) == 2:  # the second video's block mostly asks what the first one's did
        canonical[1] = [c if plan.random() < SAME_CALLS else _draw(plan, pools[1], c) for c in canonical[0]]
    order = [1, 0] if len(pools) == 2 and plan.random() < 0.5 else list(range(len(pools)))
    out = []
    for r in range(count):
        rng = random.Random(f"{seed}/{task.id}/{r}")
        videos = order[::-1] if len(order) == 2 and rng.random() < SWAP else order
        calls: list[Call] = []
        helpful = 0
        for v in videos:
            calls.append(Call("load_video", {"video": f"{task.videos[v]}.mp4"}, 0, False))
            if rng.random() < PREMATURE:
                calls.append(_draw(rng, pools[v]))
            calls.append(Call("preprocess", {}, 0, False))
            done = _analyses(rng, canonical[v], pools[v])
            helpful += len({(c.tool, str(c.args)) for c in done if c.helpful})
            calls.extend(done)
        odds = min(0.9, 0.25 + 0.15 * helpful)
        wrong = [i for i in range(len(task.choices)) if i != task.answer]
        answer = task.answer if rng.random() < odds else rng.choice(wrong)
        source = f"video policy, seed {seed}: answers {answer} ({'correct' if answer == task.answer else 'wrong'})"
        out.append(Trace(task.id, f"{task.id}#{r}", source, [c.trace() for c in calls]))
    return out
