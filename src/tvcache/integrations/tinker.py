"""Tinker cookbook: a `sandbox_factory` for its Harbor recipe whose sandboxes are tvcache rollouts.

    from tvcache.integrations import process_sandboxes
    from tvcache.integrations.tinker import sandbox_factory

    def workspace(env_dir: Path) -> tvcache.Sandboxes:          # the task's environment/ directory
        return process_sandboxes(env_dir, lambda: tvcache.WorkspaceSandboxes(env_dir / "files", timeout=3600))

    builder = HarborDatasetBuilder(..., sandbox_factory=sandbox_factory(workspace))

The Harbor recipe (`tinker_cookbook.recipes.harbor_rl`) calls `sandbox_factory(env_dir, timeout)` once per
environment of a group and drives everything through the `SandboxInterface` it gets back: the agent's `bash` tool
runs `run_command` and shows the model `{"exit_code", "stdout", "stderr"}` as JSON, and the reward (`HarborReward`)
uploads the task's tests with `write_file`, runs `test.sh` with `run_command` and reads the reward file with
`read_file`. Here that interface is a tvcache rollout of the task, on a shell sandbox (`WorkspaceSandboxes`, or a
Docker-backed one) from `sandboxes(env_dir)`, and each method does what the cookbook's Modal sandbox does:

- `run_command(command, workdir, timeout, max_output_bytes)` runs `bash -lc <command>` in a new process (so `cd` and
  exports do not carry over), in `workdir`, stopped after `timeout` seconds; stdout and stderr are captured apart,
  each cut to `max_output_bytes` (default 128 KiB) and decoded as UTF-8 with replacement. A command that timed out
  is exit code -1 with what it wrote until then, as Modal reports it, and is not cached (the state it left is not
  reproducible). The sandbox factory's own timeout is the ceiling: set it at least as high as the recipe's.
- `read_file(path, max_bytes)` is `cat` (`head -c`) through `run_command`, and `write_file(path, content,
  executable)` is `mkdir -p`, `cat >` with the content on stdin and `chmod +x`, as Modal runs them; so a missing file
  is `cat`'s own message and exit code 1.
- `cleanup()` closes the rollout.

Each command is one call of the tool `run_command` (its command, workdir, timeout and cap are the key), served by
the shell sandbox's `bash` through a thin wrapper (`CommandSandboxes`): stdout and stderr go to files and come back
base64-encoded, so the inner sandbox's `max_output` must hold 4/3 of both caps (the wrapper says so when it does
not). The tests' upload, run and reward read are calls on the rollout's final state: rollouts of a group that end in
the same state are graded once, and the others read the recorded results. The task id is the task's directory name
(`env_dir.parent.name`, Harbor's task name), the same for every rollout and epoch; `task=` changes it.

The factory pickles (the cookbook's process-pool rollout mode, `set_rollout_executor`, sends the group builder to
worker processes) when `sandboxes` and `task` are module-level functions and no `cache` object is given: workers
then use `process_cache()`, which shares results between processes when `TVCACHE_URL` names a shared store.

Install the cookbook with `pip install 'tvcache[tinker]'`; this module imports nothing from it.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cache import ToolCache
from ..calls import ToolCall, Tools
from ..rollout import Result, Rollout
from ..sandboxes.base import Outcome, Sandbox, Sandboxes
from . import streams
from .process import process_cache

__all__ = ["CommandResult", "CommandSandboxes", "SandboxFactory", "TvcacheSandbox", "harbor_task", "sandbox_factory"]

TOOL = "run_command"
TIMED_OUT = -1  # the exit code Modal reports for a command its exec timeout stopped
STREAM_CAP = 128 * 1024  # the cookbook's ModalSandbox max_stream_output_bytes default
STAGED = "/tmp/.tvcache-stdin"  # where write_file's content waits for the command that reads it

_ids = itertools.count(1)


def harbor_task(env_dir: Path) -> str:
    """A Harbor task's id: the name of its directory (`<task>/environment` is what the recipe hands the factory)."""
    return Path(env_dir).parent.name


class SandboxFactory:
    """The Harbor recipe's `sandbox_factory(env_dir, timeout)`: each sandbox it makes is a tvcache rollout of the
    task. Picklable unless it holds a `cache` object."""

    def __init__(
        self,
        sandboxes: Callable[[Path], Sandboxes],
        *,
        cache: ToolCache | None = None,
        task: Callable[[Path], str] = harbor_task,
        tools: Tools | None = None,
    ) -> None:
        self.sandboxes, self.cache, self.task, self.tools = sandboxes, cache, task, tools

    async def __call__(self, env_dir: Path, timeout: int = 3600) -> TvcacheSandbox:
        chosen = self.cache if self.cache is not None else process_cache()
        commands = CommandSandboxes.of(self.sandboxes(Path(env_dir)))
        return TvcacheSandbox(await chosen.open(self.task(Path(env_dir)), commands, self.tools))

    def __getstate__(self) -> dict[str, Any]:
        if self.cache is not None:
            raise TypeError(
                "a sandbox_factory holding a cache object cannot go to another process: leave cache=None, and set "
                "TVCACHE_URL to a shared store so that worker processes share results"
            )
        return dict(self.__dict__)


def sandbox_factory(
    sandboxes: Callable[[Path], Sandboxes],
    *,
    cache: ToolCache | None = None,
    task: Callable[[Path], str] = harbor_task,
    tools: Tools | None = None,
) -> SandboxFactory:
    """A `sandbox_factory` for the Harbor recipe; see the module docstring.

    - `sandboxes`: the task's shell sandbox factory from its `environment/` directory; return the same object for
      the same task (`process_sandboxes`), since a factory's snapshots can be restored only by it.
    - `cache`: default `process_cache()` (the `TVCACHE_URL` store, else memory). `task`: the task id of an
      environment directory. `tools`: annotations (read-only tools, ...).
    """
    return SandboxFactory(sandboxes, cache=cache, task=task, tools=tools)


class CommandResult:
    """The cookbook's `SandboxResult` fields, so this module needs no import of the cookbook: the Harbor recipe
    reads `stdout`, `stderr` and `exit_code` (and `metrics`)."""

    __slots__ = ("exit_code", "metrics", "stderr", "stdout")

    def __init__(self, stdout: str, stderr: str, exit_code: int, metrics: dict[str, Any] | None = None) -> None:
        self.stdout, self.stderr, self.exit_code = stdout, stderr, exit_code
        self.metrics = metrics or {}

    def __repr__(self) -> str:
        return f"CommandResult(exit_code={self.exit_code}, stdout={self.stdout[:60]!r}, stderr={self.stderr[:60]!r})"


class TvcacheSandbox:
    """The cookbook's `SandboxInterface` over a tvcache rollout; see the module docstring."""

    def __init__(self, rollout: Rollout) -> None:
        self._rollout = rollout
        self._id = f"tvcache-{next(_ids)}"
        self.results: list[Result] = []  # every call's result, in order: hits, seconds

    @property
    def sandbox_id(self) -> str:
        return self._id

    async def send_heartbeat(self, timeout: int = 30) -> None:
        return None  # a tvcache sandbox lives as long as its rollout

    async def call(self, tool: str, args: dict[str, Any]) -> tuple[Any, bool]:
        """One call through the rollout: `(output, failed)`."""
        result = await self._rollout.call(tool, args)
        self.results.append(result)
        return result.output, result.error

    async def run_command(
        self, command: str, workdir: str | None = None, timeout: int = 60, max_output_bytes: int | None = None
    ) -> CommandResult:
        cap = max_output_bytes if max_output_bytes is not None else STREAM_CAP
        args = {"command": command, "workdir": workdir, "timeout": timeout, "cap": cap}
        return await self._command(args)

    async def _command(self, args: dict[str, Any]) -> CommandResult:
        try:
            output, _ = await self.call(TOOL, args)
        except Exception as exc:  # as Modal's run_command: a failure of the machinery is exit code -1
            return CommandResult("", str(exc), TIMED_OUT)
        return CommandResult(str(output["stdout"]), str(output["stderr"]), int(output["exit_code"]))

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60) -> CommandResult:
        reader = f"head -c {max_bytes}" if max_bytes is not None else "cat"
        return await self.run_command(f"{reader} {shlex.quote(path)}", timeout=timeout)

    async def write_file(
        self, path: str, content: str | bytes = "", executable: bool = False, timeout: int = 60
    ) -> CommandResult:
        data = content.encode() if isinstance(content, str) else content
        staged, failed = await self.call("write_file", {"path": STAGED, "content": base64.b64encode(data).decode()})
        if failed or not isinstance(staged, dict) or "error" in staged:
            reason = staged.get("error", staged) if isinstance(staged, dict) else staged
            return CommandResult("", f"could not stage the content: {reason}", -1)
        quoted = shlex.quote(path)
        command = f"mkdir -p {shlex.quote(os.path.dirname(path))} && cat > {quoted}"
        if executable:
            command += f" && chmod +x {quoted}"
        return await self._command({"command": command, "workdir": None, "timeout": timeout, "stdin": STAGED})

    async def cleanup(self) -> None:
        # Idempotent; a cleanup on another event loop than the rollout's (its lock is bound to that one) must not
        # fail the episode.
        with contextlib.suppress(RuntimeError):
            await self._rollout.close()


# -- the run_command tool over a shell sandbox's bash -----------------------------------------------------------


class CommandSandboxes:
    """A shell sandbox factory (its `bash`, `write_file`) with one more tool, `run_command {"command", "workdir",
    "timeout", "cap", "stdin"}` -> `{"stdout", "stderr", "exit_code"}`, run as Modal runs an exec. A timed-out
    command is a failed call (`error=True`). Snapshots are the inner factory's; one wrapper per inner factory."""

    _made: dict[int, CommandSandboxes] = {}

    def __init__(self, inner: Sandboxes) -> None:
        self.inner = inner
        declared = getattr(inner, "origin", None)
        if declared:
            self.origin = declared  # snapshots restorable where the inner factory's are

    @classmethod
    def of(cls, inner: Sandboxes) -> CommandSandboxes:
        """The wrapper of `inner`, the same object every time (the cache keeps snapshots per factory object)."""
        made = cls._made.get(id(inner))
        if made is None or made.inner is not inner:
            made = cls._made[id(inner)] = cls(inner)
        return made

    @property
    def fingerprint(self) -> str:
        return f"{self.inner.fingerprint}+tinker-run_command-v1"

    async def create(self) -> Sandbox:
        return CommandSandbox(await self.inner.create())

    async def restore(self, snapshot_id: str) -> Sandbox:
        return CommandSandbox(await self.inner.restore(snapshot_id))

    async def delete(self, snapshot_id: str) -> None:
        await self.inner.delete(snapshot_id)


class CommandSandbox:
    def __init__(self, inner: Sandbox) -> None:
        self.inner = inner

    async def snapshot(self) -> str:
        return await self.inner.snapshot()

    async def close(self) -> None:
        await self.inner.close()

    async def execute(self, call: ToolCall) -> Outcome:
        if call.tool != TOOL:
            return await self.inner.execute(call)
        args = call.args
        assert isinstance(args, dict)
        outcome = await self.inner.execute(ToolCall("bash", {"command": _script(args)}))
        shell = outcome.output if isinstance(outcome.output, dict) else {}
        if outcome.error:  # the inner sandbox gave up on it (its own timeout, a crash): Modal's exec error
            why = shell.get("error", "the sandbox failed the command")
            return Outcome({"stdout": "", "stderr": str(why), "exit_code": TIMED_OUT}, outcome.changed, True)
        captured = streams.parse(str(shell.get("output", "")))
        if captured is None:
            why = "run_command's output did not come back whole: raise the shell sandbox's max_output"
            return Outcome({"stdout": "", "stderr": why, "exit_code": TIMED_OUT}, outcome.changed, True)
        output = {
            "stdout": captured.stdout.decode("utf-8", errors="replace"),
            "stderr": captured.stderr.decode("utf-8", errors="replace"),
            "exit_code": TIMED_OUT if captured.timed_out else captured.exit_code,
        }
        return Outcome(output, outcome.changed, captured.timed_out)


def _script(args: dict[str, Any]) -> str:
    """The shell code of one `run_command`: Modal's `bash -lc <command>` in `workdir`, in a subshell so that nothing
    it does to the shell carries over. Modal leaves a command's stdin open (a command reading it waits until its
    timeout), unless content is sent, which write_file stages in a file first."""
    seconds = int(args["timeout"])
    staged = args.get("stdin")
    stdin = f"< <(base64 -d {shlex.quote(staged)})" if staged else f"< <(exec sleep {seconds + 5} 2>/dev/null 3>&-)"
    cap = int(args.get("cap") or STREAM_CAP)
    code = streams.script("bash -lc", str(args["command"]), seconds, cap=cap, stdin=stdin)
    workdir = shlex.quote(args["workdir"]) if args.get("workdir") else "."
    cleanup = f"\nrm -f {shlex.quote(staged)}" if staged else ""
    return f"""(if cd -- {workdir} 2>/dev/null; then
{code}
else printf '\\n0 -1 \\n%s\\n' "$(printf 'cd: %s: No such file or directory' {workdir} | base64 -w0)"; fi{cleanup}
)"""
