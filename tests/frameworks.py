"""What the framework integration tests share: a scripted policy behind an OpenAI-compatible endpoint on loopback,
and loading the examples they run.

The scripted policy is the one stand-in the integration tests use: no language model runs on these machines, so
this server plays one. Everything around it is real (the frameworks' own clients, their rollout machinery,
tvcache's sandboxes).

A policy is a list of plans; a plan is the list of turns one rollout takes, each turn a list of tool calls
`(name, arguments as the JSON text a model emits)` or a text answer (for environments that parse actions out of
text, as SkyRL's do), and after the last turn the model answers `final` text.
The first request of a conversation (no assistant message yet) takes the next plan of its prompt, round robin,
and the server marks its first assistant message `[plan k]`, so later requests of that conversation, which
carry that message, continue the same plan. Which concurrent rollout gets which plan is up to the scheduler;
tests compare results plan by plan.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from aiohttp import web

#: The examples are scripts, not a package: what they import next to them (scripted_model.py) is on the path.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.append(str(EXAMPLES))
from scripted_model import ScriptedPolicy  # noqa: E402

Call = tuple[str, str]  # (tool name, arguments as JSON text, possibly malformed)
Plan = Sequence[Sequence[Call] | str]

MARK = re.compile(r"\[plan (\d+)\]")


class ScriptedLLM(ScriptedPolicy):
    """The examples' stand-in (examples/scripted_model.py) with what the tests ask of it: text turns, a `final`
    answer, plans taken round robin per prompt, and every request body kept (`requests`)."""

    def __init__(self, plans: Sequence[Plan], final: Callable[[int], str] = lambda k: f"done with plan {k}") -> None:
        super().__init__(plans)  # type: ignore[arg-type]
        self.final = final
        self.requests: list[dict[str, Any]] = []
        self._next: Counter[str] = Counter()
        self._ids = itertools.count()

    def answer(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        assistants = [m for m in messages if m.get("role") == "assistant"]
        if not assistants:
            prompt = json.dumps([m for m in messages if m.get("role") in ("system", "user")], sort_keys=True)
            plan = self._next[prompt] % len(self.plans)
            self._next[prompt] += 1
        else:
            found = MARK.search(str(assistants[0].get("content") or ""))
            if found is None:
                raise ValueError("a conversation without the [plan k] mark of its first answer")
            plan = int(found.group(1))
        turn = len(assistants)
        steps = self.plans[plan]
        step = steps[turn] if turn < len(steps) else None
        mark = f"[plan {plan}] " if turn == 0 or step is None else ""
        if isinstance(step, str):
            return {"role": "assistant", "content": mark + step}
        if step is None:
            return {"role": "assistant", "content": mark + self.final(plan)}
        calls = [
            {"id": f"call_{next(self._ids)}", "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in step
        ]
        return {"role": "assistant", "content": f"{mark}turn {turn}", "tool_calls": calls}

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())  # aiohttp keeps the body: the policy reads it again
        return await super()._completions(request)

    async def __aenter__(self) -> ScriptedLLM:  # type: ignore[override]
        await super().__aenter__()
        return self


def plan_of(text: str | None) -> int:
    """The plan number a conversation's first assistant message carries."""
    found = MARK.search(text or "")
    assert found is not None, text
    return int(found.group(1))


def load_example(name: str) -> ModuleType:
    """Import `examples/<name>.py` as a module (examples are scripts, not a package), with what a script run finds
    next to it (examples/scripted_model.py) importable."""
    spec = importlib.util.spec_from_file_location(f"tvcache_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


def run_example(name: str, cwd: Path) -> list[str]:
    """Run `examples/<name>.py` with no arguments as a newcomer does (from another directory, without
    $TVCACHE_WORKLOADS) and return the lines it prints; fails the test if it exits with an error."""
    env = {k: v for k, v in os.environ.items() if k != "TVCACHE_WORKLOADS"}
    script = EXAMPLES / f"{name}.py"
    result = subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def rewards_of(line: str) -> list[float]:
    """The rewards an example prints for an epoch (`epoch k: rewards [...]; ...`), sorted: which concurrent
    rollout gets which plan is up to the scheduler."""
    found = re.match(r"epoch \d+: rewards (\[[^]]*\])", line)
    assert found is not None, line
    return sorted(json.loads(found.group(1)))
