"""Every mistake a user can type gets one clear line, before any work: the real `tvcache` command in a subprocess.

A missing optional dependency is simulated by putting a module of its name first on PYTHONPATH that raises
`ModuleNotFoundError` when imported, exactly as Python does when the package is not installed; everything else
(the servers, the databases, the workloads) is real.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kv
import tvcache
from server_helpers import Server, free_port
from tvcache_bench import cli as bench_cli
from tvcache_bench import data
from tvcache_bench.data import workload_path
from tvcache_bench.traces import Trace, TraceCall, write_traces

ACCEPTED_STORES = ("memory://", "sqlite:///", "http://", "redis://")


def tvcache_command(
    *args: str, missing: tuple[str, ...] = (), env: dict[str, str] | None = None, tmp: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`tvcache ARGS` (as `python -m tvcache.cli`), with the modules in `missing` made unimportable."""
    environ = {k: v for k, v in os.environ.items() if k != "TVCACHE_TOKEN"}
    environ.update(env or {})
    if missing:
        assert tmp is not None
        fake = unimportable(tmp, *missing)
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fake), environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "tvcache.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=environ, timeout=120, cwd=tmp)


def unimportable(tmp: Path, *names: str) -> Path:
    """A directory which, first on the path, makes the modules `names` raise ModuleNotFoundError."""
    fake = tmp / "missing-modules"
    for name in names:
        (fake / name).mkdir(parents=True, exist_ok=True)
        (fake / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {name!r}'!r}, name={name!r})\n"
        )
    return fake


def one_line_error(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The command failed with `code`, printed nothing on stdout (no work was done) and one line on stderr."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stdout == "", result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def sql_traces(tmp_path: Path) -> Path:
    path = tmp_path / "sql.jsonl"
    calls = [TraceCall("sql", {"query": "SELECT count(*) FROM Track"}), TraceCall("sql", {"query": "SELECT 1"})]
    write_traces(path, [Trace("t", f"r{r}", "test", calls) for r in range(2)])
    return path


def replay_args(traces: Path, *more: str) -> list[str]:
    chinook = str(workload_path("sql", "chinook", "chinook.sqlite"))
    return [
        "replay",
        str(traces),
        "--sandbox",
        "sqlite",
        "--base",
        chinook,
        "--no-progress",
        "--turn-time",
        "none",
        *more,
    ]


# -- bad input ------------------------------------------------------------------------------------------------


def test_a_bad_store_url_names_the_accepted_forms(tmp_path: Path, sql_traces: Path) -> None:
    line = one_line_error(tvcache_command("bench", "sql", "--store", "bogus://", "--no-progress", tmp=tmp_path))
    assert line.startswith("tvcache bench sql: error: --store: unknown store URL 'bogus://'"), line
    assert all(form in line for form in ACCEPTED_STORES), line
    line = one_line_error(tvcache_command(*replay_args(sql_traces, "--store", "bogus://"), tmp=tmp_path))
    assert line.startswith("tvcache replay: error: --store: unknown store URL 'bogus://'"), line


def test_bench_sandbox_with_a_missing_base(tmp_path: Path) -> None:
    missing = tmp_path / "no-such"
    line = one_line_error(tvcache_command("bench", "sandbox", "--base", str(missing), tmp=tmp_path))
    assert line == (
        f"tvcache bench sandbox: error: --base {missing} is not a directory: name the tree to measure, or leave "
        "--base out"
    )
    line = one_line_error(tvcache_command("bench", "overhead", "--base", str(tmp_path), tmp=tmp_path))
    assert line == "tvcache bench overhead: error: --base applies to the sandbox workload only"


def test_bench_server_with_a_folder_that_is_not_the_published_system(tmp_path: Path) -> None:
    line = one_line_error(tvcache_command("bench", "server", "--published", str(tmp_path), tmp=tmp_path))
    assert line == (
        f"tvcache bench server: error: --published: {tmp_path} holds no tvcache/server/tvcache_server.py: name a "
        "checkout of the published system's repository (git clone https://github.com/TVCache/TVCache)"
    )
    env = {"TVCACHE_PUBLISHED_SERVER": str(tmp_path)}
    assert one_line_error(tvcache_command("bench", "server", env=env, tmp=tmp_path)) == line
    line = one_line_error(tvcache_command("bench", "redis", "--published", str(tmp_path), tmp=tmp_path))
    assert line == "tvcache bench redis: error: --published applies to the server workload only"


def test_serve_without_a_token_on_a_non_loopback_address(tmp_path: Path) -> None:
    port = free_port()
    result = tvcache_command("serve", "--host", "0.0.0.0", "--port", str(port), tmp=tmp_path)
    line = one_line_error(result, code=1)
    assert line == (
        "tvcache serve: 0.0.0.0 is reachable from other machines, so the server needs a token: pass --token-file "
        "FILE or set TVCACHE_TOKEN (clients then use http://:TOKEN@host:port)"
    )
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass  # it never listened


def test_replay_fails_when_every_call_of_a_strategy_failed(tmp_path: Path) -> None:
    """bash traces replayed on a SQLite sandbox: each call is refused; the report is printed, then the error."""
    bash = tmp_path / "bash.jsonl"
    good, bad = TraceCall("sql", {"query": "SELECT 1"}), TraceCall("bash", {"command": "ls /testbed"})
    write_traces(bash, [Trace("t", f"r{r}", "test", [bad, bad]) for r in range(2)])
    result = tvcache_command(*replay_args(bash, "--strategies", "none,tvcache"), tmp=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "tvcache" in result.stdout and "hit rate" in result.stdout  # the table, for what it is worth
    errors = [line for line in result.stderr.splitlines() if line.startswith("tvcache replay: error: ")]
    assert len(errors) == 2, result.stderr
    for name, line in zip(("none", "tvcache"), errors, strict=True):
        assert line.startswith(f"tvcache replay: error: every call of {name} failed (4 calls, 0 timeouts; the first:")
        assert "a SQLite sandbox has one tool, 'sql'; got 'bash'" in line and line.endswith("nothing was measured")

    # A tool that fails on every call makes the figures meaningless too, though other tools work.
    write_traces(bash, [Trace("t", "r0", "test", [bad]), Trace("t", "r1", "test", [good, good])])
    result = tvcache_command(*replay_args(bash, "--strategies", "none,tvcache"), tmp=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tvcache replay: error: ")]
    for name, line in zip(("none", "tvcache"), errors, strict=True):
        assert line.startswith(f"tvcache replay: error: every call of the tool 'bash' under {name} failed (1 calls)")
        assert "the first: t/r0 call 0 (bash): " in line and "one tool, 'sql'; got 'bash'" in line

    # Calls that all work: a measurement, exit status 0.
    write_traces(bash, [Trace("t", "r0", "test", [good]), Trace("t", "r1", "test", [good, good])])
    result = tvcache_command(*replay_args(bash, "--strategies", "none,tvcache"), tmp=tmp_path)
    assert result.returncode == 0, result.stderr


STRICT_KV = """
import tvcache

async def run(state, call):
    if call.tool == "write":
        state[call.args["key"]] = call.args["value"]
        return "ok"
    return state[call.args["key"]]  # read: a KeyError where the key was never written


def sandboxes():
    return tvcache.PythonSandboxes(make=dict, run=run, fingerprint="strict-kv")
"""


def test_replay_fails_when_a_strategy_fails_calls_the_uncached_run_answered(tmp_path: Path) -> None:
    """A naive cache answers r1's write from r0's entry without writing, so r1's read (another argument, so a
    miss) raises in r1's sandbox, where the uncached run read the value: the cache broke the rollout."""
    (tmp_path / "strict_kv.py").write_text(STRICT_KV)
    traces = tmp_path / "kv.jsonl"
    write, read = TraceCall("write", {"key": "a", "value": "x"}), TraceCall("read", {"key": "a"})
    other_read = TraceCall("read", {"key": "a", "again": 1})
    write_traces(traces, [Trace("t", "r0", "test", [write, read]), Trace("t", "r1", "test", [write, other_read])])
    argv = [
        "replay",
        str(traces),
        "--sandbox",
        "python:strict_kv:sandboxes",
        "--concurrency",
        "1",
        "--no-progress",
        "--turn-time",
        "none",
    ]
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = tvcache_command(*argv, "--strategies", "none,naive,tvcache", env=env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("tvcache replay: error: ")]
    assert errors == [
        "tvcache replay: error: naive failed 1 calls that the uncached run answered; the first: t/r1 call 1 (read): "
        "KeyError: 'a'"
    ], result.stderr
    result = tvcache_command(*argv, "--strategies", "none,tvcache", env=env)
    assert result.returncode == 0, result.stderr


# -- missing extras and data ----------------------------------------------------------------------------------


def test_charts_without_matplotlib_fail_before_the_run(tmp_path: Path, sql_traces: Path) -> None:
    charts = tmp_path / "charts"
    line = one_line_error(
        tvcache_command("bench", "quick", "--charts", str(charts), missing=("matplotlib",), tmp=tmp_path)
    )
    assert re.fullmatch(
        r"tvcache bench quick: error: --charts needs the 'bench' extra \(No module named 'matplotlib'\): "
        r"pip install (-e )?'[^']*\[bench\]'",
        line,
    ), line
    # The replay checks before it reads anything: the traces file does not even exist here.
    args = ["replay", str(tmp_path / "no-such.jsonl"), "--sandbox", "sqlite", "--charts", str(charts)]
    line = one_line_error(tvcache_command(*args, missing=("matplotlib",), tmp=tmp_path))
    assert line.startswith("tvcache replay: error: --charts needs the 'bench' extra"), line
    assert not charts.exists()


@pytest.mark.parametrize(
    ("missing", "args", "says"),
    [
        (("uvicorn",), ["serve"], "tvcache serve: the server needs the 'server' extra (No module named 'uvicorn')"),
        (
            ("rich",),
            ["bench", "quick"],
            "tvcache bench quick: error: this command needs the 'bench' extra (No module named 'rich')",
        ),
        (("aiohttp",), ["--store", "http://127.0.0.1:9"], "the http:// store needs the 'client' extra"),
        (("redis",), ["--store", "redis://127.0.0.1:9/0"], "the redis:// store needs the 'redis' extra"),
        (("aiohttp",), ["bench", "server"], "tvcache bench server: error: this command needs the 'client' extra"),
        (("gguf",), ["bench", "grpo"], "tvcache bench grpo: error: this command needs the 'grpo' extra"),
    ],
)
def test_a_missing_extra_says_what_to_install(
    tmp_path: Path, sql_traces: Path, missing: tuple[str, ...], args: list[str], says: str
) -> None:
    if args[0] == "--store":
        args = replay_args(sql_traces, *args)
    code = 1 if args[0] == "serve" else 2
    line = one_line_error(tvcache_command(*args, missing=missing, tmp=tmp_path), code=code)
    extra = re.search(r"the '(\w+)' extra", says)
    assert extra and says in line, line
    assert re.search(rf"pip install (-e )?'[^']*\[{extra[1]}\]'$", line), line


def test_docker_sandboxes_without_the_docker_extra(tmp_path: Path, sql_traces: Path) -> None:
    """The command line: one line naming the extra; the library: an ImportError whose message is the same."""
    args = ["replay", str(sql_traces), "--sandbox", "docker", "--image", "x", "--no-progress"]
    line = one_line_error(tvcache_command(*args, missing=("aiodocker",), tmp=tmp_path))
    assert line.startswith("tvcache replay: error: a Docker sandbox needs the 'docker' extra (No module named"), line
    assert re.search(r"pip install (-e )?'[^']*\[docker\]'$", line), line
    script = "import tvcache\ntry:\n    tvcache.DockerSandboxes('x')\nexcept ImportError as e:\n    print(e)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(unimportable(tmp_path, "aiodocker")), *sys.path])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.startswith("a Docker sandbox needs the 'docker' extra (No module named 'aiodocker'): pip"), out


def test_check_store_says_what_it_checked_not_which_operation_it_used() -> None:
    """`check_store=True` against a server that is not there: the message names the server and the check, and
    nothing of the store protocol (the ping is a look-up of snapshots, an internal operation)."""

    async def main() -> str:
        url = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(tvcache.StoreError) as caught:
            async with (
                tvcache.ToolCache(url, check_store=True) as cache,
                cache.rollout("t", kv.sandboxes(), kv.TOOLS),
            ):
                pass
        return str(caught.value)

    message = asyncio.run(main())
    assert message.startswith("the cache store does not answer: cache server http://127.0.0.1:"), message
    assert "failed on a ping: ClientConnectorError" in message and "snapshots" not in message, message


def test_workspace_sandboxes_without_bubblewrap(tmp_path: Path) -> None:
    """A PATH with everything but bwrap: one line saying what to install, before any work."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        for entry in Path(directory).glob("*") if Path(directory).is_dir() else []:
            if entry.name != "bwrap" and not (bin_dir / entry.name).exists():
                (bin_dir / entry.name).symlink_to(entry)
    traces = tmp_path / "bash.jsonl"
    write_traces(traces, [Trace("t", "r0", "test", [TraceCall("bash", {"command": "ls"})])])
    (tmp_path / "base").mkdir()
    args = [
        "replay",
        str(traces),
        "--sandbox",
        "workspace",
        "--base",
        str(tmp_path / "base"),
        "--no-progress",
        "--turn-time",
        "none",
    ]
    line = one_line_error(tvcache_command(*args, env={"PATH": str(bin_dir)}, tmp=tmp_path))
    assert (
        line
        == "tvcache replay: error: workspace sandboxes need bubblewrap: apt-get install bubblewrap (or dnf, apk, ...)"
    )
    line = one_line_error(tvcache_command("bench", "sandbox", env={"PATH": str(bin_dir)}, tmp=tmp_path))
    assert line.startswith("tvcache bench sandbox: error: workspace sandboxes need bubblewrap"), line


def test_grpo_without_torch_says_to_install_a_cpu_build_first(tmp_path: Path) -> None:
    # The grpo extra alone would make pip fetch the newest CUDA build of torch, several GB.
    line = one_line_error(tvcache_command("bench", "grpo", missing=("torch",), tmp=tmp_path))
    assert line.startswith("tvcache bench grpo: error: this command needs torch: install a CPU build first"), line
    assert re.search(r"then pip install (-e )?'[^']*\[grpo\]'$", line), line


def test_the_library_says_which_extra_a_store_needs(tmp_path: Path) -> None:
    """`ToolCache("http://...")` without the client extra: an ImportError whose message is the pip command."""
    script = (
        "import tvcache\ntry:\n    tvcache.ToolCache('http://127.0.0.1:9')\nexcept ImportError as e:\n    print(e)\n"
    )
    fake = tmp_path / "missing-modules" / "aiohttp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'aiohttp'\", name='aiohttp')\n")
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.startswith("the http:// store needs the 'client' extra (No module named 'aiohttp'): pip install")
    assert "[client]'" in out.stdout


def test_a_wrong_benchmark_data_directory_names_both_ways_to_provide_it(tmp_path: Path) -> None:
    line = one_line_error(
        tvcache_command("bench", "quick", env={"TVCACHE_WORKLOADS": str(tmp_path / "no")}, tmp=tmp_path)
    )
    assert line == (
        f"tvcache bench quick: error: no benchmark data: TVCACHE_WORKLOADS={tmp_path / 'no'} is not a directory; "
        "set TVCACHE_WORKLOADS to a workloads directory (the one holding traces/, sql/ and tau-airline/), or unset "
        f"it to use the data that ships with tvcache ({data.BUNDLED})"
    )


# -- reports that explain themselves --------------------------------------------------------------------------


def test_the_bench_table_explains_itself(tmp_path: Path, sql_traces: Path) -> None:
    result = tvcache_command(*replay_args(sql_traces, "--strategies", "none,naive"), tmp=tmp_path)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # rich wraps long lines
    footer = text.split("reading the tables:", 1)[1]
    assert "none = no cache: every call executes in the rollout's own sandbox; its answers are the oracle" in footer
    assert "naive = a cache keyed on (tool, args) alone, blind to the sandbox's state" in footer
    assert "paper =" not in footer and "tvcache =" not in footer  # only the strategies of this run
    assert "speedup = none's tool time / the strategy's" in footer
    assert "median speedup = none's median call / the strategy's" in footer
    assert "incorrect hits = hits whose answer differs from the uncached answer" in footer
    assert "wrong answers (noted above where there are more) also count executed calls" in footer
    result = tvcache_command(*replay_args(sql_traces, "--strategies", "paper,tvcache"), tmp=tmp_path)
    footer = " ".join(result.stdout.split()).split("reading the tables:", 1)[1]
    assert "paper = the policy of the published TVCache system (Kumar, Kataria, Oh, Manzoor and Singh," in footer
    assert "arXiv:2602.10986, 2026): a key per exact history of calls" in footer and "tvcache = " in footer
    assert "speedup =" not in footer and "incorrect hits =" not in footer  # nothing was compared without none


# -- tvcache stats --------------------------------------------------------------------------------------------


async def _rollouts(url: str) -> dict[str, float]:
    """Concurrent rollouts of two tasks, twice: identical first calls wait for one execution (waited hits),
    the second round hits. Returns the client's own counts."""
    async with tvcache.ToolCache(url) as cache:
        boxes = kv.sandboxes()

        async def rollout(task: str, value: str) -> None:
            async with cache.rollout(task, boxes, kv.TOOLS) as r:
                await r.call("write", {"key": "a", "value": "x", "delay": 0.2})
                await r.call("read", {"key": "a"})
                await r.call("append", {"key": "a", "value": value, "delay": 0.01})
                await r.call("list", {})

        for _ in range(2):
            await asyncio.gather(*(rollout(task, v) for task in ("t1", "t2") for v in "1223"))
        return dict(cache.stats())


def test_stats_hits_and_hit_rate_come_from_the_same_counts(tmp_path: Path) -> None:
    with Server(tmp_path, "memory://", "stats-token") as server:
        client: dict[str, Any] = asyncio.run(_rollouts(server.token_url))
        (tmp_path / "stats.token").write_text("stats-token\n")
        result = tvcache_command("stats", server.url, "--token-file", str(tmp_path / "stats.token"), tmp=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = dict(re.findall(r"^(\s*\S.*?)\s{2,}(\S.*)$", result.stdout, re.M))
    lookups, hits, waited = (
        int(rows[name].replace(",", "")) for name in ("lookups", "hits", "  of which after waiting (single flight)")
    )
    # The clients' own counts are the oracle: every hit, whether at once or after waiting for a concurrent
    # execution of the same call, is one hit, and the rate is those hits over the same lookups.
    assert hits == client["hits"] > waited == client["waits"] > 0
    assert rows["hit rate (hits / lookups)"] == f"{hits / lookups:.1%}"
    per_task = re.findall(r"^default/(t\d)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+%)", result.stdout, re.M)
    assert sorted(t for t, *_ in per_task) == ["t1", "t2"]
    assert sum(int(h.replace(",", "")) for _, _, h, _ in per_task) == hits
    assert sum(int(n.replace(",", "")) for _, n, _, _ in per_task) == lookups
    for _, n, h, rate in per_task:
        assert rate == f"{int(h.replace(',', '')) / int(n.replace(',', '')):.1%}"


def test_stats_of_a_server_that_is_not_there(tmp_path: Path) -> None:
    port = free_port()
    line = one_line_error(tvcache_command("stats", f"http://127.0.0.1:{port}", tmp=tmp_path), code=1)
    assert line.startswith(f"tvcache stats: cannot reach http://127.0.0.1:{port}"), line


# -- every flag a command shows, accepted ----------------------------------------------------------------------

# A valid value for each option `tvcache bench` takes.
SAMPLES = {
    "--tasks": "1",
    "--epochs": "1",
    "--rollouts": "1",
    "--seed": "0",
    "--steps": "1",
    "--latency": "0",
    "--timeout": "1",
    "--turns": "step",
    "--batch": "1",
    "--concurrency": "1",
    "--strategies": "none",
    "--store": "memory://",
    "--charts": "charts",
    "--turn-time": "fixed:0.1",
    "--turn-seed": "1",
}


def test_every_flag_the_bench_help_names_for_a_workload_is_accepted_by_it() -> None:
    parser = argparse.ArgumentParser(prog="tvcache")
    commands = parser.add_subparsers(dest="command")
    bench_cli.add_commands(commands)
    bench = commands.choices["bench"]
    checked = []
    for action in bench._actions:
        named = re.match(r"\(([a-z, ]+)\)", action.help or "")
        for workload in named.group(1).split(", ") if named else []:
            if workload not in bench_cli.BENCH_DEFAULTS:
                continue  # sandbox, redis: checked where those commands run
            flag = action.option_strings[-1]
            value = [] if action.nargs == 0 else [SAMPLES[flag]]
            args = parser.parse_args(["bench", workload, flag, *value])
            bench_cli._bench_options(args, workload)  # a flag it does not take: SystemExit
            checked.append((workload, flag))
    assert ("quick", "--no-progress") in checked and ("synthetic", "--no-progress") in checked
    assert len(checked) > 40
