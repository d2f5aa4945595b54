"""The 14 tools of tau-bench's airline domain, over an in-memory copy of its database.

Written for tvcache's `airline` workload from the documented behaviour of sierra-research/tau-bench (MIT),
and checked call by call against the outputs recorded in `traces/tau-airline.jsonl` by `conformance()`.

Fidelity. Every output is the string tau-bench returns, byte for byte, quirks included:
`get_reservation_details` answers "Error: user not found" for an unknown reservation,
`update_reservation_flights` leaves the reservation's cabin as it was, `cancel_reservation` refunds again
when called twice, and `search_onestop_flight` spells the next day "2024-05-<day+1>" (unpadded, May only)
and shows the second leg's seats and prices of the first leg's day. A Python exception inside a tool becomes
"Error: <exception>", as in tau-bench's `env.step`. Where tau-bench would surface a raw `TypeError` for
malformed arguments (missing, unexpected, wrong type) we answer a clearer "Error: ...". An unknown tool name
also gets an "Error: ..." string rather than an exception (tau-bench answers "Unknown action X"): a model
that invents a tool gets an answer, and since that answer is deterministic it may be cached like any other.

Ids. tau-bench's ids are not random: `book_reservation` takes the first free id of HATHAT, HATHAU, HATHAV
and `send_certificate` the first free of certificate_3221322, _3221323, _3221324 on that user. We continue
both sequences past three (where tau-bench would overwrite HATHAV or return None), so every output is a
pure function of the database and the call: replaying a rollout gives the same outputs every time.

Canonical arguments. The cache keys a call by the canonical JSON of its arguments (sorted keys), so an
output must not depend on the key order inside the objects a caller passes. Records built from arguments
(flights, passengers, payments) are laid out in tau-bench's schema order whatever order the caller used;
for every call in the traces that is the order the model sent anyway.

Data version. The shared users.json is tau-bench's after its commit 404f33e (January 2025), which renamed
every address's "province" to "state"; the traces were recorded before that. `load_db()` renames it back by
default, which reproduces the recorded database exactly (checked against tau-bench commit 7362a17, the one
that added the trajectories); `load_db(as_recorded=False)` keeps the file as it is.

State. A database is `{"flights": {...}, "reservations": {...}, "users": {...}}` as in the JSON files.
Tools never modify a record in place: a write builds a changed copy of the reservation or user and stores
it in the table, after every check has passed. So `copy_db` (new tables sharing the records) forks a
database in microseconds where a deep copy takes 0.3 s, and a write that fails leaves the database as it
was. Flights are never written (tau-bench does not track seats sold).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import itertools
import json
import operator
import string
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvcache.calls import ToolCall, Tools
from tvcache_bench import traces
from tvcache_bench.data import workloads_dir

__all__ = [
    "READ_ONLY",
    "RECORDED_CHARS",
    "TOOLS",
    "WRITES",
    "Db",
    "Mismatch",
    "Report",
    "TraceRollout",
    "conformance",
    "copy_db",
    "default_dir",
    "execute",
    "final_state",
    "fingerprint",
    "load_db",
    "read_traces",
    "replay",
    "run",
    "state_digest",
    "tool_annotations",
]

Db = dict[str, dict[str, Any]]

TABLES = ("flights", "reservations", "users")
# Recorded outputs in the traces are cut at this many characters.
RECORDED_CHARS = 2000
# tau-bench's "current time"; every booking is created at it.
_NOW = "2024-05-15T15:00:00"


# --- loading -------------------------------------------------------------------------------------------


def default_dir() -> Path:
    """The shared tau-airline data: `<workloads>/tau-airline`."""
    return workloads_dir() / "tau-airline"


def load_db(path: str | Path | None = None, *, as_recorded: bool = True) -> Db:
    """The initial airline database, parsed from `flights.json`, `reservations.json` and `users.json` in
    `path` (default `default_dir()`). With `as_recorded`, addresses carry "province" as when the traces
    were recorded (see the module docstring). Takes about 0.1 s; fork it with `copy_db`."""
    folder = Path(path) if path is not None else default_dir()
    db: Db = {}
    for table in TABLES:
        with open(folder / f"{table}.json", encoding="utf-8") as file:
            content = json.load(file)
        if not isinstance(content, dict):
            raise ValueError(f"{folder / table}.json must hold a JSON object keyed by id")
        db[table] = content
    if as_recorded:
        for user in db["users"].values():
            # Rebuild the dict so "province" takes the place of "state": key order shows in outputs.
            user["address"] = {("province" if k == "state" else k): v for k, v in user["address"].items()}
    return db


def fingerprint(path: str | Path | None = None, *, as_recorded: bool = True) -> str:
    """A content hash of the three JSON files (and of the `as_recorded` variant): the scope fingerprint
    of the airline workload, which changes whenever the starting database does."""
    folder = Path(path) if path is not None else default_dir()
    digest = hashlib.sha256(f"tvcache-airline/1 as_recorded={as_recorded}\n".encode())
    for table in TABLES:
        data = (folder / f"{table}.json").read_bytes()
        digest.update(f"{table}.json {len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()


def copy_db(db: Db) -> Db:
    """An independent copy of `db` for tools to run on: new reservation and user tables sharing the
    records, which tools never change in place; the flights table, which no tool writes, is shared."""
    return {table: (rows if table == "flights" else dict(rows)) for table, rows in db.items()}


def state_digest(db: Db) -> str:
    """A hash of the whole database, sensitive to key order (which shows in outputs)."""
    return hashlib.sha256(json.dumps(db).encode()).hexdigest()


# --- running tools -------------------------------------------------------------------------------------


class _Refusal(Exception):
    """A tool declines the call; the message becomes the output "Error: <message>"."""


def run(db: Db, call: ToolCall) -> str:
    """Execute one airline tool call against `db`, changing it for a successful write, and return the
    output string exactly as tau-bench formats it ("Error: ..." for anything it refuses)."""
    return execute(db, call)[0]


def execute(db: Db, call: ToolCall) -> tuple[str, bool]:
    """`run`, also saying whether the call changed the database (False for every read and refusal)."""
    tool = _REGISTRY.get(call.tool)
    if tool is None:
        return f"Error: unknown tool {call.tool!r}; the airline tools are {', '.join(TOOLS)}", False
    args = call.args
    if not isinstance(args, dict):
        return f"Error: the arguments of {call.tool} are not a JSON object: {args[:200]!r}", False
    problem = _check_args(call.tool, tool.params, args)
    if problem is not None:
        return f"Error: {problem}", False
    try:
        return tool.impl(db, args)
    except _Refusal as refusal:
        return f"Error: {refusal}", False
    except (KeyError, ValueError, TypeError, ArithmeticError) as exc:
        # tau-bench turns any exception of a tool into an output; these are the ones its data can raise
        # (an unknown cabin name is a KeyError, a malformed date a ValueError).
        return f"Error: {exc}", False


def replay(db: Db, calls: Iterable[ToolCall]) -> list[str]:
    """Run `calls` in order on `db` (which they change) and return their outputs."""
    return [run(db, call) for call in calls]


def final_state(calls: Iterable[ToolCall], initial: Db | None = None) -> Db:
    """The database after running a rollout's `calls` from a fresh copy of `initial` (default: the
    shared initial database), which is left untouched."""
    state = copy_db(initial if initial is not None else load_db())
    replay(state, calls)
    return state


def tool_annotations() -> Tools:
    """What tvcache may assume about these tools: the reads never change the database."""
    return Tools(read_only=READ_ONLY)


def _dump(value: Any) -> str:
    # tau-bench's formatting: json.dumps defaults (", " and ": " separators, non-ASCII escaped).
    return json.dumps(value)


def _put(db: Db, table: str, key: str, record: dict[str, Any]) -> bool:
    """Store a changed copy of a record; say whether it differs from what was there. Compared as JSON
    text, since a record whose keys only moved is a change: key order shows in outputs."""
    old = db[table].get(key)
    if old is not None and json.dumps(old) == json.dumps(record):
        return False
    db[table][key] = record
    return True


# Field order of records built from arguments: the order tau-bench's own records and outputs use.
_FLIGHT_FIELDS = ("origin", "destination", "flight_number", "date", "price")
_PASSENGER_FIELDS = ("first_name", "last_name", "dob")
_PAYMENT_FIELDS = ("payment_id", "amount")


def _layout(record: Mapping[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """A deep copy of `record` with known fields in schema order, then any others sorted: the result does
    not depend on the caller's key order, and the database never shares objects with the call's args."""
    ordered = [k for k in fields if k in record] + sorted(k for k in record if k not in fields)
    return {k: copy.deepcopy(record[k]) for k in ordered}


def _bookable_flight(db: Db, number: str, date: str, cabin: str, seats: int) -> tuple[Any, Any]:
    """The flight and its day's data, if it can be booked for `seats` passengers in `cabin`."""
    flight = db["flights"].get(number)
    if flight is None:
        raise _Refusal(f"flight {number} not found")
    day = flight["dates"].get(date)
    if day is None:
        raise _Refusal(f"flight {number} not found on date {date}")
    if day["status"] != "available":
        raise _Refusal(f"flight {number} not available on date {date}")
    if day["available_seats"][cabin] < seats:
        raise _Refusal(f"not enough seats on flight {number}")
    return flight, day


def _payment_method(db: Db, user_id: str, payment_id: str, amount: float) -> dict[str, Any]:
    """The user's method to pay `amount` for a change of an existing reservation."""
    method = db["users"][user_id]["payment_methods"].get(payment_id)
    if method is None:
        raise _Refusal("payment method not found")
    if method["source"] == "certificate":
        raise _Refusal("certificate cannot be used to update reservation")
    if method["source"] == "gift_card" and method["amount"] < amount:
        raise _Refusal("gift card balance is not enough")
    return dict(method)


def _reservation_ids() -> Iterator[str]:
    letters = string.ascii_uppercase
    for first, second in itertools.product(letters, letters):
        if first + second >= "AT":
            yield f"HATH{first}{second}"


# --- the tools -----------------------------------------------------------------------------------------

Args = dict[str, Any]
Result = tuple[str, bool]


def _get_user_details(db: Db, a: Args) -> Result:
    user = db["users"].get(a["user_id"])
    if user is None:
        raise _Refusal("user not found")
    return _dump(user), False


def _get_reservation_details(db: Db, a: Args) -> Result:
    reservation = db["reservations"].get(a["reservation_id"])
    if reservation is None:
        raise _Refusal("user not found")  # sic: tau-bench's message for an unknown reservation
    return _dump(reservation), False


def _list_all_airports(db: Db, a: Args) -> Result:
    return _dump(_AIRPORTS), False


def _search_direct_flight(db: Db, a: Args) -> Result:
    results = []
    for flight in db["flights"].values():
        if flight["origin"] != a["origin"] or flight["destination"] != a["destination"]:
            continue
        day = flight["dates"].get(a["date"])
        if day is not None and day["status"] == "available":
            results.append({**{k: v for k, v in flight.items() if k != "dates"}, **day})
    return _dump(results), False


def _search_onestop_flight(db: Db, a: Args) -> Result:
    date = a["date"]
    flights = db["flights"].values()
    results = []
    for first in flights:
        if first["origin"] != a["origin"]:
            continue
        for second in flights:
            if second["destination"] != a["destination"] or first["destination"] != second["origin"]:
                continue
            # tau-bench's next-day rule, kept as is: May 2024 only, day not zero-padded.
            arrives_next_day = "+1" in first["scheduled_arrival_time_est"]
            date2 = f"2024-05-{int(date[-2:]) + 1}" if arrives_next_day else date
            # Times compare as strings, like tau-bench ("03:00:00+1" sorts before "04:00:00").
            if first["scheduled_arrival_time_est"] > second["scheduled_departure_time_est"]:
                continue
            if date not in first["dates"] or date2 not in second["dates"]:
                continue
            if first["dates"][date]["status"] != "available":
                continue
            if second["dates"][date2]["status"] != "available":
                continue
            leg1 = {**{k: v for k, v in first.items() if k != "dates"}, **first["dates"][date], "date": date}
            # Seats and prices of the second leg come from `date`, not `date2`: tau-bench's quirk (and a
            # KeyError, hence "Error: '<date>'", when that flight does not fly on `date`).
            leg2 = {**{k: v for k, v in second.items() if k != "dates"}, **second["dates"][date], "date": date2}
            results.append([leg1, leg2])
    return _dump(results), False


def _book_reservation(db: Db, a: Args) -> Result:
    user_id = a["user_id"]
    if user_id not in db["users"]:
        raise _Refusal("user not found")
    user = copy.deepcopy(db["users"][user_id])
    reservation_id = next((r for r in _reservation_ids() if r not in db["reservations"]), None)
    if reservation_id is None:
        raise _Refusal("no free reservation id left")
    cabin = a["cabin"]
    flights = [_layout(f, _FLIGHT_FIELDS) for f in a["flights"]]
    passengers = [_layout(p, _PASSENGER_FIELDS) for p in a["passengers"]]
    payments = [_layout(p, _PAYMENT_FIELDS) for p in a["payment_methods"]]

    total = 0
    for flight in flights:
        info, day = _bookable_flight(db, flight["flight_number"], flight["date"], cabin, len(passengers))
        flight["price"] = day["prices"][cabin]
        flight["origin"] = info["origin"]
        flight["destination"] = info["destination"]
        total += flight["price"] * len(passengers)
    if a["insurance"] == "yes":
        total += 30 * len(passengers)
    total += 50 * a["nonfree_baggages"]

    methods = user["payment_methods"]
    for payment in payments:
        payment_id = payment["payment_id"]
        if payment_id not in methods:
            raise _Refusal(f"payment method {payment_id} not found")
        method = methods[payment_id]
        if method["source"] in ("gift_card", "certificate") and method["amount"] < payment["amount"]:
            raise _Refusal(f"not enough balance in payment method {payment_id}")
    paid = sum(payment["amount"] for payment in payments)
    if paid != total:
        raise _Refusal(f"payment amount does not add up, total price is {total}, but paid {paid}")

    for payment in payments:
        method = methods[payment["payment_id"]]
        if method["source"] == "gift_card":
            method["amount"] -= payment["amount"]
        elif method["source"] == "certificate":
            # A certificate is used up whole; naming one twice is a KeyError here, as in tau-bench.
            del methods[payment["payment_id"]]
    reservation = {
        "reservation_id": reservation_id,
        "user_id": user_id,
        "origin": a["origin"],
        "destination": a["destination"],
        "flight_type": a["flight_type"],
        "cabin": cabin,
        "flights": flights,
        "passengers": passengers,
        "payment_history": payments,
        "created_at": _NOW,
        "total_baggages": a["total_baggages"],
        "nonfree_baggages": a["nonfree_baggages"],
        "insurance": a["insurance"],
    }
    user["reservations"].append(reservation_id)
    _put(db, "reservations", reservation_id, reservation)
    _put(db, "users", user_id, user)
    return _dump(reservation), True


def _cancel_reservation(db: Db, a: Args) -> Result:
    reservation_id = a["reservation_id"]
    if reservation_id not in db["reservations"]:
        raise _Refusal("reservation not found")
    reservation = copy.deepcopy(db["reservations"][reservation_id])
    history = reservation["payment_history"]
    history.extend([{"payment_id": p["payment_id"], "amount": -p["amount"]} for p in history])
    reservation["status"] = "cancelled"
    changed = _put(db, "reservations", reservation_id, reservation)
    return _dump(reservation), changed


def _update_reservation_flights(db: Db, a: Args) -> Result:
    reservation_id, cabin, payment_id = a["reservation_id"], a["cabin"], a["payment_id"]
    if reservation_id not in db["reservations"]:
        raise _Refusal("reservation not found")
    reservation = copy.deepcopy(db["reservations"][reservation_id])
    seats = len(reservation["passengers"])

    total = 0
    flights = [_layout(f, _FLIGHT_FIELDS) for f in a["flights"]]
    for flight in flights:
        # A flight the reservation already has, in an unchanged cabin, keeps the price paid for it.
        kept = next(
            (
                old
                for old in reservation["flights"]
                if old["flight_number"] == flight["flight_number"]
                and old["date"] == flight["date"]
                and cabin == reservation["cabin"]
            ),
            None,
        )
        if kept is not None:
            source, price = kept, kept["price"]
        else:
            source, day = _bookable_flight(db, flight["flight_number"], flight["date"], cabin, seats)
            price = day["prices"][cabin]
        flight["price"] = price
        flight["origin"] = source["origin"]
        flight["destination"] = source["destination"]
        total += price * seats
    total -= sum(old["price"] for old in reservation["flights"]) * seats

    method = _payment_method(db, reservation["user_id"], payment_id, total)
    # The cabin field is left as it was: tau-bench's behaviour, which the recorded outputs show.
    reservation["flights"] = flights
    if total != 0:
        reservation["payment_history"].append({"payment_id": payment_id, "amount": total})
    changed = _charge(db, reservation["user_id"], payment_id, method, total)
    changed |= _put(db, "reservations", reservation_id, reservation)
    return _dump(reservation), changed


def _update_reservation_baggages(db: Db, a: Args) -> Result:
    reservation_id, payment_id = a["reservation_id"], a["payment_id"]
    if reservation_id not in db["reservations"]:
        raise _Refusal("reservation not found")
    reservation = copy.deepcopy(db["reservations"][reservation_id])
    total = 50 * max(0, a["nonfree_baggages"] - reservation["nonfree_baggages"])
    method = _payment_method(db, reservation["user_id"], payment_id, total)
    reservation["total_baggages"] = a["total_baggages"]
    reservation["nonfree_baggages"] = a["nonfree_baggages"]
    if total != 0:
        reservation["payment_history"].append({"payment_id": payment_id, "amount": total})
    changed = _charge(db, reservation["user_id"], payment_id, method, total)
    changed |= _put(db, "reservations", reservation_id, reservation)
    return _dump(reservation), changed


def _charge(db: Db, user_id: str, payment_id: str, method: dict[str, Any], amount: float) -> bool:
    """Take `amount` (negative: a refund) off a gift card; other methods keep no balance."""
    if method["source"] != "gift_card" or amount == 0:
        return False
    user = copy.deepcopy(db["users"][user_id])
    user["payment_methods"][payment_id]["amount"] -= amount
    return _put(db, "users", user_id, user)


def _update_reservation_passengers(db: Db, a: Args) -> Result:
    reservation_id = a["reservation_id"]
    if reservation_id not in db["reservations"]:
        raise _Refusal("reservation not found")
    reservation = copy.deepcopy(db["reservations"][reservation_id])
    if len(a["passengers"]) != len(reservation["passengers"]):
        raise _Refusal("number of passengers does not match")
    reservation["passengers"] = [_layout(p, _PASSENGER_FIELDS) for p in a["passengers"]]
    changed = _put(db, "reservations", reservation_id, reservation)
    return _dump(reservation), changed


def _send_certificate(db: Db, a: Args) -> Result:
    user_id, amount = a["user_id"], a["amount"]
    if user_id not in db["users"]:
        raise _Refusal("user not found")
    user = copy.deepcopy(db["users"][user_id])
    methods = user["payment_methods"]
    payment_id = next(f"certificate_{n}" for n in itertools.count(3221322) if f"certificate_{n}" not in methods)
    methods[payment_id] = {"source": "certificate", "amount": amount, "id": payment_id}
    _put(db, "users", user_id, user)
    return f"Certificate {payment_id} added to user {user_id} with amount {amount}.", True


def _calculate(db: Db, a: Args) -> Result:
    expression = a["expression"]
    if not all(char in "0123456789+-*/(). " for char in expression):
        raise _Refusal("invalid characters in expression")
    try:
        return str(round(float(_arithmetic(expression)), 2)), False
    except (SyntaxError, ArithmeticError, TypeError, ValueError, RecursionError) as exc:
        return f"Error: {exc}", False


def _think(db: Db, a: Args) -> Result:
    return "", False


def _transfer_to_human_agents(db: Db, a: Args) -> Result:
    return "Transfer successful", False


# --- calculate's arithmetic ----------------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Larger integer powers are refused: "9**9**9**9" would otherwise hang the sandbox.
_MAX_POWER_BITS = 100_000


def _arithmetic(expression: str) -> Any:
    """Evaluate `expression` (digits, + - * / ( ) . and spaces) as Python's `eval` would, with its error
    messages, but without running `eval` and without unbounded powers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # "2 (3)" warns "perhaps you missed a comma?"
        # eval() strips leading spaces and tabs from a string before parsing; ast.parse does not.
        tree = ast.parse(expression.lstrip(" \t"), filename="<string>", mode="eval")
    return _evaluate(tree.body)


def _evaluate(root: ast.expr) -> Any:
    """Evaluate the tree bottom-up with an explicit stack: "1+1+...+1" nests as deep as it is long, and
    Python's own recursion limit must not decide what the tool answers."""
    values: list[Any] = []
    pending: list[tuple[ast.expr, bool]] = [(root, False)]
    while pending:
        node, children_done = pending.pop()
        if not children_done:
            pending.append((node, True))
            pending.extend((child, False) for child in reversed(_operands(node)))
            continue
        arity = len(_operands(node))
        operands = values[len(values) - arity :]
        del values[len(values) - arity :]
        values.append(_apply(node, operands))
    return values[0]


def _operands(node: ast.expr) -> list[ast.expr]:
    if isinstance(node, ast.Constant) or (isinstance(node, ast.Tuple) and not node.elts):
        return []
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return [node.operand]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return [node.left, node.right]
    if isinstance(node, ast.Call) and not node.keywords:
        return [node.func, *node.args]
    raise ValueError(f"unsupported expression: {ast.unparse(node)}")


def _apply(node: ast.expr, operands: list[Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value  # numbers, or Ellipsis from "...", which float() then rejects as eval's would
    if isinstance(node, ast.Tuple):
        return ()  # "()": no comma is allowed, so the empty tuple is the only tuple
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](operands[0])
    if isinstance(node, ast.BinOp):
        left, right = operands
        if isinstance(node.op, ast.Pow) and _huge_power(left, right):
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    # A call, "2 (3)": Python evaluates the callee and the arguments, then fails to call a number.
    raise TypeError(f"'{type(operands[0]).__name__}' object is not callable")


def _huge_power(base: Any, exponent: Any) -> bool:
    if not (isinstance(base, int) and isinstance(exponent, int)) or abs(base) <= 1:
        return False
    return exponent * base.bit_length() > _MAX_POWER_BITS


# --- arguments -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Param:
    kind: str  # described in error messages
    valid: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _objects(**fields: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def valid(value: Any) -> bool:
        return isinstance(value, list) and all(
            isinstance(item, dict) and all(name in item and ok(item[name]) for name, ok in fields.items())
            for item in value
        )

    return valid


_STR = _Param("a string", lambda v: isinstance(v, str))
_INT = _Param("an integer", _is_int)
_NUMBER = _Param("a number", _is_number)
_FLIGHTS = _Param(
    "a list of objects with string flight_number and date",
    _objects(flight_number=lambda v: isinstance(v, str), date=lambda v: isinstance(v, str)),
)
_PASSENGERS = _Param(
    "a list of objects with string first_name, last_name and dob",
    _objects(
        first_name=lambda v: isinstance(v, str),
        last_name=lambda v: isinstance(v, str),
        dob=lambda v: isinstance(v, str),
    ),
)
_PAYMENTS = _Param(
    "a list of objects with a string payment_id and a number amount",
    _objects(payment_id=lambda v: isinstance(v, str), amount=_is_number),
)


def _check_args(tool: str, params: Mapping[str, _Param], args: Mapping[str, Any]) -> str | None:
    """What is wrong with `args` for `tool`, or None."""
    for name in args:
        if name not in params:
            return f"{tool}: unexpected argument {name!r} (it takes {', '.join(params) or 'no arguments'})"
    for name, param in params.items():
        if name not in args:
            return f"{tool}: missing argument {name!r}"
        if not param.valid(args[name]):
            return f"{tool}: argument {name!r} must be {param.kind}, got {_short(args[name])}"
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True, slots=True)
class _Tool:
    params: Mapping[str, _Param]
    impl: Callable[[Db, Args], Result]
    read_only: bool


_REGISTRY: dict[str, _Tool] = {
    "book_reservation": _Tool(
        {
            "user_id": _STR,
            "origin": _STR,
            "destination": _STR,
            "flight_type": _STR,
            "cabin": _STR,
            "flights": _FLIGHTS,
            "passengers": _PASSENGERS,
            "payment_methods": _PAYMENTS,
            "total_baggages": _INT,
            "nonfree_baggages": _INT,
            "insurance": _STR,
        },
        _book_reservation,
        read_only=False,
    ),
    "calculate": _Tool({"expression": _STR}, _calculate, read_only=True),
    "cancel_reservation": _Tool({"reservation_id": _STR}, _cancel_reservation, read_only=False),
    "get_reservation_details": _Tool({"reservation_id": _STR}, _get_reservation_details, read_only=True),
    "get_user_details": _Tool({"user_id": _STR}, _get_user_details, read_only=True),
    "list_all_airports": _Tool({}, _list_all_airports, read_only=True),
    "search_direct_flight": _Tool(
        {"origin": _STR, "destination": _STR, "date": _STR}, _search_direct_flight, read_only=True
    ),
    "search_onestop_flight": _Tool(
        {"origin": _STR, "destination": _STR, "date": _STR}, _search_onestop_flight, read_only=True
    ),
    "send_certificate": _Tool({"user_id": _STR, "amount": _NUMBER}, _send_certificate, read_only=False),
    "think": _Tool({"thought": _STR}, _think, read_only=True),
    "transfer_to_human_agents": _Tool({"summary": _STR}, _transfer_to_human_agents, read_only=True),
    "update_reservation_baggages": _Tool(
        {"reservation_id": _STR, "total_baggages": _INT, "nonfree_baggages": _INT, "payment_id": _STR},
        _update_reservation_baggages,
        read_only=False,
    ),
    "update_reservation_flights": _Tool(
        {"reservation_id": _STR, "cabin": _STR, "flights": _FLIGHTS, "payment_id": _STR},
        _update_reservation_flights,
        read_only=False,
    ),
    "update_reservation_passengers": _Tool(
        {"reservation_id": _STR, "passengers": _PASSENGERS}, _update_reservation_passengers, read_only=False
    ),
}

TOOLS: tuple[str, ...] = tuple(sorted(_REGISTRY))
READ_ONLY: frozenset[str] = frozenset(name for name, tool in _REGISTRY.items() if tool.read_only)
WRITES: frozenset[str] = frozenset(TOOLS) - READ_ONLY

_AIRPORTS = {
    "SFO": "San Francisco",
    "JFK": "New York",
    "LAX": "Los Angeles",
    "ORD": "Chicago",
    "DFW": "Dallas",
    "DEN": "Denver",
    "SEA": "Seattle",
    "ATL": "Atlanta",
    "MIA": "Miami",
    "BOS": "Boston",
    "PHX": "Phoenix",
    "IAH": "Houston",
    "LAS": "Las Vegas",
    "MCO": "Orlando",
    "EWR": "Newark",
    "CLT": "Charlotte",
    "MSP": "Minneapolis",
    "DTW": "Detroit",
    "PHL": "Philadelphia",
    "LGA": "LaGuardia",
}


# --- conformance against the recorded traces -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRollout:
    """One rollout of the trace file: its calls and the outputs recorded for them."""

    task: str
    rollout: str
    calls: tuple[ToolCall, ...]
    recorded: tuple[str, ...]  # as in the file (cut at RECORDED_CHARS); null (an empty output) reads as ""


def read_traces(path: str | Path | None = None) -> list[TraceRollout]:
    """The rollouts of a trace file (default: `<workloads>/traces/tau-airline.jsonl`).
    A malformed line raises `TraceError` (a `ValueError`) naming the file and line number."""
    path = Path(path) if path is not None else workloads_dir() / "traces" / "tau-airline.jsonl"
    return [
        TraceRollout(
            trace.task,
            trace.rollout,
            tuple(ToolCall(c.tool, c.args) for c in trace.calls),
            # The trace converter stored tau-bench's empty outputs (think's) as null.
            tuple(c.output or "" for c in trace.calls),
        )
        for trace in traces.read_traces(path)
    ]


@dataclass(frozen=True, slots=True)
class Mismatch:
    task: str
    rollout: str
    index: int
    call: ToolCall
    recorded: str
    produced: str


@dataclass(slots=True)
class Report:
    """How our outputs compare with the recorded ones, call by call: every call counts, exactly."""

    rollouts: int = 0
    total: int = 0
    exact: int = 0
    calls_by_tool: Counter[str] = field(default_factory=Counter)
    mismatches: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[Mismatch]] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Exact matches over all calls."""
        return self.exact / self.total if self.total else 1.0

    def summary(self) -> str:
        lines = [
            f"{self.rollouts} rollouts, {self.total} calls: {self.exact} exact ({self.rate:.2%})",
        ]
        for tool, count in self.mismatches.most_common():
            lines.append(f"  {tool}: {count} of {self.calls_by_tool[tool]} differ")
            for m in self.examples.get(tool, []):
                lines.append(f"    {m.task}/{m.rollout} call {m.index}: {m.call.key[:100]}")
                lines.append(f"      recorded {m.recorded[:150]!r}")
                lines.append(f"      produced {m.produced[:150]!r}")
        return "\n".join(lines)


def conformance(traces_path: str | Path | None = None, *, initial: Db | None = None, examples: int = 3) -> Report:
    """Replay every rollout of the traces from a fresh copy of `initial` (default `load_db()`), call by
    call, and compare each output's first RECORDED_CHARS characters with the recorded output."""
    base = initial if initial is not None else load_db()
    report = Report()
    for trace in read_traces(traces_path):
        state = copy_db(base)
        produced = [run(state, call)[:RECORDED_CHARS] for call in trace.calls]
        recorded = [output[:RECORDED_CHARS] for output in trace.recorded]
        report.rollouts += 1
        for i, call in enumerate(trace.calls):
            report.total += 1
            report.calls_by_tool[call.tool] += 1
            if produced[i] == recorded[i]:
                report.exact += 1
            else:
                report.mismatches[call.tool] += 1
                kept = report.examples.setdefault(call.tool, [])
                if len(kept) < examples:
                    kept.append(Mismatch(trace.task, trace.rollout, i, call, recorded[i], produced[i]))
    return report


if __name__ == "__main__":  # python -m tvcache_bench.workloads.airline: the conformance figures
    print(conformance().summary())
