"""Where the shared real-data workloads live.

The data (traces, databases) is never copied into the repository: benchmarks read it in place from the
workloads directory, which is `../shared/workloads` next to the repository root unless the environment
variable `TVCACHE_WORKLOADS` points elsewhere (for an installed, non-editable package, or another machine).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "MissingData", "workload_path", "workloads_dir"]

ENV_VAR = "TVCACHE_WORKLOADS"

# src/tvcache_bench/data.py -> parents[2] is the repository root.
DEFAULT = Path(__file__).resolve().parents[2].parent / "shared" / "workloads"


class MissingData(FileNotFoundError):
    """The benchmark data is not where it was looked for; the message names both ways to provide it."""


def workloads_dir() -> Path:
    """The workloads directory: `$TVCACHE_WORKLOADS` if set, else `<repo>/../shared/workloads`.

    Raises `MissingData` (a `FileNotFoundError`) naming both when the directory does not exist.
    """
    configured = os.environ.get(ENV_VAR)
    path = Path(configured).expanduser() if configured else DEFAULT
    if not path.is_dir():
        why = f"{ENV_VAR}={configured} is not a directory" if configured else f"{ENV_VAR} is not set"
        raise MissingData(
            f"no benchmark data: {why}; set {ENV_VAR} to the workloads directory (the one holding traces/, sql/ "
            f"and tau-airline/), or put that directory at {DEFAULT} (../shared/workloads next to the repository)"
        )
    return path


def workload_path(*parts: str) -> Path:
    """A file or directory inside the workloads directory, which must exist."""
    root = workloads_dir()
    path = root.joinpath(*parts)
    if not path.exists():
        source = f"${ENV_VAR}" if os.environ.get(ENV_VAR) else "the default location"
        raise MissingData(f"the benchmark data in {root} (from {source}) has no {'/'.join(parts)}")
    return path
