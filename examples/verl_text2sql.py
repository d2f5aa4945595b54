"""Text-to-SQL with veRL's agent loop on tvcache: veRL's read-only `sql` tool, its answers shared between rollouts.

    pip install 'tvcache[verl]'
    PYTHONPATH=examples python examples/verl_text2sql.py            # a built-in scripted policy, no model needed
    PYTHONPATH=examples python examples/verl_text2sql.py --base-url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-8B

In a veRL run the change is configuration (see `verl_agent_loop.yaml`, next to this file):

    actor_rollout_ref.rollout.multi_turn.function_tool_path=examples/verl_sql_tool.py   # the tool
    actor_rollout_ref.rollout.agent.agent_loop_config_path=examples/verl_agent_loop.yaml
    # and agent_name "tvcache_text2sql_agent" in the dataset rows (or agent.default_agent_loop)

The tool (`verl_sql_tool.sql`) runs each statement on the Chinook database opened read-only, so nothing a rollout
runs changes what the next one sees. `Text2SQLLoop` is veRL's `ToolAgentLoop` with a reward: 1 when the last tool
answer of the trajectory holds the rows of the gold query (the row's `reward_model.ground_truth`), which the same
tool answers. `Text2SQLAgentLoop` is the same loop with tvcache: every call goes through the trajectory's tvcache
rollout, and on a miss to the same tool (veRL's own, as `CachedToolAgentLoop` runs it); the tool is read-only
(`read_only: [sql]`), so its answers are shared between rollouts in any order, and the gold query is graded once.
The task id is `<data_source>/<extra_info.index>`.

This script runs a group of trajectories per question the way veRL's `AgentLoopWorker` runs them (the agent loop
built from veRL's registry by `hydra.utils.instantiate`, then `run(...)` with the dataset row), with veRL's loop
alone and then with tvcache's for two epochs, and prints the rewards and the calls answered from the cache. The
policy is `ScriptedServer` (veRL's server interface answering from plans, a byte-level tokenizer), or a model
behind an OpenAI-compatible completions endpoint (`--base-url`, its tokenizer from `--model`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
    register,
)
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.function_tool import load_function_tools_from_path, normalize_function_tool_return
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

import tvcache
from tvcache.integrations.verl import CachedToolAgentLoop
from tvcache_bench.data import workload_path

HERE = Path(__file__).resolve().parent
TOOL_FILE = HERE / "verl_sql_tool.py"
AGENT_LOOPS = HERE / "verl_agent_loop.yaml"
AGENT = "tvcache_text2sql_agent"
PLAIN = "text2sql_agent"

QUESTIONS = [
    ("How many tracks are in the store?", "SELECT count(*) FROM Track"),
    ("How many customers live in Brazil?", "SELECT count(*) FROM Customer WHERE Country = 'Brazil'"),
]


def chinook() -> Path:
    return workload_path("sql", "chinook", "chinook.sqlite")  # shipped with tvcache, or $TVCACHE_WORKLOADS


def rows_equal(a: str, b: str) -> bool:
    """Whether two `sql` outputs hold the same rows (in order; the header line and the padding that aligns columns
    to their names left out)."""
    return [line.split() for line in a.split("\n")[1:]] == [line.split() for line in b.split("\n")[1:]]


def score(answers: Sequence[str], gold: str) -> float:
    """The reward: 1 when the last tool answer holds the gold query's rows (both answered by the read-only tool)."""
    if not answers or answers[-1].startswith("Error") or gold.startswith("Error"):
        return 0.0
    return 1.0 if rows_equal(answers[-1], gold) else 0.0


class _Answers(ToolAgentLoop):
    """Keeps the text of every tool answer the model saw (after veRL's checks and truncation), in call order."""

    async def _call_tool(self, tool_call: Any, tools_kwargs: Any, agent_data: Any) -> Any:
        response = await super()._call_tool(tool_call, tools_kwargs, agent_data)
        position = next(i for i, c in enumerate(agent_data.tool_calls) if c is tool_call)
        answers = self.__dict__.setdefault("answers", {})
        answers[(len(agent_data.messages), position)] = response[0].text or ""
        return response

    def last_answers(self) -> list[str]:
        answers = self.__dict__.get("answers", {})
        return [answers[k] for k in sorted(answers)]


@register(PLAIN)
class Text2SQLLoop(_Answers):
    """veRL alone: its tool loop, and the gold query run by the tool itself for the reward."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        output = await super().run(sampling_params, **kwargs)
        tool = self.tools["sql"]
        gold = normalize_function_tool_return(await tool.call({"query": kwargs["reward_model"]["ground_truth"]}))
        output.reward_score = score(self.last_answers(), gold[0].text or "")
        return output


@register(AGENT)
class Text2SQLAgentLoop(_Answers, CachedToolAgentLoop):
    """The same with tvcache: the gold query is a call of the trajectory's rollout too, graded once per task."""

    async def tvcache_reward(self, rollout: tvcache.Rollout, output: Any, **row: Any) -> float | None:
        gold = await rollout.grade("sql", {"query": row["reward_model"]["ground_truth"]})
        text, _reward = gold.output
        return score(self.last_answers(), text)


def rows() -> list[dict[str, Any]]:
    """Dataset rows as veRL's RLHFDataset hands them to an agent loop."""
    return [
        {
            "raw_prompt": [
                {"role": "system", "content": "Answer questions about the Chinook database with the sql tool."},
                {"role": "user", "content": question},
            ],
            "data_source": "chinook",
            "extra_info": {"index": i},
            "index": i,
            "reward_model": {"ground_truth": gold},
            "tools_kwargs": {},
        }
        for i, (question, gold) in enumerate(QUESTIONS)
    ]


def verl_config(response_length: int = 8192, tool_format: str = "hermes") -> DictConfig:
    """veRL's default PPO config with multi-turn tool calling on, the example's tool file and agent loops."""
    import verl.trainer.config as configs

    config = OmegaConf.load(Path(configs.__file__).parent / "_generated_ppo_trainer.yaml")
    rollout = config.actor_rollout_ref.rollout
    rollout.multi_turn.enable = True
    rollout.multi_turn.format = tool_format
    rollout.multi_turn.max_assistant_turns = 4
    rollout.multi_turn.max_parallel_calls = 4  # a turn may call several tools at once
    rollout.multi_turn.function_tool_path = str(TOOL_FILE)
    rollout.agent.agent_loop_config_path = str(AGENT_LOOPS)
    rollout.prompt_length = 4096
    rollout.response_length = response_length
    return config


def register_agent_loops(config: DictConfig) -> None:
    """What AgentLoopWorker does with `agent_loop_config_path`: add the YAML's agent loops to the registry."""
    for entry in OmegaConf.load(config.actor_rollout_ref.rollout.agent.agent_loop_config_path):
        _agent_loop_registry[entry.name] = entry


async def run_trajectory(
    config: DictConfig, server: Any, tokenizer: Any, tools: Sequence[Any], agent: str, row: Mapping[str, Any]
) -> Any:
    """One trajectory as AgentLoopWorker._run_agent_loop runs it."""
    loop = hydra.utils.instantiate(
        config=_agent_loop_registry[agent],
        trainer_config=DictConfigWrap(config=config),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        hf_model_type="llama",
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap(list(tools)),
    )
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
    return await loop.run(sampling, **dict(row))


#: Per turn, the tool calls: (name, arguments), or the raw text between <tool_call> tags; None or the plan's end stops.
Plan = Sequence[Sequence[tuple[str, Any] | str] | None]


class ScriptedServer:
    """veRL's LLM server interface answering each trajectory (veRL's request id) from the next plan of `queue`, as
    the tokens of the hermes tool format: the stand-in for a model when no server is given."""

    PLANS: Sequence[Plan] = (
        ((("sql", {"query": "SELECT count(*) FROM Track"}),),),
        ((("sql", {"query": "SELECT name FROM sqlite_master WHERE type = 'table'"}),), (("sql", {"query": "{gold}"}),)),
        ((("sql", {"query": "SELEC oops"}),),),
        ((("sql", {"query": "DELETE FROM Track"}),), (("sql", {"query": "SELECT 0"}),)),  # refused: read-only
    )

    def __init__(self, tokenizer: Any, plans: Sequence[Plan] = PLANS) -> None:
        self.tokenizer, self.plans = tokenizer, plans
        self.queue: list[tuple[Plan, str]] = []
        self._taken: dict[str, tuple[Plan, str]] = {}
        self._turns: Counter[str] = Counter()

    async def generate(self, *, request_id: str, prompt_ids: list[int], **_: Any) -> TokenOutput:
        if request_id not in self._taken:
            self._taken[request_id] = self.queue.pop(0)
        (plan, gold), turn = self._taken[request_id], self._turns[request_id]
        self._turns[request_id] += 1
        step = plan[turn] if turn < len(plan) else None
        text = "I have the answer."
        if step is not None:
            calls = (c if isinstance(c, str) else json.dumps({"name": c[0], "arguments": c[1]}) for c in step)
            text = "".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls).replace("{gold}", gold)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return TokenOutput(token_ids=ids, stop_reason="completed")


class OpenAIServer:
    """veRL's LLM server interface over an OpenAI-compatible completions endpoint (vLLM, SGLang) that takes token
    ids as the prompt."""

    def __init__(self, base_url: str, model: str, tokenizer: Any) -> None:
        from openai import AsyncOpenAI

        self.client, self.model, self.tokenizer = AsyncOpenAI(base_url=base_url, api_key="none"), model, tokenizer
        self.queue: list[Any] = []  # plans are the scripted server's; a model plays its own

    async def generate(self, *, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any):
        response = await self.client.completions.create(
            model=self.model, prompt=prompt_ids, max_tokens=512, temperature=sampling_params.get("temperature", 1.0)
        )
        ids = [*self.tokenizer.encode(response.choices[0].text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return TokenOutput(token_ids=ids, stop_reason="completed")


def byte_tokenizer() -> Any:
    """A byte-level tokenizer with a ChatML template that lists the tools: the scripted policy's, no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|pad|>", bos_token="<|im_start|>"
    )
    tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


async def epoch(
    config: DictConfig, server: Any, tokenizer: Any, tools: Sequence[Any], agent: str, rollouts: int
) -> list[list[Any]]:
    """A group of `rollouts` trajectories per question; rollout k follows the server's plan k (scripted)."""
    groups = []
    for row in rows():
        gold = row["reward_model"]["ground_truth"]
        group = []
        for k in range(rollouts):
            plans = getattr(server, "plans", [None])
            server.queue.append((plans[k % len(plans)], gold))
            group.append(await run_trajectory(config, server, tokenizer, tools, agent, row))
        groups.append(group)
    return groups


async def main(rollouts: int = 4, base_url: str | None = None, model: str | None = None) -> dict[str, Any]:
    """veRL's loop for one epoch, then tvcache's for two; prints and returns the outputs per loop and epoch."""
    if base_url:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        server: Any = OpenAIServer(base_url, str(model), tokenizer)
        config = verl_config()
    else:
        tokenizer = byte_tokenizer()
        server = ScriptedServer(tokenizer)
        config = verl_config()
    register_agent_loops(config)
    tools = load_function_tools_from_path(str(TOOL_FILE))
    out: dict[str, Any] = {}
    for agent, epochs in ((PLAIN, 1), (AGENT, 2)):
        out[agent] = []
        for n in range(epochs):
            groups = await epoch(config, server, tokenizer, tools, agent, rollouts)
            out[agent].append(groups)
            line = f"{agent:24} epoch {n}: rewards {[[o.reward_score for o in g] for g in groups]}"
            if agent == AGENT:
                calls = sum(o.extra_fields["tvcache_calls"] for g in groups for o in g)
                hits = sum(o.extra_fields["tvcache_hits"] for g in groups for o in g)
                line += f"; {hits} of {calls} tool calls from the cache"
            print(line, flush=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--base-url", help="an OpenAI-compatible completions endpoint; without it a scripted policy")
    parser.add_argument("--model", default="Qwen/Qwen3-8B", help="the served model (its tokenizer is loaded)")
    args = parser.parse_args()
    asyncio.run(main(args.rollouts, args.base_url, args.model))
