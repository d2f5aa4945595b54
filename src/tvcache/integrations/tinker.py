"""Tinker cookbook: a `sandbox_factory` for its Harbor recipe whose sandboxes are tvcache rollouts.

    from tvcache.integrations import process_sandboxes
    from tvcache.integrations.tinker import sandbox_factory

    def workspace(env_dir: Path) -> tvcache.Sandboxes:          # the task's environment/ directory
        return process_sandboxes(env_dir, lambda: tvcache.WorkspaceSandboxes(env_dir / "files", timeout=120))

    builder = HarborDatasetBuilder(..., sandbox_factory=sandbox_factory(workspace))

The Harbor recipe (`tinker_cookbook.recipes.harbor_rl`) calls `sandbox_factory(env_dir, timeout)` once per
environment of a group and drives everything through the `SandboxInterface` it gets back: the agent's `bash` tool
runs `run_command`, and the reward (`HarborReward`) uploads the task's tests with `write_file`, runs `test.sh` with
`run_command` and reads the reward file with `read_file`. Here that interface is a tvcache rollout of the task, on a
shell sandbox (`WorkspaceSandboxes`, or a Docker-backed one) from `sandboxes(env_dir)`:

- `run_command(command, workdir)` is the call `bash {"command": "(cd <workdir> && <command>)"}`: a subshell, as a
  container exec runs it (a fresh process: `cd` and exports do not carry over); the answer's output (stdout and
  stderr interleaved, as the sandbox captures them) is `stdout`, with the exit code. `max_output_bytes` cuts what is
  returned, not what is cached.
- `read_file(path)` and `write_file(path, content, executable)` are the sandbox's `read_file` and `write_file`
  (and a `chmod +x` for an executable); a missing file is exit code 1 with the reason in `stderr`.
- A call the sandbox fails (a timeout) is exit code 124 and is not cached; `cleanup()` closes the rollout.

So the tests' upload, run and reward read are calls on the rollout's final state: rollouts of a group that end in
the same state are graded once, and the others read the recorded results. The task id is the task's directory name
(`env_dir.parent.name`, Harbor's task name), the same for every rollout and epoch; `task=` changes it.

Install the cookbook with `pip install 'tvcache[tinker]'`; this module imports nothing from it.
"""

from __future__ import annotations

import contextlib
import itertools
import shlex
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..cache import ToolCache
from ..calls import Tools
from ..rollout import Result, Rollout
from ..sandboxes.base import Sandboxes
from .process import process_cache

__all__ = ["CommandResult", "TvcacheSandbox", "harbor_task", "sandbox_factory"]

TIMED_OUT = 124  # the exit code `timeout` gives a command it stopped

_ids = itertools.count(1)


def harbor_task(env_dir: Path) -> str:
    """A Harbor task's id: the name of its directory (`<task>/environment` is what the recipe hands the factory)."""
    return Path(env_dir).parent.name


def sandbox_factory(
    sandboxes: Callable[[Path], Sandboxes],
    *,
    cache: ToolCache | None = None,
    task: Callable[[Path], str] = harbor_task,
    tools: Tools | None = None,
) -> Callable[[Path, int], Awaitable[TvcacheSandbox]]:
    """A `sandbox_factory` for the Harbor recipe: each sandbox it makes is a tvcache rollout of the task.

    - `sandboxes`: the task's sandbox factory from its `environment/` directory; return the same object for the
      same task (`process_sandboxes`), since a factory's snapshots can be restored only by it.
    - `cache`: default `process_cache()` (the `TVCACHE_URL` store, else memory). `task`: the task id of an
      environment directory. `tools`: annotations (read-only tools, ...).
    """

    async def make(env_dir: Path, timeout: int) -> TvcacheSandbox:
        chosen = cache if cache is not None else process_cache()
        return TvcacheSandbox(await chosen.open(task(Path(env_dir)), sandboxes(Path(env_dir)), tools))

    return make


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
        # A subshell, so that cd and exports stay in it, as in a container's exec; the newline ends a trailing comment.
        line = f"(cd {shlex.quote(workdir)} && {command}\n)" if workdir else f"({command}\n)"
        output, failed = await self.call("bash", {"command": line})
        if failed:
            return CommandResult("", f"timed out: {output}", TIMED_OUT)
        text = str(output.get("output", "")) if isinstance(output, dict) else str(output)
        if max_output_bytes is not None:
            text = text.encode()[:max_output_bytes].decode(errors="ignore")
        code = output.get("exit_code", 0) if isinstance(output, dict) else 0
        return CommandResult(text, "", int(code))

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60) -> CommandResult:
        output, failed = await self.call("read_file", {"path": path})
        if failed or not isinstance(output, dict) or "content" not in output:
            reason = output.get("error", "") if isinstance(output, dict) else str(output)
            return CommandResult("", str(reason), 1)
        content = str(output["content"])
        if max_bytes is not None:
            content = content.encode()[:max_bytes].decode(errors="ignore")
        return CommandResult(content, "", 0)

    async def write_file(
        self, path: str, content: str | bytes, executable: bool = False, timeout: int = 60
    ) -> CommandResult:
        text = content.decode(errors="surrogateescape") if isinstance(content, bytes) else content
        output, failed = await self.call("write_file", {"path": path, "content": text})
        if failed or not isinstance(output, dict) or "error" in output:
            reason = output.get("error", "") if isinstance(output, dict) else str(output)
            return CommandResult("", str(reason), 1)
        if executable:
            return await self.run_command(f"chmod +x {shlex.quote(path)}")
        return CommandResult("", "", 0)

    async def cleanup(self) -> None:
        # Idempotent; a cleanup on another event loop than the rollout's (its lock is bound to that one) must not
        # fail the episode.
        with contextlib.suppress(RuntimeError):
            await self._rollout.close()
