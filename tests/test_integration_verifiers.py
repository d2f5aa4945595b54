"""verifiers v1: the example's task run by verifiers' own machinery (`vf.Agent`, its interception server and tool
gate, the bundled `bash` harness program in a subprocess runtime, task setup and rewards) with the `CachedTask`
drop-in on real workspace sandboxes, against the same rollouts of the plain task, as verifiers alone runs them.

The model is the one stand-in: a scripted policy behind an OpenAI-compatible endpoint (tests/frameworks.py). The
harness program runs under uv, as verifiers runs it (its dependencies come from PyPI the first time).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

import tvcache

vf = pytest.importorskip("verifiers.v1", reason="needs verifiers (pip install 'tvcache[verifiers]')")
if shutil.which("uv") is None:
    pytest.skip("verifiers' bash harness runs its program with uv (pip install uv)", allow_module_level=True)

from frameworks import ScriptedLLM, load_example, plan_of, rewards_of, run_example  # noqa: E402
from tvcache.integrations import process_sandboxes  # noqa: E402
from tvcache.integrations.verifiers import CachedTask  # noqa: E402

example = load_example("verifiers_task")


def bash(command: str) -> tuple[str, str]:
    return ("bash", json.dumps({"command": command}))


def edit(old: str, new: str) -> tuple[str, str]:
    return ("edit", json.dumps({"path": "slug.py", "old_str": old, "new_str": new}))


BUGGY = "return re.sub(r'[^a-z0-9]', '-', title.lower())"
FIX = edit(BUGGY, "return '-'.join(re.findall(r'[a-z0-9]+', title.lower()))")
PLANS = [
    [[bash("ls")], [bash("cat slug.py")], [FIX]],  # fixes it: 3 of 3
    [[bash("ls")]],  # looks and stops: 1 of 3
    [[("bash", '{ "command" :\n "ls" }')], [FIX]],  # the same `ls` in another JSON layout; ends as plan 0
    [[("bash", '{"command": "ls"')]],  # malformed arguments: the harness's own error; ends as plan 1
    [[bash("printf '%s' " + "x" * 100_000 + " | wc -c")], [FIX]],  # a huge argument; ends as plan 0
    [[edit("no such text", "x")]],  # an edit that fails, with the harness's message; ends as plan 1
    [[bash("sed -i 's/-/_/' slug.py && python3 -c 'import slug; print(slug.slugify(\"A B\"))'")]],  # 0 of 3
    [[bash("rm slug.py"), bash("ls")]],  # two calls in one turn; the project is gone: 0
    [[bash("echo out1; echo err1 >&2; echo out2; exit 3")]],  # the harness shows stdout, then stderr; ends as plan 1
    [[bash("printf 'a\\r\\nb\\rc'; printf '\\xff' >&2")]],  # universal newlines; stderr that is not UTF-8
]
#: The state each plan ends in (fixed, untouched, underscored, removed): the ones that end alike are scored alike.
FINAL_STATE = [0, 1, 0, 1, 0, 1, 6, 7, 1, 1]


def tool_results(trace: Any) -> list[str]:
    return [vf.types.content_text(n.message.content) for n in trace.nodes if isinstance(n.message, vf.ToolMessage)]


def first_answer(trace: Any) -> str:
    return next(n.message.content for n in trace.nodes if isinstance(n.message, vf.AssistantMessage))


def test_verifiers_rollouts_through_tvcache_match_verifiers_alone_and_hit_later() -> None:
    async def main() -> tuple[list[Any], list[Any]]:
        async with ScriptedLLM(PLANS) as llm:
            alone = await example.main(llm.url, "scripted-policy", rollouts=len(PLANS), epochs=1, cached=False)
            cached = await example.main(llm.url, "scripted-policy", rollouts=len(PLANS), epochs=2, cached=True)
        return alone[0], cached

    alone, epochs = asyncio.run(main())
    oracle = {plan_of(first_answer(t)): t for t in alone}
    assert all(t.ok for t in alone), [t.errors for t in alone]
    assert [oracle[k].reward for k in range(len(PLANS))] == [1.0, 1 / 3, 1.0, 1 / 3, 1.0, 1 / 3, 0.0, 0.0, 1 / 3, 1 / 3]
    assert tool_results(oracle[3])[0].startswith("error: invalid JSON in tool arguments")
    assert tool_results(oracle[4])[0].strip() == "100000"
    assert tool_results(oracle[8]) == ["out1\nout2\nerr1\n"]
    assert tool_results(oracle[9])[0].startswith("error: 'utf-8' codec can't decode byte 0xff")

    for epoch, traces in enumerate(epochs):
        assert all(t.ok for t in traces), [t.errors for t in traces]
        by_plan = {plan_of(first_answer(t)): t for t in traces}
        assert sorted(by_plan) == list(range(len(PLANS)))
        for k, trace in by_plan.items():
            assert tool_results(trace) == tool_results(oracle[k]), (epoch, k)
            assert trace.reward == oracle[k].reward, (epoch, k)
            assert trace.task.key == oracle[k].task.key  # one task: the task's own key
        graded_here = [t for t in traces if t.metrics["tvcache_scoring_hits"] < t.metrics["tvcache_scoring_calls"]]
        calls = sum(t.metrics["tvcache_calls"] for t in traces)
        hits = sum(t.metrics["tvcache_hits"] for t in traces)
        if epoch == 0:
            # Rollouts that end in the same state are scored once: each scoring call (writing the hidden test,
            # running it) executes once per final state, though which rollout of a state runs which call is a race.
            executed = sum(t.metrics["tvcache_scoring_calls"] - t.metrics["tvcache_scoring_hits"] for t in traces)
            per_state = {FINAL_STATE[k]: t.metrics["tvcache_scoring_calls"] for k, t in by_plan.items()}
            assert len(per_state) == 4 and executed == sum(per_state.values())
            assert 0 < hits < calls
        else:
            assert not graded_here and hits == calls  # every call of the second epoch, setup to reward, hits


class SlowRewardTask(CachedTask, example.FixSlugTask):
    """The example task, but its tests hang: the runtime's timeout fails them."""

    def tvcache_sandboxes(self) -> tvcache.Sandboxes:
        return process_sandboxes("slow-reward", lambda: tvcache.WorkspaceSandboxes(tempfile.mkdtemp(), timeout=1))

    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        result = await runtime.run(["sleep", "30"], {})
        return 1.0 if result.exit_code == 0 else 0.0


def run_agent(task: Any, harness: str = "bash", rollouts: int = 1) -> list[Any]:
    """`rollouts` rollouts of `task`, one after the other, with a model that answers at once."""

    async def main() -> list[Any]:
        async with ScriptedLLM([[]]) as llm:
            config = vf.AgentConfig(
                model="scripted-policy",
                harness={"id": harness},
                runtime=vf.SubprocessConfig(),
                client=vf.EvalClientConfig(base_url=llm.url, api_key_var="OPENAI_API_KEY"),
            )
            async with vf.Agent(config) as agent:
                return [await agent.run(task) for _ in range(rollouts)]

    return asyncio.run(main())


def test_a_failing_reward_is_not_cached() -> None:
    data = example.SlugData(idx=0, id="slow", prompt="Fix slug.py.")
    for trace in run_agent(SlowRewardTask(data), rollouts=2):
        assert trace.ok and trace.reward == 0.0
        # The hanging test command timed out in both rollouts: executed each time, never served from the cache.
        assert trace.metrics["tvcache_scoring_calls"] == 1 and trace.metrics["tvcache_scoring_hits"] == 0


def refused_at_setup(harness: str) -> str:
    """The TaskError the cached task's setup raises, called as a rollout calls it, on a trace of an agent with
    `harness` (every harness but bash needs a container runtime, none here, so no agent runs)."""
    task = example.task(cached=True)
    config = vf.AgentConfig(model="m", harness={"id": harness}, runtime=vf.SubprocessConfig())
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=vf.State(),
        agent=vf.AgentInfo(config=config),
    )

    async def main() -> str:
        with pytest.raises(vf.TaskError) as caught:
            await task.setup(trace, None)
        return str(caught.value)

    return asyncio.run(main())


def test_a_harness_that_does_not_consult_the_tool_gate_is_refused() -> None:
    assert "tool gate" in refused_at_setup("mini_swe_agent")


def test_a_harness_that_gates_other_tools_is_refused_at_setup() -> None:
    assert "gates tools other than ['bash', 'edit']" in refused_at_setup("codex")


COMMANDS = [
    "echo out1; echo err1 >&2; echo out2; exit 3",
    "printf 'a\\r\\nb\\rc'",
    "printf 'ok'; printf '\\xfe' >&2",
    "cd /tmp; export X=1; echo $X",
    "echo ${X:-unset}; pwd",
]


def test_the_bash_tool_answers_as_the_harness_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's own `run_bash` (verifiers.v1.harnesses.utils.core), executed here, next to the same commands
    through two rollouts of a task. The harness's 3,600 s timeout is a constant inside `run_bash`: to see a timeout
    here, `subprocess.run` is patched to pass 1 s for the harness, and `HARNESS_TIMEOUT` is set to 1 for tvcache. A
    timed-out command is a failure: the model sees the harness's message, nothing is recorded (the second rollout
    runs it again), and the rollout goes on in its own sandbox (the killed command may have changed it)."""
    import subprocess

    from verifiers.v1.harnesses.utils import core

    from tvcache.integrations import verifiers as integration

    commands = [*COMMANDS[:2], "sleep 5", *COMMANDS[2:]]
    monkeypatch.chdir("/")  # the harness's working directory, as the rollout's
    run = subprocess.run
    with monkeypatch.context() as patched:
        patched.setattr(core.subprocess, "run", lambda *a, **k: run(*a, **{**k, "timeout": 1}))
        expected = [core.run_bash(command) for command in commands]
    monkeypatch.setattr(integration, "HARNESS_TIMEOUT", 1)

    async def main() -> list[tuple[list[str], int]]:
        inner = tvcache.WorkspaceSandboxes(tempfile.mkdtemp(), network=False, timeout=30)
        boxes = integration.HarnessSandboxes.of(inner)
        async with tvcache.ToolCache() as cache:
            runs = []
            for _ in range(2):
                rollout = await cache.open("harness", boxes)
                opened = integration._Open(rollout, lambda: None, "/")  # type: ignore[arg-type]
                try:
                    runs.append(
                        ([await integration._run_tool(opened, "bash", {"command": c}) for c in commands], opened.hits)
                    )
                finally:
                    await rollout.close()
            await inner.close()
            return runs

    (first, first_hits), (second, second_hits) = asyncio.run(main())
    assert first == second == expected
    assert expected[0] == "out1\nout2\nerr1\n" and expected[1] == "a\nb\nc"
    assert expected[2] == f"error: {subprocess.TimeoutExpired(['bash', '-c', 'sleep 5'], 1)}"
    assert (first_hits, second_hits) == (0, 2)  # the two commands before the timeout hit; it and the rest ran


def test_the_example_runs_without_arguments_on_its_scripted_policy(tmp_path: Path) -> None:
    """As a newcomer runs it: no model server (its built-in scripted policy on loopback stands in), from an empty
    directory. 8 rollouts take the 3 plans in turn (fix: 1.0, look only: 1/3 of the hidden tests, fix after an
    `ls` laid out otherwise: 1.0), and the second epoch repeats calls of the first, so every call hits."""
    lines = run_example("verifiers_task", tmp_path)
    assert rewards_of(lines[0]) == [0.33] * 3 + [1.0] * 5  # plans 0, 1, 2, 0, 1, 2, 0, 1
    assert rewards_of(lines[1]) == [0.33] * 2 + [1.0] * 6  # plans 2, 0, 1, 2, 0, 1, 2, 0
    hits, calls = (int(n) for n in re.findall(r"; (\d+) of (\d+) calls hit$", lines[1])[0])
    assert hits == calls > 0, lines[1]
    assert re.fullmatch(r"cache: \d+ calls, \d+ hits, \d+ executions, [\d.]+ m?s of tool time saved", lines[2])
