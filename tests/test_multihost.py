"""tvcache across machines, on real network namespaces: two sandbox hosts each running `tvcache sandbox-server`
(SQLite sandboxes), a 3-node Redis Cluster on a third, and rollout workers (separate processes) on two more,
all talking over veth pairs on a private bridge (tests/netns.py), never the machine's own network.

1. Random concurrent workloads on both workers at once, on the same tasks (so they share entries, claims and
   snapshots through the cluster): every answer equals the uncached execution of its rollout's history in a
   fresh local sandbox (the oracle).
2. A snapshot made through one worker is restored through the other.
3. One sandbox host is killed (SIGKILL) while both workers are mid-rollout: calls in its sandboxes fail with
   SandboxError (the worker retries them, as an agent loop would), the rollouts go on in sandboxes rebuilt on
   the other host, and still every answer equals the oracle's. Printed: calls that failed, rollouts that
   recovered.

Run as a script, this file is a worker: `python test_multihost.py CONFIG_JSON` prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from netns import Network
from server_helpers import SandboxServer
from test_oracle import small_db  # noqa: F401  (a fixture)

HERE = Path(__file__).resolve().parent
TOKEN = "multihost-token"
HOSTS = ["sandbox-1", "sandbox-2", "redis", "worker-1", "worker-2"]
REDIS_PORTS = (7000, 7001, 7002)
# A write that takes tens of milliseconds: worth a snapshot after it, so snapshots are made and restored.
SLOW_WRITE = (
    "INSERT INTO t (v) SELECT count(*) % 7 FROM "
    "(WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 150000) SELECT x FROM c)"
)

Plan = list[list[tuple[str, dict[str, Any]]]]


# -- the test --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_net(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[Network, list[SandboxServer], Path]]:
    why = Network.check() or (None if shutil.which("redis-server") else "redis-server is not installed")
    if why:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("multihost")
    db = Path(request.getfixturevalue("small_db"))  # test_oracle's, which its SQL is written for
    with Network(HOSTS) as net:
        redis = net.address("redis")
        for port in REDIS_PORTS:
            options = ["--port", str(port), "--bind", redis, "--protected-mode", "no", "--save", "", "--appendonly"]
            options += ["no", "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf", "--dir"]
            options += [str(tmp), "--logfile", f"redis-{port}.log"]
            net.spawn("redis", ["redis-server", *options], stdout=subprocess.DEVNULL)
        sqlite = ["--sandbox", "sqlite", "--base", str(db)]
        servers = [
            SandboxServer(tmp, sqlite, TOKEN, host=net.address(h), prefix=net.prefix(h))
            for h in ("sandbox-1", "sandbox-2")
        ]
        try:
            for server in servers:
                server.start()
            _create_cluster(net)
            yield net, servers, db
        finally:
            for server in servers:
                server.stop()


def test_rollouts_across_hosts_are_correct_share_snapshots_and_survive_losing_a_sandbox_host(
    cluster_net: tuple[Network, list[SandboxServer], Path],
) -> None:
    net, servers, db = cluster_net
    config = {
        "redis": f"redis+cluster://{net.address('redis')}:{REDIS_PORTS[0]}",
        "sandboxes": [s.url for s in servers],
        "token": TOKEN,
        "db": str(db),
    }

    # 1. Both workers on the same tasks at once.
    shared = {**config, "mode": "oracle", "namespace": "oracle", "seeds": list(range(6))}
    results = _finish(_start(net, "worker-1", shared), _start(net, "worker-2", shared))
    for result in results:
        assert result["wrong"] == 0, result
        assert result["stats"]["snapshots"] + result["stats"]["restores"] > 0, result
    keys = ("calls", "hits", "waits", "creates", "restores", "snapshots")
    print("\noracle, per worker:", [{k: int(r["stats"][k]) for k in keys} for r in results], "0 wrong answers")

    # 2. A snapshot made through worker-1, restored through worker-2.
    (made,) = _finish(_start(net, "worker-1", {**config, "mode": "snapshot"}))
    (restored,) = _finish(_start(net, "worker-2", {**config, "mode": "restore", "snapshot": made["snapshot"]}))
    assert restored["output"] == made["expected"] and restored["server"] == made["server"]

    # 3. Lose a sandbox host in the middle of the rollouts.
    long = {**config, "mode": "survive", "namespace": "survive", "rollouts": 8, "calls": 16, "think": 0.25}
    workers = [_start(net, "worker-1", {**long, "seed": 1}), _start(net, "worker-2", {**long, "seed": 2})]
    for worker in workers:  # both have begun their rollouts
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "started"
    time.sleep(1.5)
    servers[0].kill9()
    results = _finish(*workers)
    failed = sum(r["failed_calls"] for r in results)
    recovered = sum(r["recovered_rollouts"] for r in results)
    print(f"\nlosing sandbox-1: {failed} calls failed, {recovered} rollouts recovered, 0 wrong answers")
    for result in results:
        assert result["wrong"] == 0 and result["checked"] == 8 * 16, result
    assert failed > 0 and recovered > 0


def _create_cluster(net: Network) -> None:
    redis = net.address("redis")
    cli = [*net.prefix("redis"), "redis-cli", "-h", redis]
    deadline = time.monotonic() + 20
    while not all(
        subprocess.run([*cli, "-p", str(p), "PING"], capture_output=True, text=True).stdout.strip() == "PONG"
        for p in REDIS_PORTS
    ):
        assert time.monotonic() < deadline, "the Redis nodes did not come up"
        time.sleep(0.05)
    create = [*cli, "--cluster", "create", *(f"{redis}:{p}" for p in REDIS_PORTS), "--cluster-yes"]
    subprocess.run(create, check=True, capture_output=True, timeout=60)
    info = [*cli, "-p", str(REDIS_PORTS[0]), "CLUSTER", "INFO"]
    while "cluster_state:ok" not in subprocess.run(info, capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline + 20, "the Redis Cluster did not become ready"
        time.sleep(0.05)


def _start(net: Network, host: str, config: dict[str, Any]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    return net.spawn(
        host,
        [sys.executable, str(Path(__file__)), json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=HERE,
        env=env,
    )


def _finish(*workers: subprocess.Popen[str]) -> list[dict[str, Any]]:
    results = []
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, f"worker failed ({worker.returncode}):\n{err[-4000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


# -- the workers -------------------------------------------------------------------------------------------


def plan(seed: int, rollouts: int, length: int) -> Plan:
    """test_oracle's SQL plans with a slow write now and then: rollouts share prefixes, then diverge."""
    from test_oracle import SQL_READS, SQL_WRITES

    rng = random.Random(seed)

    def call() -> tuple[str, dict[str, Any]]:
        return "sql", {"query": rng.choice(SQL_READS * 2 + SQL_WRITES + [SLOW_WRITE])}

    shared = [("sql", {"query": SLOW_WRITE}), *(call() for _ in range(length - 1))]
    cuts = [rng.randrange(1, length + 1) for _ in range(rollouts)]
    return [shared[:cut] + [call() for _ in range(length - cut)] for cut in cuts]


async def _oracle(config: dict[str, Any]) -> dict[str, Any]:
    import tvcache
    from test_oracle import run_plan

    boxes = tvcache.RemoteSandboxes(config["sandboxes"], token=config["token"])
    local = tvcache.SQLiteSandboxes(config["db"])
    wrong = checked = 0
    try:
        async with tvcache.ToolCache(config["redis"], namespace=config["namespace"], snapshot_budget=4) as cache:
            for seed in config["seeds"]:
                histories = plan(seed, 6, 10)  # the same in both workers: they share the task's graph
                got = await run_plan(cache, boxes, histories, tvcache.Tools(), task=f"t{seed}", seed=os.getpid())
                for history, outputs in zip(histories, got, strict=True):
                    expected = await _uncached(local, history)
                    wrong += sum(a != b for a, b in zip(outputs, expected, strict=True))
                    checked += len(outputs)
            return {"wrong": wrong, "checked": checked, "stats": cache.stats()}
    finally:
        await boxes.close()
        await local.close()


async def _uncached(factory: Any, history: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    import tvcache

    box = await factory.create()
    try:
        return [(await box.execute(tvcache.ToolCall(tool, args))).output for tool, args in history]
    finally:
        await box.close()


WRITES = ["INSERT INTO t (v) VALUES (11)", "UPDATE t SET v = v * 2", SLOW_WRITE]


async def _snapshot(config: dict[str, Any]) -> dict[str, Any]:
    import tvcache

    boxes = tvcache.RemoteSandboxes(config["sandboxes"], token=config["token"])
    local = tvcache.SQLiteSandboxes(config["db"])
    try:
        box = await boxes.create()
        for query in WRITES:
            await box.execute(tvcache.ToolCall("sql", {"query": query}))
        snapshot = await box.snapshot()
        await box.close()
        history = [("sql", {"query": q}) for q in [*WRITES, "SELECT id, v FROM t ORDER BY id"]]
        expected = (await _uncached(local, history))[-1]
        return {"snapshot": snapshot, "server": box.server, "expected": expected}
    finally:
        await boxes.close()
        await local.close()


async def _restore(config: dict[str, Any]) -> dict[str, Any]:
    import tvcache

    boxes = tvcache.RemoteSandboxes(config["sandboxes"], token=config["token"])
    try:
        box = await boxes.restore(config["snapshot"])
        output = (await box.execute(tvcache.ToolCall("sql", {"query": "SELECT id, v FROM t ORDER BY id"}))).output
        return {"output": output, "server": box.server}
    finally:
        await boxes.close()


async def _survive(config: dict[str, Any]) -> dict[str, Any]:
    """Rollouts that each write values of their own, slowly now and then (so snapshots are taken), so every call
    executes in the rollout's own sandbox, placed on the least-loaded host: about half of them are on the host
    that is killed. (Rollouts sharing a snapshot would all restore it on the one host holding it.) A call that
    raises SandboxError is tried again, as an agent loop would retry a tool whose machine went away."""
    import tvcache

    boxes = tvcache.RemoteSandboxes(config["sandboxes"], token=config["token"])
    local = tvcache.SQLiteSandboxes(config["db"])
    seed, rollouts, length = config["seed"], config["rollouts"], config["calls"]

    def query(r: int, k: int) -> str:
        value = seed * 10**6 + r * 1000 + k
        if k % 4 == 0:
            return SLOW_WRITE.replace("count(*) % 7", f"count(*) % 7 + {value}")
        return f"INSERT INTO t (v) VALUES ({value})" if k % 2 else "SELECT sum(v) FROM t"

    histories = [[("sql", {"query": query(r, k)}) for k in range(length)] for r in range(rollouts)]
    failed = [0] * rollouts

    async def rollout(cache: tvcache.ToolCache, r: int) -> list[Any]:
        outputs = []
        async with cache.rollout("survive", boxes) as run:
            for tool, args in histories[r]:
                await asyncio.sleep(config["think"])
                for _ in range(5):
                    try:
                        outputs.append((await run.call(tool, args)).output)
                        break
                    except tvcache.SandboxError:
                        failed[r] += 1
                else:
                    raise RuntimeError(f"rollout {r} could not recover")
        return outputs

    try:
        async with tvcache.ToolCache(config["redis"], namespace=config["namespace"]) as cache:
            print("started", flush=True)
            got = await asyncio.gather(*(rollout(cache, r) for r in range(rollouts)))
            wrong = 0
            for history, outputs in zip(histories, got, strict=True):
                expected = await _uncached(local, history)
                wrong += sum(a != b for a, b in zip(outputs, expected, strict=True))
            return {
                "wrong": wrong,
                "checked": sum(map(len, got)),
                "failed_calls": sum(failed),
                "recovered_rollouts": sum(1 for f in failed if f),
                "stats": cache.stats(),
            }
    finally:
        await boxes.close()
        await local.close()


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    work = {"oracle": _oracle, "snapshot": _snapshot, "restore": _restore, "survive": _survive}[config["mode"]]
    print(json.dumps(asyncio.run(work(config))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
