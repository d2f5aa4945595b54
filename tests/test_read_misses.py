"""The read-set miss diagnosis (tvcache_bench.micro.read_misses): how a differing key is classified, and how misses
are counted from the probes' records."""

from __future__ import annotations

import io
import json
from typing import Any

from tvcache_bench.micro import read_misses as rm

FILE = {"type": "-rw-r--r--", "uid": 0, "gid": 0, "size": 3, "nlink": 1, "mtime": 1, "content": "c1"}
DIR = {"type": "drwxr-xr-x", "uid": 0, "gid": 0, "size": 60, "nlink": 1, "mtime": 1, "content": None}
DESCRIBED: dict[str, dict[str, Any]] = {
    "f1": FILE,
    "f1-later": {**FILE, "mtime": 2},
    "f2": {**FILE, "content": "c2", "mtime": 2},
    "d1": DIR,
    "d1-more": {**DIR, "size": 80, "mtime": 2},
    "d1-touched": {**DIR, "mtime": 2},
    "s1": {"cwd": "/testbed", "oldpwd": "", "exports": None},
    "s2": {"cwd": "/testbed", "oldpwd": "/testbed", "exports": None},
}


def test_a_difference_is_classified_by_what_the_two_digests_described() -> None:
    def kind(key: str, was: str, now: str | None) -> str:
        return rm.kind_of(key, was, now, DESCRIBED)

    assert kind("path:/t/a.py", "f1", "f1-later") == rm.MTIME
    assert kind("path:/t/a.py", "f1", "f2") == rm.CONTENT
    assert kind("path:/t/a.py", "", "f1") == rm.PRESENCE
    assert kind("path:/t/a.py", "f1", "") == rm.PRESENCE
    assert kind("path:/t", "d1", "d1-more") == rm.DIR_SIZE
    assert kind("path:/t", "d1", "d1-touched") == rm.MTIME
    assert kind("path:/t", "d1", "f1") == rm.OTHER  # a directory replaced by a file
    assert kind("path:/t", "d1", None) == rm.OTHER
    assert kind("list:/t", "x", "y") == rm.LISTING
    assert kind("walk:/t", "x", "y") == rm.WALK
    assert kind("shell:", "x", "y") == rm.SHELL
    assert kind("shell:", "s1", "s2") == "shell state: oldpwd"


def test_misses_are_counted_by_what_each_lookup_found() -> None:
    def lookup(
        n: int, call: str, *differ: list[tuple[str, str, str]], hit: bool = False, task: str = "t"
    ) -> dict[str, object]:
        cands = [{"differ": [{"key": k, "was": w, "now": v} for k, w, v in d], "output": "o1"} for d in differ]
        return {
            "ev": "lookup",
            "id": n,
            "task": "t",
            "call": call,
            "candidates": cands or (2 if hit else 0),
            "hit": hit,
        }

    def execute(
        n: int, call: str, edge: bool, candidate: bool, output: str = "o2", task: str = "t"
    ) -> dict[str, object]:
        return {
            "ev": "exec",
            "id": n,
            "task": task,
            "call": call,
            "edge": edge,
            "candidate": candidate,
            "output": output,
        }

    records = [
        *({"ev": "digest", "digest": d, **v} for d, v in DESCRIBED.items()),
        lookup(1, "cat a"),
        lookup(2, "cat a"),  # a concurrent rollout looks up `cat a` before the first execution of it has ended
        execute(1, "cat a", False, True),
        execute(2, "cat a", False, True),
        lookup(3, "sed -i x a"),
        execute(3, "sed -i x a", True, False),
        lookup(4, "sed -i x a"),
        execute(4, "sed -i x a", True, False),
        # The closest candidate is the one blocked by fewer kinds: the mtime alone, not content and shell.
        lookup(5, "cat a", [("path:/a", "f1", "f2"), ("shell:", "s1", "s2")], [("path:/a", "f1", "f1-later")]),
        execute(5, "cat a", False, True, output="o1"),  # the same answer as a candidate that read other digests
        lookup(6, "cat a", hit=True),
        execute(7, "cat b", False, False),  # no lookup: the rollout's state is unknown
        lookup(8, "sed -i x a", task="u"),
        execute(8, "sed -i x a", True, False, task="u"),  # another task's earlier executions do not count
    ]
    found = rm.summarise([json.dumps(r) for r in records], io.StringIO())
    assert found["misses"] == {
        "first execution of the call in its task": 3,
        "an earlier execution of it was still running (concurrent rollouts)": 1,
        "earlier executions all changed the state (no candidate)": 1,
        "candidates, none matching": 1,
        "no second phase: the rollout's state is unknown (an edge whose writes are unknown)": 1,
    }
    assert found["lookups_with_candidates"] == 2 and found["read_set_hits"] == 1
    assert found["blocked_by"] == {rm.MTIME: 1}
    assert found["same_answer_as_a_candidate"] == 1
