"""TPC-H in SQLite: the heavy-query task family of the `sql` workload.

The data comes from `tpchgen-cli` (PyPI, a Rust port of TPC-H's dbgen: same rows for the same scale
factor), written as CSV into a scratch directory and loaded into one SQLite file with primary keys and
`ANALYZE` statistics. Building takes tens of seconds, so the file is kept in a cache directory
(`~/.cache/tvcache/tpch-sf<N>.sqlite`, or `$XDG_CACHE_HOME/tvcache/...`) and reused by every later run.

The queries are TPC-H's, adapted by hand to SQLite from the text that DuckDB's `tpch` extension carries
(PyPI `duckdb-extension-tpch`, `SELECT * FROM tpch_queries()`): dates are plain 'YYYY-MM-DD' strings
compared as text (SQLite has no DATE type, and `CAST('1995-03-15' AS date)` would give the number 1995),
`extract(year FROM d)` is `CAST(strftime('%Y', d) AS INTEGER)`, and date arithmetic is done when the query is
instantiated. Only the queries that run in seconds at the default scale factor are kept: Q8, Q17, Q20 and
Q22 take minutes in SQLite (correlated subqueries without an index), and Q2, Q11, Q15, Q16 run in
milliseconds. Each query's substitution parameters are drawn as TPC-H's qgen draws them (spec 2.4),
from a caller's random generator, so a seed gives the same queries every time.
"""

from __future__ import annotations

import csv
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from tvcache.sandboxes.reclaim import scratch_dir

__all__ = [
    "DEFAULT_QUERIES",
    "DEFAULT_SCALE_FACTOR",
    "SCALE_ENV",
    "TEMPLATES",
    "Query",
    "TpchUnavailable",
    "cache_dir",
    "database_path",
    "ensure_database",
    "generator",
    "queries",
    "scale_factor_default",
]

#: At 0.3 (1.8 million lineitem rows, a 373 MB file) the default queries take 0.2-7 s each in SQLite on the
#: project's 2-core machines (median about 1 s, measured while other jobs loaded the machine): seconds-long
#: tool calls, as in the published SQL workloads.
DEFAULT_SCALE_FACTOR = 0.3
#: Overrides the default scale factor, e.g. `TVCACHE_TPCH_SF=1` for heavier queries.
SCALE_ENV = "TVCACHE_TPCH_SF"

_TABLES = ("region", "nation", "supplier", "customer", "part", "partsupp", "orders", "lineitem")

_SCHEMA = """
CREATE TABLE region(r_regionkey INTEGER PRIMARY KEY, r_name TEXT, r_comment TEXT);
CREATE TABLE nation(n_nationkey INTEGER PRIMARY KEY, n_name TEXT, n_regionkey INTEGER, n_comment TEXT);
CREATE TABLE supplier(s_suppkey INTEGER PRIMARY KEY, s_name TEXT, s_address TEXT, s_nationkey INTEGER,
    s_phone TEXT, s_acctbal REAL, s_comment TEXT);
CREATE TABLE customer(c_custkey INTEGER PRIMARY KEY, c_name TEXT, c_address TEXT, c_nationkey INTEGER,
    c_phone TEXT, c_acctbal REAL, c_mktsegment TEXT, c_comment TEXT);
CREATE TABLE part(p_partkey INTEGER PRIMARY KEY, p_name TEXT, p_mfgr TEXT, p_brand TEXT, p_type TEXT,
    p_size INTEGER, p_container TEXT, p_retailprice REAL, p_comment TEXT);
CREATE TABLE partsupp(ps_partkey INTEGER, ps_suppkey INTEGER, ps_availqty INTEGER, ps_supplycost REAL,
    ps_comment TEXT, PRIMARY KEY (ps_partkey, ps_suppkey));
CREATE TABLE orders(o_orderkey INTEGER PRIMARY KEY, o_custkey INTEGER, o_orderstatus TEXT, o_totalprice REAL,
    o_orderdate TEXT, o_orderpriority TEXT, o_clerk TEXT, o_shippriority INTEGER, o_comment TEXT);
CREATE TABLE lineitem(l_orderkey INTEGER, l_partkey INTEGER, l_suppkey INTEGER, l_linenumber INTEGER,
    l_quantity REAL, l_extendedprice REAL, l_discount REAL, l_tax REAL, l_returnflag TEXT, l_linestatus TEXT,
    l_shipdate TEXT, l_commitdate TEXT, l_receiptdate TEXT, l_shipinstruct TEXT, l_shipmode TEXT,
    l_comment TEXT, PRIMARY KEY (l_orderkey, l_linenumber));
"""


class TpchUnavailable(RuntimeError):
    """The TPC-H database cannot be built here (no `tpchgen-cli`)."""


# ---------------------------------------------------------------------------------------------------------
# The database


def generator() -> str | None:
    """The `tpchgen-cli` executable: on PATH, or next to this Python (a virtualenv not on PATH)."""
    found = shutil.which("tpchgen-cli")
    if found:
        return found
    beside = Path(sys.executable).parent / "tpchgen-cli"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def scale_factor_default() -> float:
    """`$TVCACHE_TPCH_SF` when set, else `DEFAULT_SCALE_FACTOR`."""
    text = os.environ.get(SCALE_ENV)
    if not text:
        return DEFAULT_SCALE_FACTOR
    try:
        return _check_scale(float(text))
    except ValueError as exc:
        raise ValueError(f"${SCALE_ENV}={text!r}: {exc}") from None


def cache_dir() -> Path:
    """Where built databases are kept: `$XDG_CACHE_HOME/tvcache`, default `~/.cache/tvcache`."""
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "tvcache"


def database_path(scale_factor: float, directory: str | os.PathLike[str] | None = None) -> Path:
    """The cached database file for `scale_factor` (it may not exist yet)."""
    folder = Path(directory) if directory is not None else cache_dir()
    return folder / f"tpch-sf{_check_scale(scale_factor):g}.sqlite"


def ensure_database(
    scale_factor: float | None = None,
    *,
    directory: str | os.PathLike[str] | None = None,
    tmp: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """The TPC-H database at `scale_factor` (default: `scale_factor_default()`), built if not cached yet.

    The CSV files go to a scratch directory under `tmp` (default /dev/shm) and the database is built there
    too, then moved into place with one rename, so a crash or a concurrent build never leaves a half-built
    file where a later run would take it for finished. Raises `TpchUnavailable` without `tpchgen-cli`.
    """
    sf = scale_factor_default() if scale_factor is None else _check_scale(scale_factor)
    target = database_path(sf, directory)
    if target.is_file():
        return target
    exe = generator()
    if exe is None:
        raise TpchUnavailable(
            "the TPC-H task family needs tpchgen-cli to generate its data: `pip install tpchgen-cli` "
            "(or build the workload with tpch=False)"
        )
    say = log or (lambda message: None)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = scratch_dir("tpch", _scratch_parent(tmp))
    try:
        started = time.monotonic()
        say(f"generating TPC-H data at scale factor {sf:g} with {exe}")
        _generate(exe, sf, scratch / "csv")
        say(f"loading it into SQLite ({time.monotonic() - started:.1f} s so far)")
        built = scratch / "tpch.sqlite"
        _load(scratch / "csv", built)
        # Across file systems this is a copy: do it under a temporary name, then rename atomically.
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        shutil.move(built, partial)
        os.replace(partial, target)
        say(f"built {target} ({target.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - started:.1f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _generate(exe: str, sf: float, out: Path) -> None:
    out.mkdir()
    command = [exe, "csv", "--scale-factor", f"{sf:g}", "--output-dir", str(out), "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    missing = [t for t in _TABLES if not (out / f"{t}.csv").is_file()]
    if missing:
        raise RuntimeError(f"tpchgen-cli wrote no {', '.join(missing)} CSV files into {out}")


def _load(folder: Path, path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        # A file being built from scratch needs no journal: if the build fails it is thrown away.
        conn.execute("PRAGMA journal_mode=OFF")
        conn.execute("PRAGMA synchronous=OFF")
        conn.executescript(_SCHEMA)
        conn.execute("BEGIN")
        for table in _TABLES:
            with (folder / f"{table}.csv").open(newline="") as f:
                rows = csv.reader(f)
                header = next(rows)
                # Column affinities turn the CSV's text into integers and reals.
                marks = ", ".join("?" * len(header))
                conn.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)
        conn.execute("COMMIT")
        # Without statistics SQLite picks poor join orders for several of the queries.
        conn.execute("ANALYZE")
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()


def _scratch_parent(tmp: str | os.PathLike[str] | None) -> str | None:
    if tmp is not None:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        return str(tmp)
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


def _check_scale(sf: float) -> float:
    if isinstance(sf, bool) or not isinstance(sf, int | float) or not 0 < sf <= 1000:
        raise ValueError(f"a TPC-H scale factor must be a number in (0, 1000], got {sf!r}")
    return float(sf)


# ---------------------------------------------------------------------------------------------------------
# The queries


@dataclass(frozen=True, slots=True)
class Query:
    name: str  # "q03"
    sql: str


_SEGMENTS = ("AUTOMOBILE", "BUILDING", "FURNITURE", "MACHINERY", "HOUSEHOLD")
_REGIONS = ("AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST")
_NATIONS = (
    "ALGERIA", "ARGENTINA", "BRAZIL", "CANADA", "EGYPT", "ETHIOPIA", "FRANCE", "GERMANY", "INDIA",
    "INDONESIA", "IRAN", "IRAQ", "JAPAN", "JORDAN", "KENYA", "MOROCCO", "MOZAMBIQUE", "PERU", "CHINA",
    "ROMANIA", "SAUDI ARABIA", "VIETNAM", "RUSSIA", "UNITED KINGDOM", "UNITED STATES",
)  # fmt: skip
_SHIPMODES = ("REG AIR", "AIR", "RAIL", "SHIP", "TRUCK", "MAIL", "FOB")
_COLORS = (
    "almond", "antique", "aquamarine", "azure", "beige", "bisque", "black", "blanched", "blue", "blush",
    "brown", "burlywood", "burnished", "chartreuse", "chiffon", "chocolate", "coral", "cornflower",
    "cornsilk", "cream", "cyan", "dark", "deep", "dim", "dodger", "drab", "firebrick", "floral", "forest",
    "frosted", "gainsboro", "ghost", "goldenrod", "green", "grey", "honeydew", "hot", "indian", "ivory",
    "khaki", "lace", "lavender", "lawn", "lemon", "light", "lime", "linen", "magenta", "maroon", "medium",
    "metallic", "midnight", "mint", "misty", "moccasin", "navajo", "navy", "olive", "orange", "orchid",
    "pale", "papaya", "peach", "peru", "pink", "plum", "powder", "puff", "purple", "red", "rose", "rosy",
    "royal", "saddle", "salmon", "sandy", "seashell", "sienna", "sky", "slate", "smoke", "snow", "spring",
    "steel", "tan", "thistle", "tomato", "turquoise", "violet", "wheat", "white", "yellow",
)  # fmt: skip


def _months_after(start: date, months: int) -> date:
    index = start.year * 12 + start.month - 1 + months
    return date(index // 12, index % 12 + 1, start.day)


def _month_start(rng: random.Random, first: tuple[int, int], last: tuple[int, int]) -> date:
    lo, hi = first[0] * 12 + first[1] - 1, last[0] * 12 + last[1] - 1
    index = rng.randint(lo, hi)
    return date(index // 12, index % 12 + 1, 1)


def _year_start(rng: random.Random) -> date:
    return date(rng.randint(1993, 1997), 1, 1)


Params = dict[str, str]


def _q1(rng: random.Random) -> Params:
    return {"date": str(date.fromordinal(date(1998, 12, 1).toordinal() - rng.randint(60, 120)))}


def _q3(rng: random.Random) -> Params:
    return {"segment": rng.choice(_SEGMENTS), "date": str(date(1995, 3, rng.randint(1, 31)))}


def _q4(rng: random.Random) -> Params:
    start = _month_start(rng, (1993, 1), (1997, 10))
    return {"date": str(start), "end": str(_months_after(start, 3))}


def _q5(rng: random.Random) -> Params:
    start = _year_start(rng)
    return {"region": rng.choice(_REGIONS), "date": str(start), "end": str(_months_after(start, 12))}


def _q6(rng: random.Random) -> Params:
    start = _year_start(rng)
    discount = rng.randint(2, 9) / 100
    return {
        "date": str(start),
        "end": str(_months_after(start, 12)),
        "low": f"{discount - 0.01:.2f}",
        "high": f"{discount + 0.01:.2f}",
        "quantity": str(rng.randint(24, 25)),
    }


def _q7(rng: random.Random) -> Params:
    first, second = rng.sample(_NATIONS, 2)
    return {"nation1": first, "nation2": second}


def _q9(rng: random.Random) -> Params:
    return {"color": rng.choice(_COLORS)}


def _q10(rng: random.Random) -> Params:
    start = _month_start(rng, (1993, 2), (1995, 1))
    return {"date": str(start), "end": str(_months_after(start, 3))}


def _q12(rng: random.Random) -> Params:
    first, second = rng.sample(_SHIPMODES, 2)
    start = _year_start(rng)
    return {"mode1": first, "mode2": second, "date": str(start), "end": str(_months_after(start, 12))}


def _q13(rng: random.Random) -> Params:
    return {
        "word1": rng.choice(("special", "pending", "unusual", "express")),
        "word2": rng.choice(("packages", "requests", "accounts", "deposits")),
    }


def _q14(rng: random.Random) -> Params:
    start = _month_start(rng, (1993, 1), (1997, 12))
    return {"date": str(start), "end": str(_months_after(start, 1))}


def _q18(rng: random.Random) -> Params:
    return {"quantity": str(rng.randint(312, 315))}


def _q19(rng: random.Random) -> Params:
    brands = [f"Brand#{rng.randint(1, 5)}{rng.randint(1, 5)}" for _ in range(3)]
    quantities = (rng.randint(1, 10), rng.randint(10, 20), rng.randint(20, 30))
    params = {f"brand{i + 1}": brand for i, brand in enumerate(brands)}
    params.update({f"q{i + 1}": str(q) for i, q in enumerate(quantities)})
    params.update({f"q{i + 1}_end": str(q + 10) for i, q in enumerate(quantities)})
    return params


def _q21(rng: random.Random) -> Params:
    return {"nation": rng.choice(_NATIONS)}


#: name -> (SQLite text with {placeholders}, parameter generator). Parameters are plain values spliced into
#: string or number literals; none contains a quote.
TEMPLATES: dict[str, tuple[str, Callable[[random.Random], Params]]] = {
    "q01": (
        """SELECT l_returnflag, l_linestatus, sum(l_quantity) AS sum_qty, sum(l_extendedprice) AS sum_base_price,
       sum(l_extendedprice * (1 - l_discount)) AS sum_disc_price,
       sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) AS sum_charge, avg(l_quantity) AS avg_qty,
       avg(l_extendedprice) AS avg_price, avg(l_discount) AS avg_disc, count(*) AS count_order
FROM lineitem
WHERE l_shipdate <= '{date}'
GROUP BY l_returnflag, l_linestatus
ORDER BY l_returnflag, l_linestatus""",
        _q1,
    ),
    "q03": (
        """SELECT l_orderkey, sum(l_extendedprice * (1 - l_discount)) AS revenue, o_orderdate, o_shippriority
FROM customer, orders, lineitem
WHERE c_mktsegment = '{segment}' AND c_custkey = o_custkey AND l_orderkey = o_orderkey
  AND o_orderdate < '{date}' AND l_shipdate > '{date}'
GROUP BY l_orderkey, o_orderdate, o_shippriority
ORDER BY revenue DESC, o_orderdate
LIMIT 10""",
        _q3,
    ),
    "q04": (
        """SELECT o_orderpriority, count(*) AS order_count
FROM orders
WHERE o_orderdate >= '{date}' AND o_orderdate < '{end}'
  AND EXISTS (SELECT * FROM lineitem WHERE l_orderkey = o_orderkey AND l_commitdate < l_receiptdate)
GROUP BY o_orderpriority
ORDER BY o_orderpriority""",
        _q4,
    ),
    "q05": (
        """SELECT n_name, sum(l_extendedprice * (1 - l_discount)) AS revenue
FROM customer, orders, lineitem, supplier, nation, region
WHERE c_custkey = o_custkey AND l_orderkey = o_orderkey AND l_suppkey = s_suppkey
  AND c_nationkey = s_nationkey AND s_nationkey = n_nationkey AND n_regionkey = r_regionkey
  AND r_name = '{region}' AND o_orderdate >= '{date}' AND o_orderdate < '{end}'
GROUP BY n_name
ORDER BY revenue DESC""",
        _q5,
    ),
    "q06": (
        """SELECT sum(l_extendedprice * l_discount) AS revenue
FROM lineitem
WHERE l_shipdate >= '{date}' AND l_shipdate < '{end}'
  AND l_discount BETWEEN {low} AND {high} AND l_quantity < {quantity}""",
        _q6,
    ),
    "q07": (
        """SELECT supp_nation, cust_nation, l_year, sum(volume) AS revenue
FROM (
  SELECT n1.n_name AS supp_nation, n2.n_name AS cust_nation,
         CAST(strftime('%Y', l_shipdate) AS INTEGER) AS l_year, l_extendedprice * (1 - l_discount) AS volume
  FROM supplier, lineitem, orders, customer, nation n1, nation n2
  WHERE s_suppkey = l_suppkey AND o_orderkey = l_orderkey AND c_custkey = o_custkey
    AND s_nationkey = n1.n_nationkey AND c_nationkey = n2.n_nationkey
    AND ((n1.n_name = '{nation1}' AND n2.n_name = '{nation2}') OR (n1.n_name = '{nation2}' AND n2.n_name = '{nation1}'))
    AND l_shipdate BETWEEN '1995-01-01' AND '1996-12-31'
) AS shipping
GROUP BY supp_nation, cust_nation, l_year
ORDER BY supp_nation, cust_nation, l_year""",
        _q7,
    ),
    "q09": (
        """SELECT nation, o_year, sum(amount) AS sum_profit
FROM (
  SELECT n_name AS nation, CAST(strftime('%Y', o_orderdate) AS INTEGER) AS o_year,
         l_extendedprice * (1 - l_discount) - ps_supplycost * l_quantity AS amount
  FROM part, supplier, lineitem, partsupp, orders, nation
  WHERE s_suppkey = l_suppkey AND ps_suppkey = l_suppkey AND ps_partkey = l_partkey AND p_partkey = l_partkey
    AND o_orderkey = l_orderkey AND s_nationkey = n_nationkey AND p_name LIKE '%{color}%'
) AS profit
GROUP BY nation, o_year
ORDER BY nation, o_year DESC""",
        _q9,
    ),
    "q10": (
        """SELECT c_custkey, c_name, sum(l_extendedprice * (1 - l_discount)) AS revenue, c_acctbal, n_name,
       c_address, c_phone, c_comment
FROM customer, orders, lineitem, nation
WHERE c_custkey = o_custkey AND l_orderkey = o_orderkey AND o_orderdate >= '{date}' AND o_orderdate < '{end}'
  AND l_returnflag = 'R' AND c_nationkey = n_nationkey
GROUP BY c_custkey, c_name, c_acctbal, c_phone, n_name, c_address, c_comment
ORDER BY revenue DESC
LIMIT 20""",
        _q10,
    ),
    "q12": (
        """SELECT l_shipmode,
       sum(CASE WHEN o_orderpriority = '1-URGENT' OR o_orderpriority = '2-HIGH' THEN 1 ELSE 0 END) AS high_line_count,
       sum(CASE WHEN o_orderpriority <> '1-URGENT' AND o_orderpriority <> '2-HIGH' THEN 1 ELSE 0 END) AS low_line_count
FROM orders, lineitem
WHERE o_orderkey = l_orderkey AND l_shipmode IN ('{mode1}', '{mode2}') AND l_commitdate < l_receiptdate
  AND l_shipdate < l_commitdate AND l_receiptdate >= '{date}' AND l_receiptdate < '{end}'
GROUP BY l_shipmode
ORDER BY l_shipmode""",
        _q12,
    ),
    "q13": (
        """SELECT c_count, count(*) AS custdist
FROM (
  SELECT c_custkey, count(o_orderkey) AS c_count
  FROM customer LEFT OUTER JOIN orders ON c_custkey = o_custkey AND o_comment NOT LIKE '%{word1}%{word2}%'
  GROUP BY c_custkey
) AS c_orders
GROUP BY c_count
ORDER BY custdist DESC, c_count DESC""",
        _q13,
    ),
    "q14": (
        """SELECT 100.00 * sum(CASE WHEN p_type LIKE 'PROMO%' THEN l_extendedprice * (1 - l_discount) ELSE 0 END)
       / sum(l_extendedprice * (1 - l_discount)) AS promo_revenue
FROM lineitem, part
WHERE l_partkey = p_partkey AND l_shipdate >= '{date}' AND l_shipdate < '{end}'""",
        _q14,
    ),
    "q18": (
        """SELECT c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice, sum(l_quantity)
FROM customer, orders, lineitem
WHERE o_orderkey IN (SELECT l_orderkey FROM lineitem GROUP BY l_orderkey HAVING sum(l_quantity) > {quantity})
  AND c_custkey = o_custkey AND o_orderkey = l_orderkey
GROUP BY c_name, c_custkey, o_orderkey, o_orderdate, o_totalprice
ORDER BY o_totalprice DESC, o_orderdate
LIMIT 100""",
        _q18,
    ),
    "q19": (
        """SELECT sum(l_extendedprice * (1 - l_discount)) AS revenue
FROM lineitem, part
WHERE (p_partkey = l_partkey AND p_brand = '{brand1}' AND p_container IN ('SM CASE', 'SM BOX', 'SM PACK', 'SM PKG')
       AND l_quantity >= {q1} AND l_quantity <= {q1_end} AND p_size BETWEEN 1 AND 5
       AND l_shipmode IN ('AIR', 'AIR REG') AND l_shipinstruct = 'DELIVER IN PERSON')
   OR (p_partkey = l_partkey AND p_brand = '{brand2}' AND p_container IN ('MED BAG', 'MED BOX', 'MED PKG', 'MED PACK')
       AND l_quantity >= {q2} AND l_quantity <= {q2_end} AND p_size BETWEEN 1 AND 10
       AND l_shipmode IN ('AIR', 'AIR REG') AND l_shipinstruct = 'DELIVER IN PERSON')
   OR (p_partkey = l_partkey AND p_brand = '{brand3}' AND p_container IN ('LG CASE', 'LG BOX', 'LG PACK', 'LG PKG')
       AND l_quantity >= {q3} AND l_quantity <= {q3_end} AND p_size BETWEEN 1 AND 15
       AND l_shipmode IN ('AIR', 'AIR REG') AND l_shipinstruct = 'DELIVER IN PERSON')""",
        _q19,
    ),
    "q21": (
        """SELECT s_name, count(*) AS numwait
FROM supplier, lineitem l1, orders, nation
WHERE s_suppkey = l1.l_suppkey AND o_orderkey = l1.l_orderkey AND o_orderstatus = 'F'
  AND l1.l_receiptdate > l1.l_commitdate
  AND EXISTS (SELECT * FROM lineitem l2 WHERE l2.l_orderkey = l1.l_orderkey AND l2.l_suppkey <> l1.l_suppkey)
  AND NOT EXISTS (SELECT * FROM lineitem l3 WHERE l3.l_orderkey = l1.l_orderkey AND l3.l_suppkey <> l1.l_suppkey
                  AND l3.l_receiptdate > l3.l_commitdate)
  AND s_nationkey = n_nationkey AND n_name = '{nation}'
GROUP BY s_name
ORDER BY numwait DESC, s_name
LIMIT 100""",
        _q21,
    ),
}


#: The templates of the workload's TPC-H family: the joins. Q1 (a scan of lineitem) and Q13 (an outer join
#: grouped twice) take 5-10 s each at the default scale factor and stay available by name.
DEFAULT_QUERIES: tuple[str, ...] = tuple(name for name in TEMPLATES if name not in ("q01", "q13"))


def queries(rng: random.Random, names: tuple[str, ...] | None = None) -> list[Query]:
    """One instance of each template (all of `TEMPLATES`, or `names`), parameters drawn from `rng`."""
    chosen = tuple(TEMPLATES) if names is None else names
    unknown = [n for n in chosen if n not in TEMPLATES]
    if unknown:
        raise ValueError(f"unknown TPC-H queries {unknown}; known: {', '.join(TEMPLATES)}")
    result = []
    for name in chosen:
        text, params = TEMPLATES[name]
        result.append(Query(name, text.format(**params(rng))))
    return result
