"""Every answer of a workspace sandbox's tools stays within `max_output` bytes (of UTF-8, as the cache stores it),
plus the marker line that says what was cut: bash's output, read_file, list_dir and write_file, whatever the bytes.

Bytes that are not UTF-8 become U+FFFD, three bytes of UTF-8 each: 4 KiB of such bytes made 12 KiB of answer
before the text was cut to fit.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from shell_oracle import run
from test_workspace import MODES, factory_for, small_base, usable
from tvcache import ToolCall
from tvcache.sandboxes._shell import BoundedOutput, bounded_text

LIMIT = 4096
#: The marker line's bytes (its numbers included), beyond the limit.
MARKER = 200


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return usable(str(request.param))


def size(answer: Any) -> int:
    return len(json.dumps(answer, ensure_ascii=False).encode())


def test_every_tool_answers_within_max_output(mode: str) -> None:
    make = (
        "head -c 100000 /dev/zero | tr '\\0' '\\377' > bin; head -c 4096 /dev/zero | tr '\\0' '\\377' > bin4k; "
        'python3 -c \'print("\\u00e9" * 50000, end="")\' > accents; mkdir names && cd names && '
        "for i in $(seq 300); do touch \"$(printf '\\u00e9%.0s' $(seq 40))-$i\"; done; cd /testbed"
    )

    async def main() -> None:
        with small_base() as base:
            async with factory_for(base, mode, max_output=LIMIT) as boxes:
                box = await boxes.create()
                assert (await box.execute(ToolCall("bash", {"command": make}))).output["exit_code"] == 0
                calls = [
                    ToolCall("bash", {"command": "cat bin"}),
                    ToolCall("bash", {"command": "cat bin4k"}),
                    ToolCall("bash", {"command": "cat accents"}),
                    ToolCall("read_file", {"path": "bin"}),
                    ToolCall("read_file", {"path": "bin4k"}),
                    ToolCall("read_file", {"path": "accents"}),
                    ToolCall("list_dir", {"path": "names"}),
                    ToolCall("write_file", {"path": "w", "content": "\ufffd" * 10_000}),
                ]
                for call in calls:
                    outcome = await box.execute(call)
                    assert not outcome.error and "error" not in outcome.output, outcome
                    assert size(outcome.output) <= LIMIT + MARKER, (call, size(outcome.output))
                # A path of a megabyte, which the error naming it echoed whole.
                huge = "a/" * 500_000
                for tool, args in (("read_file", {}), ("list_dir", {}), ("write_file", {"content": "x"})):
                    outcome = await box.execute(ToolCall(tool, {"path": huge, **args}))
                    assert "error" in outcome.output and size(outcome.output) <= LIMIT + MARKER, (tool, outcome)
                cut = (await box.execute(ToolCall("read_file", {"path": "accents"}))).output["content"]
                assert cut.startswith("\u00e9" * 1000) and cut.endswith("\u00e9" * 1000) and "omitted" in cut

    run(main())


def test_text_is_cut_to_fit_and_says_so() -> None:
    assert bounded_text(b"abc", b"", 3, 64) == "abc"  # what fits is left alone
    out = BoundedOutput(64)
    out.feed(b"\xff" * 64)  # 64 bytes kept, but 192 bytes of text
    text = out.text()
    assert len(text.encode()) <= 64 + MARKER and "bytes of output omitted: 64 bytes in all" in text
    assert text.startswith("\ufffd" * 10) and text.endswith("\ufffd" * 10)
    accents = "\u00e9".encode() * 100
    cut = bounded_text(accents[:32], accents[-32:], 200, 32)
    assert cut.startswith("\u00e9" * 7) and cut.endswith("\u00e9" * 7)  # whole characters, never a cut one
    assert len(cut.encode()) <= 32 + MARKER
