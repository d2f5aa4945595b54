"""verifiers v1 with tvcache: a coding task whose agent's bash and edit calls, setup and test reward run through it.

    pip install 'tvcache[verifiers]'
    python examples/verifiers_task.py                      # a built-in scripted policy stands in for the model
    python examples/verifiers_task.py --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --rollouts 8

`FixSlugTask` is an ordinary verifiers task: its setup writes a small project into the runtime, its reward runs
hidden tests there. `CachedFixSlugTask` is the drop-in: the mixin first, and the workspace sandboxes its rollouts
run in. The agent is verifiers' own `bash` harness in a subprocess runtime, its model any OpenAI-compatible endpoint
(the key from `OPENAI_API_KEY`), or without `--base-url` the one stand-in, `ScriptedPolicy` (scripted_model.py):
a chat-completions server on loopback answering from `PLANS`, so everything else (verifiers' agent, harness, runtime
and rewards) runs as it would with a model. `--no-cache` runs the plain task, as verifiers alone would.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import verifiers.v1 as vf

# examples/scripted_model.py: the stand-in for a model server, and the examples' command line
from scripted_model import ScriptedPolicy, cache_line, policy_arguments

import tvcache
from tvcache.integrations import process_cache, process_sandboxes
from tvcache.integrations.verifiers import CachedTask
from tvcache.sandboxes.reclaim import scratch_dir

PROJECT = {
    "slug.py": (
        "import re\n\n\n"
        "def slugify(title):\n"
        '    """A URL slug: lowercase words joined by single hyphens."""\n'
        "    return re.sub(r'[^a-z0-9]', '-', title.lower())\n"
    ),
}
HIDDEN_TESTS = (
    "from slug import slugify\n"
    "cases = [('Hello World', 'hello-world'), ('  Many   spaces ', 'many-spaces'), ('C++ & Rust!', 'c-rust')]\n"
    "print(sum(slugify(a) == b for a, b in cases), len(cases))\n"
)


class SlugData(vf.TaskData):
    pass


class FixSlugTask(vf.Task[SlugData]):
    """The task as verifiers alone runs it."""

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        for name, text in PROJECT.items():
            await runtime.write(name, text.encode())

    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        await runtime.write("hidden_test.py", HIDDEN_TESTS.encode())
        result = await runtime.run(["python3", "hidden_test.py"], {})
        try:
            passed, total = (int(n) for n in result.stdout.split())
        except ValueError:  # the project no longer imports
            return 0.0
        return passed / total


class CachedFixSlugTask(CachedTask, FixSlugTask):
    """The drop-in: the same task, its tools and commands through tvcache."""

    def tvcache_sandboxes(self) -> tvcache.Sandboxes:
        # One factory per process, over an empty /testbed: setup's uploads are calls (cached per task) like any.
        return process_sandboxes(
            "verifiers-slug", lambda: tvcache.WorkspaceSandboxes(scratch_dir("verifiers-example"), timeout=60)
        )


def bash(command: str) -> tuple[str, str]:
    return ("bash", json.dumps({"command": command}))


BUGGY = "return re.sub(r'[^a-z0-9]', '-', title.lower())"
FIX = (
    "edit",
    json.dumps(
        {"path": "slug.py", "old_str": BUGGY, "new_str": "return '-'.join(re.findall(r'[a-z0-9]+', title.lower()))"}
    ),
)


# The plans of the built-in scripted policy, a rollout each in turn: fix the bug (3 of 3 hidden tests pass), only
# look (1 of 3), fix it after an `ls` laid out otherwise (the same call to tvcache, so it hits).
PLANS = [
    [[bash("ls")], [bash("cat slug.py")], [FIX]],
    [[bash("ls")]],
    [[("bash", '{ "command" :\n "ls" }')], [FIX]],
]


def task(cached: bool) -> FixSlugTask:
    data = SlugData(idx=0, id="slugify-fix", prompt="slug.py's slugify gives wrong slugs. Fix it with your tools.")
    return (CachedFixSlugTask if cached else FixSlugTask)(data)


async def main(
    base_url: str | None = None, model: str = "scripted-policy", rollouts: int = 8, epochs: int = 2, cached: bool = True
) -> list[Any]:
    """`epochs` groups of `rollouts` concurrent rollouts of the task, against the model server at `base_url`
    (without one, the built-in scripted policy); returns the traces of each group."""
    if base_url is None:
        async with ScriptedPolicy(PLANS) as url:
            return await main(url, model, rollouts, epochs, cached)
    os.environ.setdefault("OPENAI_API_KEY", "none")
    config = vf.AgentConfig(
        model=model,
        harness={"id": "bash"},
        runtime=vf.SubprocessConfig(),
        client=vf.EvalClientConfig(base_url=base_url, api_key_var="OPENAI_API_KEY"),
    )
    groups = []
    async with vf.Agent(config) as agent:
        for epoch in range(epochs):
            before = process_cache().stats() if cached else {}
            traces = await asyncio.gather(*(agent.run(task(cached)) for _ in range(rollouts)))
            groups.append(traces)
            line = f"epoch {epoch}: rewards {[round(t.reward, 2) for t in traces]}"
            if cached:  # this epoch's share of the process-wide cache's counts
                after = process_cache().stats()
                line += f"; {after['hits'] - before['hits']:.0f} of {after['calls'] - before['calls']:.0f} calls hit"
            print(line)
    if cached:
        stats = process_cache().stats()
        print(cache_line(stats))
    return groups


if __name__ == "__main__":
    args = policy_arguments(__doc__, uncached="--no-cache")
    asyncio.run(main(args.base_url, args.model, args.rollouts, args.epochs, args.cached))
