"""Where the shared real-data workloads live.

The data (traces, databases) is never copied into the repository: benchmarks read it in place from the
workloads directory, which is `../shared/workloads` next to the repository root unless the environment
variable `TVCACHE_WORKLOADS` points elsewhere (for an installed, non-editable package, or another machine).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "workload_path", "workloads_dir"]

ENV_VAR = "TVCACHE_WORKLOADS"

# src/tvcache_bench/data.py -> parents[2] is the repository root.
_REPO_ROOT = Path(__file__).resolve().parents[2]


def workloads_dir() -> Path:
    """The workloads directory: `$TVCACHE_WORKLOADS` if set, else `<repo>/../shared/workloads`.

    Raises `FileNotFoundError` naming both options when the directory does not exist.
    """
    configured = os.environ.get(ENV_VAR)
    path = Path(configured).expanduser() if configured else _REPO_ROOT.parent / "shared" / "workloads"
    if not path.is_dir():
        origin = f"${ENV_VAR}" if configured else "the default location next to the repository"
        raise FileNotFoundError(
            f"workloads directory {path} (from {origin}) does not exist; "
            f"set {ENV_VAR} to the directory holding traces/, tau-airline/ and sql/"
        )
    return path


def workload_path(*parts: str) -> Path:
    """A file or directory inside the workloads directory, which must exist."""
    path = workloads_dir().joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist in the workloads directory {workloads_dir()}")
    return path
