"""ART (OpenPipe's Agent Reinforcement Trainer): rollout functions whose tool calls go through tvcache.

An ART rollout function is the user's own code: it asks the model (an OpenAI-compatible client), runs the tools the
model called, and returns an `art.Trajectory` with the messages and a reward. ART has no tool layer to swap, so the
drop-in wraps what the tools live on.

**Tools over Python state** (`cached_tools`). The tools are methods of a state object the rollout makes (a game, a
database, an inbox):

    async def rollout(model: art.Model, scenario: Scenario) -> art.Trajectory:
        shop = cached_tools(Shop(scenario))              # was: shop = Shop(scenario); nothing else changes
        ...
        result = getattr(shop, tool_call.function.name)(**json.loads(tool_call.function.arguments))
        ...
        trajectory.reward = shop.reward()

`cached_tools(obj)` returns `obj` itself, its tool methods (its public functions) going through a tvcache rollout.
The object's attributes as it was made are the root of a `PythonSandboxes` (snapshotted by copy), and the scope is
a digest of that state and of the class's source, so rollouts that start from the same state share results and
different starting states never do. A call is looked up in the cache; on a miss the method's own body runs on the
sandbox's copy of the object (what it keeps in `self` included), and what it returned, or raised, is recorded
exactly (a `str` as it is, anything else by pickle), so a hit returns or raises the same thing, of the same type.
A method that raises `TimeoutError` or `subprocess.TimeoutExpired` failed: its exception reaches the rollout as it
would without tvcache, nothing is recorded, and the next call starts from the state before it.

Reading an attribute of the object from outside (`shop.answer` in the reward) first brings it up to date
("materialises" it): the rollout's sandbox at its current state is built (a rollout that only hit never had one)
and its attributes are copied back. Setting one from outside raises `AttributeError`: the sandbox would never see
it. The tvcache rollout ends when the object is garbage-collected (when the rollout function returns, for a local
variable) or at `close(obj)`.

What the object must allow (the differences from ART alone, docs/frameworks/art.md): its attributes are pickled
(to fingerprint and copy the state) and deep-copied (snapshots), so a handle (a database connection) needs
`__getstate__`/`__setstate__`; state kept outside it (globals, files, a closure) is not the sandbox's, and a hit
does not run the method; arguments must be JSON values (a model's are). Methods run on the cache's thread, one call
at a time per sandbox: a plain method blocks the rollout's event loop until it answers (as it does without
tvcache), an async one is awaited. `results(obj)` lists the `Result` of each call (hit or not, seconds).

**Tool functions of their arguments alone** (`cached_function`). ART•E's tools search a fixed inbox: plain functions
whose result depends only on their arguments. Decorate them (`@cached_function`) and call them as before; a call is
answered from the cache, or runs the function and records what it returned or raised, as above.

**Tools in a sandbox** (`cached_rollout`). Tools that work on files or a shell belong in a tvcache sandbox
(`WorkspaceSandboxes`, `DockerSandboxes`): decorate the rollout function, and call them through
`tvcache.current_rollout()`:

    @cached_rollout(sandboxes=boxes, cache=cache)
    async def rollout(model: art.Model, scenario: Scenario) -> art.Trajectory:
        r = tvcache.current_rollout()                     # this rollout, at its scenario's task
        result = await r.call(*tvcache.parse_tool_call(tool_call))
        reward = (await r.grade("bash", {"command": "pytest -q"})).output

The decorator opens a tvcache rollout around each call of the rollout function. The task id comes from the scenario
argument: `task_key(scenario)`, a hash of its content, the same for the rollouts of a group and in every epoch;
pass `task=` to use the scenario's own id. `sandboxes` may be a function of the scenario; it must return the same
factory object for the same scenario, since a factory's snapshots can be restored only by it (`process_sandboxes`).

Nothing here imports ART. Install it with `pip install 'tvcache[art]'`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import pickle
import subprocess
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from ..cache import ToolCache
from ..calls import ToolCall, Tools
from ..functions import _fingerprint, captured
from ..rollout import Result
from ..sandboxes.base import Sandboxes
from ..sandboxes.python import PythonSandboxes
from ..sync import SyncRollout, SyncToolCache
from . import trl
from .keys import task_key
from .process import process_cache, process_sandboxes, process_sync_cache

__all__ = ["cached_function", "cached_rollout", "cached_tools", "close", "results"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

#: Exceptions that mean a tool method failed rather than answered: never recorded.
TIMEOUTS = (TimeoutError, subprocess.TimeoutExpired)


def cached_tools(
    obj: T, *, task: str | None = None, cache: SyncToolCache | None = None, tools: Tools | None = None
) -> T:
    """`obj`, its public methods (the tools) going through a tvcache rollout; see the module docstring.

    - `task`: the task id (default: the class's qualified name; the scope is the object's starting state anyway).
    - `cache`: a `SyncToolCache`, default `process_sync_cache()` (the `TVCACHE_URL` store, else memory).
    - `tools`: annotations (read-only tools, uncacheable ones, key functions).
    """
    cls = type(obj)
    if not isinstance(getattr(obj, "__dict__", None), dict) or isinstance(obj, type):
        raise TypeError(
            f"cached_tools takes an object whose public methods are the tools and whose attributes are their state; "
            f"a {cls.__qualname__} has no attributes of its own (put the state and tools on a class)"
        )
    if trl._episode(obj) is not None:
        raise TypeError(f"this {cls.__qualname__} already goes through tvcache")
    name = task if task is not None else f"{cls.__module__}.{cls.__qualname__}"
    methods = [method for _, method in inspect.getmembers(cls, predicate=inspect.isfunction)]
    salt = captured(methods, f"{cls.__qualname__}'s methods", "define the class at module level")
    episode = trl._Episode(cls, cache, lambda _row: name, tools, run=_run, salt=salt)
    try:
        episode.open(obj, {})
    except TypeError as exc:  # the state does not pickle: say so in ART's terms
        raise TypeError(
            f"cached_tools copies a {cls.__qualname__}'s attributes by pickle, and they do not pickle "
            f"({exc.__cause__ or exc}); give the attribute that holds a handle __getstate__/__setstate__ (a sqlite3 "
            "connection: serialize()/deserialize()), and keep no state in closures"
        ) from exc.__cause__
    rollout = episode.rollout
    assert rollout is not None
    obj.__class__ = _cached_class(cls)
    obj.__dict__[trl.EPISODE] = episode
    weakref.finalize(obj, _end, rollout)
    return obj


def results(obj: Any) -> list[Result]:
    """The results of the calls made through `obj`, in order."""
    return list(_episode_of(obj).results)


def close(obj: Any) -> None:
    """End `obj`'s tvcache rollout now (else it ends when `obj` is garbage-collected); it stays readable as it is."""
    episode = _episode_of(obj)
    episode.materialise(obj)
    episode.close()


def _episode_of(obj: Any) -> trl._Episode:
    episode = trl._episode(obj)
    if episode is None:
        raise TypeError(f"{type(obj).__name__} was not made by cached_tools()")
    return episode


def _end(rollout: SyncRollout) -> None:
    """Close a rollout whose object is gone, from whatever thread collected it, without waiting (the cache's own
    thread may be the one collecting)."""
    inner = rollout.rollout
    if not inner.loop.is_closed():  # else the cache closed it with itself
        with contextlib.suppress(RuntimeError):  # closed in between
            asyncio.run_coroutine_threadsafe(inner.close(), inner.loop)


#: True while a tool runs for the cache: a cached function it calls is part of that execution and runs directly
#: (waiting for the cache there would block the thread the cache runs on).
_executing: contextvars.ContextVar[bool] = contextvars.ContextVar("tvcache_art_executing", default=False)


async def _run(cls: Any, state: trl.State, call: ToolCall) -> Any:
    """A tool method on the sandbox's state (trl's), except that a timeout is a failure: raised, never recorded."""
    token = _executing.set(True)
    try:
        return _unless_timed_out(await trl._run(cls, state, call))
    finally:
        _executing.reset(token)


def _unless_timed_out(output: Any) -> Any:
    if isinstance(output, dict) and "raised" in output:
        raised = pickle.loads(bytes.fromhex(output["raised"]))
        if isinstance(raised, TIMEOUTS):
            raise raised
    return output


def cached_function(fn: F, *, cache: SyncToolCache | None = None, fingerprint: str | None = None) -> F:
    """`fn`, a tool function whose result depends only on its arguments (and on data that does not change while
    training: a search over a fixed corpus, a read-only database), going through tvcache; use it as a decorator.
    A call is looked up in the cache, and on a miss `fn` runs; what it returned, or raised, is recorded exactly, as
    for `cached_tools`, and a timeout is a failure, never recorded. Each call is a rollout of its own at the root of
    the function's scope, named by its source (`fingerprint=` names a data version too); state it changes outside
    its arguments would be skipped by a hit: give such tools an object and `cached_tools`.

    - `cache`: a `SyncToolCache`, default `process_sync_cache()` (the `TVCACHE_URL` store, else memory).
    """
    if not inspect.isfunction(fn):
        raise TypeError(f"cached_function takes a tool function (def or async def), got {fn!r}")
    name = fn.__name__
    task = f"{fn.__module__}.{fn.__qualname__}"
    scope = fingerprint or _fingerprint({name: fn}, None)  # its source and what it captures
    # One factory per code and scope: a function made per rollout does not add one each time.
    boxes = process_sandboxes(
        ("tvcache.art-function", fn.__code__, scope),
        lambda: PythonSandboxes(_no_state, functools.partial(_call_function, fn), scope),
    )

    def open_rollout() -> SyncRollout:
        return (cache or process_sync_cache()).open(task, boxes)

    wrapper: Callable[..., Any]
    if inspect.iscoroutinefunction(fn):

        async def acall(*args: Any, **kwargs: Any) -> Any:
            if _executing.get():
                return await fn(*args, **kwargs)
            given = trl.keywords(name, fn, args, kwargs)
            rollout = open_rollout()
            inner = rollout.rollout
            try:
                result = await asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(inner.call(name, given), inner.loop)
                )
            finally:
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(inner.close(), inner.loop))
            return trl._decode(result.output)

        wrapper = acall
    else:

        def call(*args: Any, **kwargs: Any) -> Any:
            if _executing.get():
                return fn(*args, **kwargs)
            given = trl.keywords(name, fn, args, kwargs)
            rollout = open_rollout()
            try:
                result = rollout.call(name, given)
            finally:
                rollout.close()
            return trl._decode(result.output)

        wrapper = call
    return functools.update_wrapper(wrapper, fn)  # type: ignore[return-value]


def _no_state() -> None:
    return None


async def _call_function(fn: Callable[..., Any], state: None, call: ToolCall) -> Any:
    assert isinstance(call.args, dict)  # called by keyword only
    token = _executing.set(True)
    try:
        return _unless_timed_out(await trl.recorded(functools.partial(fn, **call.args)))
    finally:
        _executing.reset(token)


_classes: dict[type, type] = {}


def _cached_class(cls: Any) -> type:
    """`cls` with its public methods going through the object's rollout, attribute reads that see the rollout's
    state, and attribute writes refused. Keeps the class's name, so messages that name it read the same."""
    if cls in _classes:
        return _classes[cls]
    namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    for name, method in inspect.getmembers(cls, predicate=inspect.isfunction):
        if not name.startswith("_"):
            namespace[name] = trl._tool_method(name, method)
    namespace["__getattribute__"] = trl._reading(cls.__getattribute__, frozenset(namespace))
    namespace["__setattr__"] = namespace["__delattr__"] = _refused
    made = _classes[cls] = type(cls.__name__, (cls,), namespace)
    return made


def _refused(self: Any, name: str, *value: Any) -> None:
    raise AttributeError(
        f"{type(self).__name__}.{name} cannot be changed from outside its methods once cached_tools() has it: its "
        "state is the tvcache sandbox's, which would never see the change; change it in a method"
    )


def cached_rollout(
    sandboxes: Sandboxes | Callable[[Any], Sandboxes],
    *,
    cache: ToolCache | None = None,
    task: Callable[[Any], str] = task_key,
    tools: Tools | None = None,
    scenario: str = "scenario",
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Decorate an ART rollout function `async def rollout(model, scenario, ...)` so that each call runs inside
    a tvcache rollout of the scenario's task.

    - `sandboxes`: the sandbox factory, or a function of the scenario returning it.
    - `cache`: default `process_cache()` (the `TVCACHE_URL` store, else memory).
    - `task`: the task id of a scenario (default: a hash of its content).
    - `tools`: annotations of the tools (read-only, uncacheable, key functions).
    - `scenario`: the name of the rollout function's parameter that holds the scenario.
    """

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{fn.__qualname__} must be an async rollout function (async def)")
        signature = inspect.signature(fn)
        if scenario not in signature.parameters:
            raise TypeError(
                f"{fn.__qualname__} has no parameter {scenario!r} to take the task from; "
                f"name it with cached_rollout(..., scenario='...')"
            )

        @functools.wraps(fn)
        async def rollout(*args: P.args, **kwargs: P.kwargs) -> R:
            given = signature.bind(*args, **kwargs)
            given.apply_defaults()
            value = given.arguments[scenario]
            boxes = sandboxes if isinstance(sandboxes, Sandboxes) else sandboxes(value)
            async with (cache or process_cache()).rollout(task(value), boxes, tools):
                return await fn(*args, **kwargs)

        return rollout

    return decorate
