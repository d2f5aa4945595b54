"""veRL: an agent loop whose tool calls go through one tvcache rollout per trajectory.

`CachedToolAgentLoop` is veRL's `ToolAgentLoop` (the multi-turn tool loop of `verl.experimental.agent_loop`) with
every tool call of a trajectory answered through a tvcache rollout. Importing this module registers it as
`tvcache_tool_agent`; a user selects it in the agent-loop config and the dataset's `agent_name` column:

    # agent_loop.yaml, named by actor_rollout_ref.rollout.agent.agent_loop_config_path
    - name: tvcache_tool_agent
      _target_: tvcache.integrations.verl.CachedToolAgentLoop
      sandboxes: my_project.envs:sql_sandboxes   # optional: the sandbox factory of a row, see below
      read_only: [search]                        # optional annotations: tools that never change state
      uncacheable: []                            # ... and tools that must always run

**Tools.** The loop keeps veRL's handling of a call: an unknown tool or arguments that are not JSON get veRL's
own message and never reach the cache; a response longer than `multi_turn.max_tool_response_length` is cut as
veRL cuts it. In between, the call (tool name and parsed arguments; the model's call id is not part of it) goes to
the trajectory's rollout, and on a miss to a tvcache sandbox:

- by default, `VerlToolSandboxes`: the configured veRL tools themselves (`tool_config_path` classes,
  `function_tool_path` functions), run as `ToolAgentLoop` runs them (a `BaseTool` instance per call, with the row's
  `create_kwargs`). The cached result is the response text and the tool's step reward. veRL 0.9 makes a tool
  instance per call, so a tool's answer depends on its arguments and the row: such calls are recorded as edges
  (the cache cannot see whether a tool changed something outside itself), or as memos for tools named in
  `read_only`. A tool that changes state outside itself (a container shared by a trajectory's calls) needs its
  state in a tvcache sandbox instead: the next point.
- `sandboxes: module:function`: a function of the dataset row (the keyword arguments `run` gets) returning a
  tvcache `Sandboxes` (`SQLiteSandboxes`, `WorkspaceSandboxes`, ...) whose tools answer the calls by name. Return
  the same factory object for the same task (`process_sandboxes`): its snapshots can be restored only by it.
  The sandbox's output becomes the response text (a str as it is, anything else as JSON).

**Task id**: `<data_source>/<index>`, from the row's `extra_info.index`, the stable index veRL's datasets carry
(RLHFDataset copies it to `index`); never the per-step `uid`. A row without `extra_info.index` gets `task_key` of
its prompt and tool kwargs. **Reward on the final state**: override `tvcache_reward(rollout, output, **row)` in a
subclass (registered under its own name): it runs after the trajectory's last turn, with the rollout still open,
so calls it makes (`await rollout.grade(...)`) are recorded on the final state and rollouts that end in the same
state are graded once; a float it returns becomes the trajectory's `reward_score` (veRL then skips its reward
function for it). `self.tvcache_results` holds the `Result` of each of the trajectory's tool calls (the sandbox's
output, hit or not, seconds), and each trajectory's `extra_fields` get `tvcache_calls`, `tvcache_hits` and
`tvcache_seconds`.

**Cache**: `process_cache()` of the agent-loop worker (`TVCACHE_URL`, or `tvcache_url:` in the YAML): set it to a
`tvcache serve` or Redis URL so that all workers share one graph.

Install veRL with `pip install 'tvcache[verl]'`.
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ..extras import require

require("verl", "tvcache.integrations.verl", "verl.experimental.agent_loop.tool_agent_loop")

from verl.experimental.agent_loop.agent_loop import register  # noqa: E402
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop  # noqa: E402
from verl.tools.base_tool import BaseTool  # noqa: E402
from verl.tools.function_tool import FunctionTool, normalize_function_tool_return  # noqa: E402
from verl.tools.schemas import ToolResponse  # noqa: E402

from ..calls import ToolCall, Tools, canonical_json  # noqa: E402
from ..rollout import Result, Rollout  # noqa: E402
from ..sandboxes.base import Output, SandboxError, Sandboxes  # noqa: E402
from ..sandboxes.python import PythonSandboxes  # noqa: E402
from .keys import task_key  # noqa: E402
from .process import process_cache  # noqa: E402

__all__ = ["AGENT_NAME", "CachedToolAgentLoop", "VerlToolSandboxes", "row_task"]

AGENT_NAME = "tvcache_tool_agent"

Row = Mapping[str, Any]

# The trajectory whose call a VerlToolSandboxes sandbox is executing: BaseTool.execute receives it as agent_data.
_agent_data: contextvars.ContextVar[Any] = contextvars.ContextVar("tvcache_verl_agent_data", default=None)


def row_task(row: Row) -> str:
    """The task id of a dataset row: `<data_source>/<extra_info.index>`, else a hash of its prompt and tool kwargs."""
    extra = row.get("extra_info") or {}
    if isinstance(extra, Mapping) and extra.get("index") is not None:
        return f"{row.get('data_source', 'data')}/{extra['index']}"
    return task_key({"prompt": row.get("raw_prompt"), "tools_kwargs": row.get("tools_kwargs") or {}})


class VerlToolSandboxes(PythonSandboxes[None]):
    """veRL tools as a tvcache sandbox factory for one row: a call runs the tool as `ToolAgentLoop` would (a
    `BaseTool` instance made with the row's `create_kwargs`, executed and released; a function tool called), and
    answers `[response text, step reward]`. There is no state to save: a rollout that misses after hits replays
    the calls before it. The fingerprint covers the tools' classes, configs and schemas and the row's kwargs."""

    def __init__(self, tools: Mapping[str, Any], tools_kwargs: Mapping[str, Any]) -> None:
        self._tools, self._kwargs = dict(tools), dict(tools_kwargs)
        super().__init__(make=_no_state, run=self._execute, fingerprint=self._digest(), changed=_cannot_tell)

    def _digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for name, tool in sorted(self._tools.items()):
            kind = type(tool)
            code = getattr(tool, "fn", None) if isinstance(tool, FunctionTool) else None
            h.update(f"{name}\0{kind.__module__}.{kind.__qualname__}\0{_source(code)}\0".encode())
            h.update(json.dumps(getattr(tool, "config", None), sort_keys=True, default=str).encode())
            h.update(json.dumps(tool.tool_schema.model_dump(), sort_keys=True, default=str).encode())
        h.update(json.dumps(self._kwargs, sort_keys=True, default=str).encode())
        return "verl-" + h.hexdigest()

    async def _execute(self, state: None, call: ToolCall) -> Output:
        tool = self._tools.get(call.tool)
        if tool is None:
            raise SandboxError(f"no veRL tool named {call.tool!r}")
        args = call.args if isinstance(call.args, dict) else json.loads(call.args)  # see _CachedTool.execute
        if isinstance(tool, FunctionTool):
            response, reward, _metrics = normalize_function_tool_return(await tool.call(args))
        else:
            kwargs = self._kwargs.get(call.tool, {})
            instance_id, _created = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
            try:
                response, reward, _metrics = await tool.execute(instance_id, args, agent_data=_agent_data.get())
            finally:
                await tool.release(instance_id)
        if response.image or response.video:
            raise SandboxError(f"tool {call.tool!r} answered with images or video, which tvcache does not cache")
        return [response.text or "", float(reward) if reward is not None else 0.0]


@register(AGENT_NAME)
class CachedToolAgentLoop(ToolAgentLoop):
    """veRL's ToolAgentLoop with a tvcache rollout per trajectory; see the module docstring."""

    tvcache_tools: ClassVar[Tools | None] = None

    def __init__(
        self,
        *args: Any,
        sandboxes: str | None = None,
        read_only: Sequence[str] = (),
        uncacheable: Sequence[str] = (),
        tvcache_url: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._tvcache_pick: Callable[[Row], Sandboxes] | None = _load(sandboxes) if sandboxes else None
        self._tvcache_url = tvcache_url
        self._tvcache_annotations = self.tvcache_tools or Tools(read_only=set(read_only), uncacheable=set(uncacheable))
        self.tvcache_verl_tools: dict[str, Any] = dict(self.tools)
        # veRL's _call_tool keeps doing what it does (checks, truncation); what it calls is the rollout.
        self.tools = {name: self._cached_tool(name, tool) for name, tool in self.tools.items()}
        self._tvcache_rollout: Rollout | None = None
        self._tvcache_verl = True
        #: The results of this trajectory's tool calls, in order (hit or not, seconds, the sandbox's output).
        self.tvcache_results: list[Result] = []

    def tvcache_task(self, row: Row) -> str:
        """This trajectory's task id (default `row_task`)."""
        return row_task(row)

    def tvcache_sandboxes(self, row: Row) -> Sandboxes:
        """The sandbox factory of this trajectory's calls: the YAML's `sandboxes:` function of the row, or the
        veRL tools themselves."""
        if self._tvcache_pick is not None:
            return self._tvcache_pick(row)
        return VerlToolSandboxes(self.tvcache_verl_tools, row.get("tools_kwargs") or {})

    async def tvcache_reward(self, rollout: Rollout, output: Any, **row: Any) -> float | None:
        """The trajectory's reward computed on its final state, or None to leave it to veRL's reward function."""
        return None

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        sandboxes = self.tvcache_sandboxes(kwargs)
        self._tvcache_verl = isinstance(sandboxes, VerlToolSandboxes)
        cache = process_cache(self._tvcache_url)
        async with cache.rollout(self.tvcache_task(kwargs), sandboxes, self._tvcache_annotations) as rollout:
            self._tvcache_rollout = rollout
            try:
                output = await super().run(sampling_params, **kwargs)
                score = await self.tvcache_reward(rollout, output, **kwargs)
            finally:
                self._tvcache_rollout = None
        if score is not None:
            output.reward_score = float(score)
        done = self.tvcache_results
        output.extra_fields.update(
            {
                "tvcache_calls": len(done),
                "tvcache_hits": sum(r.hit for r in done),
                "tvcache_seconds": sum(r.seconds for r in done),
            }
        )
        return output

    def _cached_tool(self, name: str, tool: Any) -> _CachedTool:
        return _CachedTool(self, name, tool.tool_schema)


class _CachedTool(BaseTool):
    """A veRL tool whose calls go through the trajectory's rollout. ToolAgentLoop treats it as any BaseTool: it
    checks the call first, then create / execute / release, then cuts a long response."""

    def __init__(self, loop: CachedToolAgentLoop, name: str, schema: Any) -> None:
        # Not BaseTool.__init__, which prints the schema.
        self.config: dict[str, Any] = {}
        self.tool_schema, self.name, self._loop = schema, name, loop

    async def execute(
        self, instance_id: str, parameters: Any, **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        loop = self._loop
        rollout = loop._tvcache_rollout
        if rollout is None:
            raise RuntimeError(f"tool {self.name!r} was called outside a trajectory's run()")
        # Arguments that are JSON but not an object reach the sandbox as their text, and the veRL tool there gets
        # them as veRL would have given them.
        args = parameters if isinstance(parameters, dict) else json.dumps(parameters)
        token = _agent_data.set(kwargs.get("agent_data"))
        try:
            result = await rollout.call(self.name, args)
        finally:
            _agent_data.reset(token)
        loop.tvcache_results.append(result)
        if loop._tvcache_verl:
            text, reward = result.output
            return ToolResponse(text=text), reward, {}
        output = result.output
        return ToolResponse(text=output if isinstance(output, str) else canonical_json(output).decode()), 0.0, {}


def _load(spec: str) -> Callable[[Row], Sandboxes]:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"sandboxes: expected 'module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise TypeError(f"sandboxes: {spec} is not a function of the dataset row")
    return fn  # type: ignore[no-any-return]


def _no_state() -> None:
    return None


def _cannot_tell(call: ToolCall, output: Output) -> None:
    return None


def _source(fn: Any) -> str:
    if fn is None:
        return ""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
