"""Why read-set reuse misses (issue 24): a replay with probes on the two-phase lookup, and the breakdown.

`python -m tvcache_bench.micro.read_misses OUT.jsonl -- <tvcache bench arguments>` runs the benchmark (for
instance `swe --tasks 2 --read-sets --strategies tvcache --no-warmup --turn-time none`) with three probes, each
writing a line of JSON to OUT.jsonl, and then prints the breakdown (`summarise`, also on its own:
`python -m tvcache_bench.micro.read_misses OUT.jsonl`):

- every execution: the call, whether it changed the state, and whether it left a candidate for other rollouts;
- every second-phase lookup whose candidates all failed: for each candidate, the keys whose digest in the
  rollout's state differs from the recorded one, each with what the two digests described;
- what each workspace digest described (a file's type, size, link count, mtime and content digest; a
  listing's names), so a difference can be told apart: content, a directory's size, an mtime alone.

A miss is then one of: the call's first execution in its task (nothing to reuse), a call whose earlier
executions all changed the state (a workspace command that changed files leaves no candidate), or a call whose
candidates all read something that differs now, classified by the kinds of keys that differ in the candidate
closest to matching. It is a diagnosis, not a benchmark: the probes slow the replay down.
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
import itertools
import json
import os
import stat
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

__all__ = ["kind_of", "main", "summarise"]

#: What the key's difference says, from the two digests' descriptions (see `kind_of`).
SHELL = "shell state (working directory, OLDPWD, exports)"  # split by what differs where both are described
MTIME = "mtime alone (same content, e.g. an identical edit made at another time)"
DIR_SIZE = "a directory's size or link count (entries made or removed in it)"
CONTENT = "a file's content"
LISTING = "a directory listing"
PRESENCE = "presence (a path probed absent is there now, or the reverse)"
WALK = "a directory walked through (its mode or owner, or it is gone)"
OTHER = "other (a type, a mode or owner, or undescribed)"


def kind_of(key: str, was: str, now: str | None, described: Mapping[str, dict[str, Any]]) -> str:
    """The kind of difference between the digest a candidate recorded for `key` (`was`) and the state's (`now`;
    None: the state cannot tell it), from the digests' descriptions."""
    kind = key.partition(":")[0]
    if kind == "shell":
        a, b = described.get(was), described.get(now or "")
        if a is None or b is None:
            return SHELL
        parts = [name for name in ("cwd", "oldpwd", "exports") if a[name] != b[name]]
        return f"{SHELL[: SHELL.index(' (')]}: {', '.join(parts) or 'undescribed'}"
    if kind == "walk":
        return WALK
    if kind == "list":
        return LISTING
    if now is None or kind != "path":
        return OTHER
    if was == "" or now == "":
        return PRESENCE
    a, b = described.get(was), described.get(now)
    if a is None or b is None or a["type"][0] != b["type"][0]:
        return OTHER
    differ = {f for f in ("content", "size", "nlink", "mtime", "uid", "gid", "type") if a[f] != b[f]}
    if "content" in differ:
        return CONTENT
    if differ == {"mtime"}:
        return MTIME
    if a["type"][0] == "d" and differ <= {"size", "nlink", "mtime"}:
        return DIR_SIZE
    return OTHER


def summarise(lines: Iterable[str], out: TextIO = sys.stdout) -> dict[str, Any]:
    """Print (and return) the breakdown of the misses recorded in `lines` (the probes' JSON lines)."""
    records = [json.loads(line) for line in lines]
    described = {r["digest"]: r for r in records if r["ev"] == "digest"}
    looked = {r["id"]: (i, r) for i, r in enumerate(records) if r["ev"] == "lookup"}
    misses: collections.Counter[str] = collections.Counter()
    blocked: collections.Counter[str] = collections.Counter()
    keys: collections.Counter[str] = collections.Counter()
    coincide = 0  # of the calls whose candidates all differed: those that answered as one of them had all the same
    # Where each call ran and was looked up, by the same call in the same task (the scope candidates are shared in).
    runs: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = collections.defaultdict(list)
    first_asked: dict[tuple[str, str], int] = {}
    for i, r in enumerate(records):
        if r["ev"] == "exec":
            runs[(r["task"], r["call"])].append((i, r))
        elif r["ev"] == "lookup":
            first_asked.setdefault((r["task"], r["call"]), i)
    for i, r in enumerate(records):
        if r["ev"] != "exec":
            continue
        at, lookup = looked.get(r["id"], (i, None))
        same = (r["task"], r["call"])
        before = [e for j, e in runs[same] if j < at]
        asked = first_asked.get(same, at) < at
        if lookup is None:
            misses["no second phase: the rollout's state is unknown (an edge whose writes are unknown)"] += 1
        elif lookup["candidates"]:
            misses["candidates, none matching"] += 1
            coincide += any(c.get("output") == r.get("output") for c in lookup["candidates"])

            def kinds(c: dict[str, Any]) -> list[str]:
                return [kind_of(m["key"], m["was"], m["now"], described) for m in c["differ"]]

            closest = min(lookup["candidates"], key=lambda c: (len(set(kinds(c))), len(c["differ"])))
            blocked[" + ".join(sorted(set(kinds(closest))))] += 1
            keys.update(kinds(closest))
        elif not before and not asked:
            misses["first execution of the call in its task"] += 1
        elif not before:
            misses["an earlier execution of it was still running (concurrent rollouts)"] += 1
        elif all(e["edge"] for e in before):
            misses["earlier executions all changed the state (no candidate)"] += 1
        elif any(e["candidate"] for e in before):
            misses["an earlier candidate not stored yet, or not kept (a large output, more than a call keeps)"] += 1
        else:
            misses["earlier executions read what cannot be observed (no candidate)"] += 1
    lookups = sum(1 for r in records if r["ev"] == "lookup" and r["candidates"])
    hits = sum(1 for r in records if r["ev"] == "lookup" and r["hit"])
    result = {
        "executions": sum(misses.values()),
        "misses": dict(misses),
        "same_answer_as_a_candidate": coincide,
        "lookups_with_candidates": lookups,
        "read_set_hits": hits,
        "blocked_by": dict(blocked),
        "differing_keys": dict(keys),
    }
    print(f"executions (misses of the exact lookup that ran): {result['executions']}", file=out)
    for what, n in misses.most_common():
        print(f"  {n:5d}  {what}", file=out)
    print(f"  (of the calls with candidates, none matching, {coincide} answered as one of them had)", file=out)
    print(f"second-phase lookups with candidates: {lookups}, of them hits: {hits}", file=out)
    print("kinds of difference that blocked the closest candidate, per miss:", file=out)
    for what, n in blocked.most_common():
        print(f"  {n:5d}  {what}", file=out)
    print("differing keys of those candidates, by kind:", file=out)
    for what, n in keys.most_common():
        print(f"  {n:5d}  {what}", file=out)
    return result


def _digest(output: bytes) -> str:
    return hashlib.blake2b(output, digest_size=8).hexdigest()


def _probe(out: TextIO) -> None:
    """Wrap the lookup, the candidates and the workspace digests so that each reports to `out`."""
    from tvcache import reads, rollout
    from tvcache.sandboxes.workspace import _reads

    lock = threading.Lock()
    described: set[str] = set()

    def emit(record: dict[str, Any]) -> None:
        with lock:
            out.write(json.dumps(record) + "\n")

    path_digest, list_digest = _reads.Digester._path_digest, _reads.Digester._list_digest

    def describe_path(self: _reads.Digester, path: str) -> str:
        digest = path_digest(self, path)
        seen = self._lstat(path) if digest and digest not in described else None
        if seen is not None:
            described.add(digest)
            content = None
            if stat.S_ISREG(seen.st_mode):
                fd = self.open_canonical(path, os.O_PATH | os.O_NOFOLLOW)
                try:
                    content = self._content(fd, seen)
                finally:
                    os.close(fd)
            fields = {"uid": seen.st_uid, "gid": seen.st_gid, "size": seen.st_size, "nlink": seen.st_nlink}
            mode = stat.filemode(seen.st_mode)
            emit({"ev": "digest", "digest": digest, "path": path, "type": mode, **fields, "mtime": seen.st_mtime_ns,
                  "content": content})  # fmt: skip
        return digest

    def describe_listing(self: _reads.Digester, path: str) -> str:
        digest = list_digest(self, path)
        if digest and digest not in described:
            described.add(digest)
            emit({"ev": "digest", "digest": digest, "path": path})
        return digest

    shell_digest = _reads.shell_digest

    def describe_shell(state: Any) -> str:
        digest = shell_digest(state)
        if digest not in described:
            described.add(digest)
            exports = None if state.exports is None else hashlib.blake2b(state.exports).hexdigest()[:16]
            emit({"ev": "digest", "digest": digest, "cwd": os.fsdecode(state.cwd),
                  "oldpwd": os.fsdecode(state.oldpwd), "exports": exports})  # fmt: skip
        return digest

    choose, candidate_of, execute_claimed = reads.choose, reads.candidate_of, rollout.Rollout._execute_claimed
    current: contextvars.ContextVar[tuple[int, str, str]] = contextvars.ContextVar("current", default=(0, "", ""))
    ids = itertools.count(1)

    async def probed_execute_claimed(self: rollout.Rollout, *args: Any) -> Any:
        current.set((next(ids), args[0].label(), self._scope_key))  # the lookup and execution report under one id
        return await execute_claimed(self, *args)

    async def probed_choose(candidates: Sequence[reads.Candidate], state: Mapping[str, str], base: Any) -> Any:
        found = await choose(candidates, state, base)
        n, call, task = current.get()
        record: dict[str, Any] = {"ev": "lookup", "id": n, "call": call, "task": task}
        record["candidates"] = len(candidates)
        record["hit"] = found is not None
        if candidates and found is None:
            now = await reads.digests({k for c in candidates for k in c.reads}, state, base)
            record["candidates"] = [
                {
                    "differ": [{"key": k, "was": v, "now": now.get(k)} for k, v in c.reads.items() if now.get(k) != v],
                    "output": _digest(c.output),
                }
                for c in candidates
            ]
        emit(record)
        return found

    async def probed_candidate_of(outcome: Any, output: bytes, seconds: float, call: str, **kw: Any) -> Any:
        made = await candidate_of(outcome, output, seconds, call, **kw)
        n, _, task = current.get()
        record = {"ev": "exec", "id": n, "task": task, "call": call, "edge": kw["edge"], "candidate": made is not None}
        emit({**record, "output": _digest(output)})
        return made

    _reads.Digester._path_digest = describe_path  # type: ignore[method-assign]
    _reads.Digester._list_digest = describe_listing  # type: ignore[method-assign]
    _reads.shell_digest = describe_shell
    rollout.choose = probed_choose  # type: ignore[attr-defined]
    rollout.candidate_of = probed_candidate_of  # type: ignore[attr-defined]
    rollout.Rollout._execute_claimed = probed_execute_claimed  # type: ignore[method-assign,assignment]


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    if "--" not in argv:
        with open(argv[0]) as f:
            summarise(f)
        return 0
    from tvcache.cli import main as tvcache_main

    with open(argv[0], "w") as out:
        _probe(out)
        code = tvcache_main(["bench", *argv[argv.index("--") + 1 :]])
    with open(argv[0]) as f:
        summarise(f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
