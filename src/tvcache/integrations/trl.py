"""TRL: `GRPOTrainer(environment_factory=...)` environments whose tool calls go through tvcache.

    from tvcache.integrations.trl import cached_environment

    trainer = GRPOTrainer(..., environment_factory=cached_environment(SQLEnv))   # instead of SQLEnv

TRL builds an environment per rollout slot with `environment_factory()`, shows the model the public methods of
its class as tools (their names, signatures and docstrings become the JSON schemas), calls `reset(**row)` with the
dataset row before each rollout, then the methods the model calls, then `get_reward()` if the class has one.

`cached_environment(env)` returns such a factory. Its environments are the class's own, and so is everything that
runs: the user's `reset`, tool methods and `get_reward`, on the user's attributes. What changes is where a tool
method runs. The environment's state (its attributes, as `reset` left them) is the root of a tvcache sandbox, a
`PythonSandboxes` whose state is the instance's attribute dictionary, snapshotted by copy; the task's scope is the
row (`task`) and a digest of that state and of the class's source, so a different starting state can never be
answered from another's results. A tool call is looked up in the cache; on a miss the method's own body runs on the
sandbox's copy of the instance (state it keeps in `self` included), and what it returned, or raised, is recorded
exactly (a `str` as it is, anything else by pickle), so a hit returns or raises the same thing, of the same type.

The instance TRL holds is brought up to date ("materialised") before anything reads it, `get_reward`, a reward
function reading an attribute, the next `reset`: the rollout's sandbox at its final state is built (a rollout that
only hit never had one) and its attributes copied back. Reading an attribute therefore costs a sandbox build when
the rollout's calls all hit; a reward that only calls tool methods (graded through the cache) costs nothing extra.

What a user's environment must allow (the one difference from TRL alone, README "Identical to the framework
alone"): its attributes after `reset` are pickled (to fingerprint and copy the state) and deep-copied (snapshots),
so a handle (a database connection, a client) needs `__getstate__`/`__setstate__` (a SQLite connection can
`serialize()` itself); attributes set on the environment from outside its own methods after `reset` are not seen by
tool methods; a tool method's arguments must be JSON (TRL's are: it parses them from the model's text).

- `env`: the environment class, or a function returning an instance of it (the instance is made by it, then its
  class is swapped for the cached one).
- `task`: the task id of a row; default `task_key(row)`, a hash of the row's content (its prompt and every other
  column), which is the same in every epoch and different for different rows.
- `tools`: annotations (read-only tools, uncacheable ones, key functions). `cache`: a `SyncToolCache`, default
  `process_sync_cache()` (the `TVCACHE_URL` store, else memory). Values other than `str` come back by pickle: a
  shared store must be trusted as the trainer's own code is.

Tool methods run on the cache's event loop thread, one call at a time per sandbox; a sync method blocks TRL's
thread until it answers (as it does without tvcache), an async one is awaited from TRL's own loop. Arguments a
method cannot take (an unknown or missing parameter) raise the class's own `TypeError` and never reach the cache.
`results(env)` lists the `Result` of each call of the environment's current rollout (hit or not, seconds).

Install TRL with `pip install 'tvcache[trl]'`; this module imports nothing from it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import json
import pickle
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from ..calls import ToolCall, Tools
from ..rollout import Result
from ..sandboxes.python import PythonSandbox, PythonSandboxes
from ..sync import SyncRollout, SyncToolCache
from .keys import task_key
from .process import process_sandboxes, process_sync_cache

__all__ = ["cached_environment", "results"]

E = TypeVar("E")

Row = Mapping[str, Any]
State = dict[str, Any]  # an environment's attributes: the sandbox's state

#: Methods of an environment that TRL calls itself and never offers the model as tools.
LIFECYCLE = ("reset", "get_reward")
#: Where the episode lives in an environment's attributes (left out of its state).
EPISODE = "_tvcache"


def cached_environment(
    env: type[E] | Callable[[], E],
    *,
    cache: SyncToolCache | None = None,
    task: Callable[[Row], str] = task_key,
    tools: Tools | None = None,
) -> Callable[[], E]:
    """An `environment_factory` for `GRPOTrainer` whose environments' tool calls go through tvcache; see the
    module docstring."""

    def factory() -> E:
        made = env()
        cls = type(made)
        made.__class__ = _cached_class(cls)
        made.__dict__[EPISODE] = _Episode(cls, cache, task, tools)
        return made

    return factory


def results(env: Any) -> list[Result]:
    """The results of the calls of `env`'s current rollout, in order (empty before its first `reset`)."""
    episode = _episode(env)
    if episode is None:
        raise TypeError(f"{type(env).__name__} was not made by cached_environment()")
    return list(episode.results)


def _episode(env: Any) -> _Episode | None:
    attributes = object.__getattribute__(env, "__dict__")
    return attributes.get(EPISODE)  # type: ignore[no-any-return]


class _Episode:
    """One environment's current tvcache rollout, opened at `reset` and closed at the next."""

    def __init__(
        self,
        cls: type,
        cache: SyncToolCache | None,
        task: Callable[[Row], str],
        tools: Tools | None,
        run: Callable[[Any, State, ToolCall], Awaitable[Any]] | None = None,
        salt: bytes = b"",
    ):
        self.cls, self.cache, self.task, self.tools = cls, cache, task, tools
        self.run = run or _run  # how a tool method runs in the sandbox (ART's treats timeouts as failures)
        self.salt = salt  # more that names the class's behaviour (ART: what its methods capture)
        self.rollout: SyncRollout | None = None
        self.results: list[Result] = []
        self.resetting = False  # the user's reset is running: its own tool calls are part of the root state
        self.stale = False  # tool calls ran in the sandbox since the instance was last brought up to date

    def open(self, env: Any, row: Row) -> None:
        state = {name: value for name, value in env.__dict__.items() if name != EPISODE}
        try:
            root = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"cached_environment copies {self.cls.__qualname__}'s attributes after reset() by pickle, and they "
                f"do not pickle ({type(exc).__name__}: {exc}); give the attribute that holds a handle "
                "__getstate__/__setstate__ (a sqlite3 connection: serialize()/deserialize())"
            ) from exc
        # The class's source and how its methods run (TRL records a timeout, ART does not) name the behaviour.
        behaviour = _source(self.cls) + f"\0{self.run.__module__}.{self.run.__qualname__}\0".encode() + self.salt
        fingerprint = hashlib.blake2b(behaviour + root, digest_size=16).hexdigest()
        cls, run = self.cls, self.run
        sandboxes = process_sandboxes(
            ("tvcache.python-instance", run, cls, fingerprint),
            lambda: PythonSandboxes(functools.partial(pickle.loads, root), functools.partial(run, cls), fingerprint),
        )
        cache = self.cache if self.cache is not None else process_sync_cache()
        self.rollout = cache.open(self.task(row), sandboxes, self.tools)

    def close(self) -> None:
        rollout, self.rollout = self.rollout, None
        self.results, self.stale = [], False
        if rollout is not None:
            rollout.close()

    def current(self, tool: str) -> SyncRollout:
        if self.rollout is None:
            raise RuntimeError(
                f"tool {tool!r} was called before reset(): TRL resets an environment before each rollout "
                "(or, through ART's cached_tools, after close())"
            )
        return self.rollout

    def call(self, tool: str, args: dict[str, Any]) -> Any:
        result = self.current(tool).call(tool, args)
        return self._answer(result)

    async def acall(self, tool: str, args: dict[str, Any]) -> Any:
        # TRL awaits async tool methods on its own loop; the rollout lives on the cache's.
        rollout = self.current(tool).rollout
        result = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(rollout.call(tool, args), rollout.loop))
        return self._answer(result)

    def _answer(self, result: Result) -> Any:
        self.results.append(result)
        self.stale = True
        return _decode(result.output)

    def materialise(self, env: Any) -> None:
        """Copy the rollout's current state into `env`, building its sandbox if the rollout only hit."""
        if not self.stale or self.rollout is None:
            return
        rollout = self.rollout.rollout

        async def pickled() -> bytes:
            async with rollout.sandbox() as box:
                assert isinstance(box, PythonSandbox)
                return pickle.dumps(box.state, protocol=pickle.HIGHEST_PROTOCOL)

        data = asyncio.run_coroutine_threadsafe(pickled(), rollout.loop).result()
        try:
            # Unpickled here, in the caller's thread: a handle the state holds (a sqlite3 connection) is used from it.
            state: State = pickle.loads(data)
        except Exception as exc:
            raise TypeError(
                f"cached_environment copies the rollout's state back into {self.cls.__qualname__}'s attributes by "
                f"pickle, and it does not unpickle ({type(exc).__name__}: {exc}); __setstate__ must rebuild what "
                "__getstate__ returned (a sqlite3 connection: deserialize() before set_authorizer(), as deserialize "
                "runs an ATTACH)"
            ) from exc
        attributes = env.__dict__
        attributes.clear()
        attributes.update(state)
        attributes[EPISODE] = self
        self.stale = False


def _source(cls: type) -> bytes:
    """What identifies the class's behaviour: its source, else (a class made at run time) its qualified name."""
    try:
        return inspect.getsource(cls).encode()
    except (OSError, TypeError):
        return f"{cls.__module__}.{cls.__qualname__}".encode()


async def _run(cls: Any, state: State, call: ToolCall) -> Any:
    """One tool call on the sandbox's state: the class's own method, on an instance whose attributes are the state
    (the same dictionary, so what the method keeps in `self` is the sandbox's new state)."""
    instance = cls.__new__(cls)
    instance.__dict__ = state
    assert isinstance(call.args, dict)  # the tool methods are called with keyword arguments only
    return await recorded(functools.partial(getattr(cls, call.tool), instance, **call.args))


async def recorded(run: Callable[[], Any]) -> Any:
    """What `run()` (a tool's call) returned, or raised, as the store keeps it: a `str` as it is, a JSON value that
    comes back equal, else a pickle (`_decode` gives it back)."""
    try:
        value = run()
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:
        return {"raised": _pickled(exc, exc)}
    if isinstance(value, str):
        return value
    try:
        if type(value) in (int, float, bool, type(None), list, dict) and json.loads(json.dumps(value)) == value:
            return {"json": value}
    except (TypeError, ValueError):
        pass
    return {"pickle": _pickled(value, None)}


def _pickled(value: Any, exc: BaseException | None) -> str:
    """`value` pickled, as text for the store. An exception whose constructor takes other arguments than its
    `args` (it pickles but does not load) is rebuilt without calling it; one that does not pickle at all (a class
    made at run time) becomes a `ToolError` with its message."""
    for candidate in (value, _Rebuilt(exc), ToolError(str(exc))) if exc is not None else (value,):
        try:
            data = pickle.dumps(candidate, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.loads(data)
        except Exception:
            if candidate is value and exc is None:
                raise
            continue
        return data.hex()
    raise AssertionError("a ToolError always pickles")


class _Rebuilt:
    """Pickles as the exception it holds, loaded by `_rebuild` instead of its constructor."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self.exc), self.exc.args, vars(self.exc)))


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], attributes: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc


def _decode(output: Any) -> Any:
    """A tool method's recorded return value, or the exception it raised, raised again."""
    if not isinstance(output, dict):
        return output
    if "json" in output:
        return output["json"]
    if "raised" in output:
        raise pickle.loads(bytes.fromhex(output["raised"]))
    return pickle.loads(bytes.fromhex(output["pickle"]))


class ToolError(Exception):
    """A tool method raised an exception that cannot be copied: this one carries its message (what TRL shows)."""


_classes: dict[type, type] = {}


def _cached_class(cls: Any) -> type:
    """`cls` with its public tool methods going through the episode's rollout, a `reset` that opens a new rollout,
    and attribute reads that see the rollout's state. Keeps the class's name: TRL logs `get_reward` under it."""
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
    namespace["__getattribute__"] = _reading(cls.__getattribute__, frozenset(namespace))
    made = _classes[cls] = type(cls.__name__, (cls,), namespace)
    return made


def _reading(read: Callable[[Any, str], Any], own: frozenset[str]) -> Callable[[Any, str], Any]:
    """Attribute reads that bring the instance up to date first (the tool methods themselves excepted)."""

    def __getattribute__(self: Any, name: str) -> Any:
        if name not in own and not name.startswith("__") and name != EPISODE:
            episode = _episode(self)
            if episode is not None and episode.stale:
                episode.materialise(self)
        return read(self, name)

    return __getattribute__


def _reset(reset: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(reset)
    def wrapper(self: Any, *args: Any, **row: Any) -> Any:
        episode = _episode(self)
        assert episode is not None
        episode.materialise(self)  # TRL's reset sees the previous rollout's final state
        episode.close()
        episode.resetting = True
        try:
            observation = reset(self, *args, **row)
        finally:
            episode.resetting = False
        episode.open(self, row)
        return observation

    return wrapper


def keywords(name: str, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call of `function` (a tool, `self` first if it is a method) by keyword, as the cache keys
    them. Arguments it cannot take raise the function's own `TypeError`: it is called with them, and binding fails
    before its body runs."""
    signature = inspect.signature(function)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        function(*args, **kwargs)
        raise
    given: dict[str, Any] = {}
    for parameter, value in bound.arguments.items():
        kind = signature.parameters[parameter].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)
        elif kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            raise TypeError(f"tvcache calls tool {name!r} by keyword; {parameter!r} cannot be passed so")
        else:
            given[parameter] = value
    return given


def _tool_method(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    self_name = next(iter(inspect.signature(method).parameters))

    def arguments(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        given = keywords(name, method, (self, *args), kwargs)
        del given[self_name]
        return given

    wrapper: Callable[..., Any]
    if inspect.iscoroutinefunction(method):

        async def acall(self: Any, *args: Any, **kwargs: Any) -> Any:
            episode = _episode(self)
            assert episode is not None
            if episode.resetting:
                return await method(self, *args, **kwargs)
            return await episode.acall(name, arguments(self, args, kwargs))

        wrapper = acall
    else:

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            episode = _episode(self)
            assert episode is not None
            if episode.resetting:
                return method(self, *args, **kwargs)
            return episode.call(name, arguments(self, args, kwargs))

        wrapper = call
    return functools.update_wrapper(wrapper, method)
