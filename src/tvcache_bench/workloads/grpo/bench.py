"""`tvcache bench grpo`: a real GRPO run with TRL on the CPU, twice from one seed, without and with tvcache.

TRL's `GRPOTrainer` trains SmolLM2-135M-Instruct (`model`) on Chinook text-to-SQL tasks (`tasks`) through its
`environment_factory`: the model calls a `sql` tool, TRL runs it in the environment (`env`) and feeds the result
back, up to `TOOL_TURNS` times per rollout, and the reward grades the last result against the gold query's on the
final state. Each step takes one question and samples `ROLLOUTS` completions of it; the questions come around
again every `TASKS` steps, as epochs do.

The run is made twice in this process, from the same seed and the same freshly loaded weights: `none` answers
every call in a fresh copy of the database, `tvcache` sends the same environment through
`tvcache.integrations.trl.cached_environment`. Tool outputs are the same either way, so the sampled completions,
the rewards and the weight updates are the same, step for step: the run checks that the reward sequences are
identical and fails otherwise. Per step it prints both runs' rewards, the tool calls the model made, how many
rewards were -1, 0 and 1, tvcache's hit rate, and the tool seconds and step wall time of both runs.

The runs take turns as wholes (`none` first), so a change in the machine's load between them shows in the step
times; the tool seconds are measured inside each call.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvcache.sandboxes.reclaim import scratch

from .env import Database, Reward, SQLEnvironment, StepTally
from .model import load_model, load_tokenizer, stop_tokens, train_last_blocks
from .tasks import EXAMPLE_QUERY, chinook, database_path, rows

__all__ = ["ROLLOUTS", "RUNS", "TASKS", "Run", "identical", "run", "summary", "train"]

RUNS = ("none", "tvcache")
ROLLOUTS = 4  # completions per question (GRPO's group)
TASKS = 5  # distinct questions: ten steps see each twice
TOOL_TURNS = 2  # tool calls per rollout at most
COMPLETION_TOKENS = 128  # per rollout, tool results included
TEMPERATURE = 0.8  # sampling; TRL's default is 1.0
TRAINED_LAYERS = 2  # the last decoder blocks, trained; the rest of the model is frozen, to fit a CPU
SQL_TIMEOUT = 10.0


@dataclass
class Run:
    name: str
    steps: list[StepTally] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rewards": [s.rewards for s in self.steps],
            "tool_seconds": [round(s.tool_seconds, 6) for s in self.steps],
            "step_seconds": [round(t, 3) for t in self.step_seconds],
            "model_tool_calls": [s.model_calls for s in self.steps],
            "tool_calls": [s.tool_calls for s in self.steps],
            "seconds": round(self.seconds, 2),
        }
        if self.name != "none":
            out["hits"] = [s.hits for s in self.steps]
            out["hit_rate"] = [round(s.hits / s.tool_calls, 4) if s.tool_calls else 0.0 for s in self.steps]
        return out


def train(
    name: str,
    steps: int,
    *,
    seed: int = 0,
    tasks: int = TASKS,
    rollouts: int = ROLLOUTS,
    completion_tokens: int = COMPLETION_TOKENS,
) -> Run:
    """One GRPO run of `steps` steps; `name` is `none` (no cache) or `tvcache`. The tests make it smaller with
    `rollouts` and `completion_tokens`."""
    if name not in RUNS:
        raise ValueError(f"run {name!r}: choose from {', '.join(RUNS)}")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL 1.16
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; no model hub here
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # TRL imports weave, whose error reports go nowhere
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer  # type: ignore[attr-defined]  # lazily exported

    from tvcache.integrations.trl import cached_environment
    from tvcache.sync import SyncToolCache

    databases = {"chinook": database_path("chinook")}
    cache = SyncToolCache() if name == "tvcache" else None
    run = Run(name)

    class StepTimer(TrainerCallback):
        started = 0.0

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            run.step_seconds.append(time.perf_counter() - self.started)

    def plain() -> SQLEnvironment:
        return SQLEnvironment(databases, SQL_TIMEOUT)

    factory: Callable[[], Any] = plain
    if cache is not None:
        factory = cached_environment(plain, cache=cache)
    reward = Reward(cached=cache is not None)
    tokenizer = load_tokenizer()
    with scratch("grpo") as folder:
        config = GRPOConfig(
            output_dir=str(folder),
            use_cpu=True,
            seed=seed,
            max_steps=steps,
            per_device_train_batch_size=rollouts,
            num_generations=rollouts,
            max_completion_length=completion_tokens,
            max_tool_calling_iterations=TOOL_TURNS,
            generation_kwargs={"eos_token_id": stop_tokens(tokenizer)},
            learning_rate=5e-6,
            temperature=TEMPERATURE,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            # TRL turns it on by default, and with it transformers makes the inputs require gradients: backpropagation
            # then runs through every frozen block (and recomputes each), not only the trained ones.
            gradient_checkpointing=False,
            # Also on by default: bfloat16 autocast, which a CPU without AVX512-BF16 or AMX emulates. One step of
            # this bench took 167 s with it and 54 s without on an AVX2-only EPYC.
            bf16=False,
        )
        try:
            example = Database(databases["chinook"], SQL_TIMEOUT).sql(EXAMPLE_QUERY)
            trainer = GRPOTrainer(
                model=train_last_blocks(load_model(), TRAINED_LAYERS),
                processing_class=tokenizer,
                reward_funcs=reward,
                args=config,
                train_dataset=Dataset.from_list(rows(chinook(tasks), example)),
                environment_factory=factory,
                callbacks=[StepTimer()],
            )
            started = time.perf_counter()
            trainer.train()
            run.seconds = time.perf_counter() - started
            run.steps = reward.steps
        finally:
            if cache is not None:
                cache.close()
    gc.collect()  # the model, its optimizer and the environments, before the next run loads its own
    return run


def identical(runs: dict[str, Run]) -> bool:
    rewards = [[s.rewards for s in r.steps] for r in runs.values()]
    return all(r == rewards[0] for r in rewards)


def summary(runs: dict[str, Run], load: tuple[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {name: r.as_dict() for name, r in runs.items()}
    out["identical"] = identical(runs)
    out["load_average"] = {"before": load[0], "after": load[1]}
    out["about"] = (
        f"TRL GRPOTrainer, SmolLM2-135M-Instruct on the CPU, {ROLLOUTS} rollouts per step, Chinook text-to-SQL "
        f"questions, sql tool on an in-memory copy of the database; none: a fresh copy per rollout; tvcache: the same "
        f"environment through cached_environment"
    )
    return out


def run(steps: int = 10, *, seed: int = 0, charts: str | None = None) -> dict[str, Any]:
    """Both runs, the per-step table and the charts; returns `summary()` (its `identical` says whether the reward
    sequences matched; the CLI writes it with --json and fails when they did not)."""
    from ...report import wide_console
    from .report import print_steps, write_charts

    console = wide_console()
    before = _load()
    runs: dict[str, Run] = {}
    for name in RUNS:
        console.print(f"grpo: {steps} steps of GRPO, {name} ...")
        runs[name] = train(name, steps, seed=seed)
    result = summary(runs, (before, _load()))
    print_steps(runs, console)
    if charts:
        for path in write_charts(runs, charts):
            console.print(f"chart: {path}")
    return result


def _load() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg has them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"
