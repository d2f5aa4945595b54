"""TRL: `GRPOTrainer(environment_factory=...)` environments whose tool methods run through tvcache.

    from tvcache.integrations import process_sandboxes
    from tvcache.integrations.trl import cached_environment

    def databases(row):                                  # the row's sandbox factory, one per database
        return process_sandboxes(row["db"], lambda: tvcache.SQLiteSandboxes(row["db"]))

    trainer = GRPOTrainer(..., environment_factory=cached_environment(SQLEnv, databases))

TRL builds an environment per rollout slot with `environment_factory()`, shows the model the public methods of
its class as tools (their names, signatures and docstrings become the JSON schemas), calls `reset(**row)` with the
dataset row before each rollout, then the methods the model calls, then `get_reward()` if the class has one.

`cached_environment(env, sandboxes)` returns such a factory. Its environments are the class's own (the same
`reset`, `get_reward` and attributes) with every public tool method replaced by one of the same name, signature and
docstring that sends the call, with its arguments bound by parameter name, to the tool of the same name in a tvcache
sandbox: `sql(query)` is the call `sql {"query": ...}` that `SQLiteSandboxes` answers, `bash(command)`,
`read_file(path)`, `write_file(path, content)` are `WorkspaceSandboxes`'s. The methods' own bodies do not run:
they are what the environment does without tvcache. Each `reset` closes the previous rollout and opens a new one,
before the class's own `reset` runs (so tool calls it makes are part of the rollout); a `get_reward` (or a reward
function given the environments) that calls tool methods grades the final state through the same rollout, so
rollouts that end in the same state are graded once.

- `env`: the environment class, or a function returning an instance of it (the instance is made by it, then its
  class is swapped for the cached one).
- `sandboxes`: the sandbox factory, or a function of the dataset row returning it. Rollouts of a task must get the
  same factory object (its snapshots can be restored only by it): see `process_sandboxes`.
- `task`: the task id of a row; default `task_key(row)`, a hash of the row's content (its prompt and every other
  column), which is the same in every epoch and different for different rows.
- `tools`: annotations (read-only tools, uncacheable ones, key functions). `cache`: a `SyncToolCache`, default
  `process_sync_cache()` (the `TVCACHE_URL` store, else memory).

A sync tool method blocks TRL's thread until the cache's event loop answers; an async one awaits it from TRL's own
loop. Arguments the model got wrong (an unknown or missing parameter) raise the same `TypeError` as the class's
own method, which TRL shows the model as an error, and never reach the cache. `results(env)` lists the `Result`
of each call of the environment's current rollout (hit or not, seconds), for metrics.

Install TRL with `pip install 'tvcache[trl]'`; this module imports nothing from it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..calls import Tools
from ..rollout import Result
from ..sandboxes.base import Sandboxes
from ..sync import SyncRollout, SyncToolCache
from .keys import task_key
from .process import process_sync_cache

__all__ = ["cached_environment", "results"]

E = TypeVar("E")

Row = Mapping[str, Any]

#: Methods of an environment that TRL calls itself and never offers the model as tools.
LIFECYCLE = ("reset", "get_reward")


def cached_environment(
    env: type[E] | Callable[[], E],
    sandboxes: Sandboxes | Callable[[Row], Sandboxes],
    *,
    cache: SyncToolCache | None = None,
    task: Callable[[Row], str] = task_key,
    tools: Tools | None = None,
) -> Callable[[], E]:
    """An `environment_factory` for `GRPOTrainer` whose environments send their tool calls through tvcache; see
    the module docstring."""
    pick = sandboxes if callable(sandboxes) and not isinstance(sandboxes, Sandboxes) else (lambda row: sandboxes)

    def factory() -> E:
        made = env()
        made.__class__ = _cached_class(type(made))
        made._tvcache = _Episode(cache, pick, task, tools)  # type: ignore[attr-defined]
        return made

    return factory


def results(env: Any) -> list[Result]:
    """The results of the calls of `env`'s current rollout, in order (empty before its first `reset`)."""
    episode: _Episode | None = getattr(env, "_tvcache", None)
    if episode is None:
        raise TypeError(f"{type(env).__name__} was not made by cached_environment()")
    return list(episode.results)


class _Episode:
    """One environment's current tvcache rollout, opened at `reset` and closed at the next."""

    def __init__(
        self,
        cache: SyncToolCache | None,
        sandboxes: Callable[[Row], Sandboxes],
        task: Callable[[Row], str],
        tools: Tools | None,
    ) -> None:
        self.cache, self.sandboxes, self.task, self.tools = cache, sandboxes, task, tools
        self.rollout: SyncRollout | None = None
        self.results: list[Result] = []

    def open(self, row: Row) -> None:
        self.close()
        cache = self.cache if self.cache is not None else process_sync_cache()
        self.rollout = cache.open(self.task(row), self.sandboxes(row), self.tools)

    def close(self) -> None:
        rollout, self.rollout = self.rollout, None
        self.results = []
        if rollout is not None:
            rollout.close()

    def current(self, tool: str) -> SyncRollout:
        if self.rollout is None:
            raise RuntimeError(
                f"tool {tool!r} was called before reset(): TRL resets an environment before each rollout"
            )
        return self.rollout

    def call(self, tool: str, args: dict[str, Any]) -> Any:
        result = self.current(tool).call(tool, args)
        self.results.append(result)
        return result.output

    async def acall(self, tool: str, args: dict[str, Any]) -> Any:
        # TRL awaits async tool methods on its own loop; the rollout lives on the cache's.
        rollout = self.current(tool).rollout
        result = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(rollout.call(tool, args), rollout.loop))
        self.results.append(result)
        return result.output


_classes: dict[type, type] = {}


def _cached_class(cls: Any) -> type:
    """`cls` with its public tool methods sending calls through the episode's rollout, and a `reset` that opens a
    new rollout first. Keeps the class's name: TRL logs an environment's `get_reward` under it."""
    if cls in _classes:
        return _classes[cls]
    if not callable(getattr(cls, "reset", None)):
        raise TypeError(f"{cls.__qualname__} has no reset(): TRL requires one of every environment")
    namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    # TRL lists tools with inspect.getmembers(type(env), inspect.isfunction): the same list here.
    for name, method in inspect.getmembers(cls, predicate=inspect.isfunction):
        if not name.startswith("_") and name not in LIFECYCLE:
            namespace[name] = _tool_method(name, method)
    namespace["reset"] = _reset(cls.reset)
    made = _classes[cls] = type(cls.__name__, (cls,), namespace)
    return made


def _reset(reset: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(reset)
    def wrapper(self: Any, *args: Any, **row: Any) -> Any:
        self._tvcache.open(row)
        return reset(self, *args, **row)

    return wrapper


def _tool_method(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(method)

    def arguments(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            # Arguments the method cannot take: its own call raises the TypeError TRL would see without tvcache
            # (binding fails before the body runs).
            method(self, *args, **kwargs)
            raise
        bound.apply_defaults()
        given = dict(bound.arguments)
        given.pop(next(iter(signature.parameters)))  # self
        return given

    wrapper: Callable[..., Any]
    if inspect.iscoroutinefunction(method):

        async def acall(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await self._tvcache.acall(name, arguments(self, args, kwargs))

        wrapper = acall
    else:

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._tvcache.call(name, arguments(self, args, kwargs))

        wrapper = call
    return functools.update_wrapper(wrapper, method)
