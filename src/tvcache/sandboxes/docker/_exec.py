"""One bash command in a running container through `docker exec`, carrying the shell state as workspace
sandboxes do (see _shell): the working directory and exported variables, saved by an EXIT trap, replayed by a
prelude before the next command.

The prelude, the trap and the state they carry are the workspace's (_shell); what differs is the plumbing
around them. The exec runs a small wrapper bash, which

- keeps the exec's stderr stream as the state channel (fd 253) and sends all of the command's output, stdout
  and stderr alike, to its stdout stream, so the two stay interleaved as they were written;
- runs the command in an inner bash: with an empty environment (`exec -c`) once the exports are known, so an
  `unset` stays unset, or with the container's own environment for the very first command;
- then ends every process the command left running (`kill -9 -1` spares only PID 1 and the wrapper itself,
  as the workspace's per-command PID namespace would), empties /dev/shm and /dev/mqueue (mounts a snapshot does
  not capture, so they must not carry state from one command to the next), and writes an end marker with the
  command's exit status. A command whose wrapper died (the container was killed, or the command killed its
  own parent) has no marker, so a cut-off output is never taken for a finished one.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from .._shell import STATE_FD, BoundedOutput, ShellState, parse_state, state_script

__all__ = ["ExecResult", "kill_everything", "run_bash"]

_END = b"\0\0tvcache-exec-end\0"

WRAPPER = f"""exec {STATE_FD}>&2 2>&1
if [ "$2" = clean ]; then (exec -c bash --noprofile --norc -c "$1"); else bash --noprofile --norc -c "$1"; fi
rc=$?
kill -9 -1 2>/dev/null
shopt -s nullglob dotglob
left=(/dev/shm/* /dev/mqueue/*)
((${{#left[@]}})) && rm -rf -- "${{left[@]}}" 2>/dev/null
printf '\\0\\0tvcache-exec-end\\0%s' "$rc" >&{STATE_FD}
exit $rc"""

#: Run as root after a timeout: ends the command and everything it started, and the same clean-up.
KILL = 'kill -9 -1 2>/dev/null; shopt -s nullglob dotglob; left=(/dev/shm/* /dev/mqueue/*); rm -rf -- "${left[@]}"'


@dataclass(frozen=True, slots=True)
class ExecResult:
    output: str
    exit_code: int | None
    """None when the command did not finish: timed out, or its wrapper died (see `finished`)."""
    timed_out: bool
    state: ShellState
    finished: bool
    """The wrapper wrote its end marker: the output and state are complete."""


async def _drain(stream: Any, output: BoundedOutput, channel: bytearray) -> None:
    while (message := await stream.read_out()) is not None:
        if message.stream == 2:
            channel += message.data
        else:
            output.feed(message.data)


async def run_bash(
    container: Any,
    command: str,
    state: ShellState,
    *,
    user: str,
    timeout: float,
    max_output: int,
    on_timeout: Any,
) -> ExecResult:
    """Run `command` in `container` (an aiodocker container) as described in the module docstring.

    `on_timeout` is an async callable that kills the command (see `kill_everything`); it is awaited when
    `timeout` seconds pass, after which the output read so far is returned with `timed_out`.
    """
    script = state_script(state, command.encode(errors="surrogateescape"))
    argv = ["bash", "--noprofile", "--norc", "-c", WRAPPER, "tvcache", script.decode(errors="surrogateescape")]
    argv.append("clean" if state.exports is not None else "inherit")
    execution = await container.exec(argv, stdout=True, stderr=True, user=user)
    output = BoundedOutput(max_output)
    channel = bytearray()
    timed_out = False
    async with execution.start(detach=False) as stream:
        drain = asyncio.ensure_future(_drain(stream, output, channel))
        try:
            await asyncio.wait_for(asyncio.shield(drain), timeout)
        except TimeoutError:
            timed_out = True
            await on_timeout()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(drain), 10)
        finally:
            if not drain.done():
                drain.cancel()
                with contextlib.suppress(BaseException):
                    await drain
        if drain.done() and not drain.cancelled() and drain.exception() is not None:
            raise drain.exception()  # type: ignore[misc]
    dump, marker, rc = bytes(channel).rpartition(_END)
    if timed_out or not marker:
        return ExecResult(output.text(), None, timed_out, state, finished=False)
    code = int(rc) if rc.isdigit() else None
    return ExecResult(output.text(), code, False, parse_state(dump, state), finished=True)


async def kill_everything(container: Any) -> None:
    """End every process in the container but its PID 1 (as root, so nothing the command started survives)."""
    execution = await container.exec(["bash", "--noprofile", "--norc", "-c", KILL], stdout=True, stderr=True, user="0")
    async with execution.start(detach=False) as stream:
        while await stream.read_out() is not None:
            pass
