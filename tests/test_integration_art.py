"""ART: the example's rollout function, run by ART's own machinery (`art.Model`'s client, `art.TrajectoryGroup`,
`art.gather_trajectory_groups`) on real workspace sandboxes, against the same rollouts executed without tvcache.

The model is the one stand-in: a scripted policy behind an OpenAI-compatible endpoint on loopback (tests/frameworks.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import re
import sqlite3
import subprocess
import tempfile
import threading
from collections.abc import Awaitable, Callable, Sequence
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

example = load_example("art_sandbox_rollouts")

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
    lines = run_example("art_sandbox_rollouts", tmp_path)
    assert rewards_of(lines[0]) == [0.67] * 3 + [1.0] * 5  # plans 0, 1, 2, 0, 1, 2, 0, 1
    assert lines[0].endswith("; 2 of 8 gradings executed")
    assert rewards_of(lines[1]) == [0.67] * 2 + [1.0] * 6  # plans 2, 0, 1, 2, 0, 1, 2, 0
    assert re.search(r"; (\d+) of \1 tool calls hit; 0 of 8 gradings executed$", lines[1]), lines[1]
    assert re.fullmatch(r"cache: \d+ calls, \d+ hits, \d+ executions, [\d.]+ m?s of tool time saved", lines[2])


# -- the drop-in for tools over Python state: ART alone next to ART + cached_tools ---------------------------------
#
# What follows is an ART user's program: tools as methods of a state object the rollout makes, a rollout function
# that asks the model (through `art.Model`'s own OpenAI client), runs the tools the model called and rewards the
# state it left. It runs twice over two epochs, as written (`wrap` is `lambda shop: shop`) and with the one-line
# drop-in (`wrap` is `cached_tools`); the model is the one stand-in, the scripted policy on loopback.


class Refusal(Exception):
    """An exception whose constructor takes more than a message (it does not unpickle as it pickles)."""

    def __init__(self, tool: str, why: str) -> None:
        super().__init__(f"{tool} refused: {why}")


class Store:
    """A database handle kept in the state; it copies by its content (`serialize`)."""

    def __init__(self, items: tuple[tuple[str, float], ...]) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.db.execute("CREATE TABLE item(name TEXT, price REAL)")
        self.db.executemany("INSERT INTO item VALUES (?, ?)", items)

    def __getstate__(self) -> bytes:
        return self.db.serialize()

    def __setstate__(self, content: bytes) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.db.deserialize(content)


@dataclasses.dataclass(frozen=True)
class Shopping:
    question: str
    items: tuple[tuple[str, float], ...]
    expected: str


class Shop:
    """The tools: state in `self` (a database, notes, the last result, the answer), results of other types than
    `str`, a shell with its own timeout, an exception after a change, an async tool."""

    def __init__(self, scenario: Shopping) -> None:
        self.store = Store(scenario.items)
        self.notes: list[str] = []
        self.last: Any = None
        self.answer: str | None = None

    def sql(self, query: str) -> str:
        self.last = self.store.db.execute(query).fetchall()
        return str(self.last)

    def note(self, text: str, times: int = 1) -> tuple[int, str]:
        self.notes.extend([text] * times)
        return len(self.notes), text[:20]

    def shell(self, command: str) -> str:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=1)
        return f"exit {done.returncode}\n{done.stdout}--\n{done.stderr}"

    def refuse(self, why: str) -> str:
        self.notes.append("refused")  # a change before the exception: kept, as without tvcache
        raise Refusal("refuse", why)

    async def lookup(self, name: str) -> list[float]:
        await asyncio.sleep(0)
        return [price for (price,) in self.store.db.execute("SELECT price FROM item WHERE name = ?", (name,))]

    def submit(self, answer: str) -> str:
        self.answer = answer
        return "submitted"


SHOP_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("sql", "note", "shell", "refuse", "lookup", "submit")
]


async def shop_rollout(model: Any, scenario: Shopping, wrap: Callable[[Shop], Shop]) -> Any:
    """The user's rollout function; `wrap` is the only thing the two runs do differently."""
    shop = wrap(Shop(scenario))
    client = model.openai_client()
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Answer with the tools."},
            {"role": "user", "content": scenario.question},
        ],
        tools=SHOP_TOOLS,
    )
    for _ in range(6):
        response = await client.chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages(), tools=SHOP_TOOLS
        )
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            break
        for tool_call in choice.message.tool_calls:
            name = tool_call.function.name
            try:
                if name.startswith("_"):
                    raise LookupError(f"no tool {name}")
                result = getattr(shop, name)(**json.loads(tool_call.function.arguments))
                if inspect.isawaitable(result):
                    result = await result
                content = result if isinstance(result, str) else repr(result)
            except Exception as exc:
                content = f"{type(exc).__name__}: {exc}"
            trajectory.messages_and_choices.append({"role": "tool", "tool_call_id": tool_call.id, "content": content})
    # The reward reads the state the rollout left (attributes, the database through its handle).
    (count,) = shop.store.db.execute("SELECT count(*) FROM item").fetchone()
    trajectory.reward = float(shop.answer == scenario.expected) + len(shop.notes) / 10 + count / 100
    return trajectory


def call(name: str, arguments: Any) -> tuple[str, str]:
    return (name, arguments if isinstance(arguments, str) else json.dumps(arguments))


COUNT = "SELECT count(*) FROM item"
SHOP_PLANS: list[list[list[tuple[str, str]]]] = [
    [
        [call("sql", {"query": "DELETE FROM item WHERE price > 2"})],
        [call("sql", {"query": COUNT})],
        [call("submit", {"answer": "1"})],
    ],  # writes, then an answer
    [[call("sql", {"query": COUNT})], [call("submit", {"answer": "3"})]],  # read-only, right
    [
        [call("shell", {"command": "echo out1; echo err1 >&2; echo out2; exit 3"})],
        [call("submit", {"answer": "3"})],
    ],  # streams, non-zero exit
    [[call("shell", {"command": "sleep 5"})], [call("sql", {"query": COUNT})]],  # the tool's own timeout
    [[call("sql", '{"query": "SELECT 1"')], [call("submit", {"answer": "2"})]],  # malformed JSON; a wrong answer
    [
        [call("drop_everything", {})],
        [call("sql", {"query": 5})],
        [call("sql", {"statement": COUNT})],
        [call("sql", {})],
    ],  # unknown tool, wrong type, unknown and missing argument
    [
        [call("note", {"text": "a", "times": "2"}), call("store", {}), call("_private", {}), call("submit", '["3"]')]
    ],  # wrong type; not a tool; not an object
    [
        [call("note", {"text": "n" * 1_000_000})],
        [call("shell", {"command": "head -c 300000 /dev/zero | tr '\\0' x"})],
    ],  # huge argument, huge output
    [
        [
            call("note", {"text": "a"}),
            call("note", {"text": "b", "times": 2}),
            call("lookup", {"name": "pear"}),
            call("sql", {"query": COUNT}),
        ]
    ],  # several in one turn
    [
        [call("refuse", {"why": "no"})],
        [call("sql", {"query": "SELEC oops"})],
        [call("submit", {"answer": "3"})],
    ],  # raises after a change; SQL error
    [
        [call("sql", '{ "query" :\n "SELECT count(*) FROM item" }')],
        [call("submit", {"answer": "3"})],
    ],  # plan 1's calls laid out otherwise
    [],  # no call at all
]
SHOPPING = Shopping("How many items are there?", (("apple", 1.5), ("pear", 2.5), ("plum", 3.0)), "3")


class PlanIds(ScriptedLLM):
    """The scripted policy with call ids from the plan, turn and position, so that two runs whose rollouts the
    scheduler interleaves differently still show the model the same bytes."""

    def answer(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        message = super().answer(messages)
        answers = [m for m in messages if m.get("role") == "assistant"]
        plan = plan_of(str(answers[0]["content"] if answers else message["content"]))
        for i, tool_call in enumerate(message.get("tool_calls", [])):
            tool_call["id"] = f"call_{plan}_{len(answers)}_{i}"
        return message


Epochs = list[tuple[list[str], dict[int, tuple[str, float]]]]


async def run_shop(wrap: Callable[[Shop], Shop]) -> Epochs:
    return await run_group(lambda model: shop_rollout(model, SHOPPING, wrap), SHOP_PLANS)


async def run_group(rollout: Callable[[Any], Awaitable[Any]], plans: Sequence[Any]) -> Epochs:
    """Two epochs of a group of one rollout per plan through ART's gathering: per epoch, the model's requests
    (sorted) and per plan the trajectory's messages and reward."""
    epochs = []
    async with PlanIds(plans) as llm:
        model = art.Model(
            name="parity",
            project="tvcache",
            inference_model_name="scripted",
            inference_base_url=llm.url,
            inference_api_key="none",
        )
        for epoch in range(2):
            seen = len(llm.requests)
            (group,) = await art.gather_trajectory_groups(
                [art.TrajectoryGroup(rollout(model) for _ in plans)], pbar_desc=None
            )
            requests = sorted(json.dumps(body["messages"], sort_keys=True) for body in llm.requests[seen:])
            by_plan = {}
            for trajectory in group.trajectories:
                messages = trajectory.messages()
                first = next(m for m in messages if m["role"] == "assistant")
                by_plan[plan_of(str(first["content"]))] = (
                    json.dumps(messages, sort_keys=True),
                    trajectory.reward,
                )
            assert sorted(by_plan) == list(range(len(plans))), epoch
            epochs.append((requests, by_plan))
    return epochs


def test_cached_tools_show_the_model_what_art_alone_shows_and_pay_the_same() -> None:
    from tvcache.integrations.art import cached_tools, close, results

    shops: list[Shop] = []
    with tvcache.SyncToolCache(max_output_bytes=100_000) as cache:

        def cached(shop: Shop) -> Shop:
            shops.append(cached_tools(shop, cache=cache))
            return shops[-1]

        plain = asyncio.run(run_shop(lambda shop: shop))
        through = asyncio.run(run_shop(cached))
        per_epoch = [
            [r for shop in shops[k * len(SHOP_PLANS) : (k + 1) * len(SHOP_PLANS)] for r in results(shop)]
            for k in (0, 1)
        ]
        for shop in shops:
            close(shop)
        failures = cache.stats()["failures"]

    for epoch, ((requests, by_plan), (requests_cached, by_plan_cached)) in enumerate(zip(plain, through, strict=True)):
        assert requests_cached == requests, epoch  # every request the model got, byte for byte
        for plan in by_plan:
            assert by_plan_cached[plan] == by_plan[plan], (epoch, plan)  # messages and reward
    rewards = {plan: reward for plan, (_, reward) in plain[0][1].items()}
    # The plain run's own rewards, as the user's reward function computes them: a write then a wrong answer (1 item
    # left), right answers, a wrong one, three notes; the cached run's are equal to these (above).
    assert [rewards[k] for k in (0, 1, 2, 4, 8)] == pytest.approx([0.01, 1.03, 1.03, 0.03, 0.33]), rewards
    tool_messages = json.loads(plain[0][1][3][0])
    assert "TimeoutExpired: Command '['bash', '-c', 'sleep 5']' timed out after 1 seconds" in json.dumps(tool_messages)

    first, second = per_epoch
    assert 0 < sum(r.hit for r in first) < len(first)  # plan 10 repeats plan 1's calls
    # The second epoch hits everything but what must run again: the output over the cache's max_output_bytes, and
    # the timed-out call, a failure that is never recorded (it raised in both epochs, so it has no result).
    missed = [r for r in second if not r.hit]
    assert len(second) > 20 and [len(r.output) for r in missed] == [300_010], [r.output for r in missed]
    assert failures == 2


def test_cached_tools_refuse_what_they_cannot_keep_identical() -> None:
    """Outside writes, calls after close, state that does not copy, objects without attributes: clear errors."""
    from tvcache.integrations.art import cached_tools, close

    with tvcache.SyncToolCache() as cache:
        shop = cached_tools(Shop(SHOPPING), cache=cache)
        with pytest.raises(AttributeError, match=r"Shop.answer cannot be changed from outside its methods"):
            shop.answer = "3"
        with pytest.raises(TypeError, match="already goes through tvcache"):
            cached_tools(shop, cache=cache)
        assert shop.sql(COUNT) == "[(3,)]"
        close(shop)
        assert shop.last == [(3,)]  # readable as the rollout left it
        with pytest.raises(RuntimeError, match=r"after close\(\)"):
            shop.sql(COUNT)

        class Counter:  # state in a closure: it would not be the sandbox's
            def __init__(self) -> None:
                n = [0]
                self.bump = lambda: n.append(n[-1] + 1)

        with pytest.raises(TypeError, match=r"Counter's attributes by pickle.*closures"):
            cached_tools(Counter(), cache=cache)
        with pytest.raises(TypeError, match="no attributes of its own"):
            cached_tools({"board": []}, cache=cache)


def test_another_starting_state_is_another_scope_and_a_dropped_object_ends_its_rollout() -> None:
    import gc

    from tvcache.integrations.art import cached_tools, results

    other = dataclasses.replace(SHOPPING, items=(("fig", 9.0),))
    with tvcache.SyncToolCache() as cache:
        seen, factories = [], set()
        for scenario in (SHOPPING, other, SHOPPING):
            shop = cached_tools(Shop(scenario), cache=cache)
            seen.append((shop.sql(COUNT), results(shop)[0].hit))
            factories.add(shop.__dict__["_tvcache"].rollout.rollout._live._sandboxes)
        assert seen == [("[(3,)]", False), ("[(1,)]", False), ("[(3,)]", True)]
        assert len(factories) == 2

        def live() -> int:  # sandboxes open in the two factories (a rollout that is not closed keeps its own)
            return sum(len(factory._live) for factory in factories)

        def settled() -> int:  # a close is handed to the cache's loop: let it run there
            for _ in range(1000):
                if not live():
                    break
                cache._run(asyncio.sleep(0))
            return live()

        # The first two objects are gone and so are their sandboxes; the third rollout only hit: it has none.
        assert settled() == 0
        shop.note("x")  # a miss: the third rollout's sandbox
        assert live() == 1
        del shop
        gc.collect()
        assert settled() == 0


def test_the_tools_example_gives_what_art_alone_gives(tmp_path: Path) -> None:
    """examples/art_rollouts.py (the drop-in as users write it) against its own `--plain` run: per plan, the same
    messages and reward in both epochs; run as a newcomer runs it, the second epoch's calls all hit."""
    tools_example = load_example("art_rollouts")

    def per_plan(steps: list[list[Any]]) -> list[dict[int, tuple[str, float]]]:
        return [
            {
                plan_of(str(t.messages()[2]["content"])): (json.dumps(t.messages(), sort_keys=True), t.reward)
                for t in step
            }
            for step in steps
        ]

    plain = per_plan(asyncio.run(tools_example.main(rollouts=4, cached=False)))
    cached = per_plan(asyncio.run(tools_example.main(rollouts=4)))
    assert cached == plain and all(len(epoch) == 4 for epoch in plain)
    assert [plain[0][k][1] for k in range(4)] == [1.0, 0.0, 1.0, 0.0]

    lines = run_example("art_rollouts", tmp_path)
    assert rewards_of(lines[0]) == rewards_of(lines[1]) == [0.0] * 4 + [1.0] * 4
    assert lines[0].endswith("; 11 of 18 tool calls hit")  # plan 2 repeats plan 0's calls; 0 and 2 run twice
    assert lines[1].endswith("; 18 of 18 tool calls hit"), lines[1]


# -- tool functions of arguments alone, ART•E-style: a search over a read-only inbox -------------------------------

INBOX = Path(tempfile.mkdtemp()) / "inbox.db"  # the corpus: made once, read by the tools, never changed


def make_inbox() -> None:
    if INBOX.exists():
        return
    db = sqlite3.connect(INBOX)
    db.execute("CREATE TABLE email(id TEXT PRIMARY KEY, subject TEXT, body TEXT)")
    db.executemany(
        "INSERT INTO email VALUES (?, ?, ?)",
        [(f"m{i}", f"subject {i} {'offsite' if i % 7 == 0 else 'weekly'}", "body " * (i % 50)) for i in range(3000)],
    )
    db.commit()
    db.close()


def search_inbox(keywords: list[str], limit: int = 5) -> list[dict[str, str]]:
    """Emails whose subject has every keyword."""
    db = sqlite3.connect(f"file:{INBOX}?mode=ro", uri=True)
    where = " AND ".join("subject LIKE ?" for _ in keywords)
    rows = db.execute(f"SELECT id, subject FROM email WHERE {where} LIMIT ?", [*(f"%{k}%" for k in keywords), limit])
    return [{"id": i, "subject": subject} for i, subject in rows]


def read_email(message_id: str) -> tuple[str, str] | None:
    """One email, or None."""
    if not message_id.startswith("m"):
        raise ValueError(f"not a message id: {message_id!r}")
    db = sqlite3.connect(f"file:{INBOX}?mode=ro", uri=True)
    return db.execute("SELECT subject, body FROM email WHERE id = ?", (message_id,)).fetchone()  # type: ignore[no-any-return]


async def count_words(message_id: str) -> int:
    await asyncio.sleep(0)
    found = read_email(message_id)
    return 0 if found is None else len(found[1].split())


def slow_index(rebuild: bool) -> str:
    """A tool with a timeout of its own."""
    subprocess.run(["sleep", "5" if rebuild else "0"], capture_output=True, timeout=1)
    return "indexed"


async def inbox_rollout(model: Any, tools: dict[str, Callable[..., Any]]) -> Any:
    """The user's rollout function, ART•E's shape: a match on the tool name, errors shown to the model, a reward
    from the final answer."""
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "When is the offsite?"}])
    answer = None
    for _ in range(6):
        response = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages()
        )
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            break
        for tool_call in choice.message.tool_calls:
            try:
                args = json.loads(tool_call.function.arguments)
                match tool_call.function.name:
                    case "final_answer":
                        answer = args["answer"]
                        result: Any = "ok"
                    case name if name in tools:
                        result = tools[name](**args)
                        if inspect.isawaitable(result):
                            result = await result
                    case name:
                        raise KeyError(name)
                content = json.dumps(result)
            except Exception as exc:
                content = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
            trajectory.messages_and_choices.append({"role": "tool", "tool_call_id": tool_call.id, "content": content})
    trajectory.reward = float(answer == "m0")
    return trajectory


INBOX_PLANS = [
    [
        [call("search_inbox", {"keywords": ["offsite"]})],
        [call("read_email", {"message_id": "m0"})],
        [call("final_answer", {"answer": "m0"})],
    ],
    [
        [call("search_inbox", {"keywords": ["offsite"], "limit": 5})],
        [call("final_answer", {"answer": "m7"})],
    ],  # defaults given
    [
        [call("search_inbox", '{"keywords": ["offsite"]')],
        [call("read_email", {"message_id": "x1"})],
        [call("read_email", {"message_id": "m99999"})],
    ],  # malformed; raises; None
    [
        [
            call("search_inbox", {"keywords": "offsite"}),
            call("search_inbox", {"keywords": 5}),
            call("read_email", {"id": "m0"}),
            call("delete_all", {}),
        ]
    ],  # wrong types, unknown argument and tool
    [
        [call("search_inbox", {"keywords": ["weekly"], "limit": 3000})],
        [call("count_words", {"message_id": "m49"})],
    ],  # a huge output; async
    [
        [
            call("slow_index", {"rebuild": True}),
            call("slow_index", {"rebuild": False}),
            call("read_email", {"message_id": "m0"}),
        ]
    ],  # a timeout, then more in the turn
    [
        [
            call("search_inbox", {"keywords": ["offsite"]}),
            call("read_email", {"message_id": "m0"}),
            call("count_words", {"message_id": "m0"}),
        ],
        [call("final_answer", {"answer": "m0"})],
    ],
]
INBOX_TOOLS = [search_inbox, read_email, count_words, slow_index]


def test_cached_function_shows_the_model_what_art_alone_shows_and_pays_the_same() -> None:
    from tvcache.integrations.art import cached_function

    make_inbox()
    plain_tools = {fn.__name__: fn for fn in INBOX_TOOLS}
    with tvcache.SyncToolCache(max_output_bytes=50_000) as cache:
        cached_tools = {fn.__name__: cached_function(fn, cache=cache) for fn in INBOX_TOOLS}
        plain = asyncio.run(run_group(lambda model: inbox_rollout(model, plain_tools), INBOX_PLANS))
        through = asyncio.run(run_group(lambda model: inbox_rollout(model, cached_tools), INBOX_PLANS))
        stats = cache.stats()

    for epoch, ((requests, by_plan), (requests_cached, by_plan_cached)) in enumerate(zip(plain, through, strict=True)):
        assert requests_cached == requests, epoch
        assert by_plan_cached == by_plan, epoch
    assert [plain[0][1][k][1] for k in range(len(INBOX_PLANS))] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    seen = json.dumps(plain[0][1])
    for shown in (
        "ValueError: not a message id: 'x1'",
        "TimeoutExpired: Command '['sleep', '5']' timed out after 1 seconds",
        "got an unexpected keyword argument 'id'",
    ):
        assert shown in seen, shown
    # 15 calls reach the tools per epoch (not the malformed one, nor those that fail to bind or name no tool), 12
    # distinct: each runs once, except what must run again in the second epoch (the timeout, a failure; the output
    # over max_output_bytes); the rest hit.
    assert (stats["calls"], stats["executions"], stats["failures"], stats["hits"]) == (30, 14, 2, 16), stats


def test_a_cached_function_called_inside_a_cached_tool_runs_as_part_of_it() -> None:
    """A tool method that calls a decorated function: on a miss the function runs inside the method's execution (on
    the cache's thread, where waiting for the cache would hang), and a hit answers the method as a whole."""
    from tvcache.integrations.art import cached_function, cached_tools, results

    make_inbox()
    cache = tvcache.SyncToolCache()  # not `with`: closing a cache whose loop hangs would hang too
    search = cached_function(search_inbox, cache=cache)

    class Desk:
        def __init__(self) -> None:
            self.found: list[str] = []

        def look(self, keyword: str) -> int:
            self.found += [row["id"] for row in search([keyword], limit=2)]
            return len(self.found)

    answers: list[tuple[int, bool, list[str]]] = []

    def rollouts() -> None:
        for _ in range(2):
            desk = cached_tools(Desk(), cache=cache)
            answers.append((desk.look("offsite"), results(desk)[0].hit, desk.found))

    worker = threading.Thread(target=rollouts, daemon=True)
    worker.start()
    worker.join(120)  # a liveness bound, not a speed check: a hang fails here instead of hanging the run
    assert not worker.is_alive(), "a call never answered"
    cache.close()
    assert answers == [(2, False, ["m0", "m7"]), (2, True, ["m0", "m7"])]


def test_tools_made_inside_a_rollout_are_told_apart_by_what_they_capture() -> None:
    """A tool function, or a class, defined inside the rollout function captures the scenario: the same source with
    other captured values is another scope, never answered from the first one's results; a capture that cannot be
    told apart (it does not pickle) is a clear error, unless `fingerprint=` names it."""
    from tvcache.integrations.art import cached_function, cached_tools

    def make_function(inbox: tuple[str, ...]) -> Callable[[str], list[str]]:
        def search(keyword: str) -> list[str]:
            return [subject for subject in inbox if keyword in subject]

        return search

    def make_class(inbox: tuple[str, ...]) -> type:
        class Box:
            def search(self, keyword: str) -> list[str]:
                return [subject for subject in inbox if keyword in subject]

        return Box

    with tvcache.SyncToolCache() as cache:
        found = []
        for inbox in (("offsite friday",), ("offsite monday",), ("offsite friday",)):
            found.append(cached_function(make_function(inbox), cache=cache)("offsite"))
            found.append(cached_tools(make_class(inbox)(), cache=cache).search("offsite"))
        assert found == [["offsite friday"]] * 2 + [["offsite monday"]] * 2 + [["offsite friday"]] * 2
        assert cache.stats()["hits"] == 2  # the third inbox is the first one again

        lock = threading.Lock()

        def locked(keyword: str) -> str:
            with lock:
                return keyword

        with pytest.raises(TypeError, match=r"locked captures .*lock.* fingerprint="):
            cached_function(locked, cache=cache)
        assert cached_function(locked, cache=cache, fingerprint="v1")("x") == "x"
