"""Tool calls on the wire (engine/server/tools.py): request parsing, each family's format, and reading calls
back out of a model's text, whole or as it streams."""

from __future__ import annotations

import json

import llguidance
import pytest

from kvgate.engine.server.tools import (ToolCallParser, ToolChoice, ToolFormat, ToolSpec, call_constraint,
                                        detect_tool_format, parse_tools)
from kvgate.engine.structured import _grammar_text
from kvgate.openai_wire import ApiError

HERMES = ToolFormat("hermes", "arguments")
LLAMA3 = ToolFormat("llama3_json", "parameters")
MISTRAL = ToolFormat("mistral", "arguments")


def streamed(fmt: ToolFormat, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    """(content sent while streaming, content at the end, calls) for text arriving in `pieces`."""
    parser = ToolCallParser(fmt)
    sent = "".join(parser.feed(p) for p in pieces)
    rest, calls = parser.finish()
    return sent, rest, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("pieces", [
    ['Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'],
    ["Let me check.\n<to", "ol_", "call>\n{\"name\": \"f\", ", "\"arguments\": {\"x\": 1}}\n</tool_call>"],
])
def test_hermes_calls_are_held_back_while_streaming_and_parsed_at_the_end(pieces: list[str]) -> None:
    sent, rest, calls = streamed(HERMES, pieces)
    assert (sent, rest) == ("Let me check.\n", "")
    assert calls == [("f", {"x": 1})]


def test_hermes_several_calls_and_text_that_only_looks_like_a_tag() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"k": "v"}}</tool_call>')
    assert streamed(HERMES, [text])[2] == [("a", {}), ("b", {"k": "v"})]
    assert streamed(HERMES, ["a < b and <tool", " is not a tag"]) == ("a < b and <tool is not a tag", "", [])


def test_a_call_that_does_not_parse_stays_content() -> None:
    sent, rest, calls = streamed(HERMES, ["ok <tool_call>{\"name\": oops</tool_call>"])
    assert (sent, rest, calls) == ("ok ", "<tool_call>{\"name\": oops</tool_call>", [])


def test_llama3_and_mistral_json_calls() -> None:
    assert streamed(LLAMA3, ['{"name": "f", ', '"parameters": {"a": [1, 2]}}'])[2] == [("f", {"a": [1, 2]})]
    assert streamed(LLAMA3, ['{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'])[2] == [
        ("f", {}), ("g", {})]
    assert streamed(MISTRAL, ['[{"name": "f", "arguments": {"q": "x"}}]'])[2] == [("f", {"q": "x"})]
    assert streamed(LLAMA3, ["  Hello", " there"]) == ("  Hello there", "", [])  # plain text streams on


def test_formats_are_read_from_the_chat_template() -> None:
    ids = {"<tool_call>": 7, "</tool_call>": 8, "[TOOL_CALLS]": 5}.get
    assert detect_tool_format("{% for t in tools %}{{ t }}{% endfor %}<tool_call>", ids) == ToolFormat(
        "hermes", "arguments", 7, 8)
    assert detect_tool_format("{% if tools %}[TOOL_CALLS]{% endif %}", ids).opener_token == 5
    assert detect_tool_format("{% if tools %}<|python_tag|>{% endif %}", ids).name == "llama3_json"
    assert detect_tool_format("{{ messages }}", ids) is None  # the template never renders tools
    assert detect_tool_format("{% if tools %}CALL:{% endif %}", ids) is None  # a format kvgate cannot parse


def test_tool_choice_parsing() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert parse_tools(tools, None)[1] == ToolChoice("auto")
    assert parse_tools(None, None) == ((), ToolChoice("none"))
    assert parse_tools(tools, {"type": "function", "function": {"name": "f"}})[1] == ToolChoice("function", "f")
    with pytest.raises(ApiError, match="distinct"):
        parse_tools(tools * 2, None)


@pytest.mark.parametrize("fmt,text", [
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"n": 3}}\n</tool_call>'),
    (LLAMA3, '{"name": "f", "parameters": {"n": 3}}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"n": 3}}]'),
])
def test_the_call_grammar_accepts_a_valid_call_and_nothing_else(fmt: ToolFormat, text: str) -> None:
    tool = ToolSpec("f", None, json.dumps({"type": "object", "required": ["n"], "additionalProperties": False,
                                           "properties": {"n": {"type": "integer", "maximum": 5}}}))
    grammar = _grammar_text(call_constraint(fmt, (tool,), ToolChoice("required")))
    tokenizer = llguidance.LLTokenizer(json.dumps(_BYTE_TOKENIZER))
    for candidate, valid in ((text, True), (text.replace("3", "9"), False), (text.replace('"f"', '"g"'), False)):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        accepted = matcher.consume_tokens(tokenizer.tokenize_str(candidate)) and matcher.is_accepting()
        assert accepted == valid, candidate


# A byte-level BPE with no merges: any text tokenizes, one token per byte.
_BYTE_TOKENIZER = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [
        {"id": 256, "content": "</s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}],
    "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                          "use_regex": False},
    "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                        "use_regex": False},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
              "vocab": None, "merges": []},
}


def _byte_vocab() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + extra)] = byte
            extra += 1
    return mapping


_BYTE_TOKENIZER["model"]["vocab"] = _byte_vocab()
