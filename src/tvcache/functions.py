"""Plain Python tool functions as cached tools, for agent loops of one's own and for framework integrations.

    def search(db: Airline, origin: str, destination: str) -> list[dict]:
        "Find direct flights."
    def book(db: Airline, flight: str, user: str) -> str:
        "Book a seat."

    tools = tvcache.ToolFunctions([search, book], state=load_airline)
    async with cache.rollout("task-3", tools.sandboxes):
        search, book = tools.cached()                    # search(origin, destination), book(flight, user)
        await book(flight="HAT001", user="mia")          # a call through the rollout, cached like any other

**Where the tools' state lives.** Every sandbox holds its own state object, made by `state()`: a tool that
takes state receives it as its first parameter (any name; `self` for methods). The sandboxes are
`PythonSandboxes`: a snapshot is a deep copy of the state object, and whether a call changed it is observed from
a digest of its pickle, so a tool that only reads becomes a memo without annotation. Without `state`, tools take
only their arguments (stateless: search engines, calculators) and every call is a memo.

An existing registry works the same way: a mapping of names to functions, or a class whose public methods are
the tools (a fresh instance per sandbox, methods receiving it as `self`), as tool classes of agent frameworks
are written.

**The wrappers** (`cached()`, `tools["book"]`) keep each function's name, docstring and signature minus the
state parameter, which is what frameworks build tool schemas from. A call binds its arguments as the function
would (defaults applied, so `book(flight="X")` and `book(flight="X", seats=1)` are one call), and runs through
`tvcache.current_rollout()`, the rollout of the innermost `cache.rollout(...)` block, where a framework hands
the tool no handle. A wrapper of an async function is async; a wrapper of a plain function blocks until the
rollout's event loop answers, so it must be called from another thread (the `SyncToolCache` pattern, or a
framework running tools in a thread pool). The wrapper returns the tool's output as a hit returns it: a JSON
round trip of the value (tuples come back as lists).

**Arguments a model got wrong** (text that is not a JSON object, a missing or unknown argument) reach the sandbox
from `rollout.call(*tvcache.parse_tool_call(...))` and get an error text as their output, the same every time,
cached or not. An exception raised inside a tool reaches the caller and is never cached.

**Fingerprint.** By default a hash of each tool's name and source code and of the state factory's, and of the
values a tool captures from the code that made it (a tool made per task over the task's data is told apart from
the same source over other data; a capture that does not pickle is a `TypeError` asking for `fingerprint=`):
editing a tool gives its results a new cache scope. Code the tools call is not part of it; pass `fingerprint=` (a
data version, say) when behaviour can change elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import io
import pickle
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from .calls import ToolCall
from .rollout import current_rollout
from .sandboxes.base import Output
from .sandboxes.python import ChangedFunction, PythonSandboxes

__all__ = ["ToolFunctions"]

S = TypeVar("S")

Function = Callable[..., Any]


class ToolFunctions(Generic[S]):
    """Tool functions over a per-sandbox state object; see the module docstring.

    - `functions`: an iterable of functions (named by `__name__`), a mapping of names to functions, or a class
      whose public methods are the tools.
    - `state`: makes a fresh state object for a sandbox; a class given as `functions` is its own default.
    - `fingerprint`: identifies the tools' behaviour and starting state (default: from their source code).
    - `changed(call, output) -> bool | None`: tells from a call and its output whether it changed the state,
      instead of comparing pickles (for states too big to pickle on every call).
    """

    def __init__(
        self,
        functions: Iterable[Function] | Mapping[str, Function] | type,
        *,
        state: Callable[[], S] | None = None,
        fingerprint: str | None = None,
        changed: ChangedFunction | None = None,
    ) -> None:
        named: dict[str, Function]
        if isinstance(functions, type):
            cls = functions
            state = state if state is not None else cls
            named = {
                name: member
                for klass in reversed(cls.__mro__[:-1])
                for name, member in vars(klass).items()
                if not name.startswith("_") and inspect.isfunction(member)
            }
        elif isinstance(functions, Mapping):
            named = dict(functions)
        else:
            named = {}
            for fn in functions:
                name = getattr(fn, "__name__", None)
                if not isinstance(name, str) or name == "<lambda>":
                    raise TypeError(f"a tool needs a name: pass a mapping for {fn!r}")
                if name in named:
                    raise ValueError(f"two tools are named {name!r}")
                named[name] = fn
        if not named:
            raise ValueError("no tool functions given")
        for name, fn in named.items():
            if not callable(fn):
                raise TypeError(f"tool {name!r} is not callable: {fn!r}")
            ToolCall(name)  # the same check every call gets: a plain name
        self._stateful = state is not None
        self._make: Callable[[], Any] = state if state is not None else _no_state
        self._signatures = {name: _signature(name, fn, self._stateful) for name, fn in named.items()}
        self._functions = named
        self.names: tuple[str, ...] = tuple(named)
        self.sandboxes: PythonSandboxes[Any] = PythonSandboxes(
            make=self._make,
            run=self._run,
            fingerprint=fingerprint or _fingerprint(named, state),
            changed=changed,
        )
        self._wrappers = {name: self._wrap(name) for name in named}

    def cached(self) -> list[Function]:
        """The wrappers, in the order the tools were given."""
        return list(self._wrappers.values())

    def __getitem__(self, name: str) -> Function:
        return self._wrappers[name]

    # -- execution inside a sandbox ----------------------------------------------------------------------

    async def _run(self, state: Any, call: ToolCall) -> Output:
        fn = self._functions.get(call.tool)
        if fn is None:
            return f"error: unknown tool {call.tool!r}; the tools are {', '.join(self.names)}"
        if not isinstance(call.args, dict):
            return f"error: the arguments of {call.tool} are not a JSON object: {call.args[:200]!r}"
        signature = self._signatures[call.tool]
        try:
            args, kwargs = _arguments(signature, call.args)
        except TypeError as exc:
            return f"error: {call.tool}: {exc}"
        if self._stateful:
            args.insert(0, state)
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result  # type: ignore[no-any-return]  # PythonSandboxes checks that it is an Output

    # -- the wrappers ------------------------------------------------------------------------------------

    def _wrap(self, name: str) -> Function:
        fn = self._functions[name]
        signature = self._signatures[name]

        def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return dict(bound.arguments)

        wrapper: Function
        if inspect.iscoroutinefunction(fn):

            async def acall(*args: Any, **kwargs: Any) -> Any:
                given = arguments(args, kwargs)
                return (await _rollout_for(name).call(name, given)).output

            wrapper = acall
        else:

            def call(*args: Any, **kwargs: Any) -> Any:
                given = arguments(args, kwargs)
                rollout = _rollout_for(name)
                try:
                    running = asyncio.get_running_loop()
                except RuntimeError:
                    running = None
                if running is rollout.loop:
                    raise RuntimeError(
                        f"tool {name!r} is a plain function called on the rollout's own event loop, where blocking "
                        "would hang it: call it from a worker thread (asyncio.to_thread) or make it async"
                    )
                future = asyncio.run_coroutine_threadsafe(rollout.call(name, given), rollout.loop)
                return future.result().output

            wrapper = call
        functools.update_wrapper(wrapper, fn)
        # Frameworks read the signature (and annotations) to build the schema the model sees: no state parameter.
        setattr(wrapper, "__signature__", signature)  # noqa: B010  # a dunder mypy does not know
        wrapper.__annotations__ = {
            key: value
            for key, value in getattr(fn, "__annotations__", {}).items()
            if key == "return" or key in signature.parameters
        }
        delattr(wrapper, "__wrapped__")  # or inspect would find the state parameter again
        return wrapper


def _no_state() -> None:
    return None


def _rollout_for(name: str) -> Any:
    rollout = current_rollout()
    if rollout is None:
        raise RuntimeError(
            f"tool {name!r} was called outside a rollout: call it inside `async with cache.rollout(task, "
            "tools.sandboxes)` (or an integration that opens one)"
        )
    return rollout


def _signature(name: str, fn: Function, stateful: bool) -> inspect.Signature:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"tool {name!r} has no signature to call it by: {exc}") from exc
    params = list(signature.parameters.values())
    if stateful:
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"tool {name!r} must take the state as its first parameter, e.g. def {name}(state, ...)")
        params = params[1:]
    return signature.replace(parameters=params)


def _arguments(signature: inspect.Signature, given: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments for the function from a call's JSON object, as `signature.bind` would
    accept them: unknown or missing names are a TypeError (which becomes the call's error text)."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    rest = dict(given)
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            extra = rest.pop(param.name, {})
            if not isinstance(extra, dict):
                raise TypeError(f"**{param.name} must be an object")
            kwargs.update(extra)
            continue
        if param.name not in rest:
            if param.default is param.empty and param.kind is not param.VAR_POSITIONAL:
                raise TypeError(f"missing a required argument: {param.name!r}")
            continue
        value = rest.pop(param.name)
        if param.kind is param.VAR_POSITIONAL:
            if not isinstance(value, list):
                raise TypeError(f"*{param.name} must be an array")
            args.extend(value)
        elif param.kind is param.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[param.name] = value
    if rest:
        raise TypeError(f"unexpected arguments: {', '.join(sorted(map(repr, rest)))}")
    signature.bind(*args, **kwargs)  # the final word, e.g. on a keyword-only parameter given positionally
    return args, kwargs


def _fingerprint(functions: Mapping[str, Function], state: Callable[[], Any] | None) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, fn in [*sorted(functions.items()), ("<state>", state)]:
        h.update(f"\0{name}\0{_code_of(fn)}".encode())
        if inspect.isfunction(fn):  # what a tool made by other code captured from it is part of its behaviour
            h.update(captured([fn], name, "pass fingerprint= to name them"))
    return "fn-" + h.hexdigest()


def captured(functions: Sequence[Any], who: str, otherwise: str) -> bytes:
    """A digest of the values `functions` capture from the code that made them (a closure's cells: the task's data
    a tool made per task sees), so that the same source capturing other values is another scope; empty when they
    capture nothing (`super()`'s cell is the class itself and says nothing more). A capture that does not pickle
    raises `TypeError`: `who` captures ..., `otherwise` says what to do."""
    cells = [
        (function.__qualname__, name, cell.cell_contents)
        for function in functions
        for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=True)
        if name != "__class__"
    ]
    if not cells:
        return b""
    buffer = io.BytesIO()
    try:
        _Digest(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(cells)
    except Exception as exc:
        names = ", ".join(sorted({name for _, name, _ in cells}))
        raise TypeError(
            f"{who} captures values that do not pickle ({names}: {type(exc).__name__}: {exc}), so tvcache cannot "
            f"tell one capture from another; {otherwise}"
        ) from exc
    return hashlib.blake2b(buffer.getvalue(), digest_size=16).digest()


class _Digest(pickle.Pickler):
    """Pickles for a digest only: a function as its name and source (a captured tool function, decorated or not,
    need not be importable under its name)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType):
            return (str, (f"{obj.__module__}.{obj.__qualname__}\0{_code_of(obj)}",))
        return NotImplemented


def _code_of(obj: Any) -> str:
    if obj is None:
        return ""
    target = inspect.unwrap(obj) if callable(obj) else obj
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)  # no source file (a REPL): the compiled code
        if code is not None:
            return f"{code.co_code.hex()}{code.co_consts!r}"
        return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"
