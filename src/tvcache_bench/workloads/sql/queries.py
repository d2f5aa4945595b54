"""SQL queries as text: tokens, clauses and identifiers, and the perturbations that turn a gold query into
the wrong candidates an agent tries first (`perturb`). Used by the `sql` workload's exploration policy.

The tokenizer is deliberately small: it knows strings, quoted names, numbers, words and punctuation, with
their parenthesis depth, which is all a perturbation needs to find a clause and change it without breaking
the query's syntax.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "COST_PRESERVING",
    "PERTURBATIONS",
    "Perturbation",
    "Query",
    "Schema",
    "body",
    "filter_columns",
    "perturb",
    "pick",
    "quote",
    "string_literal",
    "used_tables",
]


def pick(rng: random.Random, choices: Sequence[tuple[str, float]]) -> str:
    """One of the choices' names, drawn with the choices' weights."""
    return rng.choices([c for c, _ in choices], [w for _, w in choices])[0]


# ---------------------------------------------------------------------------------------------------------
# SQL text: tokens, identifiers, clauses

_TOKEN = re.compile(
    r"""
    (?P<space>\s+|--[^\n]*|/\*.*?\*/)
  | (?P<string>'(?:[^']|'')*')
  | (?P<name>"(?:[^"]|"")*"|`[^`]*`|\[[^\]]*\])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<word>[^\W\d]\w*)
  | (?P<op><=|>=|<>|!=|==|\|\||.)
    """,
    re.VERBOSE | re.DOTALL,
)

# SQLite's keywords (https://sqlite.org/lang_keywords.html): a name that is one must be quoted.
_KEYWORDS = frozenset(
    """abort action add after all alter always analyze and as asc attach autoincrement before begin between by
    cascade case cast check collate column commit conflict constraint create cross current current_date
    current_time current_timestamp database default deferrable deferred delete desc detach distinct do drop
    each else end escape except exclude exclusive exists explain fail filter first following for foreign
    from full generated glob group groups having if ignore immediate in index indexed initially inner insert
    instead intersect into is isnull join key last left like limit match materialized natural no not nothing
    notnull null nulls of offset on or order others outer over partition plan pragma preceding primary query
    raise range recursive references regexp reindex release rename replace restrict returning right rollback
    row rows savepoint select set table temp temporary then ties to transaction trigger unbounded union
    unique update using vacuum values view virtual when where window with without""".split()  # noqa: SIM905
)

_CLAUSES = frozenset({"select", "from", "where", "group", "having", "order", "limit", "window"})
_SET_OPERATORS = frozenset({"union", "intersect", "except"})


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # string, name (a quoted identifier), number, word, op
    text: str
    start: int
    end: int
    depth: int  # parentheses around it ("(" and ")" count as outside)
    word: str  # the lower-case text of a bare word, "" for every other token

    @property
    def identifier(self) -> str | None:
        if self.kind == "word":
            return self.text
        if self.kind == "name":
            inner = self.text[1:-1]
            return inner.replace('""', '"') if self.text[0] == '"' else inner
        return None

    @property
    def literal(self) -> bool:
        return self.kind in ("string", "number") or self.word == "null"


def _tokens(sql: str) -> list[_Token]:
    tokens, depth = [], 0
    for match in _TOKEN.finditer(sql):
        kind = match.lastgroup
        assert kind is not None
        if kind == "space":
            continue
        text = match.group()
        if text == ")":
            depth = max(0, depth - 1)
        word = text.lower() if kind == "word" else ""
        tokens.append(_Token(kind, text, match.start(), match.end(), depth, word))
        if text == "(":
            depth += 1
    return tokens


def quote(name: str) -> str:
    """`name` as an SQL identifier: bare when it can be, double-quoted otherwise."""
    if re.fullmatch(r"[^\W\d]\w*", name) and name.lower() not in _KEYWORDS:
        return name
    return '"' + name.replace('"', '""') + '"'


def string_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def body(sql: str) -> str:
    """A query without its trailing semicolons, to embed it in another statement or extend it."""
    return sql.strip().rstrip(";").rstrip()


class Query:
    """A query's tokens and its top-level clauses (of its first SELECT, before any UNION/INTERSECT/EXCEPT)."""

    def __init__(self, sql: str) -> None:
        self.sql = sql
        self.tokens = _tokens(sql)
        self.end = next(
            (i for i, t in enumerate(self.tokens) if t.depth == 0 and t.word in _SET_OPERATORS), len(self.tokens)
        )
        self._starts = [i for i in range(self.end) if self.tokens[i].depth == 0 and self.tokens[i].word in _CLAUSES]

    def clause(self, word: str) -> tuple[int, int, int] | None:
        """(keyword index, first body index, end index) of the first top-level clause `word`."""
        for n, i in enumerate(self._starts):
            if self.tokens[i].word != word:
                continue
            body = i + 1
            if word in ("group", "order") and body < self.end and self.tokens[body].word == "by":
                body += 1
            stop = self._starts[n + 1] if n + 1 < len(self._starts) else self.end
            return i, body, stop
        return None

    def limit(self) -> tuple[int, int] | None:
        """(LIMIT keyword index, its number's index) of a top-level `LIMIT n` anywhere in the query."""
        for i, t in enumerate(self.tokens[:-1]):
            if t.depth == 0 and t.word == "limit" and self.tokens[i + 1].kind == "number":
                return i, i + 1
        return None

    def splice(self, start: int, end: int, text: str) -> str:
        return self.sql[:start] + text + self.sql[end:]

    def cut(self, start: int, end: int) -> str:
        """The query without the characters [start, end) and the blanks around them, one space kept."""
        left, right = self.sql[:start].rstrip(), self.sql[end:].lstrip()
        return f"{left} {right}" if right else left

    def conjuncts(self) -> list[tuple[int, int]]:
        """Token ranges of the top-level WHERE's AND-ed conditions (one range if it has a top-level OR)."""
        where = self.clause("where")
        if where is None:
            return []
        _, body, stop = where
        if any(self.tokens[i].word == "or" and self.tokens[i].depth == 0 for i in range(body, stop)):
            return [(body, stop)]
        parts, first, between = [], body, False
        for i in range(body, stop):
            token = self.tokens[i]
            if token.depth != 0:
                continue
            if token.word == "between":
                between = True
            elif token.word == "and":
                if between:
                    between = False  # the AND of BETWEEN x AND y
                else:
                    parts.append((first, i))
                    first = i + 1
        parts.append((first, stop))
        return [(a, b) for a, b in parts if a < b]

    def single_table(self) -> bool:
        found = self.clause("from")
        if found is None:
            return False
        _, body, stop = found
        return not any(t.depth == 0 and (t.word == "join" or t.text == ",") for t in self.tokens[body:stop])


# ---------------------------------------------------------------------------------------------------------
# Perturbations: wrong candidate queries derived from the gold


@dataclass(frozen=True, slots=True)
class Schema:
    """The columns of the tables a query uses, for perturbations and look-ups."""

    tables: dict[str, tuple[str, ...]]  # every table of the database
    used: tuple[str, ...]  # the tables the gold query names, in order of appearance

    def tables_with(self, column: str) -> list[str]:
        low = column.lower()
        return [t for t in self.used if any(c.lower() == low for c in self.tables[t])]

    def literal(self, token: _Token) -> bool:
        """A value in the query: a string, number or NULL, or a double-quoted string (Spider writes
        `name = "France"`, which SQLite reads as a string when no column of that name exists)."""
        if token.literal:
            return True
        if token.kind != "name" or not token.text.startswith('"'):
            return False
        name = (token.identifier or "").lower()
        return not any(
            name == table.lower() or any(name == c.lower() for c in columns) for table, columns in self.tables.items()
        )


Perturbation = Callable[[Query, Schema, random.Random], str | None]


def _drop_condition(q: Query, schema: Schema, rng: random.Random) -> str | None:
    """Drop one filter (a condition with a literal or a subquery, never a join condition)."""
    parts = q.conjuncts()
    droppable = [
        n
        for n, (a, b) in enumerate(parts)
        if any(schema.literal(t) or t.word in ("select", "exists") for t in q.tokens[a:b])
    ]
    if not droppable:
        return None
    n = rng.choice(droppable)
    a, b = parts[n]
    tokens = q.tokens
    if len(parts) == 1:
        if not q.single_table():
            return None  # without its WHERE a join becomes a cross product
        where = q.clause("where")
        assert where is not None
        return q.cut(tokens[where[0]].start, tokens[b - 1].end)
    if n == 0:
        return q.splice(tokens[a].start, tokens[parts[1][0]].start, "")
    return q.splice(tokens[parts[n - 1][1] - 1].end, tokens[b - 1].end, "")


def _filter_range(q: Query) -> list[int]:
    indices: list[int] = []
    for word in ("where", "having"):
        found = q.clause(word)
        if found is not None:
            indices.extend(range(found[1], found[2]))
    return indices


def _change_literal(q: Query, schema: Schema, rng: random.Random) -> str | None:
    """Change a value the query filters on: a number off by one, a string's case, a date's year."""
    literals = [i for i in _filter_range(q) if q.tokens[i].word != "null" and schema.literal(q.tokens[i])]
    if not literals:
        return None
    token = q.tokens[rng.choice(literals)]
    if token.kind == "number":
        if re.fullmatch(r"\d+", token.text):
            number = int(token.text)
            new = str(
                number * 2 if rng.random() < 0.2 else number + 1 if number == 0 or rng.random() < 0.5 else number - 1
            )
        else:
            decimals = len(token.text.partition(".")[2]) or 1
            step = 10.0**-decimals * rng.choice((-1, 1))
            new = f"{float(token.text) + step:.{decimals}f}"
        return q.splice(token.start, token.end, new)
    quote = token.text[0]  # ' or, for Spider's strings, "
    value = token.text[1:-1].replace(quote * 2, quote)
    if re.fullmatch(r"\d{4}-\d\d-\d\d.*", value):
        year = int(value[:4]) + rng.choice((-1, 1))
        changed = f"{year:04d}{value[4:]}"
    elif "%" in value:
        changed = value.replace("%", "")
    else:
        options = [value.lower(), value.upper(), value.title(), value[:-1]]
        rng.shuffle(options)
        changed = next((o for o in options if o != value and o), value + "s")
    return q.splice(token.start, token.end, quote + changed.replace(quote, quote * 2) + quote)


_FLIPS = {">": ">=", ">=": ">", "<": "<=", "<=": "<", "=": "!=", "!=": "=", "<>": "="}


def _flip_comparison(q: Query, schema: Schema, rng: random.Random, strict_only: bool = False) -> str | None:
    """Get a comparison with a literal wrong: an off-by-one bound, or = where != was meant."""
    tokens, candidates = q.tokens, []
    for i in _filter_range(q):
        token = tokens[i]
        if token.text not in _FLIPS or (strict_only and token.text in ("=", "!=", "<>")):
            continue
        neighbours = [tokens[j] for j in (i - 1, i + 1) if 0 <= j < len(tokens)]
        if any(schema.literal(t) for t in neighbours):
            candidates.append(token)
    if not candidates:
        return None
    token = rng.choice(candidates)
    return q.splice(token.start, token.end, _FLIPS[token.text])


def _flip_bound(q: Query, schema: Schema, rng: random.Random) -> str | None:
    return _flip_comparison(q, schema, rng, strict_only=True)


def _change_limit(q: Query, schema: Schema, rng: random.Random) -> str | None:
    found = q.limit()
    if found is not None:
        keyword, number = found
        tokens = q.tokens
        if rng.random() < 0.3:
            return q.splice(tokens[keyword].start, tokens[number].end, "").rstrip()
        value = int(float(tokens[number].text))
        new = rng.choice((3, 5)) if value == 1 else value + rng.choice((1, 2, 5))
        return q.splice(tokens[number].start, tokens[number].end, str(new))
    if q.clause("order") is not None:
        return f"{q.sql} LIMIT {rng.choice((1, 1, 3, 5))}"
    return f"{q.sql} LIMIT 10"


def _flip_order(q: Query, schema: Schema, rng: random.Random) -> str | None:
    found = q.clause("order")
    if found is None:
        return None
    _, body, stop = found
    tokens = q.tokens
    for i in range(body, stop):
        if tokens[i].depth == 0 and tokens[i].word in ("asc", "desc"):
            new = "ASC" if tokens[i].word == "desc" else "DESC"
            return q.splice(tokens[i].start, tokens[i].end, new)
        if tokens[i].depth == 0 and tokens[i].text == ",":
            stop = i
            break
    return q.splice(tokens[stop - 1].end, tokens[stop - 1].end, " DESC")


_AGGREGATES = {"max": "min", "min": "max", "avg": "sum", "sum": "avg"}


def _swap_aggregate(q: Query, schema: Schema, rng: random.Random) -> str | None:
    found = q.clause("select")
    if found is None:
        return None
    _, body, stop = found
    tokens = q.tokens
    options = []
    for i in range(body, stop - 1):
        name, opening = tokens[i], tokens[i + 1]
        if opening.text != "(" or name.kind != "word":
            continue
        if name.word in _AGGREGATES:
            options.append(q.splice(name.start, name.end, _AGGREGATES[name.word]))
        elif name.word == "count" and i + 2 < len(tokens) and tokens[i + 2].text != "*":
            inner = tokens[i + 2]
            if inner.word == "distinct":
                options.append(q.splice(inner.start, tokens[i + 3].start, ""))
            else:
                options.append(q.splice(inner.start, inner.start, "DISTINCT "))
    return rng.choice(options) if options else None


def _wrong_column(q: Query, schema: Schema, rng: random.Random) -> str | None:
    """Select a neighbouring column of the same table instead of the right one."""
    found = q.clause("select")
    if found is None:
        return None
    _, body, stop = found
    tokens = q.tokens
    options = []
    for i in range(body, stop):
        name = tokens[i].identifier
        if name is None or (i + 1 < len(tokens) and tokens[i + 1].text in ("(", ".")):
            continue
        if i > 0 and tokens[i - 1].word == "as":
            continue
        for table in schema.tables_with(name):
            others = [c for c in schema.tables[table] if c.lower() != name.lower()]
            if others:
                options.append((tokens[i], others))
    if not options:
        return None
    token, others = rng.choice(options)
    return q.splice(token.start, token.end, quote(rng.choice(others)))


def _misspell(q: Query, schema: Schema, rng: random.Random) -> str | None:
    """Name a column that does not exist: a plural, a truncation, or the table's name glued to it."""
    options = [
        (token, table)
        for token in q.tokens[: q.end]
        if token.identifier is not None
        for table in schema.tables_with(token.identifier)[:1]
    ]
    if not options:
        return None
    token, table = rng.choice(options)
    name = token.identifier or ""
    wrong = pick(rng, ((name + "s", 1.0), (name[:-1] or name + "_id", 0.5), (f"{table}_{name}", 1.0)))
    return q.splice(token.start, token.end, quote(wrong))


def _toggle_distinct(q: Query, schema: Schema, rng: random.Random) -> str | None:
    found = q.clause("select")
    if found is None:
        return None
    keyword, body, _ = found
    tokens = q.tokens
    if body < len(tokens) and tokens[body].word == "distinct":
        return q.splice(tokens[keyword].end, tokens[body].end, "")
    return q.splice(tokens[keyword].end, tokens[keyword].end, " DISTINCT")


def _drop_group_by(q: Query, schema: Schema, rng: random.Random) -> str | None:
    found = q.clause("group")
    if found is None:
        return None
    keyword, _, stop = found
    tokens = q.tokens
    return q.cut(tokens[keyword].start, tokens[stop - 1].end)


#: name -> (perturbation, weight). Weights follow how often each kind of mistake shows up in text-to-SQL
#: error analyses: wrong filters and wrong columns first, then ordering and aggregation.
PERTURBATIONS: dict[str, tuple[Perturbation, float]] = {
    "drop_condition": (_drop_condition, 3.0),
    "change_literal": (_change_literal, 2.0),
    "flip_comparison": (_flip_comparison, 1.5),
    "wrong_column": (_wrong_column, 2.0),
    "misspell": (_misspell, 1.0),
    "swap_aggregate": (_swap_aggregate, 1.5),
    "change_limit": (_change_limit, 1.5),
    "flip_order": (_flip_order, 1.5),
    "toggle_distinct": (_toggle_distinct, 1.0),
    "drop_group_by": (_drop_group_by, 0.7),
}
#: The perturbations used on TPC-H: those that keep a query's cost about the same.
COST_PRESERVING: dict[str, tuple[Perturbation, float]] = {
    "change_literal": (_change_literal, 2.0),
    "flip_bound": (_flip_bound, 1.5),
    "wrong_column": (_wrong_column, 2.0),
    "misspell": (_misspell, 1.0),
    "swap_aggregate": (_swap_aggregate, 1.5),
    "change_limit": (_change_limit, 1.5),
    "flip_order": (_flip_order, 1.5),
    "toggle_distinct": (_toggle_distinct, 1.0),
}


def perturb(
    sql: str,
    tables: dict[str, tuple[str, ...]],
    rng: random.Random,
    *,
    count: int = 6,
    kinds: dict[str, tuple[Perturbation, float]] | None = None,
) -> list[str]:
    """Up to `count` distinct wrong variants of `sql`, each one or two perturbations away from it, most
    likely first. `tables` is the database's schema (table -> columns)."""
    kinds = PERTURBATIONS if kinds is None else kinds
    base = body(sql)
    schema = Schema(tables, used_tables(Query(base), tables))
    names, weights = list(kinds), [w for _, w in kinds.values()]
    found: list[str] = []
    parsed = {base: Query(base)}  # most draws start from the gold: tokenize it once
    for _ in range(8 * count):
        text = base
        for _ in range(2 if rng.random() < 0.3 else 1):
            query = parsed.get(text) or Query(text)
            changed = kinds[rng.choices(names, weights)[0]][0](query, schema, rng)
            text = changed if changed is not None else text
        text = text.strip()
        if _normal(text) != _normal(base) and text not in found:
            found.append(text)
            if len(found) == count:
                break
    return found


def _normal(sql: str) -> str:
    return " ".join(sql.split()).lower()


def used_tables(q: Query, tables: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    by_lower = {name.lower(): name for name in tables}
    used: dict[str, None] = {}
    for token in q.tokens:
        name = token.identifier
        if name is not None and name.lower() in by_lower:
            used.setdefault(by_lower[name.lower()])
    return tuple(used)


def filter_columns(q: Query, schema: Schema) -> list[tuple[str, str]]:
    """(table, column) pairs the query's WHERE filters on, in order of appearance."""
    where = q.clause("where")
    if where is None:
        return []
    pairs: dict[tuple[str, str], None] = {}
    for i in range(where[1], where[2]):
        name = q.tokens[i].identifier
        if name is None or (i + 1 < len(q.tokens) and q.tokens[i + 1].text in ("(", ".")):
            continue
        for table in schema.tables_with(name)[:1]:
            column = next(c for c in schema.tables[table] if c.lower() == name.lower())
            pairs.setdefault((table, column))
    return list(pairs)
