"""A command's stdout and stderr apart, through a shell sandbox's `bash` tool (which interleaves them).

Harnesses show a command's streams apart (Modal's exec in the Tinker cookbook) or one after the other (verifiers'
bash harness), so `script(...)` wraps the command: it runs in a new `bash` process, killed after `seconds`, its
streams captured without touching the file system (a temporary file would make every read-only command a state
change), each cut to `cap` bytes (the rest drained, as a reader that stops early would not) and base64-encoded.
`parse(output)` reads them back.
"""

from __future__ import annotations

import base64
import binascii
import shlex
from dataclasses import dataclass

__all__ = ["Captured", "parse", "script"]


@dataclass(frozen=True)
class Captured:
    stdout: bytes
    stderr: bytes
    exit_code: int
    timed_out: bool


def script(shell: str, command: str, seconds: int, *, cap: int | None = None, stdin: str = "</dev/null") -> str:
    """Shell code running `<shell> <command>` (e.g. `bash -lc`) in a subshell with `stdin` (a redirection), printing
    a line `<timed out 0/1> <exit code> <stdout in base64>` and then a line with stderr in base64."""
    keep = "cat" if cap is None else f"{{ head -c {int(cap)}; cat >/dev/null; }}"
    run = f"timeout -s KILL {int(seconds)} {shell} {shlex.quote(command)} {stdin}"
    return f"""(
exec 3>&1
__e=$( {{
  __s=$SECONDS
  __o=$({run} | {keep} | base64 -w0; exit "${{PIPESTATUS[0]}}")
  __c=$? __t=0
  if [ "$__c" -eq 137 ] && [ $((SECONDS - __s)) -ge {int(seconds)} ]; then __t=1; fi
  printf '\\n%s %s %s\\n' "$__t" "$__c" "$__o" >&3
}} 2>&1 | {keep} | base64 -w0 )
printf '%s\\n' "$__e"
)"""


def parse(output: str) -> Captured | None:
    """The streams `script`'s code printed, or None when its output did not come back whole (cut by the sandbox's
    output limit, or the code never ran to its end)."""
    lines = output.removesuffix("\n").split("\n")
    try:
        timed_out, code, stdout = lines[-2].split(" ")
        return Captured(
            base64.b64decode(stdout, validate=True),
            base64.b64decode(lines[-1], validate=True),
            int(code),
            timed_out == "1",
        )
    except (IndexError, ValueError, binascii.Error):
        return None
