"""Call keys: canonical, so equal calls hash equal everywhere; strict, so nothing ambiguous gets a key."""

from __future__ import annotations

import math

import pytest

from tvcache import ToolCall, Tools


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


def test_args_must_be_a_mapping() -> None:
    with pytest.raises(TypeError, match="mapping"):
        ToolCall("t", ["x"])  # type: ignore[arg-type]


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
