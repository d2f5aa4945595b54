"""Which commands are worth tracing: only those whose read sets can be reused.

A traced command pays for its tracing (the kernel's records, then digesting what they name), but only a command
that leaves the files as they were yields a read set anyone can reuse (`WorkspaceSandbox._observed`): a `pip
install`, an edit through `sed -i` or `cat > file`, a test run that writes its cache pay and get nothing. Which
commands do that is a habit of the program, not of one call, so the plan groups commands by program (`program`)
and learns, per factory, what each group's traced runs did: a group whose runs changed the files (at least
`TRIES` runs, under one in `USEFUL` leaving them alone) is traced only once in `PROBE` runs from then on, so a
group whose habit changes is seen again.

Soundness does not depend on the plan: an untraced command has no read set, and is reused by exact history only.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

__all__ = ["TracingPlan", "program"]

TRIES = 4  # runs of a group traced before judging it
USEFUL = 4  # a group stays traced while at least one in this many of its traced runs left the files alone
PROBE = 16  # a group judged useless is traced once in this many runs

_CD = re.compile(r"\s*cd\s+[^;&|]*?\s*(?:&&|;)")  # a leading `cd dir &&`: the program is what follows
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_WRITE = re.compile(r"(?<![0-9&>])>{1,2}(?![&>])\s*(?!/dev/null\b)\S")  # `> file`, `>> file`, not `2>&1`


def program(command: str) -> str:
    """The group of `command`: its first program's name, its first option (`sed -n` reads, `sed -i` writes), the
    module after `-m`, and `>` when it redirects output into a file. A heuristic: a group is only a unit to learn
    about, and a command put in the wrong one is traced or not, never answered wrongly."""
    text = command.strip()
    while text.startswith(("(", "{")):
        text = text[1:].lstrip()
    while (cd := _CD.match(text)) is not None:
        text = text[cd.end() :]
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote, a here-document: the plain words will do
        words = text.split()
    while words and _ASSIGN.match(words[0]):
        words = words[1:]
    key = words[:1]
    if len(words) > 1 and words[1].startswith("-"):
        key.append(words[1])
        if words[1] == "-m" and len(words) > 2:
            key.append(words[2])
    if _WRITE.search(text):
        key.append(">")
    return " ".join(key)


@dataclass
class _Group:
    traced: int = 0  # traced runs whose outcome is known
    useful: int = 0  # of them, the runs that left the files alone
    runs: int = 0  # runs since the group was judged useless


class TracingPlan:
    """What one factory has learnt about its commands' groups (see the module docstring)."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}

    def wanted(self, command: str) -> str | None:
        """The group of `command` if it is to be traced, else None. Counts it as a run of its group."""
        name = program(command)
        group = self._groups.setdefault(name, _Group())
        if group.traced < TRIES or group.useful * USEFUL >= group.traced:
            return name
        group.runs += 1
        return name if group.runs % PROBE == 1 else None

    def traced(self, name: str, *, useful: bool) -> None:
        """A traced run of group `name` (what `wanted` said) ended: it left the files alone (`useful`) or not."""
        group = self._groups.setdefault(name, _Group())
        group.traced += 1
        group.useful += useful

    def untraced(self) -> dict[str, int]:
        """Per group judged useless, the runs since (tracing skipped in all but one in `PROBE`)."""
        return {name: group.runs for name, group in self._groups.items() if group.runs}
