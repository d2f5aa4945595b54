"""ART rollouts of a coding agent whose tools live in a tvcache sandbox: its bash calls, and the tests that grade
it, go through tvcache (tools over Python state need less: examples/art_rollouts.py).

    pip install 'tvcache[art]'
    python examples/art_sandbox_rollouts.py              # a built-in scripted policy stands in for the model
    python examples/art_sandbox_rollouts.py --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --rollouts 8

Any OpenAI-compatible endpoint serves the model (vLLM, an ART backend's, a hosted API; the key from
`OPENAI_API_KEY`), or without `--base-url` the one stand-in, `ScriptedPolicy` (scripted_model.py): a chat-completions
server on loopback answering from `PLANS`, so everything else (ART's client and gathering, tvcache) runs as it would
with a model. The task: a small project in a workspace sandbox whose `total()` ignores quantities; the agent
explores and edits it with a `bash` tool, and its reward is the share of hidden tests passing on its final state.
The rollouts of a group run concurrently, as `art.gather_trajectory_groups` runs them; their identical calls (the
`ls` and `cat` every rollout starts with, the test run of every rollout that ends in the same state) execute once.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ART imports LiteLLM, which would fetch a model price list from the internet at import; its bundled copy serves.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art

# examples/scripted_model.py: the stand-in for a model server, and the examples' command line
from scripted_model import ScriptedPolicy, cache_line, policy_arguments

import tvcache
from tvcache.integrations.art import cached_rollout
from tvcache.sandboxes.reclaim import scratch

PROJECT = {
    "inventory.py": (
        "def total(items):\n"
        '    """The value of an order: the sum of price times quantity over its items."""\n'
        "    return sum(item['price'] for item in items)\n"
    ),
    "README.md": "inventory: order totals. Tests live in tests/ (run `python3 -m pytest -q tests`).\n",
}
HIDDEN_TESTS = {
    "/testbed/tests/test_inventory.py": (
        "from inventory import total\n\n"
        "def test_empty():\n    assert total([]) == 0\n\n"
        "def test_quantities():\n"
        "    assert total([{'price': 2.5, 'quantity': 4}, {'price': 1, 'quantity': 3}]) == 13\n\n"
        "def test_single():\n    assert total([{'price': 7, 'quantity': 1}]) == 7\n"
    ),
    # Prints "passed total"; needs no pytest, and a project that does not even import scores 0.
    "/testbed/tests/grade.py": (
        "import sys\n"
        "sys.path.insert(0, '.')\n"
        "names = ['test_empty', 'test_quantities', 'test_single']\n"
        "space = {}\n"
        "try:\n"
        "    exec(open('tests/test_inventory.py').read(), space)\n"
        "except Exception:\n"
        "    names = []\n"
        "passed = 0\n"
        "for name in names:\n"
        "    try:\n"
        "        space[name]()\n"
        "        passed += 1\n"
        "    except Exception:\n"
        "        pass\n"
        "print(passed, 3)\n"
    ),
}
GRADER = {"command": "cd /testbed && python3 tests/grade.py"}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command in the project (at /testbed) and return its output and exit code.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "The command."}},
                "required": ["command"],
            },
        },
    }
]


def bash(command: str) -> tuple[str, str]:
    return ("bash", json.dumps({"command": command}))


FIXED = "def total(items):\n    return sum(item['price'] * item['quantity'] for item in items)\n"
FIX = bash(f"cat > /testbed/inventory.py <<'EOF'\n{FIXED}EOF")
# The plans of the built-in scripted policy, a rollout each in turn: fix it (3 of 3 hidden tests pass), look and give
# up (2 of 3), fix it after an `ls` laid out otherwise (the same call to tvcache, so it hits).
PLANS = [
    [[bash("ls /testbed")], [bash("cat /testbed/inventory.py")], [FIX]],
    [[bash("ls /testbed")], [bash("cat /testbed/inventory.py")]],
    [[("bash", '{ "command" :\n "ls /testbed" }')], [FIX]],
]


@dataclass(frozen=True)
class Scenario:
    """One task. Its content is its identity: the tvcache task id is a hash of these fields."""

    instruction: str
    max_turns: int = 8


def render(result: tvcache.Result) -> str:
    """A tool result as the model reads it."""
    out = result.output
    if isinstance(out, dict) and "output" in out:
        return f"{out['output']}[exit code {out.get('exit_code')}]"
    return json.dumps(out)


def score(graded: tvcache.Result) -> float:
    if graded.error or not isinstance(graded.output, dict):
        return 0.0
    passed, total = (int(n) for n in graded.output["output"].split())
    return passed / total


def make_rollout(boxes: tvcache.Sandboxes, cache: tvcache.ToolCache) -> Any:
    """The ART rollout function, decorated: every call runs in a tvcache rollout of its scenario's task."""

    @cached_rollout(sandboxes=boxes, cache=cache)
    async def rollout(model: art.Model, scenario: Scenario) -> art.Trajectory:
        r = tvcache.current_rollout()
        assert r is not None
        client = model.openai_client()
        trajectory = art.Trajectory(
            messages_and_choices=[
                {"role": "system", "content": "You are a careful software engineer with a bash tool."},
                {"role": "user", "content": scenario.instruction},
            ],
            tools=TOOLS,  # type: ignore[arg-type]
        )
        hits = calls = 0
        for _ in range(scenario.max_turns):
            response = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=trajectory.messages(),
                tools=TOOLS,  # type: ignore[arg-type]
            )
            choice = response.choices[0]
            trajectory.messages_and_choices.append(choice)
            if not choice.message.tool_calls:
                break
            for tool_call in choice.message.tool_calls:
                calls += 1
                try:
                    result = await r.call(*tvcache.parse_tool_call(tool_call))
                except (ValueError, TypeError) as exc:  # arguments the tool refuses (e.g. not a JSON object)
                    content = f"error: {exc}"
                else:
                    hits += result.hit
                    content = render(result)
                trajectory.messages_and_choices.append(
                    {"role": "tool", "tool_call_id": tool_call.id, "content": content}
                )
        # The reward on the final state: the hidden tests are uploaded and run there, a step cached like any call.
        graded = await r.grade("bash", GRADER, files=HIDDEN_TESTS)
        trajectory.reward = score(graded)
        trajectory.metrics.update(tool_calls=calls, tool_hits=hits, graded_from_cache=graded.hit)
        return trajectory.finish()

    return rollout


async def main(
    base_url: str | None = None, model_name: str = "scripted-policy", rollouts: int = 8, epochs: int = 2
) -> list[list[art.Trajectory]]:
    """Run `epochs` steps of one group of `rollouts` on the task, against the model server at `base_url` (without
    one, the built-in scripted policy); return the trajectories of each step."""
    if base_url is None:
        async with ScriptedPolicy(PLANS) as url:
            return await main(url, model_name, rollouts, epochs)
    model = art.Model(
        name="tvcache-example",
        project="tvcache",
        inference_model_name=model_name,
        inference_base_url=base_url,
        inference_api_key=os.environ.get("OPENAI_API_KEY", "none"),
    )
    scenario = Scenario("The order total in inventory.py is wrong for quantities above one. Fix it.")
    with scratch("art-example") as project:
        for name, text in PROJECT.items():
            (Path(project) / name).write_text(text)
        async with tvcache.WorkspaceSandboxes(project, timeout=60) as boxes, tvcache.ToolCache() as cache:
            rollout = make_rollout(boxes, cache)
            steps = []
            for epoch in range(epochs):
                (group,) = await art.gather_trajectory_groups(
                    [art.TrajectoryGroup(rollout(model, scenario) for _ in range(rollouts))],
                    pbar_desc=f"epoch {epoch}",
                )
                steps.append(list(group.trajectories))
                rewards = [round(t.reward, 2) for t in group.trajectories]
                hits, calls = (sum(int(t.metrics[k]) for t in group.trajectories) for k in ("tool_hits", "tool_calls"))
                graded = sum(not t.metrics["graded_from_cache"] for t in group.trajectories)
                print(
                    f"epoch {epoch}: rewards {rewards}; {hits} of {calls} tool calls hit; "
                    f"{graded} of {len(rewards)} gradings executed"
                )
            stats = cache.stats()
            print(cache_line(stats))
            return steps


if __name__ == "__main__":
    args = policy_arguments(__doc__)
    asyncio.run(main(args.base_url, args.model, args.rollouts, args.epochs))
