"""The stand-in for a model server that the framework examples run on when given no `--base-url`: no language
model runs here, so a scripted policy plays one, behind the same OpenAI-compatible chat-completions API on loopback.
Everything around it (the framework's client, its rollout machinery, tvcache) is the real code path.

A policy is a list of plans; a plan is the turns of one rollout, each turn the tool calls the "model" makes, as
`(name, arguments as the JSON text a model emits)`; after its last turn it answers "Done.".
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from typing import Any

from aiohttp import web

Plan = Sequence[Sequence[tuple[str, str]]]


class ScriptedPolicy:
    """Stands in for a model server when none is given: an OpenAI-compatible chat-completions endpoint on
    127.0.0.1 whose answers are the tool calls of `plans`, a plan per rollout in turn. Its first answer of a
    conversation says `[plan k]`, so the later requests of that conversation (which carry it) continue plan k."""

    def __init__(self, plans: Sequence[Plan]) -> None:
        self.plans = plans
        self._started = 0

    def answer(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        answers = [m for m in messages if m.get("role") == "assistant"]
        if answers:
            plan = int(re.findall(r"\[plan (\d+)\]", str(answers[0].get("content")))[0])
        else:
            plan, self._started = self._started % len(self.plans), self._started + 1
        steps, turn = self.plans[plan], len(answers)
        mark = f"[plan {plan}] " if turn == 0 else ""
        if turn >= len(steps):
            return {"role": "assistant", "content": mark + "Done."}
        calls = [
            {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(steps[turn])
        ]
        return {"role": "assistant", "content": f"{mark}turn {turn}", "tool_calls": calls}

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        message = self.answer(body["messages"])
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        head = {"id": "scripted", "created": 0, "model": body.get("model", MODEL)}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            return web.json_response({**head, "object": "chat.completion", "choices": [choice], "usage": usage})
        # verifiers' harness streams: the whole answer in one chunk, then the finish reason and usage.
        delta = dict(message)
        if "tool_calls" in delta:
            delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
        chunks = [
            {"index": 0, "delta": delta, "finish_reason": None},
            {"index": 0, "delta": {}, "finish_reason": finish},
        ]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n, choice in enumerate(chunks):
            chunk = {**head, "object": "chat.completion.chunk", "choices": [choice], **({"usage": usage} if n else {})}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def __aenter__(self) -> str:
        """Serves on a free loopback port; returns its base URL."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"
        return self.url

    async def __aexit__(self, *exc_info: object) -> None:
        await self._runner.cleanup()


#: The model name the stand-in serves, and the default of `--model`.
MODEL = "scripted-policy"


def policy_arguments(doc: str, *, uncached: str | None = None) -> argparse.Namespace:
    """The command line of every example driven by a policy: `--base-url` (default: the stand-in), `--model`,
    `--rollouts`, `--epochs`, and where given the flag `uncached` ("--plain") that runs the example without tvcache
    (`args.cached` False)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--base-url", help="an OpenAI-compatible server (default: a built-in scripted policy)")
    parser.add_argument("--model", default=MODEL, help="the model the server serves")
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    if uncached:
        parser.add_argument(uncached, dest="uncached", action="store_true", help="run without tvcache, to compare")
    args = parser.parse_args()
    if args.base_url and args.model == MODEL:
        parser.error("--base-url needs --model: the model the server serves")
    args.cached = not getattr(args, "uncached", False)
    return args


def cache_line(stats: dict[str, float]) -> str:
    """The last line the examples print: what the cache did."""
    saved = stats["seconds_saved"]
    shown = f"{saved:.1f} s" if saved >= 1 else f"{saved * 1e3:.1f} ms"
    return (
        f"cache: {stats['calls']:.0f} calls, {stats['hits']:.0f} hits, {stats['executions']:.0f} executions, "
        f"{shown} of tool time saved"
    )
