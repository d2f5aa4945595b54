"""tvcache inside agent frameworks: one module per framework, each behind its own extra.

    tvcache.integrations.verifiers    pip install 'tvcache[verifiers]'   verifiers v1 tasks (harness tools, runtime)
    tvcache.integrations.skyrl        pip install 'tvcache[skyrl]'       SkyRL-gym text environments
    tvcache.integrations.art          pip install 'tvcache[art]'         ART rollout functions

This package itself imports no framework: what every integration shares lives here, light.

- `task_key(value)`: a task id from the task's own data (a scenario, a dataset row), the same in every epoch and
  every process, and different for different prompts.
- `process_cache()` / `process_sync_cache()`: the cache of this process (and event loop), made on first use from
  the `TVCACHE_URL` environment variable (memory when unset), for frameworks that build environments in worker
  processes where no cache object can be handed in.
- `process_sandboxes(key, make)`: one sandbox factory per key in this process, so rollouts of one task share
  snapshots (a factory's snapshots can be restored only by that factory) and its fingerprint is computed once.
"""

from .keys import task_key
from .process import process_cache, process_sandboxes, process_sync_cache

__all__ = ["process_cache", "process_sandboxes", "process_sync_cache", "task_key"]
