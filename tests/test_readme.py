"""Every Python block of the README runs as written: a newcomer pastes them. Each runs in a fresh interpreter from
the repository's root, with nothing but what the README itself names (the data in ../shared/workloads, an image
the README says how to build)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def blocks() -> list[object]:
    params = []
    for match in BLOCK.finditer(README):
        line = README.count("\n", 0, match.start()) + 1
        heading = re.findall(r"^#+ (.+)$", README[: match.start()], re.M)
        name = re.sub(r"[^a-z0-9]+", "-", (heading[-1] if heading else "top").lower()).strip("-")
        params.append(pytest.param(match.group(1), id=f"{name}-line{line}"))
    return params


def test_the_readme_has_python_blocks() -> None:
    assert len(blocks()) >= 10


@pytest.mark.parametrize("code", blocks())
def test_a_readme_block_runs_as_written(code: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TVCACHE_WORKLOADS"}  # only the paths the README names
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"
