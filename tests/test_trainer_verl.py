"""veRL: trajectories of veRL's own agent loop machinery (the loop built from veRL's registry by hydra, as
AgentLoopWorker builds it, `run` with a dataset row, `_call_tool` for every call), alone and with tvcache.

The parity harness: veRL's `tool_agent` next to `tvcache_tool_agent`, and the example's loop with its reward alone
(`text2sql_agent`) next to its tvcache version, on the same adversarial plans (writes then an answer, SQL errors,
unknown tools, malformed JSON, wrong argument types, several calls in one turn, a huge answer, a NUL byte); the
tokens the model sees and writes and the reward equal byte for byte over two epochs, the second from the cache.
The one stand-in is the LLM server (veRL's `generate(...) -> TokenOutput` interface; no GPU and no inference server
here): the example's scripted policy, as the model's tokens in the hermes tool format with a byte-level tokenizer.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="needs veRL (pip install 'tvcache[verl]')")

import tvcache
from tvcache.calls import ToolCall
from tvcache.integrations import process_sandboxes
from tvcache.integrations.verl import AGENT_NAME, row_task

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))  # veRL's hydra imports the example's agent loop by module name, as workers do

import verl_text2sql as example  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry  # noqa: E402
from verl.tools.function_tool import load_function_tools_from_path  # noqa: E402


def sql(query: str) -> tuple[str, Any]:
    return ("sql", {"query": query})


COUNT = "SELECT count(*) FROM Track"
PLANS: list[Any] = [
    [[sql(COUNT)]],  # right
    [[sql("SELECT Name FROM Artist LIMIT 3")], [sql(COUNT)]],
    [[sql("SELEC oops")]],  # an SQL error, as the tool's answer
    [[("bash", {"command": "ls"})]],  # a tool that does not exist: veRL's own message
    [[("sql", "just text")]],  # arguments that are JSON but not an object: the tool fails as in veRL
    [[("sql", {"query": 5})]],  # the wrong type
    [[("sql", {"query": COUNT, "limit": 3})]],  # an argument the tool does not take
    [['{"name": "sql", "arguments": {"query": '], [sql(COUNT)]],  # malformed JSON: dropped, the turn final
    [[sql("DELETE FROM Track")], [sql("SELECT 0")]],  # the reward hack: the tool is read-only, the answer wrong
    [[sql("DELETE FROM Track WHERE TrackId > 10")], [sql(COUNT)]],  # refused too: the count stays 3503
    [[sql(COUNT), sql("SELECT Name FROM Artist LIMIT 3"), sql(COUNT)]],  # several calls in one turn
    [[sql("SELECT * FROM Track")]],  # a huge answer, which veRL cuts
    [[sql("SELECT 'a\0b'")]],  # a NUL byte
    [[sql(COUNT)]],  # plan 0 again
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return example.byte_tokenizer()


@pytest.fixture(scope="module")
def setup() -> tuple[Any, list[Any]]:
    config = example.verl_config()
    example.register_agent_loops(config)
    return config, load_function_tools_from_path(str(example.TOOL_FILE))


async def trajectories(setup: tuple[Any, list[Any]], tokenizer: Any, agent: str, row: dict[str, Any]) -> list[Any]:
    config, tools = setup
    server = example.ScriptedServer(tokenizer, PLANS)
    outputs = []
    for plan in PLANS:
        server.queue.append((plan, row["reward_model"]["ground_truth"]))
        outputs.append(await example.run_trajectory(config, server, tokenizer, tools, agent, row))
    return outputs


def seen(output: Any) -> tuple[Any, ...]:
    """Everything of a trajectory that training reads: the tokens the model saw and wrote, and the reward."""
    return (output.prompt_ids, output.response_ids, output.response_mask, output.num_turns, output.reward_score)


@pytest.mark.parametrize(("plain", "cached"), [("tool_agent", AGENT_NAME), (example.PLAIN, example.AGENT)])
def test_cached_loops_answer_as_verl_alone_byte_for_byte(setup: Any, tokenizer: Any, plain: str, cached: str) -> None:
    row = example.rows()[0]

    async def go() -> tuple[list[Any], list[Any], list[Any]]:
        alone = await trajectories(setup, tokenizer, plain, row)
        first = await trajectories(setup, tokenizer, cached, row)
        again = await trajectories(setup, tokenizer, cached, row)  # the next epoch
        return alone, first, again

    alone, first, again = asyncio.run(go())
    for k, (mine, theirs) in enumerate(zip(first, alone, strict=True)):
        assert seen(mine) == seen(theirs), k
    assert [seen(o) for o in again] == [seen(o) for o in alone]
    texts = [tokenizer.decode(o.response_ids) for o in alone]
    assert "3503" in texts[0] and "syntax error" in texts[2] and "Unknown function 'bash'" in texts[3]
    assert all("Error executing tool 'sql'" in texts[k] for k in (4, 5, 6))
    assert "readonly database" in texts[8] and "readonly database" in texts[9] and "3503" in texts[9]
    assert "...(truncated)" in texts[11]
    if plain == example.PLAIN:
        # veRL's tool is read-only: deleting the table and answering with an empty count earns nothing.
        rewards = [o.reward_score for o in alone]
        assert rewards[0] == rewards[9] == rewards[13] == 1.0 and rewards[8] == 0.0
    calls = [o.extra_fields["tvcache_calls"] for o in first]
    # An unknown tool never reaches the cache, nor does a dropped call; a tool that raised is not recorded.
    assert calls == [1, 2, 1, 0, 0, 0, 0, 0, 2, 2, 3, 1, 1, 1]
    assert sum(o.extra_fields["tvcache_hits"] for o in first) > 0  # plans repeat earlier plans' calls
    assert [o.extra_fields["tvcache_hits"] for o in again] == calls  # the second epoch hits everywhere


def writable_sandboxes(row: Any) -> tvcache.Sandboxes:
    """The `sandboxes:` function of a loop whose tool keeps its state: a writable copy of Chinook per rollout."""
    path = example.chinook()
    return process_sandboxes(("verl-test-sqlite", str(path)), lambda: tvcache.SQLiteSandboxes(path, timeout=10))


VIEW = "CREATE TEMP VIEW long AS SELECT * FROM Track WHERE Milliseconds > 600000"
WRITING: list[Any] = [
    [[sql("DELETE FROM Track WHERE TrackId > 10")], [sql(COUNT)]],  # its own database: 10
    [[sql(COUNT)]],
    [
        [sql("CREATE TEMP VIEW long AS SELECT * FROM Track WHERE Milliseconds > 600000")],
        [sql("SELECT count(*) FROM long")],
    ],
    [[sql("CREATE TEMP VIEW long AS SELECT * FROM Track WHERE Milliseconds > 600000")], [sql("SELECT 1")]],
    [[sql(COUNT)]],  # plan 1 again
    [[("sql", {"query": 5})], [sql(COUNT)]],  # a bad call: refused, and the rollout goes on
]


def test_sandboxes_mode_answers_as_uncached_execution(setup: Any, tokenizer: Any) -> None:
    """A tool whose state lives in a tvcache sandbox (`sandboxes:`): every answer the model sees equals the plan's
    calls executed uncached in a fresh sandbox, and repeated prefixes hit."""
    config, tools = setup
    name = "test_writable_sql_agent"
    _agent_loop_registry[name] = OmegaConf.create(
        {
            "name": name,
            "_target_": "tvcache.integrations.verl.CachedToolAgentLoop",
            "sandboxes": f"{__name__}:writable_sandboxes",
        }
    )
    row = example.rows()[0]

    async def go() -> list[Any]:
        server = example.ScriptedServer(tokenizer, WRITING)
        outputs = []
        for plan in WRITING:
            server.queue.append((plan, ""))
            outputs.append(await example.run_trajectory(config, server, tokenizer, tools, name, row))
        return outputs

    async def uncached(plan: list[Any]) -> list[str]:
        async with tvcache.SQLiteSandboxes(example.chinook(), timeout=10) as boxes:
            box = await boxes.create()
            return [str((await box.execute(ToolCall(n, a))).output) for step in plan for n, a in step]

    outputs = asyncio.run(go())
    for output, plan in zip(outputs, WRITING, strict=True):
        decoded = tokenizer.decode(output.response_ids)
        for text in asyncio.run(uncached(plan)):
            assert text in decoded, (plan, text)
    assert "count(*)\n      10<" in tokenizer.decode(outputs[0].response_ids)  # the rollout's own writes count
    # Plan 3 starts as plan 2 did; plan 4 repeats plan 1; plan 5's count after its refused call is plan 1's too.
    assert [o.extra_fields["tvcache_hits"] for o in outputs] == [0, 0, 0, 1, 1, 1]


def test_task_ids_come_from_the_stable_index_not_the_uid() -> None:
    row = {"data_source": "chinook", "extra_info": {"index": 7}, "uid": "a1b2", "raw_prompt": []}
    assert row_task(row) == "chinook/7"
    assert row_task({**row, "uid": "c3d4"}) == "chinook/7"
    no_index = {"raw_prompt": [{"role": "user", "content": "q"}], "tools_kwargs": {}}
    assert row_task(no_index) == row_task(dict(no_index)) != row_task({**no_index, "raw_prompt": []})


def test_row_kwargs_enter_the_fingerprint() -> None:
    from tvcache.integrations.verl import VerlToolSandboxes

    tools = {t.name: t for t in load_function_tools_from_path(str(example.TOOL_FILE))}
    a = VerlToolSandboxes(tools, {"sql": {"create_kwargs": {"ground_truth": "1"}}})
    b = VerlToolSandboxes(tools, {"sql": {"create_kwargs": {"ground_truth": "2"}}})
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == VerlToolSandboxes(tools, {"sql": {"create_kwargs": {"ground_truth": "1"}}}).fingerprint


def test_the_examples_run_without_arguments() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), *sys.path])}
    tool = subprocess.run([sys.executable, str(example.TOOL_FILE)], capture_output=True, text=True, env=env)
    assert tool.returncode == 0 and tool.stdout.split() == ["tracks", "3503"], tool.stderr[-3000:]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "verl_text2sql.py")], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [example.PLAIN] + [example.AGENT] * 2
    rewards = [line.split("rewards ")[1].split(";")[0] for line in lines]
    assert rewards[0] == rewards[1] == rewards[2] and "1.0" in rewards[0]
    assert lines[2].endswith("tool calls from the cache") and lines[2].split("; ")[1].split()[0] != "0"
