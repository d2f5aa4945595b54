"""Tinker cookbook: the Harbor recipe's own environments (`HarborEnvGroupBuilder.make_envs`, the `bash` tool,
`HarborReward` grading with the task's `tests/test.sh`) on tvcache's `sandbox_factory`, stepped token by token as
the cookbook's rollout loop steps them, next to the same environments on the cookbook's own `ModalSandbox`.

Two stand-ins, for what cannot run here: the policy (no model is sampled: scripted turns rendered to tokens with
SmolLM2's real tokenizer and parsed back by the cookbook's Qwen 3 renderer), and Modal's cloud container. The
cookbook's `ModalSandbox` code runs as it is (its exec calls, stream caps, decoding, stdin upload, error handling);
only the `modal.Sandbox` object under it is `LocalModal`, whose `exec` runs the process in a bubblewrap jail holding
the task's files at /testbed, with Modal's semantics: the process's stdout and stderr apart, stdin open until the
caller closes it, and a process past its `timeout` killed and reported with exit code -1. Every observation the
model sees (the bash tool's JSON) and every reward must be equal, byte for byte, over two epochs.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pickle
import shutil
import signal
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker_cookbook", reason="needs the Tinker cookbook (pip install 'tvcache[tinker]')")

from tinker_cookbook import tokenizer_utils
from tinker_cookbook.recipes.harbor_rl.harbor_env import HarborEnvGroupBuilder, HarborTask
from tinker_cookbook.sandbox.modal_sandbox import ModalSandbox

import tvcache
from tvcache.integrations import process_cache, process_sandboxes
from tvcache.integrations.tinker import harbor_task, sandbox_factory

TOKENIZER = "tvcache-tests/smollm2-135m-instruct"
GREET = 'name="${1:-world}"\necho "Helo, $name!"\n'
TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(bash /testbed/greet.sh tvcache)" = "Hello, tvcache!" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
FIX = "sed -i 's/Helo/Hello/' /testbed/greet.sh"
COMMAND_TIMEOUT = 2
PLANS: list[list[str]] = [
    ["cat /testbed/greet.sh", FIX],  # fixes it: reward 1
    ["cat /testbed/greet.sh"],  # looks, leaves it: 0
    ["cat /testbed/greet.sh", FIX],  # plan 0 again: hits, its grading too
    ["echo out1; echo err1 >&2; echo out2; exit 3", "ls /nonexistent"],  # streams apart, non-zero exits
    ["echo started; sleep 30", "cat"],  # past the command timeout; a command that waits on its open stdin
    ["cd /tmp && export X=1 && pwd", "pwd; echo ${X:-unset}; shopt -q login_shell && echo login"],  # bash -lc
    ["head -c 40000 /dev/zero | tr '\\0' a; echo done >&2", "printf 'bad \\xff\\xfe utf8'"],  # huge; not UTF-8
    [FIX + " && echo broken >> /testbed/greet.sh"],  # fixes, then appends a failing line: still 1
]
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


@pytest.fixture(scope="module", autouse=True)
def tokenizer() -> Any:
    return register_tokenizer()


def register_tokenizer() -> Any:
    from tvcache_bench.workloads.grpo.model import load_tokenizer

    loaded = load_tokenizer()
    tokenizer_utils.register_tokenizer(TOKENIZER, lambda: loaded)
    return loaded


@pytest.fixture
def task(tmp_path: Path) -> HarborTask:
    return make_task(tmp_path)


def make_task(where: Path) -> HarborTask:
    root = where / "fix-greeting"
    (root / "environment" / "files").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "environment" / "Dockerfile").write_text("FROM debian:12\nCOPY files /testbed\n")
    (root / "environment" / "files" / "greet.sh").write_text(GREET)
    (root / "tests" / "test.sh").write_text(TEST)
    (root / "home").mkdir()  # root's home in the sandboxes, empty as in LocalModal's jail (see workspace)
    return HarborTask("fix-greeting", "Fix the typo in /testbed/greet.sh.", root)


def workspace(env_dir: Path) -> tvcache.Sandboxes:
    """The task's sandbox factory, one per process (module level, so the sandbox factory pickles).

    /root is an empty directory, as in LocalModal's jail and in a fresh container: the host's own /root would
    give each command's login shell (`bash -lc`) this machine's ~/.profile, which may run anything (here pyenv
    rebuilding its shims, seconds per command, and a change to the sandbox)."""
    files = {"/testbed": env_dir / "files", "/root": env_dir.parent / "home"}
    return process_sandboxes(
        ("tinker-test", env_dir), lambda: tvcache.WorkspaceSandboxes(files, network=False, timeout=60)
    )


# -- Modal's container, stood in for by a local jail --------------------------------------------------------------


class _Aio:
    def __init__(self, fn: Any) -> None:
        self.aio = fn


class LocalModal:
    """What `ModalSandbox` uses of a `modal.Sandbox`: `exec.aio(*argv, timeout, workdir)`, `terminate`, `wait`."""

    def __init__(self, files: Path, scratch: Path) -> None:
        self.object_id = f"local-{scratch.name}"
        self.dirs = {"/testbed": scratch / "testbed"}
        shutil.copytree(files, self.dirs["/testbed"])
        for place in ("/tmp", "/root", "/logs", "/tests"):
            self.dirs[place] = scratch / place.strip("/")
            self.dirs[place].mkdir()
        self.exec, self.terminate, self.wait = _Aio(self._exec), _Aio(self._done), _Aio(self._done)

    async def _done(self, **_: Any) -> None:
        return None

    async def _exec(self, *argv: str, timeout: int | None = None, workdir: str | None = None) -> LocalProcess:
        jail = ["bwrap", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev"]
        for link in ("bin", "lib", "lib64", "sbin"):
            jail += ["--symlink", f"usr/{link}", f"/{link}"]
        for place, where in self.dirs.items():
            jail += ["--bind", str(where), place]
        jail += ["--unshare-pid", "--unshare-net", "--die-with-parent", "--chdir", workdir or "/"]
        process = await asyncio.create_subprocess_exec(
            *jail, *argv, stdin=-1, stdout=-1, stderr=-1, start_new_session=True
        )
        return LocalProcess(process, timeout)


class LocalProcess:
    def __init__(self, process: asyncio.subprocess.Process, timeout: int | None) -> None:
        self._process = process
        self.stdout, self.stderr = _chunks(process.stdout), _chunks(process.stderr)
        self.stdin = _Stdin(process.stdin)
        self.wait = _Aio(self._wait)
        self._ended = asyncio.ensure_future(self._end(timeout))

    async def _end(self, timeout: int | None) -> int:
        try:
            return await asyncio.wait_for(self._process.wait(), timeout)
        except TimeoutError:
            os.killpg(self._process.pid, signal.SIGKILL)
            await self._process.wait()
            return -1  # what Modal's ContainerProcess.wait reports past the exec's deadline

    async def _wait(self) -> int:
        return await self._ended


class _Stdin:
    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self.drain = _Aio(writer.drain)

    def write(self, data: bytes) -> None:
        self._writer.write(data)

    def write_eof(self) -> None:
        self._writer.close()


async def _chunks(reader: Any) -> AsyncIterator[bytes]:
    while chunk := await reader.read(1 << 16):
        yield chunk


def modal_factory(scratch: Path) -> Any:
    made = iter(range(1000))

    async def make(env_dir: Path, timeout: int) -> ModalSandbox:
        where = scratch / f"sandbox-{next(made)}"
        where.mkdir(parents=True)
        return ModalSandbox(timeout, None, None, LocalModal(env_dir / "files", where))  # type: ignore[arg-type]

    return make


def action(tokenizer: Any, command: str | None) -> list[int]:
    if command is None:
        text = "I am done."
    else:
        text = f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]


async def run_group(
    task: HarborTask, factory: Any, tokenizer: Any, plans: list[list[str]] = PLANS
) -> tuple[list[float], list[list[str]], Any]:
    """One group of the recipe's environments, each stepped through its plan; rewards and tool outputs."""
    builder = group_builder(task, plans, factory)
    envs = await builder.make_envs()
    rewards, outputs = [], []
    try:
        for env, plan in zip(envs, plans, strict=True):
            await env.initial_observation()
            total, seen = 0.0, []
            for command in [*plan, None]:
                step = await env.step(action(tokenizer, command), extra={"stop_reason": "stop"})
                total += step.reward
                if step.episode_done:
                    break
            history = env.message_env.history
            seen = [str(m["content"]) for m in history if m["role"] == "tool"]
            rewards.append(total)
            outputs.append(seen)
        sandboxes = list(builder._sandboxes)
    finally:
        await builder.cleanup()
    return rewards, outputs, sandboxes


def test_harbor_envs_on_tvcache_match_modal_and_later_groups_hit(
    task: HarborTask, tokenizer: Any, tmp_path: Path
) -> None:
    async def go() -> tuple[Any, Any, Any, dict[str, float]]:
        plain = await run_group(task, modal_factory(tmp_path / "modal"), tokenizer)
        make = sandbox_factory(workspace)
        first = await run_group(task, make, tokenizer)
        again = await run_group(task, make, tokenizer)  # the next epoch
        stats = process_cache().stats()
        return plain, first, again, stats

    plain, first, again, stats = asyncio.run(go())
    assert plain[0] == REWARDS, plain
    assert first[0] == plain[0] and again[0] == plain[0]
    assert first[1] == plain[1] and again[1] == plain[1]
    seen = [[json.loads(o) for o in outputs] for outputs in plain[1]]
    assert seen[3][0] == {"exit_code": 3, "stdout": "out1\nout2\n", "stderr": "err1\n"}
    assert seen[4][0] == {"exit_code": -1, "stdout": "started\n", "stderr": ""}  # the per-call timeout
    assert seen[4][1]["exit_code"] == -1  # cat waited on its open stdin
    assert seen[5][1]["stdout"] == "/\nunset\nlogin\n"  # a new login shell per command, in the tool's workdir
    assert len(seen[6][0]["stdout"]) == 16384 and seen[6][0]["stderr"] == "done\n"
    assert seen[6][1]["stdout"] == "bad \ufffd\ufffd utf8"
    # Plan 2 repeats plan 0: its two commands, the test upload, test.sh and the reward read all hit.
    assert all(r.hit for r in first[2][2].results)
    # The next epoch hits every call but the timed-out ones (never cached) and what follows them.
    assert all(r.hit for i, box in enumerate(again[2]) if i != 4 for r in box.results)
    assert stats["mismatches"] == 0


def test_the_factory_pickles_and_rolls_out_in_the_cookbooks_process_pool(task: HarborTask, tmp_path: Path) -> None:
    from tinker_cookbook.rl.rollouts import set_rollout_executor

    builder = group_builder(task, [PLANS[0], PLANS[1]])
    assert pickle.loads(pickle.dumps(builder)).sandbox_factory.sandboxes is workspace
    with pytest.raises(TypeError, match="TVCACHE_URL"):
        pickle.dumps(sandbox_factory(workspace, cache=tvcache.ToolCache()))
    spawn = multiprocessing.get_context("spawn")
    os.environ["TVCACHE_URL"] = f"sqlite:///{tmp_path / 'cache.db'}"  # the workers share results through it
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn, initializer=register_tokenizer) as pool:
            set_rollout_executor(pool)  # checks the start method as the cookbook does
            set_rollout_executor(None)
            groups = [pool.submit(roll_out, builder).result(timeout=600) for _ in range(2)]
    finally:
        del os.environ["TVCACHE_URL"]
    assert groups[0][0] == groups[1][0] == [1.0, 0.0]
    assert groups[1][1] == groups[1][2] > 0  # the second group, in another event loop, hit every call


def group_builder(task: HarborTask, plans: list[list[str]], factory: Any = None) -> HarborEnvGroupBuilder:
    return HarborEnvGroupBuilder(
        task=task,
        model_name=TOKENIZER,
        renderer_name="qwen3_instruct",
        max_turns=4,
        group_size=len(plans),
        command_timeout=COMMAND_TIMEOUT,
        grader_timeout=30,
        sandbox_factory=factory or sandbox_factory(workspace),
    )


def roll_out(builder: HarborEnvGroupBuilder) -> tuple[list[float], int, int]:
    """A worker's group rollout, in a fresh event loop as the cookbook's `_run_rollout_sync` runs one: the plans
    of PLANS[0] and PLANS[1]; rewards, calls and hits."""
    tokenizer = tokenizer_utils.get_tokenizer(TOKENIZER)

    async def go() -> tuple[list[float], int, int]:
        rewards, _, boxes = await run_group(builder.task, builder.sandbox_factory, tokenizer, [PLANS[0], PLANS[1]])
        results = [r for box in boxes for r in box.results]
        return rewards, len(results), sum(r.hit for r in results)

    return asyncio.run(go())


def test_task_id_is_the_harbor_task_name(tmp_path: Path) -> None:
    assert harbor_task(tmp_path / "fix-greeting" / "environment") == "fix-greeting"


def test_the_example_runs_a_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import tinker_harbor

    task = tinker_harbor.load_task(tinker_harbor.write_task(tmp_path / "fix-greeting"))
    # The example's factory but with an empty /root (see workspace): this machine's login scripts took most of
    # the test's time, none of what it checks.
    (tmp_path / "fix-greeting" / "home").mkdir()
    monkeypatch.setattr(tinker_harbor, "workspace", workspace)
    outcomes = asyncio.run(tinker_harbor.main(task, tinker_harbor.COMMANDS, rollouts=3))
    assert [reward for reward, _, _ in outcomes] == [1.0, 1.0, 1.0]
    calls = outcomes[0][1]
    assert calls > len(tinker_harbor.COMMANDS)  # the commands, then the grading's upload, test run and reads
    assert outcomes[0][2] == 0 and outcomes[1][2] == outcomes[2][2] == calls  # the others repeat the first
