"""Every code block of the README and of the docs pages runs as written: a newcomer pastes them. A Python block runs
in a fresh interpreter from the repository's root, with nothing but what the page itself names (an image the page
says how to build); a YAML block parses, and every `_target_` it names imports. A `text` block (a drawing, an
output) and a `console` block (a session with its output) are not run; a fence without a language is refused, so
that no code block goes unchecked by mistake."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
RUN = {"python", "yaml"}
NOT_CODE = {"text", "console"}  # a drawing or output; a session transcript, its output this machine's


def blocks(language: str) -> list[Any]:
    params = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) != language:
                continue
            line = text.count("\n", 0, match.start()) + 1
            heading = re.findall(r"^#+ (.+)$", text[: match.start()], re.M)
            name = re.sub(r"[^a-z0-9]+", "-", (heading[-1] if heading else "top").lower()).strip("-")
            where = page.relative_to(ROOT).with_suffix("").as_posix().replace("/", "-")
            params.append(pytest.param(match.group(2), id=f"{where}-{name}-line{line}"))
    return params


def test_the_pages_have_python_blocks() -> None:
    assert len(blocks("python")) >= 17


def test_every_fence_names_a_language_the_test_knows() -> None:
    unknown = [
        f"{page.relative_to(ROOT)}:{page.read_text().count(chr(10), 0, match.start()) + 1}: {match.group(1)!r}"
        for page in PAGES
        for match in FENCE.finditer(page.read_text())
        if match.group(1) not in RUN | NOT_CODE
    ]
    assert not unknown, f"fences this test would not check (label them python, yaml or text): {unknown}"


@pytest.mark.parametrize("code", blocks("python"))
def test_a_python_block_runs_as_written(code: str) -> None:
    assert "../" not in code, "a path outside the repository works in no one else's checkout"
    env = {k: v for k, v in os.environ.items() if k != "TVCACHE_WORKLOADS"}  # only the paths the page names
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"


def targets(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["_target_"]] if isinstance(node.get("_target_"), str) else []
        return own + [t for value in node.values() for t in targets(value)]
    if isinstance(node, list):
        return [t for value in node for t in targets(value)]
    return []


@pytest.mark.parametrize("code", blocks("yaml"))
def test_a_yaml_block_parses_and_names_what_exists(code: str) -> None:
    for target in targets(yaml.safe_load(code)):
        module, _, name = target.rpartition(".")
        assert hasattr(importlib.import_module(module), name), target


def test_ci_runs_the_readme_test_command_as_written() -> None:
    """CI runs the tests exactly as the README tells a contributor to (`bash .ci/run` on a fresh machine), so the
    two cannot drift apart: the README's indented `python -m pytest` line is a line of `.ci/run`."""
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^    (python -m pytest[^\n]*)$", readme, re.M)
    assert len(commands) == 1, f"the README names one test command, found {commands}"
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert commands[0].strip() in ci, f"{commands[0]!r} is not a line of .ci/run"
