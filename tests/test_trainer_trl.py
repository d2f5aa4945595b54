"""TRL: environments made by `cached_environment`, next to the same environment class alone, as GRPOTrainer drives them.

What TRL does with an environment is checked against TRL 1.16 itself where it can be called on its own
(`GRPOTrainer.__init__` probes the factory and builds the tool list and schemas from the class); the per-rollout loop
(`_tool_call_loop`) cannot run without generating, so `dispatch` below does what it does, step for step: a tool
name the environment lacks is `ValueError("Tool <name> not found.")`, a method is called with `**arguments`, an
exception becomes `{"error": str(exc)}`, a result becomes `str(result)` unless it is a list; async methods are
awaited together on TRL's own event loop. The scripted policies include adversarial calls; the oracle is the plain
class (every observation and reward must be equal, byte for byte, over two epochs of the same pooled instances).
The real SmolLM2 model and a full GRPO step, with and without tvcache, run in tests/test_grpo.py.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import sqlite3
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # TRL imports weave, whose error reports go nowhere here
pytest.importorskip("trl", reason="needs TRL (pip install 'tvcache[trl]')")

from transformers.utils import get_json_schema
from trl.trainer.utils import start_event_loop_in_daemon

import tvcache
from tvcache.integrations.trl import cached_environment, results


class Store:
    """A database handle as a user keeps one in `self`; it copies by its content (`serialize`)."""

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.db.executescript("CREATE TABLE item(id INTEGER PRIMARY KEY, name TEXT); INSERT INTO item VALUES (1,'a');")

    def __getstate__(self) -> bytes:
        return self.db.serialize()

    def __setstate__(self, content: bytes) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.db.deserialize(content)


class Refusal(Exception):
    """An exception whose constructor takes more than a message (it does not unpickle as it pickles)."""

    def __init__(self, tool: str, why: str) -> None:
        super().__init__(f"{tool} refused: {why}")


class Shop:
    """An environment as TRL users write them: its state in `self`, tools that return other types than `str`,
    raise, shell out, and a `get_reward` that reads the state."""

    def reset(self, **row: Any) -> str:
        self.store = Store()
        self.last: Any = None
        self.notes: list[str] = []
        self.calls = 0
        return f"Task {row['task']}"

    def sql(self, query: str) -> str:
        """Run one SQLite statement.

        Args:
            query: The statement.
        """
        self.calls += 1
        self.last = self.store.db.execute(query).fetchall()
        return str(self.last)

    def note(self, text: str, times: int = 1) -> tuple[int, str]:
        """Keep a note.

        Args:
            text: The note.
            times: How often.
        """
        self.notes.extend([text] * times)
        return len(self.notes), text

    def shell(self, command: str) -> str:
        """Run a shell command.

        Args:
            command: The command.
        """
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=0.5)
        return f"exit {done.returncode}\n{done.stdout}--\n{done.stderr}"

    def refuse(self, why: str) -> str:
        """Refuse.

        Args:
            why: The reason.
        """
        self.notes.append("refused")  # a change before the exception: kept, as without tvcache
        raise Refusal("refuse", why)

    def get_reward(self) -> float:
        return float(self.last == [(2,)]) + len(self.notes) / 10


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


COUNT = "SELECT count(*) FROM item"
# Scripted policies: a rollout is a list of turns, a turn the tool calls of one assistant message.
POLICIES = [
    [[call("sql", {"query": "INSERT INTO item(name) VALUES ('b')"})], [call("sql", {"query": COUNT})]],  # writes
    [[call("sql", {"query": COUNT})]],  # read-only: the first epoch's second rollout of it hits
    [[call("shell", {"command": "echo out1; echo err1 >&2; echo out2; exit 3"})]],  # interleaved, non-zero exit
    [[call("shell", {"command": "sleep 5"})], [call("sql", {"query": COUNT})]],  # the method's own timeout
    [[call("sql", '{"query": "SELECT 1"')]],  # malformed JSON: TRL passes the text on as it is
    [[call("drop_everything", {})], [call("sql", {"query": 5})], [call("sql", {"statement": COUNT})]],  # unknown, wrong
    [[call("note", {"text": "n" * 3_000_000})], [call("sql", {"query": "SELECT name FROM item"})]],  # huge
    [[call("note", {"text": "a"}), call("note", {"text": "b", "times": 2}), call("sql", {"query": COUNT})]],  # several
    [[call("refuse", {"why": "no"})], [call("sql", {"query": "SELEC oops"})]],  # raising after a change; SQL error
    [[call("sql", {"query": "INSERT INTO item(name) VALUES ('b')"})], [call("note", {"text": "x"})]],
    [],  # no call at all
]


def dispatch(env: Any, turn: list[dict[str, Any]], trl_loop: asyncio.AbstractEventLoop) -> list[Any]:
    """One assistant message's tool calls, answered as GRPOTrainer._tool_call_loop answers them (TRL 1.16)."""
    methods = {name: getattr(env, name) for name in tools_of(env)}
    sync = {name: m for name, m in methods.items() if not inspect.iscoroutinefunction(m)}
    asynchronous = {name: m for name, m in methods.items() if inspect.iscoroutinefunction(m)}
    answers: list[tuple[str, Any]] = []
    coroutines = []
    for tool_call in turn:
        function = tool_call["function"]
        name = function["name"]
        try:
            if name in sync:
                answers.append((name, sync[name](**function["arguments"])))
            elif name in asynchronous:
                coroutines.append((name, asynchronous[name](**function["arguments"])))
            else:
                raise ValueError(f"Tool {name} not found.")
        except Exception as exc:
            answers.append((name, {"error": str(exc)}))
    if coroutines:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(c for _, c in coroutines), return_exceptions=True)

        done = asyncio.run_coroutine_threadsafe(gather(), trl_loop).result()
        for (name, _), result in zip(coroutines, done, strict=True):
            answers.append((name, {"error": str(result)} if isinstance(result, Exception) else result))
    return [{"role": "tool", "name": name, "content": r if isinstance(r, list) else str(r)} for name, r in answers]


def tools_of(env: Any) -> list[str]:
    """The tools TRL finds on an environment (inspect.getmembers of its class, as GRPOTrainer.__init__ does)."""
    return [
        name
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def state_reward(completions: list[Any], environments: list[Any], **_: Any) -> list[float]:
    """A reward function reading the environments' attributes, as TRL passes them."""
    return [
        float(getattr(env, "calls", 0)) + len(getattr(env, "notes", getattr(env, "seen", None))) for env in environments
    ]


def epochs(factory: Callable[[], Any], policies: list[Any], count: int = 2) -> list[Any]:
    """`count` epochs of `policies` on one pool of instances, as GRPOTrainer runs them: per rollout `reset(**row)`,
    the turns' tool calls, then the reward function and `get_reward`. Everything the model or the trainer sees."""
    seen: list[Any] = []
    thread, trl_loop, ready = start_event_loop_in_daemon(name="trl-like")
    ready.wait()
    try:
        pool = [factory() for _ in policies]
        for epoch in range(count):
            row = {"task": "shop", "prompt": [{"role": "user", "content": "Count the items."}]}
            for env, policy in zip(pool, policies, strict=True):
                seen.append(("reset", epoch, env.reset(**row)))
                for turn in policy:
                    seen.append(dispatch(env, turn, trl_loop))
            seen.append(("rewards", state_reward([], pool), [env.get_reward() for env in pool]))
    finally:
        trl_loop.call_soon_threadsafe(trl_loop.stop)
        thread.join(timeout=10)
    return seen


def test_parity_with_the_plain_environment_over_two_epochs() -> None:
    with tvcache.SyncToolCache() as cache:
        expected = epochs(Shop, POLICIES)
        pool: list[Any] = []

        def cached() -> Any:
            pool.append(cached_environment(Shop, cache=cache)())
            return pool[-1]

        got = epochs(cached, POLICIES)
        second_epoch = [[r.hit for r in results(env)] for env in pool]
        stats = cache.stats()
    assert got == expected
    # What the observations must be, as TRL alone shows them:
    tool_answers = [m["content"] for turn in expected if isinstance(turn, list) for m in turn]
    assert "[(2,)]" in tool_answers  # the method's own format
    assert "exit 3\nout1\nout2\n--\nerr1\n" in tool_answers
    assert any("timed out after 0.5 seconds" in a for a in tool_answers)
    assert "Tool drop_everything not found." in str(tool_answers)
    assert "refuse refused: no" in str(tool_answers) and 'near "SELEC": syntax error' in str(tool_answers)
    assert any("Shop.sql() argument after ** must be a mapping, not str" in a for a in map(str, tool_answers))
    assert expected[-1][2][0] == 1.0 and expected[-1][2][7] == pytest.approx(0.3)  # get_reward read self
    # The second epoch's rollouts hit (the timeout is a failure, never cached; so is the huge output, past the
    # cache's size limit) and their instances were brought up to date for the rewards.
    assert all(all(hits) for i, hits in enumerate(second_epoch) if i not in (3, 6))
    assert stats["mismatches"] == 0


class Returning(Shop):
    """An environment whose reset() does not start everything over: it sees what the previous rollout left."""

    def reset(self, **row: Any) -> str:
        before = getattr(self, "notes", [])
        super().reset(**row)
        self.notes = before[-2:]
        return f"notes kept: {before[-2:]}"


def test_reset_sees_the_previous_rollouts_final_state() -> None:
    with tvcache.SyncToolCache() as cache:
        assert epochs(cached_environment(Returning, cache=cache), POLICIES) == epochs(Returning, POLICIES)


def test_a_rollout_that_only_hit_is_materialised_before_get_reward_reads_it() -> None:
    writes = [[[call("sql", {"query": "INSERT INTO item(name) VALUES ('b')"})], [call("sql", {"query": COUNT})]]]
    with tvcache.SyncToolCache() as cache:
        factory = cached_environment(Shop, cache=cache)
        first = epochs(factory, writes, count=1)
        fresh = factory()  # a new instance, whose rollout will only hit
        seen = epochs(lambda: fresh, writes, count=1)
        assert all(r.hit for r in results(fresh))
    assert seen[-1] == first[-1] == ("rewards", [2.0], [1.0])


def test_trl_builds_the_same_tools_and_schemas() -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tvcache_bench.workloads.grpo.model import load_model, load_tokenizer

    with tvcache.SyncToolCache() as cache:
        tools = {}
        rewards = {}
        for name, factory in (("plain", Shop), ("cached", cached_environment(Shop, cache=cache))):
            config = GRPOConfig(output_dir="/tmp/tvcache-trl-test", use_cpu=True, report_to="none", max_steps=1)
            trainer = GRPOTrainer(
                model=load_model(),
                processing_class=load_tokenizer(),
                reward_funcs=state_reward,
                args=config,
                train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "q"}], "task": "t"}]),
                environment_factory=factory,
            )
            tools[name] = [(fn.__name__, get_json_schema(fn)) for fn in trainer._env_tools[None]]
            rewards[name] = trainer.reward_func_names
    assert tools["cached"] == tools["plain"]
    assert [name for name, _ in tools["plain"]] == ["note", "refuse", "shell", "sql"]
    assert rewards["cached"] == rewards["plain"] == ["state_reward", "Shop"]  # get_reward, under the class's name


class Unpicklable:
    def reset(self, **row: Any) -> None:
        self.lock = __import__("threading").Lock()

    def sql(self, query: str) -> str:
        """Run.

        Args:
            query: The statement.
        """
        return query


def test_state_that_cannot_be_copied_is_a_clear_error_at_reset() -> None:
    with tvcache.SyncToolCache() as cache:
        env = cached_environment(Unpicklable, cache=cache)()
        with pytest.raises(TypeError, match=r"Unpicklable's attributes after reset\(\) .*__getstate__"):
            env.reset(task="t")


class Sealed:
    """Pickles, but does not unpickle: as a sqlite3 connection whose authorizer refuses deserialize()'s ATTACH."""

    def __init__(self) -> None:
        self.handle = 1  # pickle calls __setstate__ only for a non-empty state

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("sealed")


class Sealing:
    def reset(self, **row: Any) -> None:
        self.box: Sealed | None = None

    def seal(self, why: str) -> str:
        """Seal.

        Args:
            why: The reason.
        """
        self.box = Sealed()
        return why

    def get_reward(self) -> float:
        return 1.0


def test_state_that_cannot_be_copied_back_is_a_clear_error_where_it_is_read() -> None:
    with tvcache.SyncToolCache() as cache:
        env = cached_environment(Sealing, cache=cache)()
        env.reset(task="t")
        assert env.seal("x") == "x"
        with pytest.raises(TypeError, match=r"back into Sealing's attributes .*RuntimeError: sealed.*__setstate__"):
            env.get_reward()


class AsyncBook:
    """An environment with async tool methods, which TRL awaits on its own event loop."""

    def reset(self, **row: Any) -> None:
        self.seen: list[str] = []

    async def look(self, key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        await asyncio.sleep(0)
        self.seen.append(key)
        if key == "bad":
            raise KeyError(key)
        return f"{key}={len(self.seen)}"

    def get_reward(self) -> float:
        return float(len(self.seen))


def test_async_tools_stay_async_and_match_the_plain_class() -> None:
    policies = [[[call("look", {"key": "a"}), call("look", {"key": "bad"})], [call("look", {"key": "b"})]]] * 2
    with tvcache.SyncToolCache() as cache:
        env = cached_environment(AsyncBook, cache=cache)()
        assert inspect.iscoroutinefunction(env.look)
        assert get_json_schema(env.look) == get_json_schema(AsyncBook().look)
        with pytest.raises(RuntimeError, match="before reset"):
            asyncio.run(env.look("a"))
        assert epochs(cached_environment(AsyncBook, cache=cache), policies) == epochs(AsyncBook, policies)


@pytest.mark.slow
def test_the_example_trains_a_step_as_written() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "trl_text2sql.py")],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calls hit" in done.stdout  # the cache's figures, per step
    rewards = [line for line in done.stdout.splitlines() if line.startswith("rewards [")][-1]
    assert len(eval(rewards.removeprefix("rewards "))) == 2
