"""Run one bash command inside a sandbox (see workspace._jail for the namespaces, mounts and privileges), and capture
the shell's state.

Every command gets its own bash. What a terminal would keep between commands, the working directory and the
exported environment, is saved by an EXIT trap into a private pipe and replayed by a prelude before the next
command, so it also survives snapshots and forks. The process chain is

    [nsenter [--user --mount] [--net=NETNS]] bwrap ... -- bash --noprofile --norc -c PRELUDE+COMMAND

- bash is PID 1 of a new PID namespace: when it exits, the kernel kills everything it left running. A
  timeout kills that PID 1 itself (and bubblewrap, and the sandbox's cgroup), so the namespace goes down
  whatever the command did with signals or its parent-death signal.
- NETNS is the sandbox's private network namespace (loopback only, already up), made once per sandbox; as
  root the jail is spawned straight into it and into the sandbox's mount namespace by a thread that joined
  both (see workspace._mounts), in userns mode through nsenter.
- The prelude first moves the shell into the sandbox's cgroups (through descriptors opened here), so a fork
  bomb or a memory hog is capped there, then says it started: a command whose shell never said so (the
  machinery failed) is a failure, never an answer.
- bash starts with an empty environment and the prelude declares the saved exports, so an `unset` in one
  command stays unset in the next.

Processes are started with a plain fork/exec and awaited through a pidfd on the event loop: asyncio's own
subprocess machinery (a thread per child) costs several milliseconds more per command.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import shlex
import signal
import subprocess
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .base import Outcome

__all__ = [
    "STATE_FD",
    "BoundedOutput",
    "CommandResult",
    "ShellState",
    "bounded_text",
    "fresh_shell",
    "parse_state",
    "run_bash",
    "state_script",
    "truncated_text",
    "unfinished",
]

#: The file descriptor the EXIT trap writes the shell state to; high so scripts' own `exec 3>...` miss it.
STATE_FD = 253
#: Where the sandbox's cgroup.procs files are passed (252, 251, ...), for bash to join before the command runs.
CGROUP_FD = 252
#: Where the tracer's pipe is passed (see run_bash's `tracer`); closed by the prelude before the command runs.
TRACE_FD = 250
#: Run by a traced shell right before the command: a lookup the tracer records, which tells the shell's own start
#: (the machinery's reads) from the command's. A path no procfs has; `|| :` keeps `$?` at 0 as without it.
TRACE_MARK = b"{ test -e /proc/.tvcache-start || :; }; "
#: Seconds a timed-out command's processes get to die and close their pipes after they are killed.
_GRACE = 5.0
#: What the prelude writes to the state pipe once the shell runs inside its cgroups.
_STARTED = b"S"

# $? first: the trap must not change the exit status. PWD, OLDPWD and SHLVL are bash's own and saved apart.
_TRAP = (
    'trap \'__tvcache_rc=$?; { printf "%s\\0%s\\0%s\\0" "$__tvcache_rc" "$PWD" "${OLDPWD-}"; '
    f"unset PWD OLDPWD SHLVL __tvcache_rc; export -p; }} >&{STATE_FD} 2>/dev/null' EXIT"
)


@dataclass(frozen=True, slots=True)
class ShellState:
    """What carries over from one command to the next: the working directories and the exported variables.

    `exports` is bash's own `export -p` text (replayed verbatim), or None for the initial environment that
    the factory passes to the process.
    """

    cwd: bytes
    oldpwd: bytes = b""
    exports: bytes | None = None


@dataclass(frozen=True, slots=True)
class CommandResult:
    output: str
    exit_code: int | None
    timed_out: bool
    state: ShellState
    """The shell state after the command (the previous one if the command left none, e.g. after `exec`)."""
    started: bool = True
    """False when the shell never ran the command (the sandbox machinery failed; `output` says why)."""
    trace: bytes | None = None
    """What the tracer wrote (see `run_bash`'s `tracer`), or None when not traced or beyond its size limit."""
    trace_tail: bytes = b""
    """The last 64 KiB the tracer wrote (all of it may not fit `trace`)."""


class BoundedOutput:
    """Collects a stream, keeping at most `limit` bytes: the first and the last half when it is longer."""

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self._head = bytearray()
        self._tail = bytearray()

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data
            if len(self._tail) > 2 * self.limit:
                del self._tail[: len(self._tail) - self.limit]

    def head(self) -> bytes:
        return bytes(self._head)

    def last(self, n: int) -> bytes:
        """The last `n` bytes fed (fewer if fewer were)."""
        return bytes((self._head + self._tail)[-n:]) if self.total <= self.limit else bytes(self._tail[-n:])

    def text(self) -> str:
        if self.total <= self.limit:
            return bounded_text(bytes(self._head), b"", self.total, self.limit)
        half = self.limit // 2
        tail = bytes((self._head[half:] + self._tail)[-(self.limit - half) :])
        return bounded_text(bytes(self._head[:half]), tail, self.total, self.limit)


def bounded_text(head: bytes, tail: bytes, total: int, limit: int) -> str:
    """The first bytes `head` and the last bytes `tail` of `total` as text of at most `limit` bytes of UTF-8, with a
    marker line between them when anything is left out. Bytes that are not UTF-8 become U+FFFD, three bytes each,
    so their text is cut further to fit."""
    if len(head) + len(tail) == total:
        text = (head + tail).decode(errors="replace")
        if len(text.encode()) <= limit:
            return text
        whole, half = head + tail, limit // 2
        head, tail = whole[:half], whole[half:]
    half = limit // 2
    return truncated_text(_fitting(head, half, from_end=False), _fitting(tail, limit - half, from_end=True), total)


def _fitting(data: bytes, budget: int, *, from_end: bool) -> bytes:
    """A prefix (or suffix) of `data` whose text takes at most `budget` bytes of UTF-8, the longest or nearly."""

    def part(n: int) -> bytes:
        return data[len(data) - n :] if from_end else data[:n]

    low, high = 0, min(len(data), budget)
    while low < high:
        mid = (low + high + 1) // 2
        if len(part(mid).decode(errors="replace").encode()) <= budget:
            low = mid
        else:
            high = mid - 1
    return part(low)


def truncated_text(head: bytes, tail: bytes, total: int) -> str:
    """`head`, a marker line saying what was left out, and `tail`, as text."""
    marker = (
        f"\n[... {total - len(head) - len(tail)} bytes of output omitted: {total} bytes in all, "
        f"the first {len(head)} and the last {len(tail)} are shown ...]\n"
    )
    return head.decode(errors="replace") + marker + tail.decode(errors="replace")


def unfinished(output: str, error: str) -> Outcome:
    """A command that did not finish (timed out, its shell killed): what it printed, no exit code, and why; an
    error, so never cached."""
    return Outcome({"output": output, "exit_code": None, "error": error}, None, True)


def fresh_shell(workdir: str | None, command: str) -> str:
    """`command` as a harness that starts every command in a new shell runs it (verifiers' bash harness,
    mini-swe-agent's `docker exec -w WORKDIR ... bash -lc`): in a subshell started in `workdir`, so that neither its
    `cd` nor its exports carry over to the next command, as they do in a sandbox's `bash` tool."""
    start = "" if workdir is None else f"cd {shlex.quote(workdir)} || exit\n"
    return f"(\n{start}{command}\n)"


def bash_quote(value: bytes) -> bytes:
    return b"'" + value.replace(b"'", b"'\\''") + b"'"


def _high_fd(fd: int, at_least: int) -> int:
    """Move `fd` to the lowest free number >= `at_least` (nearly always exactly that), so the prelude, which
    `ps` shows as bash's command line, reads the same in every process."""
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, at_least)
    finally:
        os.close(fd)


def _prelude(state: ShellState, cgroup_fds: Sequence[int], state_fd: int, trace_fd: int | None = None) -> bytes:
    lines = []
    if trace_fd is not None:  # the tracer opened its own descriptor of the pipe; the command never holds one
        lines.append(f"exec {trace_fd}>&-".encode())
    for fd in cgroup_fds:
        # Join the sandbox's cgroups before anything runs, or do not run at all.
        lines.append(f"{{ echo 0 >&{fd}; }} 2>/dev/null || exit 125; exec {fd}>&-".encode())
    if state_fd != STATE_FD:  # after the joins: STATE_FD may have been one of theirs
        lines.append(f"exec {STATE_FD}>&{state_fd} {state_fd}>&-".encode())
    lines.append(f"printf {_STARTED.decode()} >&{STATE_FD}".encode())
    return b"\n".join(lines) + b"\n"


def state_script(state: ShellState, command: bytes, mark: bytes = b"") -> bytes:
    """A script that puts a fresh bash where the last command left it (exports, working directories), then runs
    `command` with the EXIT trap that saves its state to STATE_FD: for any backend that runs commands this way.

    The command runs in a bash of its own, exec'd with the state in its environment and the trap on its first line,
    so its line numbers are its own: `cd /nope` fails with "bash: line 1: ..." as under `bash -c`, whatever the
    prelude's length (which differs between backends). `mark` runs first on the command's line (see `TRACE_MARK`)."""
    lines = []
    if state.exports is not None:
        lines.append(b"{\n" + state.exports + b"\n} 2>/dev/null")
    lines.append(b"cd -- " + bash_quote(state.cwd) + b" 2>/dev/null || cd /")
    # Put OLDPWD back as it was (the `cd` above just set it); "exported, no value" is how bash starts.
    lines.append(b"OLDPWD=" + bash_quote(state.oldpwd) if state.oldpwd else b"unset OLDPWD; declare -x OLDPWD")
    lines.append(b"unset SHLVL")  # so the command's bash counts itself the first, as under `bash -c`
    lines.append(b"exec bash --noprofile --norc -c " + bash_quote(_TRAP.encode() + b"; " + mark + command))
    return b"\n".join(lines) + b"\n"


def parse_state(dump: bytes, previous: ShellState) -> ShellState:
    """The state the EXIT trap of `state_script` wrote, or `previous` when it wrote none."""
    parts = dump.split(b"\0", 3)
    if len(parts) < 4:
        return previous  # no dump: the command replaced the shell (`exec`) or its EXIT trap
    _, cwd, oldpwd, exports = parts
    return ShellState(cwd=cwd, oldpwd=oldpwd, exports=exports.rstrip(b"\n"))


class _Reader:
    """Reads a non-blocking pipe on the event loop into a BoundedOutput until EOF."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, sink: BoundedOutput):
        self.loop, self.fd, self.sink = loop, fd, sink
        self.done: asyncio.Future[None] = loop.create_future()
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            while data := os.read(self.fd, 1 << 16):
                self.sink.feed(data)
        except BlockingIOError:
            return
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        if not self.done.done():
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.done.set_result(None)


class _ThreadReader:
    """Reads a pipe into a BoundedOutput until EOF in a thread of its own, not on the event loop: the tracer writes
    every system call of the command to its pipe and stops when the pipe is full, so a reader that waits for a busy
    event loop (another call's read set being digested, a large trace parsed) would stop the command with it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, sink: BoundedOutput):
        self.loop, self.fd, self.sink = loop, fd, sink
        self.done: asyncio.Future[None] = loop.create_future()
        self._closing = threading.Event()
        with contextlib.suppress(OSError):  # room for the bursts between two wake-ups of the thread
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
        threading.Thread(target=self._run, name="tvcache-trace-reader", daemon=True).start()

    def _run(self) -> None:
        try:
            with select.epoll() as poll:
                poll.register(self.fd, select.EPOLLIN)
                while not self._closing.is_set():
                    if not poll.poll(0.5):
                        continue  # looks at `close()` now and then: a writer may hold the pipe open for good
                    data = os.read(self.fd, 1 << 20)
                    if not data:
                        break
                    self.sink.feed(data)
        except OSError:
            pass
        finally:
            os.close(self.fd)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                self.loop.call_soon_threadsafe(self._finish)

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def close(self) -> None:
        """Stop reading (the thread ends within half a second, closing the pipe); done at once."""
        self._closing.set()
        self._finish()


def end_namespace(proc: subprocess.Popen[bytes]) -> None:
    """Kill the jail `proc` and the PID 1 of its PID namespace, which takes everything in the namespace with it.

    Killing the jail alone is not enough: its child, the namespace's PID 1, dies with it only through its
    parent-death signal, which the command may clear (`prctl(PR_SET_PDEATHSIG, 0)`). The jail is stopped
    first so that it cannot reap its child while the child is looked up: the pid found is the child's, not a
    reused one, and the pidfd pins it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            children = []
        for child in children:
            try:
                pidfd = os.pidfd_open(child)
            except OSError:
                continue
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        proc.kill()


def _wait_exit(loop: asyncio.AbstractEventLoop, proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
    """A future for the process's exit status, woken by its pidfd."""
    done: asyncio.Future[int] = loop.create_future()
    pidfd = os.pidfd_open(proc.pid)

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        if not done.done():
            done.set_result(proc.wait())

    loop.add_reader(pidfd, on_exit)
    return done


async def run_bash(
    jail: Sequence[str],
    command: str,
    state: ShellState,
    *,
    env: dict[str, str],
    timeout: float,
    max_output: int,
    cgroups: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    spawn: Callable[..., Awaitable[subprocess.Popen[bytes]]] | None = None,
    kill: Callable[[], None] | None = None,
    tracer: Callable[[int], Sequence[str]] | None = None,
    trace_limit: int = 1 << 26,
    mark: bool = False,
) -> CommandResult:
    """Run `command` as described in the module docstring and return its output, exit code and new state.

    `jail` is the argv that enters the sandbox, up to the command (see workspace._jail). `env` is the process
    environment; it reaches bash only when `state.exports` is None (the first command of a factory).
    `cgroups` are the cgroup.procs files the shell joins; `pass_fds` are descriptors the jail needs (the
    seccomp program), which this function closes; `spawn(argv, **popen_kwargs)` starts the process (in the
    sandbox's namespaces), by default a plain Popen. On a timeout the command's PID namespace is torn down (see
    `end_namespace`) and `kill()` (the sandbox's cgroup kill) ends whatever else the command started.
    `tracer(fd)` is the argv of a tracer that writes to descriptor `fd` and runs the shell after it (see
    workspace._reads); what it writes, up to `trace_limit` bytes, comes back as the result's `trace`. `mark`: run
    `TRACE_MARK` before the command although no tracer is given here (the eBPF tracer watches from outside).
    """
    loop = asyncio.get_running_loop()
    script = command.encode(errors="surrogateescape")
    cgroup_fds: list[int] = []
    try:
        for i, procs in enumerate(cgroups):
            cgroup_fds.append(_high_fd(os.open(procs, os.O_WRONLY | os.O_CLOEXEC), CGROUP_FD - i))
        out_r, out_w = os.pipe()
    except BaseException:
        for fd in (*cgroup_fds, *pass_fds):
            os.close(fd)
        raise
    state_r, state_w = os.pipe()
    state_w = _high_fd(state_w, STATE_FD)
    trace_r = trace_w = None
    shell: Sequence[str] = ["bash"]
    if tracer is not None:
        trace_r, trace_w = os.pipe()
        trace_w = _high_fd(trace_w, TRACE_FD)
        shell = tracer(trace_w)
    marker = TRACE_MARK if tracer is not None or mark else b""
    script = _prelude(state, cgroup_fds, state_w, trace_w) + state_script(state, script, marker)
    argv: list[str | bytes] = [*jail, *shell, "--noprofile", "--norc", "-c", script]
    fds = (state_w, *cgroup_fds, *pass_fds, *([] if trace_w is None else [trace_w]))
    popen: dict[str, Any] = dict(
        stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w, pass_fds=fds, env=env if state.exports is None else {}
    )
    try:
        if spawn is None:
            proc = subprocess.Popen(argv, **popen)  # noqa: ASYNC220 - a vfork+exec, cheaper than asyncio's machinery
        else:
            proc = await spawn(argv, **popen)
    except BaseException:
        for fd in (out_r, state_r, *([] if trace_r is None else [trace_r])):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, *fds):
            os.close(fd)
    output = BoundedOutput(max_output)
    dump = BoundedOutput(1 << 26)
    readers: list[_Reader | _ThreadReader] = [_Reader(loop, out_r, output), _Reader(loop, state_r, dump)]
    trace = BoundedOutput(trace_limit)
    if trace_r is not None:
        readers.append(_ThreadReader(loop, trace_r, trace))
    exited = _wait_exit(loop, proc)
    everything = asyncio.gather(*(r.done for r in readers), exited)
    timed_out = False
    try:
        try:
            await asyncio.wait_for(asyncio.shield(everything), timeout)
        except TimeoutError:
            timed_out = True
            end_namespace(proc)
            if kill is not None:
                kill()
            try:
                await asyncio.wait_for(asyncio.shield(everything), _GRACE)
            except TimeoutError:  # something still holds the pipes open: stop reading, the answer is "timed out"
                for reader in readers:
                    reader.close()
    except BaseException:
        end_namespace(proc)
        proc.wait()
        for reader in readers:
            reader.close()
        raise
    started = dump.head().startswith(_STARTED)
    if timed_out:
        return CommandResult(output.text(), None, True, state, started)
    code = exited.result()
    exit_code = code if code >= 0 else 128 - code
    traced = trace.head() if trace_r is not None and trace.total <= trace_limit else None
    new_state = parse_state(dump.head()[len(_STARTED) :], state)
    tail = trace.last(1 << 16) if trace_r is not None else b""
    return CommandResult(output.text(), exit_code, False, new_state, started, traced, tail)
