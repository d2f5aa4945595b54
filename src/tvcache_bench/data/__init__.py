"""The benchmark data: real SQL databases, tau-bench's airline database and real agent traces.

It ships with the package (this directory; origins and licences in its README.md), so the benchmarks and the
documentation's examples run wherever tvcache is installed. `TVCACHE_WORKLOADS` names another directory of the
same layout (traces/, sql/, tau-airline/) to use instead.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["BUNDLED", "ENV_VAR", "MissingData", "chinook", "workload_path", "workloads_dir"]

ENV_VAR = "TVCACHE_WORKLOADS"

BUNDLED = Path(__file__).resolve().parent


class MissingData(FileNotFoundError):
    """The benchmark data is not where it was looked for; the message says where it was looked for and why."""


def workloads_dir() -> Path:
    """The workloads directory: `$TVCACHE_WORKLOADS` if set, else the data that ships with the package.

    Raises `MissingData` (a `FileNotFoundError`) when `$TVCACHE_WORKLOADS` names no directory.
    """
    configured = os.environ.get(ENV_VAR)
    if not configured:
        return BUNDLED
    path = Path(configured).expanduser()
    if not path.is_dir():
        raise MissingData(
            f"no benchmark data: {ENV_VAR}={configured} is not a directory; set {ENV_VAR} to a workloads directory "
            f"(the one holding traces/, sql/ and tau-airline/), or unset it to use the data that ships with tvcache "
            f"({BUNDLED})"
        )
    return path


def workload_path(*parts: str) -> Path:
    """A file or directory inside the workloads directory, which must exist."""
    root = workloads_dir()
    path = root.joinpath(*parts)
    if not path.exists():
        source = f"${ENV_VAR}" if os.environ.get(ENV_VAR) else "the data that ships with tvcache"
        raise MissingData(f"the benchmark data in {root} (from {source}) has no {'/'.join(parts)}")
    return path


def chinook() -> Path:
    """The Chinook database (a music store: 11 tables, 1 MB; lerocha/chinook-database, MIT), for examples."""
    return workload_path("sql", "chinook", "chinook.sqlite")
