"""Text-to-SQL with veRL's agent loop on tvcache: each trajectory's `sql` calls in its own copy of the database.

    pip install 'tvcache[verl]'
    PYTHONPATH=examples python examples/verl_text2sql.py --rollouts 4

In a veRL run the change is configuration (see `verl_agent_loop.yaml`, next to this file):

    actor_rollout_ref.rollout.multi_turn.function_tool_path=examples/verl_sql_tool.py   # the tool's schema
    actor_rollout_ref.rollout.agent.agent_loop_config_path=examples/verl_agent_loop.yaml
    # and agent_name "tvcache_text2sql_agent" in the dataset rows (or agent.default_agent_loop)

`Text2SQLAgentLoop` is `CachedToolAgentLoop` with a reward computed on the trajectory's final state: the gold query
(the row's `reward_model.ground_truth`) runs through the trajectory's rollout, and the reward is 1 when its rows
equal those of the trajectory's last `sql` result. The task id is `<data_source>/<extra_info.index>`.

This script runs a group of trajectories per question the way veRL's `AgentLoopWorker` runs them (the agent loop
built from veRL's registry by `hydra.utils.instantiate`, then `run(...)` with the dataset row), twice: first with
veRL's own `tool_agent` (statements on the read-only database), then with `tvcache_text2sql_agent`. No GPU runs here,
so the model is SmolLM2-135M-Instruct on the CPU behind veRL's server interface (`SmolServer`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.function_tool import load_function_tools_from_path
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

import tvcache
from tvcache.integrations import process_sandboxes
from tvcache.integrations.verl import CachedToolAgentLoop
from tvcache_bench.data import workload_path

HERE = Path(__file__).resolve().parent
TOOL_FILE = HERE / "verl_sql_tool.py"
AGENT_LOOPS = HERE / "verl_agent_loop.yaml"
AGENT = "tvcache_text2sql_agent"

QUESTIONS = [
    ("How many tracks are in the store?", "SELECT count(*) FROM Track"),
    ("How many customers live in Brazil?", "SELECT count(*) FROM Customer WHERE Country = 'Brazil'"),
]


def chinook() -> Path:
    return workload_path("sql", "chinook", "chinook.sqlite")  # shipped with tvcache, or $TVCACHE_WORKLOADS


def sandboxes(row: Mapping[str, Any]) -> tvcache.Sandboxes:
    """The sandbox factory of a row (`sandboxes: verl_text2sql:sandboxes` in the YAML): one per process."""
    path = chinook()
    return process_sandboxes(("verl-sqlite", str(path)), lambda: tvcache.SQLiteSandboxes(path, timeout=10))


def rows_equal(a: str, b: str) -> bool:
    """Whether two `sql` outputs hold the same rows (in order; the header line and the padding that aligns columns
    to their names left out)."""
    return [line.split() for line in a.split("\n")[1:]] == [line.split() for line in b.split("\n")[1:]]


@register(AGENT)
class Text2SQLAgentLoop(CachedToolAgentLoop):
    async def tvcache_reward(self, rollout: tvcache.Rollout, output: Any, **row: Any) -> float | None:
        answers = [str(r.output) for r in self.tvcache_results if not r.error]
        if not answers or answers[-1].startswith("Error:"):
            return 0.0
        gold = await rollout.grade("sql", {"query": row["reward_model"]["ground_truth"]})
        return 1.0 if not gold.error and rows_equal(answers[-1], str(gold.output)) else 0.0


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


def verl_config(response_length: int = 256, tool_format: str = "hermes") -> DictConfig:
    """veRL's default PPO config with multi-turn tool calling on, the example's tool file and agent loops."""
    import verl.trainer.config as configs

    config = OmegaConf.load(Path(configs.__file__).parent / "_generated_ppo_trainer.yaml")
    rollout = config.actor_rollout_ref.rollout
    rollout.multi_turn.enable = True
    rollout.multi_turn.format = tool_format
    rollout.multi_turn.max_assistant_turns = 4
    rollout.multi_turn.function_tool_path = str(TOOL_FILE)
    rollout.agent.agent_loop_config_path = str(AGENT_LOOPS)
    rollout.prompt_length = 1024
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


@ToolParser.register("sql_block")
class SQLBlockParser(ToolParser):
    """The tool format SmolLM2 uses here (`tvcache_bench.workloads.grpo.model`): the chat template opens each turn
    with a ```sql line, and the text up to the closing ``` is a call of `sql`."""

    @property
    def stop_token_ids(self) -> list[int]:
        from tvcache_bench.workloads.grpo.model import stop_tokens

        return stop_tokens(self.tokenizer)

    async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list[Any]]:
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        query, fence, _ = text.partition("```")
        if not fence:
            return text, []
        return "", [FunctionCall(name="sql", arguments=json.dumps({"query": query.strip()}))]


class SmolServer:
    """veRL's server interface (`generate(request_id, prompt_ids, sampling_params, ...) -> TokenOutput`) over
    SmolLM2-135M-Instruct in transformers, for running this example without a GPU."""

    def __init__(self, seed: int = 0) -> None:
        from tvcache_bench.workloads.grpo.model import load_model

        self.model, self.seed = load_model(), seed

    async def generate(
        self, *, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> TokenOutput:
        import torch

        torch.manual_seed(self.seed + len(prompt_ids))
        ids = torch.tensor([prompt_ids])
        stop = sampling_params.get("stop_token_ids") or None
        out = await asyncio.to_thread(
            self.model.generate,
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            do_sample=True,
            eos_token_id=stop,
        )
        return TokenOutput(token_ids=out[0, len(prompt_ids) :].tolist(), stop_reason="completed")


async def main(rollouts: int) -> None:
    from tvcache_bench.workloads.grpo.model import load_tokenizer

    config = verl_config(tool_format="sql_block")
    register_agent_loops(config)
    tokenizer, server = load_tokenizer(), SmolServer()
    tools = load_function_tools_from_path(str(TOOL_FILE))
    for agent in ("tool_agent", AGENT):
        for row in rows():
            outputs = [await run_trajectory(config, server, tokenizer, tools, agent, row) for _ in range(rollouts)]
            hits = sum(o.extra_fields.get("tvcache_hits", 0) for o in outputs)
            print(f"{agent:24} task {row['index']}: turns {[o.num_turns for o in outputs]}, tvcache hits {hits}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=4)
    asyncio.run(main(parser.parse_args().rollouts))
