"""veRL: trajectories of veRL's own agent loop machinery (the loop built from veRL's registry by hydra, as
AgentLoopWorker builds it, `run` with a dataset row, `_call_tool` for every call), with and without tvcache.

The one stand-in is the LLM server (veRL's `generate(...) -> TokenOutput` interface; no GPU and no inference server
here): a scripted policy that answers each trajectory's turns from a plan, as the model's tokens in the hermes tool
format, with SmolLM2's real tokenizer. Oracles: veRL's `tool_agent` loop on the same plans (the default mode, veRL's
own tools answering misses), and the same calls executed uncached in a fresh SQLite sandbox (the `sandboxes:` mode).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="needs veRL (pip install 'tvcache[verl]')")

import tvcache
from tvcache.calls import ToolCall
from tvcache.integrations import process_cache
from tvcache.integrations.verl import AGENT_NAME, row_task

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))  # veRL's hydra imports the example's agent loop by module name, as workers do

import verl_text2sql as example  # noqa: E402
from verl.tools.function_tool import load_function_tools_from_path  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

Step = list[tuple[str, Any]] | None  # the tool calls of a turn (name, arguments), or None: a final answer


class ScriptedServer:
    """veRL's LLM server interface, answering each trajectory (veRL's request id) from the next plan in `queue`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.queue: list[list[Step]] = []
        self.plans: dict[str, list[Step]] = {}
        self.turns: Counter[str] = Counter()

    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any):
        if request_id not in self.plans:
            self.plans[request_id] = self.queue.pop(0)
        plan, turn = self.plans[request_id], self.turns[request_id]
        self.turns[request_id] += 1
        step = plan[turn] if turn < len(plan) else None
        if step is None:
            text = "I have the answer."
        else:
            text = "".join(
                f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>" for name, args in step
            )
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return TokenOutput(token_ids=ids, stop_reason="completed")


def sql(query: str) -> tuple[str, Any]:
    return ("sql", {"query": query})


COUNT = "SELECT count(*) FROM Track"
READING = [
    [[sql(COUNT)]],
    [[sql("SELECT Name FROM Artist LIMIT 3")], [sql(COUNT)]],
    [[sql("SELEC oops")]],  # an SQL error, as the tool's answer
    [[("bash", {"command": "ls"})]],  # a tool that does not exist: veRL's own message
    [[("sql", "just text")]],  # arguments that are JSON but not an object: the tool fails as in veRL
    [[sql(COUNT)], [sql("DELETE FROM Track")]],  # the read-only database refuses, in both
    [[sql(COUNT)]],  # plan 0 again
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tvcache_bench.workloads.grpo.model import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def setup(tokenizer: Any) -> tuple[Any, list[Any]]:
    config = example.verl_config()
    example.register_agent_loops(config)
    return config, load_function_tools_from_path(str(example.TOOL_FILE))


async def trajectories(
    setup: tuple[Any, list[Any]], tokenizer: Any, agent: str, plans: list[list[Step]], row: dict[str, Any]
) -> list[Any]:
    config, tools = setup
    server = ScriptedServer(tokenizer)
    outputs = []
    for plan in plans:
        server.queue.append(plan)
        outputs.append(await example.run_trajectory(config, server, tokenizer, tools, agent, row))
    return outputs


def comparable(output: Any) -> tuple[Any, ...]:
    return (output.prompt_ids, output.response_ids, output.response_mask, output.num_turns)


def test_cached_loop_answers_as_verl_and_later_rollouts_hit(setup: Any, tokenizer: Any) -> None:
    row = example.rows()[0]

    async def go() -> tuple[list[Any], list[Any], list[Any], dict[str, float]]:
        plain = await trajectories(setup, tokenizer, "tool_agent", READING, row)
        first = await trajectories(setup, tokenizer, AGENT_NAME, READING, row)
        again = await trajectories(setup, tokenizer, AGENT_NAME, READING, row)  # the next epoch
        return plain, first, again, process_cache().stats()

    plain, first, again, stats = asyncio.run(go())
    assert [comparable(o) for o in first] == [comparable(o) for o in plain]
    assert [comparable(o) for o in again] == [comparable(o) for o in plain]
    texts = [tokenizer.decode(o.response_ids) for o in plain]
    assert "3503" in texts[0] and "syntax error" in texts[2] and "readonly database" in texts[5]
    assert "Unknown function 'bash'" in texts[3] and "Error executing tool 'sql'" in texts[4]
    calls = [o.extra_fields["tvcache_calls"] for o in first]
    # An unknown tool never reaches the cache; a tool that raised is never recorded (nor counted as a result).
    assert calls == [1, 2, 1, 0, 0, 2, 1]
    # The first epoch hits where a plan repeats an earlier one's calls; the second hits everywhere.
    assert [o.extra_fields["tvcache_hits"] for o in first] == [0, 0, 0, 0, 0, 1, 1]
    assert [o.extra_fields["tvcache_hits"] for o in again] == calls
    assert stats["hits"] == 2 + sum(calls)


WRITING = [
    [[sql("DELETE FROM Track WHERE TrackId > 10")], [sql(COUNT)]],  # right answer on its own final state: 10
    [[sql(COUNT)]],  # 3503, right
    [
        [sql("CREATE TEMP VIEW long AS SELECT * FROM Track WHERE Milliseconds > 600000")],
        [sql("SELECT count(*) FROM long")],
    ],
    [[sql("CREATE TEMP VIEW long AS SELECT * FROM Track WHERE Milliseconds > 600000")], [sql("SELECT 1")]],
    [[sql(COUNT)]],  # plan 1 again: its calls and its grading hit
    [[sql("SELEC oops")]],
]


async def oracle(plan: list[list[Step]], gold: str) -> tuple[list[str], float]:
    """The plan's calls executed uncached in a fresh sandbox, and the reward graded there."""
    boxes = tvcache.SQLiteSandboxes(example.chinook(), timeout=10)
    box = await boxes.create()
    try:
        outputs = [
            str((await box.execute(ToolCall(name, args))).output) for step in plan if step for name, args in step
        ]
        if not outputs or outputs[-1].startswith("Error:"):
            return outputs, 0.0
        gold_output = str((await box.execute(ToolCall("sql", {"query": gold}))).output)
        return outputs, 1.0 if example.rows_equal(outputs[-1], gold_output) else 0.0
    finally:
        await box.close()
        await boxes.close()


def test_sandboxes_mode_matches_uncached_execution_and_grades_final_states_once(setup: Any, tokenizer: Any) -> None:
    row = example.rows()[0]
    gold = row["reward_model"]["ground_truth"]

    async def go() -> tuple[list[Any], list[Any], dict[str, float]]:
        outputs = []
        executed: list[float] = []
        for plan in WRITING:
            before = process_cache().stats()["executions"]
            outputs += await trajectories(setup, tokenizer, example.AGENT, [plan], row)
            executed.append(process_cache().stats()["executions"] - before)
        return outputs, executed, process_cache().stats()

    outputs, executed, stats = asyncio.run(go())
    expected = [asyncio.run(oracle(plan, gold)) for plan in WRITING]
    for output, plan, (texts, reward) in zip(outputs, WRITING, expected, strict=True):
        decoded = tokenizer.decode(output.response_ids)
        for text in texts:
            assert text.split("\n")[-1] in decoded, (plan, text)
        assert output.reward_score == reward, plan
    assert [o.reward_score for o in outputs] == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    # Plan 4 repeats plan 1: its call and the grading of its final state (the untouched database) hit.
    assert executed[4] == 0 and outputs[4].extra_fields["tvcache_hits"] == 1
    # Plan 3 starts as plan 2 did: its first call hits; its grading runs (another final state).
    assert outputs[3].extra_fields["tvcache_hits"] == 1
    assert stats["mismatches"] == 0 and stats["detached"] == 0


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


def test_the_examples_code_block_parser(tokenizer: Any) -> None:
    parser = example.SQLBlockParser(tokenizer)
    ids = tokenizer.encode("SELECT count(*) FROM Track\n```", add_special_tokens=False)
    content, calls = asyncio.run(parser.extract_tool_calls(ids))
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("sql", {"query": COUNT})]
    assert asyncio.run(parser.extract_tool_calls(tokenizer.encode("SELECT", add_special_tokens=False)))[1] == []
    assert ids[-1] in parser.stop_token_ids
