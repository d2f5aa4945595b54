"""The airline tools against the outputs tau-bench recorded, and their state semantics.

The oracle is `traces/tau-airline.jsonl`: real tau-bench outputs for 1,164 calls of 200 rollouts.
"""

from __future__ import annotations

import copy
import json
import pickle
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tvcache.calls import ToolCall
from tvcache_bench.data import ENV_VAR, workload_path, workloads_dir
from tvcache_bench.workloads import airline


@pytest.fixture(scope="module")
def base() -> airline.Db:
    return airline.load_db()


@pytest.fixture(scope="module")
def pristine(base: airline.Db) -> bytes:
    """The initial database, pickled: a copy_db copy that no call changed pickles to the same bytes."""
    return pickle.dumps(base)


def rewritten(db: airline.Db, base: airline.Db) -> dict[tuple[str, str], str]:
    """The records of `db` that are not those of `base` (tools replace the records they change), as JSON
    text, which is sensitive to key order: a cheap way to compare two states derived from `base`."""
    return {
        (table, key): json.dumps(record)
        for table, rows in db.items()
        for key, record in rows.items()
        if base[table].get(key) is not record
    }


@pytest.fixture(scope="module")
def traces() -> list[airline.TraceRollout]:
    return airline.read_traces()


def call(tool: str, **args: Any) -> ToolCall:
    return ToolCall(tool, args)


# A reservation of the initial database, its user and one of the user's payment methods of each kind.
RESERVATION, USER = "JG7FMM", "omar_davis_3817"
CREDIT_CARD, GIFT_CARD = "credit_card_2929732", "gift_card_3481935"


def booking(**overrides: Any) -> ToolCall:
    """A booking that succeeds on the initial database: one economy seat on HAT136 + HAT039 (152 + 103)."""
    args: dict[str, Any] = {
        "user_id": USER,
        "origin": "JFK",
        "destination": "SEA",
        "flight_type": "one_way",
        "cabin": "economy",
        "flights": [
            {"flight_number": "HAT136", "date": "2024-05-20"},
            {"flight_number": "HAT039", "date": "2024-05-20"},
        ],
        "passengers": [{"first_name": "Omar", "last_name": "Davis", "dob": "1982-10-19"}],
        "payment_methods": [{"payment_id": CREDIT_CARD, "amount": 255}],
        "total_baggages": 0,
        "nonfree_baggages": 0,
        "insurance": "no",
    }
    args.update(overrides)
    return ToolCall("book_reservation", args)


# --- conformance with the recorded outputs -------------------------------------------------------------


def test_conformance_on_the_real_traces(base: airline.Db) -> None:
    before = pickle.dumps(base)
    report = airline.conformance(initial=base)
    print(report.summary())
    assert (report.rollouts, report.total) == (200, 1164)
    # Exact: every recorded output is its own call's (the trace file matches outputs to calls in order).
    assert report.exact == report.total, report.summary()
    assert not report.mismatches
    assert pickle.dumps(base) == before, "replaying must not touch the initial database"


def test_the_traces_use_exactly_the_fourteen_tools(traces: list[airline.TraceRollout]) -> None:
    used = {c.tool for t in traces for c in t.calls}
    assert used == set(airline.TOOLS)
    assert len(airline.TOOLS) == 14
    assert set(airline.TOOLS) == airline.READ_ONLY | airline.WRITES
    assert {
        "book_reservation",
        "cancel_reservation",
        "send_certificate",
        "update_reservation_baggages",
        "update_reservation_flights",
        "update_reservation_passengers",
    } == airline.WRITES
    assert airline.tool_annotations().read_only == airline.READ_ONLY


def write_traces(path: Path, rollouts: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    return path


def real_rows(n: int) -> list[dict[str, Any]]:
    lines = workload_path("traces", "tau-airline.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[:n]]


def test_a_planted_wrong_output_is_counted(tmp_path: Path, base: airline.Db) -> None:
    rows = real_rows(2)
    # Rollout 0's call 6 is `calculate 305 - 250` -> "55.0"; no earlier call shows its output.
    assert rows[0]["calls"][6]["output"] == "55.0"
    rows[0]["calls"][6]["output"] = "56.0"
    report = airline.conformance(write_traces(tmp_path / "t.jsonl", rows), initial=base)
    assert report.mismatches == {"calculate": 1}
    (example,) = report.examples["calculate"]
    assert (example.index, example.recorded, example.produced) == (6, "56.0", "55.0")

    rows = real_rows(1)
    rows[0]["calls"][3]["output"] = "256.0"
    report = airline.conformance(write_traces(tmp_path / "u.jsonl", rows), initial=base)
    assert report.mismatches == {"calculate": 1}


def test_every_call_is_checked_against_its_own_output(tmp_path: Path, base: airline.Db) -> None:
    row = real_rows(1)[0]
    # The same output at another call of the rollout excuses nothing: each call answers for its own.
    assert row["calls"][3]["output"] == "255.0"
    row["calls"][0]["output"] = "255.0"
    report = airline.conformance(write_traces(tmp_path / "a.jsonl", [row]), initial=base)
    assert report.mismatches == {"get_user_details": 1}
    assert report.exact == report.total - 1


def test_a_malformed_trace_line_names_its_line(tmp_path: Path) -> None:
    rows = real_rows(2)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n" + '{"task": "x", "calls": [{"tool": "think"}]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2:"):
        airline.read_traces(path)


# --- state ---------------------------------------------------------------------------------------------


READS = [
    call("get_user_details", user_id=USER),
    call("get_reservation_details", reservation_id=RESERVATION),
    call("list_all_airports"),
    call("search_direct_flight", origin="JFK", destination="SEA", date="2024-05-20"),
    call("search_onestop_flight", origin="JFK", destination="SEA", date="2024-05-20"),
    call("calculate", expression="(152 + 103) * 2"),
    call("think", thought="nothing to do"),
    call("transfer_to_human_agents", summary="help"),
]


def test_reads_leave_the_database_unchanged(base: airline.Db, pristine: bytes) -> None:
    assert {c.tool for c in READS} == airline.READ_ONLY
    db = airline.copy_db(base)
    for c in READS:
        output, changed = airline.execute(db, c)
        assert not changed and not output.startswith("Error"), (c, output)
    assert pickle.dumps(db) == pristine


WRITES = [
    booking(),
    call("cancel_reservation", reservation_id=RESERVATION),
    call("send_certificate", user_id=USER, amount=100),
    call("update_reservation_baggages", reservation_id=RESERVATION, total_baggages=3, nonfree_baggages=1,
         payment_id=CREDIT_CARD),
    call("update_reservation_flights", reservation_id=RESERVATION, cabin="economy", payment_id=CREDIT_CARD,
         flights=[{"flight_number": "HAT028", "date": "2024-05-21"},
                  {"flight_number": "HAT277", "date": "2024-05-21"}]),
    call("update_reservation_passengers", reservation_id=RESERVATION, passengers=[
        {"first_name": "Omar", "last_name": "Davis", "dob": "1982-10-19"},
        {"first_name": "Ivan", "last_name": "Smith", "dob": "1960-01-01"}]),
]  # fmt: skip


@pytest.mark.parametrize("write", WRITES, ids=lambda c: c.tool)
def test_a_write_changes_the_copy_and_nothing_else(base: airline.Db, pristine: bytes, write: ToolCall) -> None:
    db = airline.copy_db(base)
    output, changed = airline.execute(db, write)
    assert changed and not output.startswith("Error"), output
    assert pickle.dumps(db) != pristine
    assert pickle.dumps(base) == pristine, "a write on a copy must not reach the database it was copied from"


def test_writes_have_their_effect(base: airline.Db) -> None:
    db = airline.copy_db(base)
    paid = db["reservations"][RESERVATION]["payment_history"]
    cancelled = json.loads(airline.run(db, call("cancel_reservation", reservation_id=RESERVATION)))
    assert cancelled["status"] == "cancelled"
    assert cancelled["payment_history"][len(paid) :] == [
        {"payment_id": p["payment_id"], "amount": -p["amount"]} for p in paid
    ]
    assert json.loads(airline.run(db, call("get_reservation_details", reservation_id=RESERVATION))) == cancelled

    balance = db["users"][USER]["payment_methods"][GIFT_CARD]["amount"]
    booked = json.loads(
        airline.run(db, booking(payment_methods=[{"payment_id": GIFT_CARD, "amount": 22},
                                                 {"payment_id": CREDIT_CARD, "amount": 233}]))
    )  # fmt: skip
    assert booked["reservation_id"] == "HATHAT"
    assert [f["price"] for f in booked["flights"]] == [152, 103]
    user = json.loads(airline.run(db, call("get_user_details", user_id=USER)))
    assert user["payment_methods"][GIFT_CARD]["amount"] == balance - 22
    assert user["reservations"][-1] == "HATHAT"


def test_a_refused_write_changes_nothing(base: airline.Db, pristine: bytes) -> None:
    db = airline.copy_db(base)
    refused = [
        booking(payment_methods=[{"payment_id": CREDIT_CARD, "amount": 200}]),
        booking(flights=[{"flight_number": "HAT999", "date": "2024-05-20"}]),
        booking(cabin="first"),  # tau-bench's KeyError, shown as "Error: 'first'"
        call("update_reservation_flights", reservation_id=RESERVATION, cabin="economy", payment_id="certificate_1",
             flights=[{"flight_number": "HAT028", "date": "2024-05-21"}]),
        call("update_reservation_passengers", reservation_id=RESERVATION, passengers=[]),
        call("cancel_reservation", reservation_id="NOSUCH"),
    ]  # fmt: skip
    outputs = [airline.execute(db, c) for c in refused]
    assert outputs == [
        ("Error: payment amount does not add up, total price is 255, but paid 200", False),
        ("Error: flight HAT999 not found", False),
        ("Error: 'first'", False),
        ("Error: payment method not found", False),
        ("Error: number of passengers does not match", False),
        ("Error: reservation not found", False),
    ]
    assert pickle.dumps(db) == pristine


def test_ids_follow_tau_benchs_sequences(base: airline.Db) -> None:
    db = airline.copy_db(base)
    ids = [json.loads(airline.run(db, booking()))["reservation_id"] for _ in range(4)]
    # tau-bench stops at HATHAV (and would overwrite it); we go on.
    assert ids == ["HATHAT", "HATHAU", "HATHAV", "HATHAW"]
    sent = [airline.run(db, call("send_certificate", user_id=USER, amount=50)) for _ in range(4)]
    assert sent[0] == f"Certificate certificate_3221322 added to user {USER} with amount 50."
    assert [s.split()[1] for s in sent] == [f"certificate_{n}" for n in range(3221322, 3221326)]


def test_output_does_not_depend_on_the_key_order_of_arguments(base: airline.Db) -> None:
    shuffled = booking(
        passengers=[{"dob": "1982-10-19", "last_name": "Davis", "first_name": "Omar"}],
        payment_methods=[{"amount": 255, "payment_id": CREDIT_CARD}],
        flights=[{"date": "2024-05-20", "flight_number": "HAT136"}, {"date": "2024-05-20", "flight_number": "HAT039"}],
    )
    assert shuffled.digest == booking().digest  # the cache cannot tell these apart...
    assert airline.run(airline.copy_db(base), shuffled) == airline.run(airline.copy_db(base), booking())


def test_replaying_is_deterministic(base: airline.Db, traces: list[airline.TraceRollout]) -> None:
    writing = [t for t in traces if any(c.tool in airline.WRITES for c in t.calls)]
    assert len(writing) > 100
    for trace in writing:
        first, second = airline.copy_db(base), airline.copy_db(base)
        assert airline.replay(first, trace.calls) == airline.replay(second, trace.calls)
        assert rewritten(first, base) == rewritten(second, base)
    trace = writing[0]
    first, second = airline.final_state(trace.calls, base), airline.final_state(trace.calls, base)
    assert airline.state_digest(first) == airline.state_digest(second) != airline.state_digest(base)


def test_a_shared_copy_behaves_like_a_deep_copy(base: airline.Db, traces: list[airline.TraceRollout]) -> None:
    # copy_db shares records between copies; that is only sound if no tool changes a record in place.
    trace = max(traces, key=lambda t: sum(c.tool in airline.WRITES for c in t.calls))
    shallow, deep = airline.copy_db(base), copy.deepcopy(base)
    assert airline.replay(shallow, trace.calls) == airline.replay(deep, trace.calls)
    assert pickle.dumps(shallow) == pickle.dumps(deep)


def test_final_state_of_a_rollout(base: airline.Db, pristine: bytes, traces: list[airline.TraceRollout]) -> None:
    trace = next(t for t in traces if any(c.tool == "cancel_reservation" for c in t.calls))
    cancelled = next(c.args["reservation_id"] for c in trace.calls if c.tool == "cancel_reservation")
    state = airline.final_state(trace.calls, base)
    assert state["reservations"][cancelled]["status"] == "cancelled"
    assert "status" not in base["reservations"][cancelled]
    assert pickle.dumps(base) == pristine


# --- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (call("get_user_details"), "Error: get_user_details: missing argument 'user_id'"),
        (call("get_user_details", user_id=USER, verbose=True), "unexpected argument 'verbose'"),
        (call("get_user_details", user_id=7), "argument 'user_id' must be a string, got 7"),
        (call("list_all_airports", x=1), "list_all_airports: unexpected argument 'x' (it takes no arguments)"),
        (call("send_certificate", user_id=USER, amount="100"), "'amount' must be a number"),
        (call("send_certificate", user_id=USER, amount=True), "'amount' must be a number"),
        (booking(total_baggages=1.5), "'total_baggages' must be an integer"),
        (booking(flights=[{"flight_number": "HAT136"}]), "'flights' must be a list of objects with string"),
        (booking(passengers={"first_name": "A"}), "'passengers' must be a list of objects"),
        (booking(payment_methods=[{"payment_id": CREDIT_CARD}]), "'payment_methods' must be a list of objects"),
        (call("book_flight", user_id=USER), "Error: unknown tool 'book_flight'; the airline tools are"),
        (call("get_reservation_details", reservation_id="NOSUCH"), "Error: user not found"),  # sic, tau-bench
        (call("get_user_details", user_id="nobody_1"), "Error: user not found"),
        (call("calculate", expression="import os"), "Error: invalid characters in expression"),
        (call("calculate", expression="1 +"), "Error: invalid syntax (<string>, line 1)"),
        (call("calculate", expression="1 / 0"), "Error: division by zero"),
        (call("search_onestop_flight", origin="LGA", destination="SFO", date="may 3rd"), "Error: invalid literal"),
    ],
    ids=lambda v: v.tool if isinstance(v, ToolCall) else "",
)
def test_bad_arguments_get_a_clear_error(base: airline.Db, bad: ToolCall, message: str) -> None:
    db = airline.copy_db(base)
    output, changed = airline.execute(db, bad)
    assert output.startswith("Error: ") and message in output, output
    assert not changed and not rewritten(db, base)


@pytest.mark.parametrize(
    "expression", ["152 + 103", "(122 + 127) * 2", "1023 - 62 - 500", "7 / 3", "2 ** -1", "-(-3) ** 2", "5 // 2.0",
                   "  4 * 4", "1+" * 1500 + "1"],
)  # fmt: skip
def test_calculate_agrees_with_python(base: airline.Db, expression: str) -> None:
    expected = str(round(float(eval(expression, {"__builtins__": None}, {})), 2))
    assert airline.run(base, call("calculate", expression=expression)) == expected


def test_calculate_refuses_a_runaway_power(base: airline.Db) -> None:
    start = time.perf_counter()
    assert airline.run(base, call("calculate", expression="9 ** 9 ** 9 ** 9")) == "Error: exponent too large"
    assert time.perf_counter() - start < 5  # a guard against hanging, not a speed measurement


# --- data ----------------------------------------------------------------------------------------------


def test_the_recorded_variant_of_the_data(base: airline.Db) -> None:
    plain = airline.load_db(as_recorded=False)
    address = base["users"][USER]["address"]
    assert list(address) == ["address1", "address2", "city", "country", "province", "zip"]
    assert list(plain["users"][USER]["address"])[4] == "state"
    assert address["province"] == plain["users"][USER]["address"]["state"]
    assert plain["reservations"] == base["reservations"] and plain["flights"] == base["flights"]


def test_fingerprint_follows_the_content(tmp_path: Path) -> None:
    source = airline.default_dir()
    assert airline.fingerprint() == airline.fingerprint(source)
    assert airline.fingerprint() != airline.fingerprint(as_recorded=False)
    for name in ("flights.json", "reservations.json", "users.json"):
        shutil.copy(source / name, tmp_path / name)
    assert airline.fingerprint(tmp_path) == airline.fingerprint()
    users = tmp_path / "users.json"
    users.write_bytes(users.read_bytes().replace(b'"gold"', b'"silver"', 1))
    assert airline.fingerprint(tmp_path) != airline.fingerprint()


def test_workloads_dir_can_be_moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = workloads_dir()
    assert (real / "tau-airline" / "flights.json").is_file()
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    assert workloads_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="tau-airline"):
        workload_path("tau-airline")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=ENV_VAR):
        workloads_dir()
