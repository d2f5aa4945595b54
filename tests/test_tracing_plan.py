"""Only commands whose read sets can be reused are traced (workspace._tracing_plan).

A command that changes the files yields no read set anyone can reuse, yet pays for its tracing. The plan groups
commands by program and stops tracing a group whose traced runs keep changing the files, but for one run in
`PROBE`. What must hold: the grouping keeps readers and writers of one program apart; a group that writes stops
being traced and a group that reads never does; an untraced command answers exactly as a traced one, and is
reused by exact history only.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import pytest

import tvcache
from test_read_sets import NO_EBPF, bash, execute, factory, tree, uses
from tvcache.sandboxes.workspace._tracing_plan import PROBE, TRIES, TracingPlan, program

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="read sets need strace (apt-get install strace)")


@pytest.mark.parametrize(
    ("command", "group"),
    [
        ("grep -n x src/a.py | head -20", "grep -n"),
        ("(\ncd /testbed && sed -n '1,20p' a.py\n)", "sed -n"),
        ("sed -i 's/a/b/' a.py", "sed -i"),
        ("cat a.py", "cat"),
        ("cat > a.py << 'EOF'\nprint(1)\nEOF", "cat >"),
        ("echo x >> log", "echo >"),
        ("python -m pytest tests -x 2>&1 | tail -5", "python -m pytest"),
        ("FOO=1 python -m pip install -e .", "python -m pip"),
        ("find . -name '*.py' > /dev/null", "find"),
        ("cd /testbed; git status", "git"),
        ("echo 'unbalanced", "echo"),
    ],
)
def test_commands_are_grouped_by_program_and_whether_they_redirect_into_a_file(command: str, group: str) -> None:
    assert program(command) == group


def test_a_group_that_keeps_writing_is_traced_once_in_probe_runs() -> None:
    plan = TracingPlan()
    for k in range(TRIES):
        assert plan.wanted(f"echo {k} > f{k}") == "echo >"
        plan.traced("echo >", useful=False)
    decisions = [plan.wanted("echo again > f") for _ in range(2 * PROBE)]
    assert decisions.count("echo >") == 2 and decisions[0]  # the first run after the verdict is a probe
    assert decisions.count(None) == 2 * PROBE - 2
    assert plan.untraced() == {"echo >": 2 * PROBE}
    assert all(plan.wanted("cat f") == "cat" for _ in range(3 * PROBE))  # another group: untouched


def test_a_group_that_sometimes_leaves_the_files_alone_stays_traced() -> None:
    plan = TracingPlan()
    for k in range(40):
        assert plan.wanted("python run.py") == "python"
        plan.traced("python", useful=k % 3 == 0)  # a third of its runs read only
    assert plan.untraced() == {}


@NO_EBPF
def test_a_writing_group_stops_being_traced_and_answers_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        with tree({"a": "A\n"}) as base:
            async with factory(base, "ebpf") as boxes:
                await uses(boxes, "ebpf")
                tracer, watched = boxes._ebpf, []
                assert tracer is not None
                begin = tracer.begin

                def counted(group: int) -> Any:
                    watched.append(group)
                    return begin(group)

                monkeypatch.setattr(tracer, "begin", counted)
                box = await boxes.create()
                for k in range(TRIES + 1):  # the last one is the probe after the verdict
                    await execute(box, bash(f"echo {k} > /testbed/w{k}"))
                assert len(watched) == TRIES + 1
                untraced = await box.execute(bash("echo late > /testbed/late"))
                assert len(watched) == TRIES + 1  # the kernel never watched it
                reader = await execute(box, bash("cat /testbed/a /testbed/w0"))
                assert len(watched) == TRIES + 2
                assert boxes._plan.untraced() == {"echo >": 2}
                assert untraced.reads is None and untraced.reads_later is None
                assert untraced.output == {"output": "", "exit_code": 0} and untraced.changed
                assert reader.reads is not None and reader.output == {"output": "A\n0\n", "exit_code": 0}

                # Through a cache, in a rollout past the verdict: its untraced write is still recorded with what
                # it wrote (state as content), so a reader after it is reused by what it read, from a rollout that
                # never wrote.
                async with tvcache.ToolCache() as cache:
                    async with cache.rollout("t", boxes, tools=tvcache.Tools()) as r:
                        first = await r.call("bash", {"command": "cat /testbed/a"})
                    await cache.flush()
                    async with cache.rollout("t", boxes, tools=tvcache.Tools()) as r:
                        write = await r.call("bash", {"command": "echo 2 > /testbed/b"})
                        second = await r.call("bash", {"command": "cat /testbed/a"})
                    assert write.output == {"output": "", "exit_code": 0} and not write.hit
                    assert first.output == second.output == {"output": "A\n", "exit_code": 0}
                    assert not first.hit and second.hit and cache.stats()["read_set_hits"] == 1
                assert boxes._plan.untraced() == {"echo >": 3}

    asyncio.run(main())
