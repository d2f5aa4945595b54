"""ART: the example's rollout function, run by ART's own machinery (`art.Model`'s client, `art.TrajectoryGroup`,
`art.gather_trajectory_groups`) on real workspace sandboxes, against the same rollouts executed without tvcache.

The model is the one stand-in: a scripted policy behind an OpenAI-compatible endpoint on loopback (tests/frameworks.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest

import tvcache

art = pytest.importorskip("art", reason="the ART integration test needs openpipe-art (pip install 'tvcache[art]')")

# Importing ART swaps a transformers function, process-wide, for one written against an older transformers signature
# (art/transformers/patches.py); every model forward pass in this process then fails, the TRL and GRPO tests' among
# them. ART's training backend runs in its own process, so nothing here needs the patch: put the original back.
try:
    from art.transformers import patches as _art_patches
    from transformers import masking_utils as _masking_utils

    _masking_utils._preprocess_mask_arguments = _art_patches._preprocess_mask_arguments
except ImportError:  # no transformers, nothing patched
    pass

from frameworks import ScriptedLLM, load_example, plan_of, rewards_of, run_example  # noqa: E402

example = load_example("art_rollouts")

TMP = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None

FIXED = "def total(items):\n    return sum(item['price'] * item['quantity'] for item in items)\n"
WRONG = "def total(items):\n    return sum(item['price'] * 2 for item in items)\n"


def bash(command: str) -> tuple[str, str]:
    return ("bash", json.dumps({"command": command}))


FIX = bash(f"cd /testbed && cat > inventory.py <<'EOF'\n{FIXED}EOF")
PLANS = [
    [[bash("ls")], [bash("cat inventory.py")], [FIX]],  # fixes it
    [[bash("ls")], [bash("cat inventory.py")]],  # gives up: 2 of 3 tests pass
    [[("bash", '{ "command" :\n "ls" }')], [FIX]],  # the same `ls` in another JSON layout; ends as plan 0
    [[("bash", '{"command": "ls"')]],  # malformed JSON: the tool's error, then gives up; ends as plan 1
    [[bash("printf '%s' " + "x" * 100_000 + " | wc -c")], [FIX]],  # a huge argument; ends as plan 0
    [[bash(f"cd /testbed && cat > inventory.py <<'EOF'\n{WRONG}EOF")]],  # a wrong fix: 1 of 3
    [[bash("cat README.md"), FIX]],  # two calls in one turn; ends as plan 0
    [[bash("rm /testbed/inventory.py")]],  # breaks the project: 0 of 3
]
FINAL_STATES = 4  # fixed, untouched, wrongly fixed, removed


async def uncached(boxes: tvcache.Sandboxes, plan: list[list[tuple[str, str]]]) -> tuple[list[str], float]:
    """The oracle: one plan's calls and grading executed in order in one fresh sandbox, no cache."""
    box = await boxes.create()
    try:
        contents = []
        for turn in plan:
            for name, arguments in turn:
                try:
                    call = tvcache.ToolCall(name, arguments)
                    outcome = await box.execute(call)
                    result = tvcache.Result(outcome.output, False, 0.0, "executed", outcome.error)
                    contents.append(example.render(result))
                except (ValueError, TypeError) as exc:
                    contents.append(f"error: {exc}")
        for path, content in example.HIDDEN_TESTS.items():
            await box.execute(tvcache.ToolCall("write_file", {"path": path, "content": content}))
        graded = await box.execute(tvcache.ToolCall("bash", example.GRADER))
        return contents, example.score(tvcache.Result(graded.output, False, 0.0, "executed", graded.error))
    finally:
        await box.close()


def tool_contents(trajectory: Any) -> list[str]:
    return [m["content"] for m in trajectory.messages_and_choices if isinstance(m, dict) and m.get("role") == "tool"]


def first_answer(trajectory: Any) -> str:
    choices = [m for m in trajectory.messages_and_choices if not isinstance(m, dict)]
    return str(choices[0].message.content)


def test_art_rollouts_through_tvcache_match_uncached_rollouts_and_hit_later() -> None:
    async def main() -> None:
        async with ScriptedLLM(PLANS) as llm:
            steps = await example.main(llm.url, "scripted-policy", rollouts=len(PLANS), epochs=2)
        with tempfile.TemporaryDirectory() as project:
            for name, text in example.PROJECT.items():
                (Path(project) / name).write_text(text)
            async with tvcache.WorkspaceSandboxes(project, tmp=TMP, timeout=60) as boxes:
                oracle = [await uncached(boxes, plan) for plan in PLANS]

        assert [r for _, r in oracle] == [1.0, 2 / 3, 1.0, 2 / 3, 1.0, 1 / 3, 1.0, 0.0]
        for epoch, trajectories in enumerate(steps):
            by_plan = {plan_of(first_answer(t)): t for t in trajectories}
            assert sorted(by_plan) == list(range(len(PLANS)))  # every plan ran once per epoch
            for k, trajectory in by_plan.items():
                contents, reward = oracle[k]
                assert tool_contents(trajectory) == contents, (epoch, k)
                assert trajectory.reward == reward, (epoch, k)
            graded_here = [t for t in trajectories if not t.metrics["graded_from_cache"]]
            calls = sum(t.metrics["tool_calls"] for t in trajectories)
            hits = sum(t.metrics["tool_hits"] for t in trajectories)
            if epoch == 0:
                # Rollouts that end in the same state run the grader once; the `ls` of three rollouts runs once.
                assert len(graded_here) == FINAL_STATES
                assert 0 < hits < calls
            else:
                assert not graded_here
                assert hits == calls - 1  # all but the malformed call, which the sandbox refuses every time

    asyncio.run(main())


def test_task_ids_come_from_the_scenario_content() -> None:
    import numpy as np
    import pydantic

    from tvcache.integrations import task_key
    from tvcache.integrations.art import cached_rollout

    class Email(pydantic.BaseModel):  # ART•E-style scenarios are pydantic models
        id: int
        question: str
        inbox: list[str]

    a, b = Email(id=1, question="When is the offsite?", inbox=["x"]), Email(id=2, question="Who signs?", inbox=["x"])
    assert task_key(a) == task_key(Email(id=1, question="When is the offsite?", inbox=["x"]))  # every epoch
    assert task_key(a) != task_key(b)
    assert task_key(example.Scenario("fix it")) == task_key(example.Scenario("fix it"))  # dataclasses
    assert task_key(example.Scenario("fix it")) != task_key(example.Scenario("fix it", max_turns=3))
    row = {"question": "q", "embedding": np.array([0.5, 1.5]), "step_uid": "a1"}
    assert task_key(row, ignore={"step_uid"}) == task_key({**row, "step_uid": "b2"}, ignore={"step_uid"})
    assert task_key("task-17") == "task-17" and task_key(17) == "17"
    with pytest.raises(TypeError, match="JSON values"):
        task_key({"handle": object()})

    with pytest.raises(TypeError, match="async"):
        cached_rollout(sandboxes=lambda s: None)(lambda model, scenario: None)  # type: ignore[arg-type]

    async def no_scenario(model: object, task: object) -> None: ...

    with pytest.raises(TypeError, match="no parameter 'scenario'"):
        cached_rollout(sandboxes=lambda s: None)(no_scenario)  # type: ignore[arg-type]


def test_the_example_runs_without_arguments_on_its_scripted_policy(tmp_path: Path) -> None:
    """As a newcomer runs it: no model server (its built-in scripted policy on loopback stands in), from an empty
    directory. 8 rollouts take the 3 plans in turn (fix: 1.0, look and give up: 2 of 3 tests, fix after an `ls`
    laid out otherwise: 1.0); two final states, so two gradings execute; the second epoch's calls and gradings all
    hit."""
    lines = run_example("art_rollouts", tmp_path)
    assert rewards_of(lines[0]) == [0.67] * 3 + [1.0] * 5  # plans 0, 1, 2, 0, 1, 2, 0, 1
    assert lines[0].endswith("; 2 of 8 gradings executed")
    assert rewards_of(lines[1]) == [0.67] * 2 + [1.0] * 6  # plans 2, 0, 1, 2, 0, 1, 2, 0
    assert re.search(r"; (\d+) of \1 tool calls hit; 0 of 8 gradings executed$", lines[1]), lines[1]
    assert re.fullmatch(r"cache: \d+ calls, \d+ hits, \d+ executions, [\d.]+ s of tool time saved", lines[2])
