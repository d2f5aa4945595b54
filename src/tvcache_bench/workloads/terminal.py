"""`tvcache bench terminal`: terminal-agent rollouts (bash in a workspace), the published system's first workload.

Six tasks in the style of Terminal-Bench, each a small project under `tvcache_bench/data/terminal/base/` (mounted
at `/testbed`, the shell starting there): fix two bugs in a Python statistics package until its unittest suite
passes (`statskit`), summarise a web server's access log (`weblogs`), deduplicate a CSV of contacts into JSON
(`contacts`), fix a C calculator until its test script passes (`calc`, needs `make` and a C compiler), convert an
INI configuration to JSON (`service`), and build a SQLite database with Python and answer a question from it
(`shop`).

The rollouts (`data/terminal/traces.jsonl`, written by `generate()`; `python -m tvcache_bench.workloads.terminal
OUT` writes it again) come from a seeded policy shaped like a GRPO group of one model: per task, a sequence of
stages (look around, read the task, read the code, run the tests, edit, run the tests again, check the result),
each with the alternatives such an agent issues (`cat` or `sed -n` or `grep -n`; `sed -i` or a Python rewrite or a
heredoc; a wrong edit that is then undone); a rollout takes the group's most likely alternative with a
probability that falls with depth, so rollouts share their first steps and then diverge. They carry no outputs:
replaying them in tvcache's sandboxes produces them. The commands are real and do real work (`make` compiles,
unittest runs, `python3` writes SQLite files), with the outputs such commands have, a few of which are not
deterministic (`unittest` prints its run time).

Replay them as the checker of issue #23 does:

    tvcache replay tvcache_bench/data/terminal/traces.jsonl --sandbox workspace --base tvcache_bench/data/terminal/base
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from tvcache.calls import Tools

from ..data import BUNDLED
from ..traces import Trace, TraceCall, read_traces
from ..workload import Workload, first_tasks

__all__ = ["BASE", "SEED", "TASKS", "TRACES", "build_workload", "describe", "generate", "write"]

TRACES = BUNDLED / "terminal" / "traces.jsonl"
BASE = BUNDLED / "terminal" / "base"
SEED = 0
ROLLOUTS = 8  # per task: a GRPO group

# A stage is a list of alternatives, each (weight, commands). The first alternative is the group's most likely.
Stage = list[tuple[float, list[str]]]

_STATS_MEDIAN_SED = "sed -i 's|^    return ordered\\[middle\\]$|    return (ordered[middle - 1] + ordered[middle]) / 2|' statskit/core.py"
_STATS_MEDIAN_PY = """python3 - <<'EOF'
path = "statskit/core.py"
text = open(path).read()
text = text.replace(
    "        return ordered[middle]\\n    return ordered[middle]\\n",
    "        return ordered[middle]\\n    return (ordered[middle - 1] + ordered[middle]) / 2\\n",
)
open(path, "w").write(text)
EOF"""
_STATS_VARIANCE_SED = "sed -i 's|/ n$|/ (n - 1 if sample else n)|' statskit/core.py"
_STATS_VARIANCE_PY = """python3 - <<'EOF'
path = "statskit/core.py"
text = open(path).read()
text = text.replace("return sum((v - m) ** 2 for v in values) / n", "return sum((v - m) ** 2 for v in values) / (n - 1 if sample else n)")
open(path, "w").write(text)
EOF"""
_STATS_TESTS = "python3 -m unittest discover -s tests 2>&1 | tail -n 15"

_STATSKIT: list[Stage] = [
    [(6, ["ls"]), (2, ["ls -la"]), (1, ["pwd && ls -F"])],
    [(6, ["cat statskit/README.md"]), (2, ["find statskit -type f | sort"])],
    [(9, ["cd statskit"])],
    [(5, ["cat statskit/core.py"]), (2, ["grep -n 'def ' statskit/core.py"]), (2, ["sed -n 1,40p statskit/core.py"])],
    [(6, [_STATS_TESTS]), (3, ["python3 -m unittest discover -s tests -v 2>&1 | grep -E 'FAIL|ERROR|ok$'"])],
    [(4, ["grep -n -A3 'median_even\\|variance' tests/test_core.py"]), (3, ["cat tests/test_core.py"]), (3, [])],
    [
        (5, [_STATS_MEDIAN_SED]),
        (3, [_STATS_MEDIAN_PY]),
        (
            2,
            [
                "sed -i 's|middle = len(ordered) // 2|middle = len(ordered) / 2|' statskit/core.py",
                _STATS_TESTS,
                "sed -i 's|middle = len(ordered) / 2|middle = len(ordered) // 2|' statskit/core.py",
                _STATS_MEDIAN_SED,
            ],
        ),
    ],
    [(5, [_STATS_TESTS]), (3, ["sed -n 13,22p statskit/core.py"]), (2, [])],
    [
        (5, [_STATS_VARIANCE_SED]),
        (3, [_STATS_VARIANCE_PY]),
        (2, ["grep -n 'sample' statskit/core.py", _STATS_VARIANCE_SED]),
    ],
    [(7, [_STATS_TESTS]), (3, ["python3 -m unittest discover -s tests -v 2>&1 | tail -n 4"])],
    [(4, ["cat statskit/core.py | head -n 40"]), (6, [])],
]

_REPORT_AWK = (
    "awk '{n++; if ($9 ~ /^5/) e++; c[$1]++} END {for (ip in c) if (c[ip] > best) {best = c[ip]; top = ip}; "
    'printf "requests: %d\\nerrors: %d\\ntop: %s\\n", n, e, top}\' access.log > report.txt'
)
_REPORT_SHELL = (
    '{ echo "requests: $(wc -l < access.log)"; echo "errors: $(awk \'$9 ~ /^5/\' access.log | wc -l)"; '
    "echo \"top: $(cut -d' ' -f1 access.log | sort | uniq -c | sort -rn | head -n 1 | awk '{print $2}')\"; } > report.txt"
)
_REPORT_PY = """python3 - <<'EOF'
from collections import Counter
lines = open("access.log").read().splitlines()
errors = sum(1 for line in lines if line.split()[8].startswith("5"))
top = Counter(line.split()[0] for line in lines).most_common(1)[0][0]
with open("report.txt", "w") as f:
    f.write(f"requests: {len(lines)}\\nerrors: {errors}\\ntop: {top}\\n")
EOF"""

_WEBLOGS: list[Stage] = [
    [(6, ["ls"]), (2, ["ls -la"])],
    [(7, ["cat weblogs/README.md"]), (2, ["ls -la weblogs"])],
    [(9, ["cd weblogs"])],
    [(5, ["head -n 5 access.log"]), (3, ["head -n 3 access.log && wc -l access.log"]), (2, ["tail -n 3 access.log"])],
    [(5, ["wc -l access.log"]), (3, ["awk '{print $9}' access.log | sort | uniq -c | sort -rn"]), (2, [])],
    [
        (4, ["awk '{print $1}' access.log | sort | uniq -c | sort -rn | head -n 5"]),
        (3, ["cut -d' ' -f1 access.log | sort | uniq -c | sort -rn | head -n 3"]),
        (3, ["grep -c '\" 5[0-9][0-9] ' access.log"]),
    ],
    [(4, ["awk '$9 ~ /^5/' access.log | wc -l"]), (3, ["grep -E '\" 5[0-9]{2} ' access.log | head -n 5"]), (3, [])],
    [(4, [_REPORT_AWK]), (3, [_REPORT_SHELL]), (3, [_REPORT_PY])],
    [(8, ["cat report.txt"]), (2, ["cat report.txt && wc -l report.txt"])],
    [(3, ["grep -c . report.txt"]), (7, [])],
]

_CONTACTS_PY = """cat > convert.py <<'EOF'
import csv
import json

seen = set()
people = []
with open("data/contacts.csv", newline="") as f:
    for row in csv.DictReader(f):
        key = row["email"].lower()
        if key in seen:
            continue
        seen.add(key)
        people.append({"name": row["name"], "email": row["email"], "city": row["city"]})
people.sort(key=lambda p: p["name"])
with open("contacts.json", "w") as f:
    json.dump(people, f, indent=2)
print(len(people), "contacts")
EOF"""
_CONTACTS_WRONG = """cat > convert.py <<'EOF'
import csv
import json

with open("data/contacts.csv", newline="") as f:
    people = list(csv.DictReader(f))
people.sort(key=lambda p: p["name"])
with open("contacts.json", "w") as f:
    json.dump(people, f, indent=2)
print(len(people), "contacts")
EOF"""
_CONTACTS_ONELINER = (
    "python3 -c \"import csv, json; rows = list(csv.DictReader(open('data/contacts.csv'))); seen = {}; "
    "[seen.setdefault(r['email'].lower(), r) for r in rows]; "
    "json.dump(sorted(seen.values(), key=lambda r: r['name']), open('contacts.json', 'w'), indent=2); "
    "print(len(seen), 'contacts')\""
)

_CONTACTS: list[Stage] = [
    [(6, ["ls"]), (3, ["ls contacts contacts/data"])],
    [(8, ["cat contacts/README.md"])],
    [(9, ["cd contacts"])],
    [(5, ["head -n 5 data/contacts.csv"]), (3, ["wc -l data/contacts.csv && head -n 3 data/contacts.csv"])],
    [
        (4, ["cut -d, -f2 data/contacts.csv | tr A-Z a-z | sort | uniq -d | wc -l"]),
        (3, ["cut -d, -f2 data/contacts.csv | sort -f | uniq -di | head"]),
        (3, []),
    ],
    [
        (5, [_CONTACTS_PY, "python3 convert.py"]),
        (3, [_CONTACTS_ONELINER]),
        (2, [_CONTACTS_WRONG, "python3 convert.py", _CONTACTS_PY, "python3 convert.py"]),
    ],
    [
        (5, ["python3 -c \"import json; d = json.load(open('contacts.json')); print(len(d), d[0])\""]),
        (3, ["head -n 12 contacts.json"]),
        (2, ["jq length contacts.json"]),
    ],
    [
        (
            4,
            [
                "python3 -c \"import json; d = json.load(open('contacts.json')); "
                "print(len({p['email'].lower() for p in d}) == len(d))\""
            ],
        ),
        (6, []),
    ],
]

_CALC_FIX_SUB = "sed -i 's|\\*out = b - a;|*out = a - b;|' src/ops.c"
_CALC_FIX_DIV = (
    "sed -i 's|    case .\\/.:|    case '\"'\"'/'\"'\"':\\n        if (b == 0)\\n            return 2;|; "
    "s|    case .%.:|    case '\"'\"'%'\"'\"':\\n        if (b == 0)\\n            return 2;|' src/ops.c"
)
_CALC_FIX_PY = """python3 - <<'EOF'
path = "src/ops.c"
text = open(path).read()
text = text.replace("*out = b - a;", "*out = a - b;")
for op in "/%":
    text = text.replace(f"    case '{op}':\\n", f"    case '{op}':\\n        if (b == 0)\\n            return 2;\\n")
open(path, "w").write(text)
EOF"""

_CALC: list[Stage] = [
    [(6, ["ls"]), (3, ["ls -R calc"])],
    [(7, ["cat calc/README.md"]), (2, ["cat calc/Makefile"])],
    [(9, ["cd calc"])],
    [(6, ["make"]), (3, ["make 2>&1 | tail -n 5"])],
    [(7, ["./tests.sh"]), (2, ["./tests.sh; echo exit=$?"])],
    [(5, ["cat src/ops.c"]), (3, ["grep -n 'case' src/ops.c"]), (2, ["sed -n 1,30p src/ops.c"])],
    [
        (5, [_CALC_FIX_SUB, _CALC_FIX_DIV]),
        (3, [_CALC_FIX_PY]),
        (2, [_CALC_FIX_SUB, "make && ./tests.sh", _CALC_FIX_DIV]),
    ],
    [(5, ["cat src/ops.c"]), (5, [])],
    [(7, ["make && ./tests.sh"]), (3, ["make clean && make && ./tests.sh"])],
    [(3, ["./calc 10 / 0; echo exit=$?"]), (7, [])],
]

_SERVICE_PY = """python3 - <<'EOF'
import configparser
import json

parser = configparser.ConfigParser()
parser.read("config.ini")


def value(text):
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


config = {section: {k: value(v) for k, v in parser[section].items()} for section in parser.sections()}
with open("config.json", "w") as f:
    json.dump(config, f, indent=2)
EOF"""
_SERVICE_STRINGS = (
    "python3 -c \"import configparser, json; p = configparser.ConfigParser(); p.read('config.ini'); "
    "json.dump({s: dict(p[s]) for s in p.sections()}, open('config.json', 'w'), indent=2)\""
)
_SERVICE_HEREDOC = """cat > config.json <<'EOF'
{
  "server": {"host": "0.0.0.0", "port": 8080, "workers": 4, "debug": false},
  "database": {"url": "postgresql://app@db:5432/shop", "pool_size": 10, "timeout": 2.5},
  "cache": {"enabled": true, "ttl": 300}
}
EOF"""

_SERVICE: list[Stage] = [
    [(6, ["ls"]), (3, ["ls -la service"])],
    [(8, ["cat service/README.md"])],
    [(9, ["cd service"])],
    [(6, ["cat config.ini"]), (3, ["cat config.ini app.py"])],
    [(5, ["cat app.py"]), (3, ["grep -n 'REQUIRED' -A5 app.py"]), (2, ["python3 app.py --check"])],
    [(3, ["cat tests/test_config.py"]), (7, [])],
    [(5, [_SERVICE_PY]), (3, [_SERVICE_HEREDOC]), (2, [_SERVICE_STRINGS, "python3 app.py --check", _SERVICE_PY])],
    [(6, ["python3 app.py --check"]), (4, ["cat config.json && python3 app.py --check"])],
    [
        (6, ["python3 -m unittest discover -s tests 2>&1 | tail -n 3"]),
        (4, ["python3 -m unittest discover -s tests -v"]),
    ],
]

_SHOP_BUILD = (
    "python3 -c \"import sqlite3; db = sqlite3.connect('shop.db'); db.executescript(open('schema.sql').read()); "
    "db.executescript(open('data.sql').read()); db.commit(); print('built')\""
)
_SHOP_QUERY = (
    "SELECT c.name, ROUND(SUM(p.price * i.quantity), 2) AS total FROM customers c JOIN orders o ON o.customer_id = c.id "
    "JOIN order_items i ON i.order_id = o.id JOIN products p ON p.id = i.product_id WHERE o.status = 'shipped' "
    "GROUP BY c.id ORDER BY total DESC LIMIT 3"
)
_SHOP_QUERY_WRONG = (
    "SELECT c.name, ROUND(SUM(p.price), 2) AS total FROM customers c JOIN orders o ON o.customer_id = c.id "
    "JOIN order_items i ON i.order_id = o.id JOIN products p ON p.id = i.product_id GROUP BY c.id ORDER BY total DESC "
    "LIMIT 3"
)


def _sql(query: str) -> str:
    return f"python3 -c \"import sqlite3; print(*sqlite3.connect('shop.db').execute(\\\"{query}\\\").fetchall(), sep='\\n')\""


_SHOP_ANSWER = (
    "python3 -c \"import sqlite3; name, total = sqlite3.connect('shop.db').execute(\\\""
    + _SHOP_QUERY.replace("LIMIT 3", "LIMIT 1")
    + "\\\").fetchone(); open('answer.txt', 'w').write(f'{name},{total:.2f}\\\\n')\""
)

_SHOP: list[Stage] = [
    [(6, ["ls"]), (3, ["ls shop"])],
    [(8, ["cat shop/README.md"])],
    [(9, ["cd shop"])],
    [(6, ["cat schema.sql"]), (3, ["cat schema.sql && head -n 5 data.sql"])],
    [(4, ["head -n 20 data.sql"]), (3, ["grep -c 'INSERT INTO orders' data.sql"]), (3, [])],
    [(8, [_SHOP_BUILD]), (2, ["rm -f shop.db && " + _SHOP_BUILD])],
    [
        (4, [_sql("SELECT status, COUNT(*) FROM orders GROUP BY status")]),
        (3, [_sql("SELECT * FROM products")]),
        (3, []),
    ],
    [(5, [_sql(_SHOP_QUERY)]), (3, [_sql(_SHOP_QUERY_WRONG), _sql(_SHOP_QUERY)])],
    [(8, [_SHOP_ANSWER]), (2, ["echo 'Emeka Obi,0.00' > answer.txt", _SHOP_ANSWER])],
    [(8, ["cat answer.txt"]), (2, [])],
]

TASKS: dict[str, list[Stage]] = {
    "statskit-fix": _STATSKIT,
    "weblogs-report": _WEBLOGS,
    "contacts-json": _CONTACTS,
    "calc-fix": _CALC,
    "service-config": _SERVICE,
    "shop-sqlite": _SHOP,
}


def _rollout(stages: Sequence[Stage], r: random.Random) -> list[str]:
    """One rollout: at stage `depth` the group's most likely alternative with probability falling from 0.95 (the
    first steps nearly everyone takes) to 0.35, else one drawn by weight."""
    commands: list[str] = []
    for depth, stage in enumerate(stages):
        keep = max(0.35, 0.95 - 0.1 * depth)
        likely = r.random() < keep
        chosen = stage[0][1] if likely else r.choices([a for _, a in stage], [w for w, _ in stage])[0]
        commands.extend(chosen)
    return commands


def generate(seed: int = SEED, rollouts: int = ROLLOUTS) -> list[Trace]:
    """The workload's rollouts: `rollouts` per task, from a policy seeded by `seed` and the task's name."""
    traces = []
    for task, stages in TASKS.items():
        r = random.Random(f"{seed}:{task}")
        for k in range(rollouts):
            calls = [TraceCall("bash", {"command": c}) for c in _rollout(stages, r)]
            traces.append(Trace(task, f"r{k}", f"tvcache_bench.workloads.terminal seed {seed}", calls))
    return traces


def write(path: str | Path = TRACES, seed: int = SEED) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for trace in generate(seed):
            f.write(json.dumps(trace.to_json(), separators=(",", ":")) + "\n")


def build_workload(tasks: int | None = None, *, timeout: float = 60.0, read_sets: bool = False) -> Workload:
    """The shipped rollouts of the first `tasks` tasks (all 6 when None) in workspace sandboxes over the shipped
    base, as `tvcache replay TRACES --sandbox workspace --base BASE` replays them. `read_sets` traces the reads
    of the commands of the strategies that reuse by them (tvcache), while the others run untraced, as swe's do.
    Close the workload."""
    from tvcache.sandboxes.workspace import WorkspaceSandboxes

    traces = first_tasks(read_traces(TRACES), tasks)
    factory = WorkspaceSandboxes(BASE, timeout=timeout, read_sets=read_sets)
    untraced = WorkspaceSandboxes(BASE, timeout=timeout) if read_sets else None

    async def close() -> None:
        await factory.close()
        if untraced is not None:
            await untraced.close()

    return Workload(
        name="terminal",
        traces=traces,
        sandboxes=lambda task: factory,
        untraced=None if untraced is None else (lambda task: untraced),
        tools=Tools(),
        close=close,
        notes=describe(),
    )


def describe() -> str:
    """Where the workload's data comes from, for reports."""
    return (
        "terminal: 6 Terminal-Bench-style tasks (tvcache_bench/data/terminal/base: a Python package to fix, an "
        "access log to summarise, a CSV to deduplicate into JSON, a C program to fix with make, an INI to convert "
        f"to JSON, a SQLite database to build and query), {ROLLOUTS} bash rollouts each from a seeded policy "
        "(tvcache_bench.workloads.terminal) that shares its first steps and then diverges; workspace sandboxes, "
        "/testbed the task folder's parent, network off"
    )


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else TRACES)
