"""The house rules: `import tvcache` stays light, and every import points down the layers.

calls, graph, stats, version, errors    what a call and a state are, and what can go wrong
_owner                                  which process an object belongs to (not a forked child)
tasks                                   the cache's task group
policy, jsonhttp                        decisions from measured costs (pure); the HTTP client under both
stores, sandboxes                       where the graph lives; where calls run
warm, context                           what a cache shares with its rollouts
live, rollout                           the per-call algorithm
cache, sync                             the public face
functions, integrations                 tools and frameworks on top of the face
server, cli                             processes
tvcache_bench                           benchmarks: a separate package, never imported by the library
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LIBRARY = SRC / "tvcache"

RANKS = {
    "calls": 0,
    "graph": 0,
    "stats": 0,
    "version": 0,
    "errors": 0,
    "_owner": 0,
    "tasks": 0,
    "policy": 1,
    "jsonhttp": 1,
    "stores": 2,
    "sandboxes": 2,
    "warm": 3,
    "context": 3,
    "reads": 3,
    "live": 4,
    "rollout": 4,
    "cache": 5,
    "sync": 5,
    "functions": 6,
    "integrations": 6,
    "server": 7,
    "cli": 8,
    "__init__": 8,
}


def layer(module: str) -> str:
    """tvcache.stores.redis -> stores; tvcache -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[str]:
    """Absolute names of the tvcache modules `path` imports, including imports inside functions."""
    module = ".".join(path.relative_to(SRC).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            targets = [name] if node.module else [f"{name}.{alias.name}" for alias in node.names]
            found += targets
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name.split(".")[0] in ("tvcache", "tvcache_bench")]


def library_modules() -> list[Path]:
    return sorted(LIBRARY.rglob("*.py"))


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(LIBRARY)))
def test_every_import_points_down(path: Path) -> None:
    own = layer(".".join(path.relative_to(SRC).with_suffix("").parts))
    for name in imports(path):
        if name.startswith("tvcache_bench"):
            # Only the command line may reach the benchmarks, and only to hand them their own commands.
            assert own == "cli", f"{path.relative_to(SRC)} imports the benchmarks ({name})"
            continue
        target = layer(name)
        if target == own or target not in RANKS:
            continue
        assert RANKS[target] <= RANKS[own], f"{path.relative_to(SRC)} ({own}) imports {name} ({target}), a layer above"


def test_policy_is_pure_and_stores_and_sandboxes_do_not_know_each_other() -> None:
    for name in imports(LIBRARY / "policy.py"):
        assert layer(name) in ("calls", "graph", "stats"), f"policy.py imports {name}"
    for side, other in (("stores", "sandboxes"), ("sandboxes", "stores")):
        for path in (LIBRARY / side).rglob("*.py"):
            assert not [n for n in imports(path) if layer(n) == other], f"{path.relative_to(SRC)} imports {other}"


def test_import_tvcache_stays_light() -> None:
    code = (
        "import sys, tvcache\n"
        "heavy = ('tvcache_bench', 'rich', 'matplotlib', 'tvcache.server', 'uvicorn', 'aiohttp', 'redis', 'docker',"
        " 'aiodocker', 'torch', 'verifiers', 'skyrl_gym', 'art', 'trl', 'verl', 'tvcache.integrations')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m.startswith(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import tvcache loaded {out.strip()}"


def test_tvcache_serve_does_not_load_the_benchmarks() -> None:
    code = (
        "import sys\n"
        "from tvcache import cli\n"
        "try:\n"
        "    cli.main(['serve', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('tvcache_bench', 'rich', 'matplotlib'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_no_workload_or_microbenchmark_lives_in_the_library() -> None:
    assert not (LIBRARY / "bench").exists()
    for path in library_modules():
        text = path.read_text()
        assert "tvcache_bench" not in text or layer(".".join(path.relative_to(SRC).with_suffix("").parts)) == "cli", (
            f"{path.relative_to(SRC)} mentions the benchmark package"
        )


BACKENDS = ("workspace", "docker", "remote")


def test_each_backend_keeps_its_parts_and_the_shared_top_knows_none() -> None:
    """sandboxes/ holds the protocol and what several backends share at the top, and one package per larger backend
    with its private parts: a backend imports no other backend's package, and the shared parts (base, lifecycle,
    the `_`-modules) import none. Only reclaim (every backend's leftovers) and images (a Docker image as a
    workspace's layers) reach into backends."""
    top = LIBRARY / "sandboxes"
    for backend in BACKENDS:
        assert (top / backend / "__init__.py").is_file(), f"sandboxes/{backend}/ is not a package"
        for path in (top / backend).rglob("*.py"):
            for name in imports(path):
                parts = name.split(".")
                if parts[:2] == ["tvcache", "sandboxes"] and len(parts) > 2 and parts[2] in BACKENDS:
                    assert parts[2] == backend, f"{path.relative_to(SRC)} imports {name}, another backend's"
    for path in top.glob("*.py"):
        if path.stem in ("reclaim", "images"):
            continue
        for name in imports(path):
            parts = name.split(".")
            assert not (parts[:2] == ["tvcache", "sandboxes"] and len(parts) > 2 and parts[2] in BACKENDS), (
                f"{path.relative_to(SRC)} (shared) imports the backend {name}"
            )
