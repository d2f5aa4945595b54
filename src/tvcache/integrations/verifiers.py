"""verifiers (v1): a task whose agent's `bash` and `edit` calls, and whose own runtime commands, go through tvcache.

    import verifiers.v1 as vf
    from tvcache.integrations.verifiers import CachedTask

    class FixTask(CachedTask, MyTask):                 # the mixin first; MyTask is an ordinary vf.Task
        def tvcache_sandboxes(self) -> tvcache.Sandboxes:
            return process_sandboxes("repo", lambda: tvcache.WorkspaceSandboxes("repo/"))

Nothing else changes: the taskset, the harness (any that consults verifiers' tool gate, as the bundled `bash`
harness does), the runtime and the rewards are the task's own.

**The agent's tools.** A verifiers harness asks the rollout's tool gate before it executes a call; the gate runs the
task's `@vf.intercept` request hooks, and a hook that puts a result in the call's place makes the harness show the
model that result instead of executing the call. `CachedTask` adds such a hook: every `bash` and `edit` call the
model makes is executed by this trace's tvcache rollout, in its workspace sandbox, and the harness executes nothing.
`bash` runs in a fresh shell started in the sandbox's working directory, as the harness runs each command (`cd`
and exports do not carry over), and answers what the harness's `run_bash` answers (`HarnessSandboxes`): stdout then
stderr, or the harness's message for a command that reached its 3,600 s timeout, a failed call never recorded;
`edit` is the harness's single-occurrence replacement, with its messages, run inside the sandbox. Calls whose
arguments are not a JSON object, and other tools (MCP toolsets), are left to the harness. The harness's runtime
still hosts the harness program itself.

**The task's own commands.** `setup`, `finalize`, `stage_verifier` and the task's `@vf.reward` / `@vf.metric`
functions receive, as `runtime`, a view whose `run`, `read` and `write` are calls of the same rollout: setup
uploads are cached per task, and the tests a reward runs execute once per final state, however many rollouts end
there. A reward that fails (a timeout) is not cached.

**Ids.** The task id is the task's own stable `Task.key` (its data's content hash unless the task overrides it), the
same in every epoch and every worker, different for different tasks. Each trace gets its own rollout, opened in
`setup` and closed after scoring. Per-rollout values never enter a key: the call ids the harness sends are not
part of a call, and the model's arguments are keyed as canonical JSON; the runtime view keys a command by its
argv and the environment it is given (not the harness's endpoint, secrets or trace id, which only the harness's
own runtime sees).

**The cache.** `tvcache_cache()` defaults to `process_cache()`: the `TVCACHE_URL` store, else memory per process
(verifiers runs rollouts in env-server workers, which then share one graph only through a store URL).
"""

from __future__ import annotations

import asyncio
import base64
import json
import posixpath
import shlex
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

from ..extras import require

require("verifiers", "tvcache.integrations.verifiers", "verifiers.v1")

import verifiers.v1 as vf  # noqa: E402
from verifiers.v1.utils.loaders import harness_class  # noqa: E402

from ..cache import ToolCache  # noqa: E402
from ..calls import ToolCall, Tools  # noqa: E402
from ..rollout import Result, Rollout  # noqa: E402
from ..sandboxes._shell import fresh_shell  # noqa: E402
from ..sandboxes.base import Outcome, Output, Sandbox, Sandboxes  # noqa: E402
from . import streams  # noqa: E402
from .process import process_cache  # noqa: E402
from .tinker import CommandSandbox, CommandSandboxes  # noqa: E402

__all__ = ["CachedRuntime", "CachedTask"]

#: The bash harness's per-command timeout (verifiers.v1.harnesses.utils.core.run_bash).
HARNESS_TIMEOUT = 3600
#: The harness tools `CachedTask` executes (the bundled bash harness's names).
HARNESS_TOOLS = frozenset({"bash", "edit"})
#: Harnesses whose every gated tool is one of HARNESS_TOOLS (null has none); others are refused at setup.
SERVED_HARNESSES = frozenset({"bash", "null"})

# The bash harness's `edit`, run inside the sandbox so that files of any size are edited whole. Its arguments
# arrive base64-encoded JSON in argv; its messages are the harness's.
_EDIT = r"""
import base64, json, sys
from pathlib import Path
a = json.loads(base64.b64decode(sys.argv[1]))
path, old, new = a.get("path"), a.get("old_str"), a.get("new_str")
def edit():
    if not isinstance(path, str) or not path:
        return "error: 'path' is required"
    if not isinstance(old, str) or not isinstance(new, str):
        return "error: 'old_str' and 'new_str' must be strings"
    if not old:
        return "error: 'old_str' must be a non-empty string"
    file = Path(path) if Path(path).is_absolute() else Path.cwd() / path
    if not file.exists():
        return f"error: {path} not found"
    try:
        content = file.read_text()
    except Exception as e:
        return f"error: could not read {path}: {e}"
    count = content.count(old)
    if count != 1:
        return f"error: old_str must appear exactly once in {path} (found {count})"
    try:
        file.write_text(content.replace(old, new, 1))
    except Exception as e:
        return f"error: could not write {path}: {e}"
    return f"Edited {path}"
sys.stdout.write(edit())
"""


@dataclass
class _Open:
    """A trace's tvcache rollout while the trace runs, and what its calls found in the cache."""

    rollout: Rollout
    trace: weakref.ref[vf.Trace]
    workdir: str | None
    calls: int = 0
    hits: int = 0

    async def call(self, tool: str, args: dict[str, Any]) -> Result:
        result = await self.rollout.call(tool, args)
        self.calls += 1
        self.hits += result.hit
        return result


_open: dict[str, _Open] = {}


class CachedTask(vf.Task):
    """A mixin for `vf.Task` subclasses (put it first in the bases); see the module docstring.

    Override `tvcache_sandboxes()` (a factory whose sandboxes have `bash`, such as `WorkspaceSandboxes`; the same
    object for every rollout of a task, see `process_sandboxes`); optionally `tvcache_cache()`, `tvcache_task()`
    and `tvcache_tools` (annotations: read-only or uncacheable tools, key functions)."""

    tvcache_tools: ClassVar[Tools | None] = None

    def tvcache_sandboxes(self) -> Sandboxes:
        raise NotImplementedError(f"{type(self).__name__} must define tvcache_sandboxes()")

    def tvcache_cache(self) -> ToolCache:
        return process_cache()

    def tvcache_task(self) -> str:
        return str(self.key)

    # -- the lifecycle: a rollout per trace, from setup to scoring ------------------------------------------

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        await _close_finished()
        harness = trace.agent.config.harness if trace.agent is not None else None
        if harness is not None and not harness_class(harness.id).SUPPORTS_TOOL_INTERCEPTION:
            raise vf.TaskError(
                f"harness {harness.id!r} does not consult verifiers' tool gate, so its tool calls cannot run "
                "through tvcache; use a harness that does (bash, null, codex, claude_code, pi, kimi_code)"
            )
        if harness is not None and harness.id not in SERVED_HARNESSES:
            raise vf.TaskError(
                f"harness {harness.id!r} gates tools other than {sorted(HARNESS_TOOLS)}, which tvcache does not serve: "
                "their calls would run in the harness's runtime, which never got the task's sandbox state; use the "
                f"bash harness (tvcache serves {', '.join(sorted(SERVED_HARNESSES))})"
            )
        sandboxes = self.tvcache_sandboxes()
        rollout = await self.tvcache_cache().open(
            self.tvcache_task(), HarnessSandboxes.of(sandboxes), self.tvcache_tools
        )
        _open[trace.id] = _Open(rollout, weakref.ref(trace), getattr(sandboxes, "cwd", None))
        await super().setup(trace, self._view(trace, runtime))

    async def finalize(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        await super().finalize(trace, self._view(trace, runtime))

    async def stage_verifier(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        await super().stage_verifier(trace, self._view(trace, runtime))

    async def score(self, trace: vf.Trace, runtime: vf.Runtime | None = None) -> None:
        """The task's scoring, its commands through the rollout; then the trace's cache metrics: `tvcache_calls`
        and `tvcache_hits` over the whole rollout, and the same for scoring alone."""
        opened = _open.get(trace.id)
        try:
            calls, hits = (opened.calls, opened.hits) if opened else (0, 0)
            await super().score(trace, None if runtime is None else self._view(trace, runtime))
            if opened is not None:
                trace.record_metrics(
                    {
                        "tvcache_calls": opened.calls,
                        "tvcache_hits": opened.hits,
                        "tvcache_scoring_calls": opened.calls - calls,
                        "tvcache_scoring_hits": opened.hits - hits,
                    }
                )
        finally:
            await _close(trace.id)

    def _view(self, trace: vf.Trace, runtime: vf.Runtime) -> vf.Runtime:
        opened = _open.get(trace.id)
        return runtime if opened is None else CachedRuntime(runtime, opened)

    # -- the agent's tools, at the tool gate ---------------------------------------------------------------

    @vf.intercept
    async def tvcache_tool_calls(self, request: vf.Request, trace: vf.Trace) -> vf.Request | None:
        """Answer a proposed `bash` or `edit` call with its result from this trace's rollout."""
        messages = request.messages
        probe = messages[-1] if messages else None
        opened = _open.get(trace.id)
        if opened is None or not isinstance(probe, vf.ToolMessage) or probe.content != "":
            return None  # not a gate probe (a user turn, or a result the harness already has)
        call = _proposed(messages[:-1], probe.tool_call_id)
        if call is None or call.name not in HARNESS_TOOLS:
            return None
        try:
            args = json.loads(call.arguments or "{}")
        except ValueError:
            return None  # the harness answers malformed arguments itself, executing nothing
        if not isinstance(args, dict):
            return None
        text = await _run_tool(opened, call.name, args)
        # An empty result would read as "no verdict" and the harness would execute the call itself.
        content: vf.MessageContent = text if text else [vf.TextContentPart(text="")]
        answered = probe.model_copy(update={"content": content})
        return request.model_copy(update={"messages": [*messages[:-1], answered]})


def _proposed(messages: list[Any], call_id: str) -> Any:
    """The tool call `call_id` of the last assistant message."""
    for message in reversed(messages):
        if isinstance(message, vf.AssistantMessage):
            return next((c for c in message.tool_calls or [] if c.id == call_id), None)
    return None


async def _run_tool(opened: _Open, name: str, args: dict[str, Any]) -> str:
    if name == "bash":
        command = args.get("command", "")
        if not isinstance(command, str):
            return f"error: the command must be a string, got {type(command).__name__}"
        call = {"command": command, "workdir": opened.workdir, "timeout": HARNESS_TIMEOUT}
        return str((await opened.call(HARNESS_BASH, call)).output)
    encoded = base64.b64encode(json.dumps(args).encode()).decode()
    edit = f"python3 -c {shlex.quote(_EDIT)} {encoded}"
    return _text(await opened.call("bash", {"command": fresh_shell(opened.workdir, edit)}))


#: The tool that runs a command as the harness's `run_bash` does (`HarnessSandboxes`).
HARNESS_BASH = "harness_bash"


class HarnessSandboxes(CommandSandboxes):
    """A shell sandbox factory with one more tool, `harness_bash {"command", "workdir", "timeout"}`, answering what
    the harness's `run_bash` answers. A command that reaches the timeout is a failed call (`error=True`: never
    recorded, and the rollout goes on in its own sandbox), answered with the harness's message. The rest is Tinker's
    wrapper of a shell factory (`CommandSandboxes`): one per inner factory, its snapshots the inner one's."""

    _made: dict[int, CommandSandboxes] = {}  # its own: `of` must not hand out a Tinker wrapper

    @property
    def fingerprint(self) -> str:
        return f"{self.inner.fingerprint}+verifiers-harness_bash-v1"

    async def create(self) -> Sandbox:
        return HarnessSandbox(await self.inner.create())

    async def restore(self, snapshot_id: str) -> Sandbox:
        return HarnessSandbox(await self.inner.restore(snapshot_id))


class HarnessSandbox(CommandSandbox):
    async def execute(self, call: ToolCall) -> Outcome:
        if call.tool != HARNESS_BASH:
            return await self.inner.execute(call)
        args = call.args
        assert isinstance(args, dict)
        command, seconds = str(args["command"]), int(args["timeout"])
        code = fresh_shell(args.get("workdir"), streams.script("bash -c", command, seconds))
        outcome = await self.inner.execute(ToolCall("bash", {"command": code}))
        out = outcome.output
        captured = streams.parse(str(out.get("output", ""))) if isinstance(out, dict) and not outcome.error else None
        if captured is None:  # the sandbox failed the command (its own timeout), or the working directory is gone
            return Outcome(_text(out), outcome.changed, outcome.error)
        if captured.timed_out:
            return Outcome(f"error: Command '{['bash', '-c', command]}' timed out after {seconds} seconds", None, True)
        try:
            decoded = [s.decode().replace("\r\n", "\n").replace("\r", "\n") for s in (captured.stdout, captured.stderr)]
        except UnicodeDecodeError as exc:
            return Outcome(f"error: {exc}", outcome.changed)
        # stdout then stderr, decoded as `subprocess.run(text=True)` decodes them (UTF-8, universal newlines)
        return Outcome(decoded[0] + decoded[1], outcome.changed)


def _text(result: Result | Output) -> str:
    """A sandbox's bash result (or its output) as the harness shows a command's result: its output."""
    out = result.output if isinstance(result, Result) else result
    if isinstance(out, dict):
        text = str(out.get("output", ""))
        return f"{text}error: {out['error']}" if "error" in out else text
    return out if isinstance(out, str) else json.dumps(out)


async def _close(trace_id: str) -> None:
    opened = _open.pop(trace_id, None)
    if opened is not None:
        await opened.rollout.close()


async def _close_finished() -> None:
    """Close the rollouts of traces that ended without scoring (a failed rollout skips it); forget those of event
    loops that are gone."""
    loop = asyncio.get_running_loop()
    for trace_id, opened in list(_open.items()):
        trace = opened.trace()
        if opened.rollout.loop.is_closed():
            _open.pop(trace_id, None)
        elif opened.rollout.loop is loop and (trace is None or trace.is_completed):
            await _close(trace_id)


class CachedRuntime(vf.Runtime):
    """A view of a rollout's runtime for the task's own hooks: `run`, `read` and `write` are calls of the trace's
    tvcache rollout (bash, read_file, write_file), relative paths and commands from the sandbox's working
    directory; everything else is the real runtime's."""

    def __init__(self, real: vf.Runtime, opened: _Open) -> None:
        super().__init__(real.name)
        self.env = dict(real.env)
        self.user, self.home = real.user, real.home
        self._real, self._opened, self._workdir = real, opened, opened.workdir

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)  # config, info, and whatever else a hook reads

    async def start(self) -> None:
        """The view starts nothing: the rollout's sandbox is made when a call needs it."""

    async def alive(self) -> bool:
        return True

    async def run(self, argv: list[str], env: dict[str, str]) -> vf.ProgramResult:
        command = shlex.join(argv)
        variables = self.process_env(env)
        if variables:
            command = f"env {' '.join(shlex.quote(f'{k}={v}') for k, v in sorted(variables.items()))} {command}"
        result = await self._opened.call("bash", {"command": fresh_shell(self._workdir, command)})
        out = result.output if isinstance(result.output, dict) else {}
        code = out.get("exit_code")
        if result.error or code is None:
            return vf.ProgramResult(exit_code=124, stdout=str(out.get("output", "")), stderr=str(out.get("error", "")))
        return vf.ProgramResult(exit_code=int(code), stdout=str(out.get("output", "")), stderr="")

    def _path(self, path: str) -> str:
        # From the working directory the runtime started in, wherever the agent's commands left the shell.
        return path if self._workdir is None else posixpath.join(self._workdir, path)

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        result = await self._opened.call("read_file", {"path": self._path(path)})
        out = result.output if isinstance(result.output, dict) else {}
        if "content" not in out:
            raise vf.SandboxError(f"read {path!r}: {out.get('error', result.output)}")
        data = str(out["content"]).encode()
        return data if max_bytes is None else data[:max_bytes]

    async def write(self, path: str, data: bytes) -> None:
        try:
            text = data.decode()
        except UnicodeDecodeError:  # binary: through base64 in a shell, since write_file takes text
            encoded = base64.b64encode(data).decode()
            command = f"printf %s {encoded} | base64 -d > {shlex.quote(self._path(path))}"
            result = await self._opened.call("bash", {"command": fresh_shell(self._workdir, command)})
        else:
            result = await self._opened.call("write_file", {"path": self._path(path), "content": text})
        if result.error or (isinstance(result.output, dict) and "error" in result.output):
            raise vf.SandboxError(f"write {path!r}: {result.output}")
