"""The `swe` workload: real SWE-agent bash rollouts replayed in workspace sandboxes holding each project.

**Traces.** `traces/swe-dev.jsonl` (SWE-agent/mini-swe-agent, MIT): 12 SWE-bench dev instances of
marshmallow, astroid and sqlfluff, solved 3-4 times each by different model configurations, 46 rollouts and
3,835 `bash` calls in all. Commands assume the repository at `/testbed`. `traces/swe-dev-instances.json`
names each instance's PyPI project and the version its traces show installed.

**The base of an instance** is built once and kept on disk, under `~/.cache/tvcache/swe/<project>-<version>/`
(`$TVCACHE_SWE_CACHE` overrides the folder), by `build_base`:

- `testbed/`: the project's release sdist from PyPI (`pip download --no-deps --no-binary <project>`), the
  exact version when PyPI has its sdist, else the closest release that has one (`closest_version`). Where
  the traces do not say which version was installed, the instance's version in SWE-bench is used
  (`SWE_BENCH_VERSIONS`). The tree is committed to a fresh git repository, so `git diff`, `git status` and
  `git checkout FILE` work as on a checkout (its history is that one commit), and byte-compiled.
- `env/`: a virtual environment of the Python running tvcache (the traces were recorded with 3.11.5) holding
  the project installed in editable mode (its `.pth` rewritten to point at `/testbed`, so imports see the
  sandbox's edits), its dependencies, pytest, the project's `test`/`tests`/`testing` extras, and whatever
  third-party modules its tests import (found by reading the test files; installed best-effort).

A sandbox mounts `testbed/` at `/testbed` and `env/` at `/opt/venv` (over the host's read-only `/`), with
`/opt/venv/bin` first on PATH, so `python`, `pip` and `pytest` are that environment. Every command starts
in a new shell in `/testbed`, as mini-swe-agent ran the traced ones (`docker exec -w /testbed ... bash -lc`; a
subshell here, not a login shell: the host's login scripts are not the traced image's), so a `cd` or an export
does not carry over to the next command. The network is off, as
during training. The sandbox's environment variables make reads look like reads and outputs reproducible:
`PYTHONDONTWRITEBYTECODE=1` and `PYTEST_ADDOPTS=-p no:cacheprovider` (running code or tests writes no
`__pycache__` or `.pytest_cache` into the tree), `GIT_OPTIONAL_LOCKS=0` (`git status` does not rewrite the
index), `PYTHONHASHSEED=0` (set orders in outputs are the same every run), and pip offline (`PIP_NO_INDEX=1`,
`PIP_NO_BUILD_ISOLATION=0`: `pip install -e .` works from what is installed, and a missing package fails at
once instead of retrying a network that is not there).

**Outputs** are the workspace's `{"output", "exit_code"}`, with one normalisation (`mask_durations`): the
wall-clock durations in test-run summaries (pytest's "3 passed in 0.12s", unittest's "Ran 3 tests in
0.004s") read "in N.NNs", and pytest's summary line is centred again for the masked text (its `=` fill
depends on the duration's digits: a 10 s run has one `=` fewer than a 9 s one). They differ between most
runs of the same state; masking them lets the replay check most cached answers against the uncached one
exactly, and lets tvcache rebuild a state through test runs without taking the timing difference for a
nondeterministic tool. Other output still differs from run to run and the replay's re-executions tell it
apart: object addresses (`<Name.X l.7 at 0x7f...>`: address-space randomisation is on in the sandboxes) and
tests whose ids hold the current time (marshmallow's `test_invalid_datetime_deserialization[07:39:05 ...]`).

Known gaps. Inherent to sdists: astroid's ship no tests and sqlfluff's only `test/test_testing.py`, so
most of their traced pytest commands answer "file or directory not found" (marshmallow's ship the full
suite), and the git history the agents sometimes browse is one commit. astroid 2.9 and 2.10 pin
`wrapt<1.14`, which does not build on Python 3.11; their bases take the newest wrapt (see `_install`).
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tvcache.calls import ToolCall, Tools
from tvcache.sandboxes._shell import fresh_shell
from tvcache.sandboxes.base import Outcome, Sandbox, Sandboxes
from tvcache.sandboxes.reclaim import scratch_dir

from ..data import workload_path
from ..traces import read_traces, task_order
from ..workload import Workload, first_tasks

__all__ = [
    "SWE_BENCH_VERSIONS",
    "Base",
    "Instance",
    "MaskedSandboxes",
    "build_base",
    "build_workload",
    "cache_root",
    "closest_version",
    "describe",
    "mask_durations",
    "read_instances",
    "sandbox_env",
]

#: Where a sandbox sees a base's environment (its scripts' `#!` lines say so).
ENV_MOUNT = "/opt/venv"
TESTBED = "/testbed"  # where the traces' commands start (`workdir` in swe-dev-instances.json)
#: Seconds a command may run in the sandbox before it is killed (pytest on a whole suite can take minutes).
TIMEOUT = 60.0
#: The instance's version in SWE-bench, for instances whose traces do not show which version was installed.
SWE_BENCH_VERSIONS = {"pylint-dev__astroid-1196": "2.12", "pylint-dev__astroid-1978": "2.14"}
#: Extras that hold a project's test dependencies, by the names projects use for them.
TEST_EXTRAS = ("test", "tests", "testing")
#: Import names whose PyPI distribution is named otherwise.
DISTRIBUTIONS = {
    "yaml": "PyYAML",
    "dateutil": "python-dateutil",
    "attr": "attrs",
    "pkg_resources": "setuptools",
    "_pytest": "pytest",
    "PIL": "Pillow",
    "typing_extensions": "typing-extensions",
    "dns": "dnspython",
}
_BUILD_VERSION = 3  # bump when the layout of a base changes: older bases are rebuilt
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Log = Callable[[str], None]


# -- instances ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Instance:
    task: str
    project: str
    version: str  # the version wanted: seen in the traces, or SWE-bench's
    version_from: str  # "traces" or "SWE-bench"


def read_instances(path: str | Path | None = None) -> dict[str, Instance]:
    """The instances of `swe-dev-instances.json` (default: the shared one), by task."""
    source = Path(path) if path is not None else workload_path("traces", "swe-dev-instances.json")
    try:
        raw = json.loads(source.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected an object keyed by instance id")
    out = {}
    for task, info in raw.items():
        if not isinstance(info, dict) or not isinstance(info.get("pypi_project"), str):
            raise ValueError(f"{source}: instance {task!r} has no pypi_project")
        seen = info.get("version_seen_in_trace")
        if isinstance(seen, str) and seen:
            out[task] = Instance(task, info["pypi_project"], seen, "traces")
        elif task in SWE_BENCH_VERSIONS:
            out[task] = Instance(task, info["pypi_project"], SWE_BENCH_VERSIONS[task], "SWE-bench")
        else:
            raise ValueError(f"{source}: instance {task!r} names no version and SWE_BENCH_VERSIONS has none")
    return out


# -- choosing a release ---------------------------------------------------------------------------------

_VERSION = re.compile(
    r"^v?(\d+(?:\.\d+)*)(?:[-_.]?(a|b|c|rc|alpha|beta|pre|preview)[-_.]?(\d*))?(?:[-_.]?post(\d+))?"
    r"(?:[-_.]?dev(\d*))?$",
    re.IGNORECASE,
)
_PRE = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}


def _version_key(text: str) -> tuple[Any, ...]:
    """An ordering key for PEP 440 versions of the usual shapes (release, pre, post, dev)."""
    m = _VERSION.match(text.strip())
    if m is None:
        raise ValueError(f"cannot read version {text!r}")
    release = [int(x) for x in m.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()  # 2.12 == 2.12.0
    label, number, post_number, dev_number = m.group(2), m.group(3), m.group(4), m.group(5)
    dev = (0, int(dev_number or 0)) if dev_number is not None else (1, 0)
    if label is not None:
        pre = (_PRE[label.lower()], int(number or 0))
    elif dev_number is not None and post_number is None:
        pre = (-1, 0)  # 1.0.dev1 comes before 1.0a1
    else:
        pre = (3, 0)  # a final release comes after its pre-releases
    post = int(post_number) if post_number is not None else -1
    return (tuple(release), pre, post, dev)


def closest_version(wanted: str, available: Iterable[str]) -> str:
    """The release to use for `wanted`: itself if available (2.12 and 2.12.0 are the same), else the newest
    release older than it, else the oldest newer one. Versions that cannot be read are ignored."""
    target = _version_key(wanted)
    keyed = []
    for version in available:
        with contextlib.suppress(ValueError):
            keyed.append((_version_key(version), version))
    if not keyed:
        raise ValueError(f"no release to choose from for {wanted!r}")
    keyed.sort()
    for key, version in keyed:
        if key == target:
            return version
    older = [version for key, version in keyed if key < target]
    return older[-1] if older else keyed[0][1]


# -- building a base ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Base:
    """A built base on disk: the project's source and the environment to run it."""

    project: str
    version: str
    root: Path

    @property
    def testbed(self) -> Path:
        return self.root / "testbed"

    @property
    def env(self) -> Path:
        return self.root / "env"

    def info(self) -> dict[str, Any]:
        """What `build_base` recorded about the base (versions, what it installed)."""
        data: dict[str, Any] = json.loads((self.root / "complete.json").read_text())
        return data


def cache_root() -> Path:
    """Where bases are kept: `$TVCACHE_SWE_CACHE`, else `$XDG_CACHE_HOME/tvcache/swe` (`~/.cache/tvcache/swe`)."""
    configured = os.environ.get("TVCACHE_SWE_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "tvcache" / "swe"


def build_base(project: str, wanted: str, *, root: str | Path | None = None, log: Log | None = None) -> Base:
    """The base for `project` at the release closest to `wanted`, built on first use (needs PyPI; tens of
    seconds) and reused afterwards. Safe to call from several processes at once (a lock file serialises the
    builds). Raises `BuildError` with pip's message when PyPI has no usable release."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", project):
        raise ValueError(f"not a PyPI project name: {project!r}")
    _version_key(wanted)  # a clear error for a malformed version before anything is downloaded
    say = log or (lambda message: None)
    folder = Path(root).expanduser() if root is not None else cache_root()
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / ".lock"):
        known = _known(folder, project, wanted)
        if known is not None:
            return known
        scratch = scratch_dir("swe-download", folder)
        try:
            version, archive = _download(project, wanted, scratch, say)
            base = Base(project, version, folder / f"{project}-{version}")
            if (base.root / "complete.json").is_file() and _complete(base):
                _remember(folder, project, wanted, version)
                return base
            say(f"building the swe base {base.root.name} (once; kept in {folder})")
            shutil.rmtree(base.root, ignore_errors=True)
            base.root.mkdir()
            _unpack(archive, base.testbed)
            _git_init(base.testbed, f"{project} {version} (PyPI sdist)")
            extras, relaxed = _install(base, say)
            missing = _install_test_imports(base, say)
            _point_at_sandbox_paths(base)
            _finish_testbed(base)
            installed = _run([str(base.env / "bin" / "python"), "-m", "pip", "freeze", "--all"], base.root).splitlines()
            info = {
                "build": _BUILD_VERSION,
                "project": project,
                "wanted": wanted,
                "version": version,
                "python": sys.version.split()[0],
                "extras": extras,
                "pins_relaxed_because": relaxed,
                "not_installed": missing,
                "packages": installed,
                "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            (base.root / "complete.json").write_text(json.dumps(info, indent=1) + "\n")
            _remember(folder, project, wanted, version)
            say(f"built {base.root}")
            return base
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


class BuildError(RuntimeError):
    """Building a base failed (no release on PyPI, no network, an install that fails)."""


@contextlib.contextmanager
def _locked(path: Path) -> Any:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _complete(base: Base) -> bool:
    try:
        info = base.info()
    except (OSError, ValueError):
        return False
    return bool(
        info.get("build") == _BUILD_VERSION and base.testbed.is_dir() and (base.env / "bin" / "python").exists()
    )


def _known(folder: Path, project: str, wanted: str) -> Base | None:
    """A base built earlier for (project, wanted), found without asking PyPI."""
    index = folder / "resolved.json"
    try:
        resolved = json.loads(index.read_text())
    except (OSError, ValueError):
        return None
    version = resolved.get(f"{project}=={wanted}")
    if not isinstance(version, str):
        return None
    base = Base(project, version, folder / f"{project}-{version}")
    return base if _complete(base) else None


def _remember(folder: Path, project: str, wanted: str, version: str) -> None:
    index = folder / "resolved.json"
    try:
        resolved = json.loads(index.read_text())
    except (OSError, ValueError):
        resolved = {}
    resolved[f"{project}=={wanted}"] = version
    index.write_text(json.dumps(resolved, indent=1, sort_keys=True) + "\n")


def _pip_download(project: str, version: str, dest: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", project]
    command += ["--disable-pip-version-check", "-d", str(dest), f"{project}=={version}"]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def _download(project: str, wanted: str, dest: Path, say: Log) -> tuple[str, Path]:
    """Download the sdist of the release closest to `wanted`; returns (version, archive)."""
    say(f"pip download {project}=={wanted} (sdist)")
    done = _pip_download(project, wanted, dest)
    version = wanted
    if done.returncode != 0:
        listed = re.search(r"\(from versions: ([^)]*)\)", done.stdout + done.stderr)
        if listed is None or listed.group(1).strip() in ("", "none"):
            raise BuildError(f"no sdist of {project} on PyPI (is PyPI reachable?):\n{_tail(done)}")
        version = closest_version(wanted, [v.strip() for v in listed.group(1).split(",")])
        say(f"{project} {wanted} has no sdist on PyPI; using the closest release, {version}")
        done = _pip_download(project, version, dest)
        if done.returncode != 0:
            raise BuildError(f"pip download {project}=={version} failed:\n{_tail(done)}")
    archives = [p for p in dest.iterdir() if p.name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".zip"))]
    if len(archives) != 1:
        raise BuildError(f"pip download {project}=={version} left {[p.name for p in dest.iterdir()]}")
    # The archive names the exact version (2.12 -> astroid-2.12.0.tar.gz); sdist names are NAME-VERSION.
    stem = re.sub(r"\.(tar\.gz|tgz|tar\.bz2|zip)$", "", archives[0].name)
    return (stem.rsplit("-", 1)[1] if "-" in stem else version), archives[0]


def _unpack(archive: Path, testbed: Path) -> None:
    """Extract the sdist's single top-level directory as `testbed`."""
    scratch = scratch_dir("swe-unpack", testbed.parent)
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                z.extractall(scratch)
        else:
            with tarfile.open(archive) as t:
                t.extractall(scratch, filter="data")
        tops = list(scratch.iterdir())
        if len(tops) != 1 or not tops[0].is_dir():
            raise BuildError(f"{archive.name} does not hold one top-level directory")
        tops[0].rename(testbed)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _git_init(testbed: Path, message: str) -> None:
    """Commit the sdist to a fresh repository, as the checkout the traces assume. Byte-code and build
    leftovers (the sdist's egg-info, which the editable install rewrites) are ignored, as a repository's
    .gitignore would."""
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "tvcache",
        "GIT_AUTHOR_EMAIL": "tvcache@localhost",
        "GIT_COMMITTER_NAME": "tvcache",
        "GIT_COMMITTER_EMAIL": "tvcache@localhost",
        "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
    }
    _run(["git", "init", "-q", "-b", "main"], testbed, env=env)
    exclude = testbed / ".git" / "info" / "exclude"
    exclude.parent.mkdir(exist_ok=True)
    with exclude.open("a") as f:
        f.write("__pycache__/\n*.pyc\n*.egg-info/\nbuild/\n.eggs/\n")
    _run(["git", "add", "-A"], testbed, env=env)
    _run(["git", "commit", "-q", "--no-verify", "-m", message], testbed, env=env)


def _pip(base: Base, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(base.env / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", *args]
    return subprocess.run(command, capture_output=True, text=True, check=False, cwd=base.root)


def _install(base: Base, say: Log) -> tuple[list[str], str | None]:
    """The environment: the project (editable) with its test extras, pytest, and wheel (so that `pip install
    -e .` works offline inside the sandbox). Old releases pin dependencies that no longer build on this
    Python (astroid 2.9 pins wrapt<1.14, whose setup fails on 3.11); then each dependency is installed at
    its newest release instead, as the traced agents did by hand. Returns the extras installed and, when
    the pins were relaxed, why."""
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(base.env)], base.root)
    extras = [e for e in _extras(base.testbed) if e in TEST_EXTRAS]
    target = str(base.testbed) + (f"[{','.join(extras)}]" if extras else "")
    say(f"pip install -e {base.testbed.name}{'[' + ','.join(extras) + ']' if extras else ''} pytest wheel")
    done = _pip(base, "-e", target, "pytest", "wheel", "setuptools")
    if done.returncode == 0:
        return extras, None
    why = _reason(done)
    say(f"the pinned dependencies of {base.project} {base.version} do not install here ({why}); relaxing the pins")
    done = _pip(base, "--no-deps", "-e", str(base.testbed))
    if done.returncode != 0:
        raise BuildError(f"installing {base.project} {base.version} failed:\n{_tail(done)}")
    probe = (
        "import importlib.metadata as m, sys\n"
        "from pip._vendor.packaging.requirements import Requirement\n"
        "for text in m.requires(sys.argv[1]) or []:\n"
        "    r = Requirement(text)\n"
        "    if r.marker is None or any(r.marker.evaluate({'extra': e}) for e in sys.argv[2:]):\n"
        "        print(r.name + ('[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''))\n"
    )
    python = str(base.env / "bin" / "python")
    names = _run([python, "-c", probe, base.project, "", *extras], base.root).split()
    say(f"pip install {' '.join(names)} pytest wheel (newest releases)")
    done = _pip(base, *dict.fromkeys(names), "pytest", "wheel", "setuptools")
    if done.returncode != 0:
        raise BuildError(f"installing the dependencies of {base.project} {base.version} failed:\n{_tail(done)}")
    return extras, why


def _reason(done: subprocess.CompletedProcess[str]) -> str:
    """The most telling line of a failed pip run: the last error a subprocess printed, else pip's own."""
    lines = [line.strip() for line in (done.stdout + "\n" + done.stderr).splitlines() if line.strip()]
    for pattern in (r"\w+Error: ", r"^ERROR: ", r"^error: "):
        found = [line for line in lines if re.search(pattern, line)]
        if found:
            return found[-1][:300]
    return lines[-1][:300] if lines else "pip failed"


def _extras(testbed: Path) -> list[str]:
    """The extras the sdist declares (its PKG-INFO's Provides-Extra lines)."""
    info = testbed / "PKG-INFO"
    if not info.is_file():
        return []
    text = info.read_text(errors="replace")
    return re.findall(r"^Provides-Extra:\s*(\S+)\s*$", text, re.MULTILINE)


def _install_test_imports(base: Base, say: Log) -> list[str]:
    """Install the third-party modules the tests import that the environment lacks; returns those that
    could not be installed (an optional dependency of a few tests, say)."""
    wanted = sorted(_test_imports(base.testbed))
    if not wanted:
        return []
    probe = (
        "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    )
    lacking = _run([str(base.env / "bin" / "python"), "-c", probe, *wanted], base.root).split()
    failed = []
    for module in lacking:
        dist = DISTRIBUTIONS.get(module, module)
        say(f"pip install {dist} (imported by the tests)")
        if _pip(base, dist).returncode != 0:
            failed.append(dist)
    return failed


def _test_imports(testbed: Path) -> set[str]:
    """Top-level modules imported by the test files that are neither the standard library nor the
    project's own (any module or package found in the source tree)."""
    files = [p for p in testbed.rglob("*.py") if _is_test_file(p.relative_to(testbed))]
    own = {p.stem for p in testbed.rglob("*.py")} | {p.parent.name for p in testbed.rglob("__init__.py")}
    found: set[str] = set()
    for path in files:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue  # Python 2 leftovers and the like
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in own and m.isidentifier()}


def _is_test_file(relative: Path) -> bool:
    parts = relative.parts
    return (
        relative.name == "conftest.py"
        or any(p in ("test", "tests", "testing") for p in parts[:-1])
        or (relative.name.startswith("test_") or relative.name.endswith("_test.py"))
    )


def _point_at_sandbox_paths(base: Base) -> None:
    """The environment was built where it is kept; inside a sandbox the source is at /testbed and the
    environment at ENV_MOUNT. Rewrite the paths it recorded: the editable install's (so imports see the
    sandbox's edits), the scripts' `#!` lines and the venv's own files."""
    testbed, env = str(base.testbed), str(base.env)
    editable = 0
    for path in base.env.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        in_bin = path.parent == base.env / "bin" or path.name == "pyvenv.cfg"
        hook = path.suffix in (".pth", ".egg-link") or path.name == "direct_url.json" or "__editable__" in path.name
        if not (in_bin or hook):
            continue
        data = path.read_bytes()
        if b"\0" in data[:1024]:
            continue  # a binary
        text = data.decode(errors="surrogateescape")
        new = text.replace(testbed, "/testbed").replace(env, ENV_MOUNT)
        if new != text:
            path.write_bytes(new.encode(errors="surrogateescape"))
            editable += hook and testbed in text
    if not editable:
        raise BuildError(f"found no editable install of {base.project} pointing at {testbed} in {env}")


def _finish_testbed(base: Base) -> None:
    """Byte-compile the source (the sandbox does not write byte-code, so this only saves time), and let git
    record the files' stat data, so `git status` in a sandbox has nothing to refresh."""
    subprocess.run(
        [str(base.env / "bin" / "python"), "-m", "compileall", "-q", "-j", "0", str(base.testbed)],
        capture_output=True,
        check=False,  # Python 2 leftovers do not compile; they are left as they are
    )
    _run(["git", "status", "--porcelain"], base.testbed)


def _run(command: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise BuildError(f"{' '.join(command)} failed in {cwd}:\n{_tail(done)}")
    return done.stdout


def _tail(done: subprocess.CompletedProcess[str], lines: int = 25) -> str:
    text = (done.stdout + "\n" + done.stderr).strip().splitlines()
    return "\n".join(line for line in text[-lines:] if "is ignored: it is neither a file nor a directory" not in line)


# -- the sandboxes --------------------------------------------------------------------------------------


def sandbox_env(base: Base) -> dict[str, str]:
    """The exported environment every sandbox of `base` starts with (see the module docstring)."""
    return {
        "PATH": f"{ENV_MOUNT}/bin:{_PATH}",
        "VIRTUAL_ENV": ENV_MOUNT,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "PYTEST_ADDOPTS": "-p no:cacheprovider",
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",  # sic: pip reads this variable as "build isolation: off"
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "GIT_OPTIONAL_LOCKS": "0",  # `git status` does not rewrite the index: a read stays a read
    }


_PYTEST_TIME = re.compile(
    r"(\b(?:passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?|no tests ran|rerun) in )"
    r"\d+(?:\.\d+)?s(?: \(\d+:\d\d:\d\d\))?"
)
_UNITTEST_TIME = re.compile(r"(\bRan \d+ tests? in )\d+(?:\.\d+)?s\b")


# pytest centres its summary in `=` to the terminal's width (80 columns in a pipe): "=== 1 passed in 9.87s ==="
# has one `=` more on the left than "== 1 passed in 10.02s ==", so masking the duration alone leaves a
# difference between two runs of the same state (`_recentre`).
_PYTEST_SEP = re.compile(r"^(=+) (.+?) (=+)$", re.MULTILINE)


def mask_durations(text: str) -> str:
    """`text` with the durations of test-run summaries replaced by N.NN (see the module docstring)."""
    return _UNITTEST_TIME.sub(r"\1N.NNNs", _PYTEST_TIME.sub(r"\1N.NNs", _PYTEST_SEP.sub(_recentre, text)))


def _recentre(line: re.Match[str]) -> str:
    """A pytest summary line with its duration masked, centred as pytest would centre the masked title: the
    terminal's width is the line's length (pytest fills to it, at most one column short). A title too long
    for one `=` a side has no known width: it is left with one."""
    fill, title = line[1], line[2]
    masked = _PYTEST_TIME.sub(r"\1N.NNs", title)
    if masked == title:
        return line[0]
    if len(fill) == 1:
        return f"= {masked} ="
    width = len(line[0])
    # As _pytest._io.terminalwriter.TerminalWriter.sep does it.
    n = max((width - len(masked) - 2) // 2, 1)
    out = f"{'=' * n} {masked} {'=' * n}"
    return out + "=" if len(out) + 1 <= width else out


class MaskedSandboxes:
    """Workspace sandboxes that run each bash command as mini-swe-agent ran the traced ones, in a new shell in
    /testbed (`docker exec -w /testbed ... bash -lc`: a `cd` or an export does not carry over to the next
    command), and mask the test durations in its output (`mask_durations`)."""

    def __init__(self, inner: Sandboxes):
        self.inner = inner

    @property
    def fingerprint(self) -> str:
        return f"{self.inner.fingerprint}+mask-durations-2+fresh-shell"

    async def create(self) -> Sandbox:
        return _Masked(await self.inner.create())

    async def restore(self, snapshot_id: str) -> Sandbox:
        return _Masked(await self.inner.restore(snapshot_id))

    async def delete(self, snapshot_id: str) -> None:
        await self.inner.delete(snapshot_id)

    async def base_digests(self, keys: Collection[str]) -> Mapping[str, str]:
        """The inner factory's (masking changes outputs, not what a call read)."""
        base = getattr(self.inner, "base_digests", None)
        return {} if base is None else await base(keys)

    async def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            await close()


class _Masked:
    def __init__(self, inner: Sandbox):
        self.inner = inner

    async def execute(self, call: ToolCall) -> Outcome:
        args = call.args
        if isinstance(args, dict) and isinstance(args.get("command"), str):
            # No `cd /testbed` first: the sandbox's shell starts there and, every command being a subshell, never
            # leaves. A `cd` would be a read of /testbed's size and link count, which every file an agent makes
            # there changes, and so would miss every read-set candidate after it (as `docker exec -w` does not).
            call = ToolCall(call.tool, {**args, "command": fresh_shell(None, args["command"])})
        outcome = await self.inner.execute(call)
        output = outcome.output
        if isinstance(output, dict) and isinstance(output.get("output"), str):
            masked = mask_durations(output["output"])
            if masked != output["output"]:
                return replace(outcome, output={**output, "output": masked})
        return outcome

    async def snapshot(self) -> str:
        return await self.inner.snapshot()

    async def close(self) -> None:
        await self.inner.close()


def make_sandboxes(
    base: Base, *, timeout: float = TIMEOUT, tmp: str | None = None, read_sets: bool = False
) -> MaskedSandboxes:
    """Workspace sandboxes over `base`: /testbed and the environment, the network off, commands traced for their
    read sets (`read_sets`)."""
    from tvcache.sandboxes.workspace import WorkspaceSandboxes

    workspace = WorkspaceSandboxes(
        {TESTBED: str(base.testbed), ENV_MOUNT: str(base.env)},
        env=sandbox_env(base),
        cwd=TESTBED,
        timeout=timeout,
        network=False,
        tmp=tmp,
        read_sets=read_sets,
    )
    return MaskedSandboxes(workspace)


# -- the workload ---------------------------------------------------------------------------------------


def build_workload(
    tasks: int | None = None,
    *,
    timeout: float = TIMEOUT,
    root: str | Path | None = None,
    tmp: str | None = None,
    log: Log | None = None,
    read_sets: bool = False,
) -> Workload:
    """The `swe` workload: the rollouts of the first `tasks` instances of `swe-dev.jsonl` (all 12 when
    None), each instance in sandboxes over its base (built on first use, see `build_base`). `timeout` is
    the seconds a command may run; `tmp` where sandboxes live (default /dev/shm); `read_sets` traces the reads of
    the commands of the strategies that reuse by them (tvcache), while the others run untraced, as they would
    without read sets, so that the paired cost against none is what tracing costs. Close the workload."""
    traces = first_tasks(read_traces(workload_path("traces", "swe-dev.jsonl")), tasks)
    instances = read_instances()
    unknown = [t for t in task_order(traces) if t not in instances]
    if unknown:
        raise ValueError(f"swe-dev-instances.json does not describe {unknown}")
    bases: dict[str, Base] = {}
    for task in task_order(traces):
        instance = instances[task]
        bases[task] = build_base(instance.project, instance.version, root=root, log=log)
    factories: dict[Path, MaskedSandboxes] = {}
    untraced: dict[Path, MaskedSandboxes] = {}
    for base in bases.values():
        if base.root not in factories:
            # No sandbox runs yet if a later one fails: the earlier factories clean up when collected.
            factories[base.root] = make_sandboxes(base, timeout=timeout, tmp=tmp, read_sets=read_sets)
            if read_sets:
                untraced[base.root] = make_sandboxes(base, timeout=timeout, tmp=tmp)

    async def close() -> None:
        for factory in [*factories.values(), *untraced.values()]:
            await factory.close()

    calls = sum(len(t.calls) for t in traces)
    used = sorted({f"{b.project} {b.version}" for b in bases.values()})
    return Workload(
        name="swe",
        traces=traces,
        sandboxes=lambda task: factories[bases[task].root],
        untraced=(lambda task: untraced[bases[task].root]) if read_sets else None,
        tools=Tools(),  # bash may change anything: whether a command did is observed per call
        close=close,
        notes=f"{len(traces)} SWE-agent rollouts ({calls} bash calls) of {len(bases)} SWE-bench dev instances "
        f"from traces/swe-dev.jsonl (SWE-agent/mini-swe-agent, MIT), replayed in workspace sandboxes over the "
        f"PyPI sdists {', '.join(used)} with their test dependencies; network off, {timeout:g} s per command, "
        "test durations masked. See tvcache_bench.workloads.swe.describe().",
    )


def describe() -> str:
    """Where the workload's data comes from, for the README."""
    return (
        "**swe** — `traces/swe-dev.jsonl`: 46 real rollouts (3,835 `bash` calls) of mini-swe-agent "
        "(SWE-agent/mini-swe-agent@ec0e8e84, MIT) on 12 SWE-bench dev instances of marshmallow, astroid and "
        "sqlfluff, 3-4 model configurations per instance. Each instance is replayed in workspace sandboxes "
        "(overlayfs) whose `/testbed` holds the project's release sdist from PyPI closest to the version the "
        "traces show installed (SWE-bench's version where they do not say), committed to a fresh git "
        "repository, with a virtual environment at `/opt/venv` holding the project (editable), its "
        "dependencies, pytest and what its tests import: built once into `~/.cache/tvcache/swe/` and "
        "mounted read-only under every sandbox. Real `pytest`, `grep`, `sed -i`, `git diff` run, the network "
        "off, 60 s per command. The environment sets `PYTHONDONTWRITEBYTECODE=1`, "
        "`PYTEST_ADDOPTS=-p no:cacheprovider`, `GIT_OPTIONAL_LOCKS=0`, `PYTHONHASHSEED=0` and offline pip; "
        "test-run durations in outputs are masked ('in N.NNs'). marshmallow's sdists carry the test suite; "
        "astroid's carry no tests and sqlfluff's one test file, so most of their test commands find no tests."
    )
