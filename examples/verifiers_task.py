"""verifiers v1 with tvcache: a coding task whose agent's bash and edit calls, setup and test reward run through it.

    pip install 'tvcache[verifiers]'
    python examples/verifiers_task.py --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B --rollouts 8

`FixSlugTask` is an ordinary verifiers task: its setup writes a small project into the runtime, its reward runs
hidden tests there. `CachedFixSlugTask` is the drop-in: the mixin first, and the workspace sandboxes its rollouts
run in. The agent is verifiers' own `bash` harness in a subprocess runtime, its model any OpenAI-compatible endpoint
(the key from `OPENAI_API_KEY`); `--no-cache` runs the plain task, as verifiers alone would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import verifiers.v1 as vf

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


def task(cached: bool) -> FixSlugTask:
    data = SlugData(idx=0, id="slugify-fix", prompt="slug.py's slugify gives wrong slugs. Fix it with your tools.")
    return (CachedFixSlugTask if cached else FixSlugTask)(data)


async def main(base_url: str, model: str, rollouts: int = 8, epochs: int = 2, cached: bool = True) -> list[Any]:
    """`epochs` groups of `rollouts` concurrent rollouts of the task; returns the traces of each group."""
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
            traces = await asyncio.gather(*(agent.run(task(cached)) for _ in range(rollouts)))
            groups.append(traces)
            print(f"epoch {epoch}: rewards {[t.reward for t in traces]}")
    if cached:
        print("cache:", process_cache().stats())
    return groups


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--no-cache", action="store_true", help="run the plain verifiers task")
    args = parser.parse_args()
    asyncio.run(main(args.base_url, args.model, args.rollouts, args.epochs, not args.no_cache))
