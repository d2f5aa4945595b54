"""Tinker cookbook: the Harbor recipe's own environments (`HarborEnvGroupBuilder.make_envs`, the `bash` tool,
`HarborReward` grading with the task's `tests/test.sh`) on tvcache's `sandbox_factory`, stepped token by token as
the cookbook's rollout loop steps them.

The one stand-in is the policy (no model is sampled here): a scripted one whose turns are rendered to tokens with
SmolLM2's real tokenizer and parsed back by the cookbook's Qwen 3 renderer. The sandboxes are real workspace
sandboxes holding a small Harbor-style task. Oracle: the same environments on a factory whose sandboxes execute
every call directly in a fresh sandbox of their own (no cache).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker_cookbook", reason="needs the Tinker cookbook (pip install 'tvcache[tinker]')")

from tinker_cookbook import tokenizer_utils
from tinker_cookbook.recipes.harbor_rl.harbor_env import HarborEnvGroupBuilder, HarborTask

import tvcache
from tvcache.calls import ToolCall
from tvcache.integrations import process_cache
from tvcache.integrations.tinker import TvcacheSandbox, harbor_task, sandbox_factory

TOKENIZER = "tvcache-tests/smollm2-135m-instruct"
GREET = 'name="${1:-world}"\necho "Helo, $name!"\n'
TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(bash /testbed/greet.sh tvcache)" = "Hello, tvcache!" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
FIX = "sed -i 's/Helo/Hello/' /testbed/greet.sh"
PLANS: list[list[str]] = [
    ["cat /testbed/greet.sh", FIX],  # fixes it: reward 1
    ["cat /testbed/greet.sh"],  # looks, leaves it: 0
    ["cat /testbed/greet.sh", FIX],  # plan 0 again: hits, its grading too
    ["echo broken > /testbed/greet.sh"],  # breaks it: 0
    ["cd /tmp && ls /testbed", "pwd"],  # a cd inside a command does not carry over, as in a container exec
]


@pytest.fixture(scope="module", autouse=True)
def tokenizer() -> Any:
    from tvcache_bench.workloads.grpo.model import load_tokenizer

    loaded = load_tokenizer()
    tokenizer_utils.register_tokenizer(TOKENIZER, lambda: loaded)
    return loaded


@pytest.fixture
def task(tmp_path: Path) -> HarborTask:
    root = tmp_path / "fix-greeting"
    (root / "environment" / "files").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "environment" / "Dockerfile").write_text("FROM debian:12\nCOPY files /testbed\n")
    (root / "environment" / "files" / "greet.sh").write_text(GREET)
    (root / "tests" / "test.sh").write_text(TEST)
    return HarborTask("fix-greeting", "Fix the typo in /testbed/greet.sh.", root)


def workspace(env_dir: Path) -> tvcache.Sandboxes:
    return tvcache.WorkspaceSandboxes(env_dir / "files", network=False, timeout=30)


class Uncached(TvcacheSandbox):
    """The oracle: every call executed directly in this sandbox's own fresh workspace."""

    def __init__(self, box: Any) -> None:
        self._box, self.results, self._id = box, [], "uncached"

    async def call(self, tool: str, args: dict[str, Any]) -> tuple[Any, bool]:
        outcome = await self._box.execute(ToolCall(tool, args))
        return outcome.output, outcome.error

    async def cleanup(self) -> None:
        await self._box.close()


def uncached_factory(boxes: dict[Path, tvcache.Sandboxes]) -> Any:
    async def make(env_dir: Path, timeout: int) -> Uncached:
        factory = boxes.setdefault(env_dir, workspace(env_dir))
        return Uncached(await factory.create())

    return make


def action(tokenizer: Any, command: str | None) -> list[int]:
    if command is None:
        text = "I am done."
    else:
        text = f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]


async def run_group(task: HarborTask, factory: Any, tokenizer: Any) -> tuple[list[float], list[list[str]], Any]:
    """One group of the recipe's environments, each stepped through its plan; rewards and tool outputs."""
    builder = HarborEnvGroupBuilder(
        task=task,
        model_name=TOKENIZER,
        renderer_name="qwen3_instruct",
        max_turns=4,
        group_size=len(PLANS),
        command_timeout=30,
        grader_timeout=30,
        sandbox_factory=factory,
    )
    envs = await builder.make_envs()
    rewards, outputs = [], []
    try:
        for env, plan in zip(envs, PLANS, strict=True):
            await env.initial_observation()
            total, seen = 0.0, []
            for command in [*plan, None]:
                step = await env.step(action(tokenizer, command), extra={"stop_reason": "stop"})
                total += step.reward
                if step.episode_done:
                    break
            history = env.message_env.history
            seen = [str(m["content"]) for m in history if m["role"] == "tool"]
            rewards.append(total)
            outputs.append(seen)
        sandboxes = list(builder._sandboxes)
    finally:
        await builder.cleanup()
    return rewards, outputs, sandboxes


def test_harbor_envs_on_tvcache_match_uncached_and_later_groups_hit(task: HarborTask, tokenizer: Any) -> None:
    async def go() -> tuple[Any, Any, Any, dict[str, float]]:
        boxes: dict[Path, tvcache.Sandboxes] = {}
        plain = await run_group(task, uncached_factory(boxes), tokenizer)
        for factory in boxes.values():
            await factory.close()
        cached_boxes: dict[Path, tvcache.Sandboxes] = {}

        def shared(env_dir: Path) -> tvcache.Sandboxes:
            return cached_boxes.setdefault(env_dir, workspace(env_dir))

        make = sandbox_factory(shared)
        first = await run_group(task, make, tokenizer)
        again = await run_group(task, make, tokenizer)  # the next epoch
        stats = process_cache().stats()
        for factory in cached_boxes.values():
            await factory.close()
        return plain, first, again, stats

    plain, first, again, stats = asyncio.run(go())
    assert plain[0] == [1.0, 0.0, 1.0, 0.0, 0.0], plain
    assert first[0] == plain[0] and again[0] == plain[0]
    assert first[1] == plain[1] and again[1] == plain[1]
    assert json.loads(plain[1][4][1])["stdout"].strip() == "/"  # the cd stayed in its command
    # Plan 2 repeats plan 0: its two commands, the test upload, test.sh and the reward read all hit.
    assert all(r.hit for r in first[2][2].results)
    assert not any(r.hit for r in first[2][0].results[:1])
    # The next epoch hits every call of every environment, grading included.
    assert all(r.hit for box in again[2] for r in box.results)
    assert stats["mismatches"] == 0 and stats["detached"] == 0


def test_task_id_is_the_harbor_task_name(tmp_path: Path) -> None:
    assert harbor_task(tmp_path / "fix-greeting" / "environment") == "fix-greeting"


def test_the_example_runs_a_group(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import tinker_harbor

    task = tinker_harbor.load_task(tinker_harbor.write_task(tmp_path / "fix-greeting"))
    outcomes = asyncio.run(tinker_harbor.main(task, tinker_harbor.COMMANDS, rollouts=3))
    assert [reward for reward, _, _ in outcomes] == [1.0, 1.0, 1.0]
    calls = outcomes[0][1]
    assert calls > len(tinker_harbor.COMMANDS)  # the commands, then the grading's upload, test run and reads
    assert outcomes[0][2] == 0 and outcomes[1][2] == outcomes[2][2] == calls  # the others repeat the first
