"""SkyRL-gym: text environments whose tool calls run through tvcache, in SkyRL's thread-pool `step`.

    from tvcache.integrations.skyrl import CachedTextEnv

    class SearchEnv(CachedTextEnv, BaseTextEnv):      # the mixin first
        def tvcache_sandboxes(self) -> tvcache.Sandboxes:
            return process_sandboxes("search", make_search_sandboxes)

Everything an environment runs through `self.tool_call(tool, args)` (and `_execute_tool`, which the mixin routes
there as `tool_call(tool_name, {"args": [...]})`) is a call of this environment's tvcache rollout: opened at the
first call, closed by `env.close()`. Calls block the worker thread SkyRL runs `step` on; the cache itself runs on
the event loop of `process_sync_cache()` (the `TVCACHE_URL` store, or `env_config.tvcache_url`).

**Task ids** come from the dataset row: `task_key` of the prompt `init()` receives and of the row's extra fields
without `max_turns` (which SkyRL's generator adds from its own config). A row has the same content in every epoch,
so the rollouts of a prompt share one graph across epochs; two rows differing in any field never do (two questions
about one database with the same gold query included).

**The worked example**, `Text2SQLEnv`, registered as `env_class: tvcache_text2sql`, is SkyRL-SQL's `text2sql`
environment itself (a subclass of it: the same dataset rows, `env_config.db_path` layout, prompts, parsing, turn
counting, `done` and step outputs) whose statements and reward go through tvcache. On a miss they run SkyRL-gym's
own code, in `Text2SQLSandboxes`: the `sql` tool of its `SQLCodeExecutorToolGroup` (each statement in a
transaction that is rolled back, on the dataset's database file, with SkyRL's timeout, error messages, pandas
table and truncation) and its `compute_score_single` reward. Since SkyRL rolls every statement back, no statement
changes the database: every call is a memo on the task's one state, answered from the cache in any order, and a
statement that writes (`DELETE FROM t`) is as invisible to later ones, and to the reward, as it is in SkyRL.
The tests run SkyRL's `text2sql` next to `tvcache_text2sql` on the same actions and compare every observation and
reward byte for byte.

What tvcache does not reproduce: SkyRL prints a `frozenset` of the rows, whose order depends on the process's
string hash seed; a cached table has the order of the process that ran it first (SkyRL itself differs between
two processes). A statement that times out, or finds the database locked by another rollout's write, answers as
in SkyRL and is not cached.

Importing this module registers it: import it in the process that builds environments (SkyRL's entrypoint, where
custom environments are registered), then select it with `env_class: tvcache_text2sql`.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from ..extras import require

require("skyrl", "tvcache.integrations.skyrl", "skyrl_gym")

import skyrl_gym  # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402
from skyrl_gym.envs.sql.env import SQLEnv  # noqa: E402
from skyrl_gym.envs.sql.utils import compute_score_single, verify_format_and_extract  # noqa: E402
from skyrl_gym.tools import SQLCodeExecutorToolGroup  # noqa: E402

from ..calls import Args, ToolCall, Tools  # noqa: E402
from ..rollout import Result  # noqa: E402
from ..sandboxes.base import Outcome, Sandboxes, refusal  # noqa: E402
from ..sandboxes.lifecycle import ManagedSandbox, ManagedSandboxes  # noqa: E402
from ..sync import SyncRollout  # noqa: E402
from .keys import task_key  # noqa: E402
from .process import process_sandboxes, process_sync_cache  # noqa: E402

__all__ = ["CachedTextEnv", "Text2SQLEnv", "Text2SQLSandboxes"]

ENV_ID = "tvcache_text2sql"
#: Seconds per statement: the default of SkyRL-SQL's `sql` tool, which its environment uses.
SQL_TIMEOUT = 5.0
#: Seconds per query of the reward: `calculate_reward_single`'s default.
REWARD_TIMEOUT = 30.0
#: What the sandbox passes SkyRL's tool as `turns_left`: the tool formats it into the observation's reminder, and
#: the environment puts the rollout's own number there, so that one cached observation serves every turn.
TURNS = "\0turns\0"


class CachedTextEnv(BaseTextEnv):
    """A mixin for SkyRL-gym text environments (put it first in the bases); see the module docstring.

    Override `tvcache_sandboxes()`; optionally `tvcache_task()` and the class attribute `tvcache_tools`
    (annotations: read-only tools, key functions that drop per-step values such as a turn counter)."""

    tvcache_tools: ClassVar[Tools | None] = None

    _tvcache_config: Any
    _tvcache_extras: Mapping[str, Any]
    _tvcache_rollout: SyncRollout | None
    _tvcache_metrics: dict[str, float]
    _tvcache_prompt: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> CachedTextEnv:
        # SkyRL builds environments as cls(env_config=..., extras=...); the mixin reads both here, so that
        # subclasses keep their own __init__ signatures and super() chains untouched.
        self: CachedTextEnv = super().__new__(cls)
        config = kwargs.get("env_config", args[0] if args else None)
        extras = kwargs.get("extras", args[1] if len(args) > 1 else None)
        self._tvcache_config = config
        self._tvcache_extras = dict(extras or {})
        self._tvcache_rollout = None
        self._tvcache_prompt = None
        self._tvcache_metrics = {"tvcache_calls": 0, "tvcache_hits": 0, "tvcache_seconds": 0.0}
        return self

    # -- what a subclass says ------------------------------------------------------------------------------

    def tvcache_sandboxes(self) -> Sandboxes:
        raise NotImplementedError(f"{type(self).__name__} must define tvcache_sandboxes()")

    def tvcache_task(self) -> str:
        """This rollout's task id: a hash of the prompt and of the dataset row's extras (without max_turns)."""
        extras = {k: v for k, v in self._tvcache_extras.items() if k != "max_turns"}
        return task_key({"prompt": self._tvcache_prompt, "extras": extras})

    def init(self, prompt: Any) -> Any:
        self._tvcache_prompt = prompt if self._tvcache_prompt is None else self._tvcache_prompt
        return super().init(prompt)

    # -- calls -----------------------------------------------------------------------------------------------

    def tool_call(self, tool: str, args: Mapping[str, Any] | str | None = None) -> Result:
        """Call `tool` through this environment's rollout, blocking until it answers."""
        return self._counted(self._tvcache_open().call(tool, args))

    def grade(self, tool: str, args: Args | None = None, *, files: Mapping[str, str] | None = None) -> Result:
        """`Rollout.grade` on this environment's final state, blocking."""
        return self._counted(self._tvcache_open().grade(tool, args, files=files))

    def get_metrics(self) -> dict[str, Any]:
        """The environment's own metrics and this rollout's: tool calls, hits, and seconds spent in them."""
        return {**super().get_metrics(), **self._tvcache_metrics}

    def _counted(self, result: Result) -> Result:
        metrics = self._tvcache_metrics
        metrics["tvcache_calls"] += 1
        metrics["tvcache_hits"] += result.hit
        metrics["tvcache_seconds"] += result.seconds
        return result

    def _execute_tool(self, tool_group_name: str, tool_name: str, tool_input: Any) -> Any:
        return self.tool_call(tool_name, {"args": list(tool_input)}).output

    def close(self) -> None:
        try:
            if self._tvcache_rollout is not None:
                rollout, self._tvcache_rollout = self._tvcache_rollout, None
                rollout.close()
        finally:
            super().close()

    def _tvcache_open(self) -> SyncRollout:
        if self._tvcache_rollout is None:
            config = self._tvcache_config
            url = config.get("tvcache_url") if isinstance(config, Mapping) else getattr(config, "tvcache_url", None)
            sync = process_sync_cache(url)
            self._tvcache_rollout = sync.open(self.tvcache_task(), self.tvcache_sandboxes(), self.tvcache_tools)
        return self._tvcache_rollout


class Text2SQLSandboxes(ManagedSandboxes["_Text2SQLSandbox", None]):
    """SkyRL-SQL's statements and reward on one database, as a tvcache sandbox factory; see the module docstring.

    Tools: `sql` `{"query": str}` answers SkyRL's observation of the statement (its `<reminder>` naming `TURNS`
    turns), `reward` `{"predicted": str, "gold": str}` answers SkyRL's score. Both run on the database file itself,
    as SkyRL's do, and roll back everything: the state never changes, so a snapshot is a name. The fingerprint
    covers the file's path (SkyRL's error messages show it) and content, and the versions of skyrl-gym and pandas
    (which print the tables)."""

    kind = "skyrl-sql"

    def __init__(self, db_path: str, db_id: str, *, timeout: float = SQL_TIMEOUT) -> None:
        super().__init__()
        self.db_file = os.path.join(db_path, db_id, db_id + ".sqlite")
        self._db_id, self._timeout = db_id, timeout
        self._tools = SQLCodeExecutorToolGroup(db_file_path=db_path)
        h = hashlib.blake2b(digest_size=16)
        versions = (importlib.metadata.version(p) for p in ("skyrl-gym", "pandas"))
        h.update(f"{self.db_file}\0{timeout!r}\0{' '.join(versions)}\0".encode())
        with open(self.db_file, "rb") as f:
            h.update(hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).digest())
        self._fingerprint = f"skyrl-sql-{h.hexdigest()}"

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    async def create(self) -> _Text2SQLSandbox:
        self._check_open()
        return _Text2SQLSandbox(self)

    async def restore(self, snapshot_id: str) -> _Text2SQLSandbox:
        self._lookup(snapshot_id)
        return _Text2SQLSandbox(self)

    async def delete(self, snapshot_id: str) -> None:
        self._forget(snapshot_id)

    def _run(self, call: ToolCall) -> Outcome:
        """One call, on a worker thread (SkyRL's code blocks while its own thread runs the statement)."""
        args = call.args if isinstance(call.args, dict) else {}
        start = time.monotonic()
        if call.tool == "sql" and set(args) == {"query"} and isinstance(args["query"], str):
            text = self._tools.sql(self._db_id, args["query"], TURNS, timeout=self._timeout)
            # A timeout, or a lock held by a concurrent rollout's uncommitted write, is an answer of the moment.
            passing = time.monotonic() - start >= self._timeout or "database is locked" in text
            return Outcome(text, changed=False, error=passing)
        if (
            call.tool == "reward"
            and set(args) == {"predicted", "gold"}
            and all(isinstance(v, str) for v in args.values())
        ):
            # The predicted query as the one solution of a well-formed completion, which SkyRL's reward extracts
            # again exactly (it was extracted from one): the reward is SkyRL's own function, whole.
            completion = f"<think></think><solution>{args['predicted']}</solution>"
            score = compute_score_single(completion, args["gold"], self.db_file)
            return Outcome(score, changed=False, error=time.monotonic() - start >= REWARD_TIMEOUT)
        return refusal(
            'Error: the skyrl-sql sandbox has the tools sql {"query": str} and reward {"predicted": str, "gold": str}; '
            f"got {call.key[:200]}"
        )


class _Text2SQLSandbox(ManagedSandbox):
    def __init__(self, factory: Text2SQLSandboxes) -> None:
        super().__init__(factory)
        self._factory = factory

    async def execute(self, call: ToolCall) -> Outcome:
        async with self._turn():
            return await asyncio.to_thread(self._factory._run, call)

    async def snapshot(self) -> str:
        async with self._turn():
            return self._factory._keep(None)


class Text2SQLEnv(CachedTextEnv, SQLEnv):
    """SkyRL-SQL's text2sql environment with its statements and reward through tvcache; see the module docstring."""

    tvcache_tools = Tools(read_only={"sql", "reward"})

    def tvcache_sandboxes(self) -> Sandboxes:
        db_path, db_id = self.db_path, self.db_id  # as SkyRL's tool group gets them
        return process_sandboxes(("skyrl-sql", self.db_file), lambda: Text2SQLSandboxes(db_path, db_id))

    def _execute_tool(self, tool_group_name: str, tool_name: str, tool_input: Any) -> str:
        _, sql, turns_left = tool_input
        if sql is None:  # SkyRL's tool answers that the action is invalid, without touching the database
            return str(BaseTextEnv._execute_tool(self, tool_group_name, tool_name, tool_input))
        observation = str(self.tool_call("sql", {"query": sql}).output)
        before, _, after = observation.rpartition(TURNS)  # the reminder comes last, after the statement's text
        return f"{before}{turns_left}{after}"

    def _get_reward(self, action: str, done: bool) -> float:
        if not done:
            return 0
        history = "".join(item["content"] for item in self.chat_history)
        valid, _, predicted, _ = verify_format_and_extract(history)
        if not valid:
            return -1.0  # what SkyRL's reward answers, before it runs anything
        graded = self.tool_call("reward", {"predicted": predicted, "gold": self.gold_sql})
        self._tvcache_metrics["tvcache_graded_from_cache"] = graded.hit
        return graded.output  # type: ignore[no-any-return]  # SkyRL's score, a number


if ENV_ID not in skyrl_gym.registry:
    skyrl_gym.register(id=ENV_ID, entry_point=f"{__name__}:Text2SQLEnv")
