"""Task ids from a task's own data.

Rollouts of the same prompt must share a graph, in every epoch and every worker, and rollouts of different prompts
must never share one. The id that guarantees both is a hash of the task's content: the scenario or dataset row the
framework hands the environment. Two rows with equal content are the same prompt (sharing is right); a field that
changes between epochs (a sampling index, a per-step uid) only costs hits, never a wrong answer; so such fields are
left out by the caller (`ignore`), and a framework's own stable key (verifiers' `Task.key`) is used where it has one.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ..calls import canonical_json

__all__ = ["task_key"]

#: A str id longer than this is hashed, to keep keys (and the dashboard) readable.
MAX_TEXT = 200


def task_key(value: Any, *, ignore: Collection[str] = ()) -> str:
    """A stable task id for `value`: a short string or an int as it is, anything else as `sha256:` of the
    canonical JSON of its content (mappings, lists, dataclasses, pydantic models, objects with `tolist()` such as
    numpy arrays), without the top-level fields named in `ignore`. A value with no JSON content raises TypeError
    naming it: pass the framework integration a `task=` function then."""
    if isinstance(value, str) and len(value) <= MAX_TEXT and not ignore:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and not ignore:
        return str(value)
    plain = _plain(value)
    if ignore:
        if not isinstance(plain, dict):
            raise TypeError(f"ignore= names fields, but the task is a {type(value).__name__}, not a record")
        plain = {k: v for k, v in plain.items() if k not in ignore}
    return "sha256:" + hashlib.sha256(canonical_json(plain)).hexdigest()[:32]


def _plain(value: Any) -> Any:
    """`value` as JSON data, converting the containers frameworks use (omegaconf's are mappings and sequences);
    anything else is left for canonical_json to refuse with a TypeError naming its type."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return [_plain(v) for v in value]
    dump = getattr(value, "model_dump", None)  # pydantic
    if callable(dump):
        return _plain(dump(mode="json"))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        return _plain(tolist())
    return value
