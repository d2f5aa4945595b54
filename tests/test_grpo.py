"""`tvcache bench grpo` in small: one GRPO step of TRL's GRPOTrainer with the real SmolLM2-135M-Instruct on the CPU,
without and with tvcache, from the same seed. Nothing is a stand-in: the model samples its own SQL, TRL parses it and
calls the environment, the statements run in SQLite sandboxes, and the rewards drive a real update.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # TRL imports weave, whose error reports go nowhere here
pytest.importorskip("trl", reason="needs TRL (pip install 'tvcache[grpo]')")
pytest.importorskip("gguf", reason="needs gguf (pip install 'tvcache[grpo]')")

from tvcache_bench.workloads.grpo import bench, model
from tvcache_bench.workloads.grpo.env import Database, grade
from tvcache_bench.workloads.grpo.tasks import database_path


@pytest.fixture(scope="module")
def runs() -> dict[str, bench.Run]:
    # Two rollouts and a short budget keep the step to seconds; the full run has four and 128 tokens.
    return {name: bench.train(name, 1, rollouts=2, completion_tokens=48) for name in bench.RUNS}


@pytest.mark.slow
def test_one_step_gives_the_same_rewards_with_and_without_tvcache(runs: dict[str, bench.Run]) -> None:
    none, cached = runs["none"], runs["tvcache"]
    assert len(none.steps) == len(cached.steps) == 1
    assert bench.identical(runs)
    assert set(none.steps[0].rewards) <= {-1.0, 0.0, 1.0} and len(none.steps[0].rewards) == 2
    assert cached.steps[0].tool_calls == none.steps[0].tool_calls  # the same calls reached the environment
    assert cached.steps[0].model_calls == none.steps[0].model_calls
    assert len(none.step_seconds) == len(cached.step_seconds) == 1


def test_summary_and_charts(runs: dict[str, bench.Run], tmp_path: Path) -> None:
    from tvcache_bench.workloads.grpo.report import write_charts

    summary = json.loads(json.dumps(bench.summary(runs, ("0.1 0.2 0.3", "0.1 0.2 0.3"))))
    assert summary["identical"] is True
    for name in bench.RUNS:
        run = summary[name]
        assert len(run["rewards"]) == len(run["tool_seconds"]) == len(run["step_seconds"]) == 1
    assert len(summary["tvcache"]["hit_rate"]) == 1 and "hit_rate" not in summary["none"]
    paths = write_charts(runs, tmp_path)
    assert [p.name for p in paths] == ["grpo-rewards.png", "grpo-tool-seconds.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_a_different_reward_sequence_is_reported() -> None:
    a, b = bench.Run("none"), bench.Run("tvcache")
    a.steps = [bench.StepTally(rewards=[1.0, 0.0])]
    b.steps = [bench.StepTally(rewards=[0.0, 1.0])]
    assert not bench.identical({"none": a, "tvcache": b})


def test_the_summary_line_says_more_or_less() -> None:
    from tvcache_bench.workloads.grpo.report import _ratio

    assert (_ratio(0.3, 0.1), _ratio(0.068, 0.292), _ratio(1.0, 0.0)) == ("3.00x less", "4.29x more", "-")


def test_reward_scheme() -> None:
    gold: list[str] = []

    def run_gold() -> str:
        gold.append("ran")
        return "count(*)\n    3503"

    assert grade([], run_gold) == -1.0 and not gold  # no statement ran: the model's call was malformed or missing
    assert grade(["Error: no such table: x"], run_gold) == 0.0 and not gold
    assert grade(["n\n3503"], run_gold) == 1.0  # the header may differ
    assert grade(["count(*)\n    3503", "count(*)\n       1"], run_gold) == 0.0  # the last statement is the answer


def test_a_database_copies_with_its_content_and_its_refusals() -> None:
    # With tvcache, TRL's reset copies a rollout's state back into the environment by pickling; sqlite3's deserialize
    # runs an ATTACH, which the copy's authorizer used to refuse ("not authorized", at the 10-step run's second step).
    db = Database(database_path("chinook"), 10.0)
    assert db.sql("UPDATE Artist SET Name = 'x' WHERE ArtistId = 1") == "OK, 1 row affected"
    copy = pickle.loads(pickle.dumps(db))
    assert copy.sql("SELECT Name FROM Artist WHERE ArtistId <= 2") == db.sql(
        "SELECT Name FROM Artist WHERE ArtistId <= 2"
    )
    assert copy.sql("CREATE TEMP TABLE t (a)") == "Error: not authorized"
    assert copy.sql("ATTACH ':memory:' AS other") == "Error: not authorized"


def test_tool_format_round_trip() -> None:
    tokenizer = model.load_tokenizer()
    ids = tokenizer("SELECT Name FROM Artist\n```", add_special_tokens=False)["input_ids"]
    parsed: Any = tokenizer.parse_response(ids)
    assert parsed["tool_calls"][0]["function"] == {"name": "sql", "arguments": {"query": "SELECT Name FROM Artist"}}
    assert tokenizer.parse_response(tokenizer("SELECT Name FROM", add_special_tokens=False)["input_ids"]) is None
    assert ids[-1] in model.stop_tokens(tokenizer)  # the closing fence ends the turn
    call = {"type": "function", "function": {"name": "sql", "arguments": {"query": "SELECT 1"}}}
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        tokenize=False,
        add_generation_prompt=False,
    )
    assert "<|im_start|>assistant\n```sql\nSELECT 1\n```<|im_end|>" in rendered
    question = [{"role": "user", "content": "q"}]
    prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n```sql\n")
    text = "SELECT 'héllo', 2024;\n  -- done"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
