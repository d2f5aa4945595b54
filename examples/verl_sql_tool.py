"""The `sql` tool of the veRL example, as veRL loads it (`multi_turn.function_tool_path`).

Each statement runs on the Chinook database opened read-only (veRL 0.9 makes a tool instance per call, so nothing
carries from one call to the next, and a write is refused). With tvcache's agent loop the same function answers
the misses, and since it is read-only (`read_only: [sql]`), its answers are shared between rollouts in any order.
"""

from __future__ import annotations

import sqlite3
from urllib.parse import quote

from verl.tools.function_tool import function_tool

from tvcache.sandboxes.sqlite import format_rows
from tvcache_bench.data import workload_path

CHINOOK = workload_path("sql", "chinook", "chinook.sqlite")  # shipped with tvcache, or $TVCACHE_WORKLOADS


@function_tool
def sql(query: str) -> str:
    """Run one SQLite statement on the Chinook music store database and return its result rows.

    Args:
        query: One SQLite statement, for example SELECT Name FROM Artist LIMIT 3
    """
    conn = sqlite3.connect(f"file:{quote(str(CHINOOK.resolve()))}?mode=ro", uri=True)
    try:
        cursor = conn.execute(query)
        return format_rows(cursor) if cursor.description else "OK"
    except sqlite3.Error as exc:
        return f"Error: {exc}"
    finally:
        conn.close()


if __name__ == "__main__":  # the tool on its own, as veRL calls it: one statement's answer
    print(sql("SELECT count(*) AS tracks FROM Track"))
