"""Call keys: canonical, so equal calls hash equal everywhere; strict, so nothing ambiguous gets a key."""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path

import pytest

from tvcache import ToolCall, Tools
from tvcache.calls import parse_tool_call


def test_keys_are_canonical_json() -> None:
    a = ToolCall("sql", {"query": "SELECT 1", "db": {"b": 1, "a": [1, 2.5, None, True]}})
    b = ToolCall("sql", {"db": {"a": [1, 2.5, None, True], "b": 1}, "query": "SELECT 1"})
    assert a.key == b.key == 'sql {"db":{"a":[1,2.5,null,true],"b":1},"query":"SELECT 1"}'
    assert a.digest == b.digest and len(a.digest) == 16
    assert ToolCall("sql", {"query": "é"}).key == 'sql {"query":"é"}'  # UTF-8, not \\u escapes


def test_different_calls_get_different_digests() -> None:
    calls = [ToolCall("a", {"x": 1}), ToolCall("a", {"x": "1"}), ToolCall("b", {"x": 1}), ToolCall("a", {"x": 1.5})]
    assert len({c.digest for c in calls}) == len(calls)
    assert ToolCall("a", None).key == ToolCall("a", {}).key == "a {}"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, [1, math.nan]])
def test_nan_and_infinity_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="NaN or infinity"):
        ToolCall("t", {"x": bad})


@pytest.mark.parametrize("bad", [object(), b"bytes", {1, 2}, 1j])
def test_non_json_values_are_a_clear_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match=f"JSON values.*{type(bad).__name__}"):
        ToolCall("t", {"x": bad})


@pytest.mark.parametrize("name", ["", "two words", "tab\there", 3])
def test_tool_names_must_be_plain(name: object) -> None:
    with pytest.raises(ValueError, match="tool name"):
        ToolCall(name, {})  # type: ignore[arg-type]


def test_args_must_be_a_mapping_or_a_json_string() -> None:
    with pytest.raises(TypeError, match="mapping or a JSON string"):
        ToolCall("t", ["x"])  # type: ignore[arg-type]


# --- arguments as chat models emit them: a JSON string ------------------------------------------------------


def test_a_json_string_is_the_object_it_encodes_in_any_key_order() -> None:
    given = ToolCall("sql", {"query": "SELECT 1", "limit": 5})
    for text in (
        '{"query": "SELECT 1", "limit": 5}',
        '{"limit":5,"query":"SELECT 1"}',
        ' {\n "limit": 5, "query": "SELECT 1"}',
    ):
        call = ToolCall("sql", text)
        assert call.args == {"query": "SELECT 1", "limit": 5}
        assert (call.key, call.digest) == (given.key, given.digest)


@pytest.mark.parametrize("text", ['{"query": "SELECT 1"', "SELECT 1", "", "null", "[1, 2]", "5", '"x"', '{"x": NaN}'])
def test_text_that_is_not_a_json_object_is_keyed_raw_and_passed_unchanged(text: str) -> None:
    call = ToolCall("sql", text)
    assert call.args == text  # the tool sees exactly what the model wrote, and answers with its own error
    assert call.key == "sql " + json.dumps(text, ensure_ascii=False, separators=(",", ":"))
    assert call.digest == ToolCall("sql", text).digest
    assert call.digest != ToolCall("sql", text + " ").digest
    assert call.digest != ToolCall("sql", {}).digest


def test_a_huge_json_string_parses_and_keys_like_the_object() -> None:
    rows = [{"id": i, "name": "x" * 50} for i in range(20_000)]
    text = json.dumps({"rows": rows})
    assert len(text) > 1_000_000
    assert ToolCall("insert", text).digest == ToolCall("insert", {"rows": rows}).digest
    assert ToolCall("insert", text[:-1]).args == text[:-1]  # cut short: raw text, not a crash


def test_a_key_function_applies_to_objects_only() -> None:
    tools = Tools(key={"t": lambda a: {k: v for k, v in a.items() if k != "rid"}})
    assert tools.call("t", '{"x": 1, "rid": 7}').digest == tools.call("t", {"x": 1, "rid": 8}).digest
    assert tools.call("t", "not json").args == "not json"


def test_integers_past_64_bits_have_a_canonical_key() -> None:
    big = 2**64 + 1
    a = ToolCall("t", {"n": big, "s": "é"})
    assert a.key == 't {"n":18446744073709551617,"s":"é"}'
    assert a.digest == ToolCall("t", '{"s": "é", "n": 18446744073709551617}').digest
    assert a.digest != ToolCall("t", {"n": big + 1, "s": "é"}).digest


def test_parse_tool_call_reads_openai_and_anthropic_objects() -> None:
    openai = {"id": "call_1", "type": "function", "function": {"name": "sql", "arguments": '{"query": "SELECT 1"}'}}
    other_id = {**openai, "id": "call_2"}
    responses = {"type": "function_call", "call_id": "c", "name": "sql", "arguments": '{"query":"SELECT 1"}'}
    anthropic = {"type": "tool_use", "id": "toolu_1", "name": "sql", "input": {"query": "SELECT 1"}}

    class Function:  # the attribute form of the OpenAI SDK's objects
        name, arguments = "sql", '{"query": "SELECT 1"}'

    class SdkCall:
        id, type, function = "call_3", "function", Function()

    for obj in (openai, other_id, responses, anthropic, SdkCall()):
        assert parse_tool_call(obj) == ("sql", {"query": "SELECT 1"})
    assert parse_tool_call({"function": {"name": "sql", "arguments": "SELECT 1"}}) == ("sql", "SELECT 1")
    assert parse_tool_call({"name": "ls"}) == ("ls", {})
    with pytest.raises(TypeError, match="no tool name"):
        parse_tool_call({"arguments": "{}"})


def test_key_functions_drop_noise_but_keep_the_args() -> None:
    tools = Tools(key={"tmux": lambda a: {k: v for k, v in a.items() if k != "socket"}})
    a = tools.call("tmux", {"keys": "ls", "socket": "/tmp/s1"})
    b = tools.call("tmux", {"keys": "ls", "socket": "/tmp/s2"})
    assert a.digest == b.digest
    assert a.args == {"keys": "ls", "socket": "/tmp/s1"}
    assert tools.call("other", {"socket": 1}).digest != tools.call("other", {"socket": 2}).digest


def test_tools_reject_a_bare_string() -> None:
    with pytest.raises(TypeError, match="collection of tool names"):
        Tools(read_only="read_file")
    assert Tools(read_only=["a"], uncacheable={"b"}).read_only == frozenset({"a"})


def test_labels_shorten_each_long_value_so_every_argument_shows() -> None:
    call = ToolCall("write_file", {"content": "x" * 5000, "path": "/testbed/a.py"})
    label = call.label()
    assert len(label) <= 200 and "/testbed/a.py" in label and "…" in label
    short = ToolCall("sql", {"query": "SELECT 1"})
    assert short.label() == short.key
    assert len(ToolCall("t", "y" * 1000).label()) <= 210


def test_a_lone_surrogate_is_keyed_and_never_shares_a_key_with_its_escaped_text() -> None:
    # A model's JSON may escape half a surrogate pair ("\ud800"); json.loads gives a str with no UTF-8 form.
    lone = ToolCall("bash", '{"command": "echo \\ud800"}')
    assert lone.args == {"command": "echo \ud800"}
    literal = ToolCall("bash", {"command": "echo \\ud800"})  # a backslash and "ud800"
    assert lone.digest != literal.digest
    assert json.loads(lone.key.split(" ", 1)[1]) == lone.args
    assert lone.label() == lone.key


def test_outputs_with_lone_surrogates_round_trip() -> None:
    from tvcache.graph import decode_output, encode_output

    name = os.fsdecode(b"caf\xe9")  # a Latin-1 file name, as os.listdir returns it on a UTF-8 system
    for output in (name, [name, b"\xff", 1], {name: {"k": name}, "plain": "é"}, {"plain": "ok"}):
        assert decode_output(encode_output(output)) == output


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_a_tool_answering_a_non_utf8_file_name_is_cached_and_answered_the_same(store: str, tmp_path: Path) -> None:
    from tvcache import ToolCache
    from tvcache.sandboxes.python import PythonSandboxes
    from tvcache.stores.sqlite import SQLiteStore

    names = [os.fsdecode(b"caf\xe9.txt"), "plain.txt"]

    def run(state: list[str], call: ToolCall) -> object:
        if call.tool == "touch":
            assert isinstance(call.args, dict)
            state.append(call.args["name"])
            return "ok"
        return sorted(state)

    async def main() -> list[list[object]]:
        seen = []
        kept = SQLiteStore(tmp_path / "c.db") if store == "sqlite" else None
        async with ToolCache(store=kept) as cache:
            boxes = PythonSandboxes(lambda: list(names), run, "names-v1")
            for _ in range(2):
                async with cache.rollout("t", boxes) as r:
                    answers = [(await r.call("ls")).output, (await r.call("touch", {"name": names[0] + "2"})).output]
                    answers.append((await r.call("ls")).output)
                    seen.append(answers)
            assert cache.stats()["hits"] == 3
        return seen

    first, second = asyncio.run(main())
    assert first == second == [sorted(names), "ok", sorted([*names, names[0] + "2"])]
