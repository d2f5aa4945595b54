"""The `sql` tool of the veRL example, as veRL loads it (`multi_turn.function_tool_path`).

Without tvcache this function is the tool: each statement runs on the Chinook database opened read-only (veRL 0.9
makes a tool instance per call, so nothing carries from one call to the next). With tvcache's agent loop and
`sandboxes:` set, the function only gives the schema the model sees; the calls run in the trajectory's own writable
copy of the database (`SQLiteSandboxes`), which answers in the same format.
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
