"""The main job runs wherever tvcache is installed: the wheel built from this checkout, installed with its bench
extra into a fresh virtual environment, runs `tvcache bench quick` from an empty directory, reading the data the
wheel carries.

The virtual environment sees the machine's site-packages (`--system-site-packages`) and pip runs with
`--no-index`: the bench extra's dependencies are met by what `.ci/run` installed, so nothing is downloaded (tests
reach no network). tvcache itself comes from the wheel, which the test checks: its modules and its data load from
inside the virtual environment, and no checkout is on the path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert result.returncode == 0, f"{argv}:\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built offline once for the file's tests (neither changes it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    run(*pip, "-w", dist, ROOT, cwd=tmp)
    (built,) = dist.glob("tvcache-*.whl")
    return built


def test_the_redis_stores_lua_scripts_are_package_data_of_the_wheel(wheel: Path) -> None:
    scripts = {p.name for p in (ROOT / "src" / "tvcache" / "stores" / "redis_lua").glob("*.lua")}
    assert len(scripts) >= 12
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.rpartition("/")[2] for n in names if n.startswith("tvcache/stores/redis_lua/")} == scripts


@pytest.mark.slow
def test_the_installed_wheel_runs_the_main_job_from_an_empty_directory(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", venv, cwd=tmp_path)
    run(venv / "bin" / "python", "-m", "pip", "install", "--no-index", "-q", f"{wheel}[bench]", cwd=tmp_path)

    # Nothing of this checkout or of the shared data: no PYTHONPATH, no TVCACHE_WORKLOADS, an empty directory.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TVCACHE_WORKLOADS")}
    empty = tmp_path / "empty"
    empty.mkdir()
    where = run(
        venv / "bin" / "python",
        "-c",
        "import tvcache, tvcache_bench.data as d; print(tvcache.__file__); print(d.chinook())",
        cwd=empty,
        env=env,
    ).stdout.split()
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    assert where == [str(site / "tvcache" / "__init__.py"), str(site / "tvcache_bench/data/sql/chinook/chinook.sqlite")]

    result = run(venv / "bin" / "tvcache", "bench", "quick", "--json", "figures.json", cwd=empty, env=env)
    assert "reading the tables:" in result.stdout
    assert sorted(p.name for p in empty.iterdir()) == ["figures.json"]  # nothing else written where it ran
    figures = json.loads((empty / "figures.json").read_text())
    strategies = figures["strategies"]
    assert figures["tasks"] == 64 and set(strategies) == {"none", "naive", "paper", "exact", "tvcache"}
    assert strategies["tvcache"]["incorrect_hits"] == 0 and strategies["tvcache"]["hit_rate"] > 0.5
    assert strategies["naive"]["incorrect_hits"] > 0  # the oracle check ran on the shipped data
