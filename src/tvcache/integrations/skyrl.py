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
environment (the same dataset rows, `env_config.db_path` layout, prompts, `<sql>` actions, observations with turn
reminders, `<solution>` parsing and rewards) with its statements executed in tvcache's `SQLiteSandboxes`, one
private copy of the database per rollout. Three differences from SkyRL's own, all deliberate:

- Tables are SQLiteSandboxes' text tables, rows in SQLite's order (SkyRL prints a pandas frame of a `frozenset`,
  whose row order changes between processes); SQL errors read `Error: <message>`.
- A statement that writes (`CREATE TEMP VIEW`, `INSERT`, ...) changes the rollout's own database for its later
  statements (SkyRL rolls every statement back).
- The reward is computed on the rollout's final state, as one cached statement that compares the solution's rows
  with the gold query's as sets, both directions of `EXCEPT` (SkyRL compares `frozenset`s of rows from the original
  file): rollouts that end in the same state with the same solution are graded once. For rollouts that do not
  write, the reward equals SkyRL's; the tests check it.

Importing this module registers it: import it in the process that builds environments (SkyRL's entrypoint, where
custom environments are registered), then select it with `env_class: tvcache_text2sql`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..extras import require

require("skyrl", "tvcache.integrations.skyrl", "skyrl_gym")

import skyrl_gym  # noqa: E402
from skyrl_gym.envs.base_text_env import BaseTextEnv  # noqa: E402
from skyrl_gym.envs.sql.env import SQLEnv  # noqa: E402
from skyrl_gym.envs.sql.utils import verify_format_and_extract  # noqa: E402

from ..calls import Args, Tools  # noqa: E402
from ..rollout import Result  # noqa: E402
from ..sandboxes.base import Sandboxes  # noqa: E402
from ..sandboxes.sqlite import SQLiteSandboxes  # noqa: E402
from ..sync import SyncRollout  # noqa: E402
from .keys import task_key  # noqa: E402
from .process import process_sandboxes, process_sync_cache  # noqa: E402

__all__ = ["CachedTextEnv", "Text2SQLEnv", "answers_one", "same_rows_query"]

ENV_ID = "tvcache_text2sql"
#: Seconds per statement, as SkyRL-SQL's tool allows.
SQL_TIMEOUT = 5.0
#: SkyRL-SQL's observation for an action without a <sql> statement.
INVALID_ACTION = (
    "Your previous action is invalid. Follow the format of outputting thinking process and sql tool, and try again."
)


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


def same_rows_query(predicted: str, gold: str) -> str:
    """One statement answering `1` when `predicted` and `gold` return the same set of rows, else `0` (an error
    when either does not run, or their column counts differ)."""
    a, b = (q.strip().rstrip(";").strip() for q in (predicted, gold))
    left, right = f"SELECT * FROM (\n{a}\n)", f"SELECT * FROM (\n{b}\n)"
    return f"SELECT NOT EXISTS ({left} EXCEPT {right}) AND NOT EXISTS ({right} EXCEPT {left}) AS same_rows"


def answers_one(table: str) -> bool:
    """Whether an SQL output is a one-column, one-row table holding 1 (what `same_rows_query` answers when the
    rows are the same)."""
    lines = table.split("\n")
    return len(lines) == 2 and lines[1].strip() == "1"


class Text2SQLEnv(CachedTextEnv, SQLEnv):
    """SkyRL-SQL's text2sql environment on tvcache's SQLite sandboxes; see the module docstring."""

    def tvcache_sandboxes(self) -> Sandboxes:
        db_file = self.db_file
        return process_sandboxes(("sqlite", db_file), lambda: SQLiteSandboxes(db_file, timeout=SQL_TIMEOUT))

    def _execute_tool(self, tool_group_name: str, tool_name: str, tool_input: Any) -> str:
        _, sql, turns_left = tool_input
        reminder = f"<reminder>You have {turns_left} turns left to complete the task.</reminder>"
        if sql is None:
            observation = INVALID_ACTION
        else:
            result = self.tool_call("sql", {"query": sql})
            observation = f"SQL Timeout:\n{sql}" if result.error else str(result.output)
        return f"\n\n<observation>{observation}\n{reminder}</observation>\n\n"

    def _get_reward(self, action: str, done: bool) -> float:
        if not done:
            return 0
        history = "".join(item["content"] for item in self.chat_history)
        valid, _, predicted, _ = verify_format_and_extract(history)
        if not valid:
            return -1.0
        graded = self.tool_call("sql", {"query": same_rows_query(predicted, self.gold_sql)})
        self._tvcache_metrics["tvcache_graded_from_cache"] = graded.hit
        return 1.0 if not graded.error and answers_one(str(graded.output)) else 0.0


if ENV_ID not in skyrl_gym.registry:
    skyrl_gym.register(id=ENV_ID, entry_point=f"{__name__}:Text2SQLEnv")
