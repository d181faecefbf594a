"""Tool-call parsers per template family on recorded-style outputs: whole, split into
chunks of every size, several calls, and malformed calls (returned as text)."""

from __future__ import annotations

import json

import llguidance
import pytest

from tqserve.api.toolcalls import FAMILIES, ToolCall, family_of
from tqserve.api.toolcalls.stream import ToolCallStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}},
           "required": ["city"]}
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}}}
# family -> (an output as such models write it, the calls in it, the text around them)
RECORDED = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "now", '
               '"arguments": {}}\n</tool_call>',
               [("get_weather", {"city": "Paris", "days": 2}), ("now", {})],
               "Let me check.\n\n"),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
                    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                    "</tool_call>", [("get_weather", {"city": "New York", "days": 3})], ""),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
               '{"name": "now", "parameters": {}}',
               [("get_weather", {"city": "Paris"}), ("now", {})], ""),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "now", "arguments": {}}]',
                [("get_weather", {"city": "Oslo"}), ("now", {})], ""),
    "gemma": ("Checking. <start_function_call>call:get_weather{city:<escape>Rome, IT"
              "<escape>,days:4}<end_function_call>",
              [("get_weather", {"city": "Rome, IT", "days": 4})], "Checking. "),
}


def run(family: str, text: str, size: int) -> tuple[str, list[ToolCall]]:
    stream = ToolCallStream(FAMILIES[family], SCHEMAS)
    pieces = []
    for i in range(0, len(text), size):
        pieces += stream.feed(text[i:i + size])
    pieces += stream.finish()
    assert stream.calls == [p for p in pieces if isinstance(p, ToolCall)]
    return "".join(p for p in pieces if isinstance(p, str)), stream.calls


@pytest.mark.parametrize("family", sorted(RECORDED))
def test_recorded_outputs_in_chunks_of_every_size(family):
    text, calls, around = RECORDED[family]
    for size in (1, 2, 3, 5, 7, 64, len(text)):
        got_text, got = run(family, text, size)
        assert got_text == around, (size, got_text)
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls, size
        assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_")
                                                            for c in got)


def test_mistral_v11_and_llama_python_tag():
    _, calls = run("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
                              '[TOOL_CALLS]now[ARGS]{}', 4)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}'),
                                                      ("now", "{}")]
    text, calls = run("llama3", 'Calling.<|python_tag|>{"name": "now", "parameters": {}}', 3)
    assert text == "Calling." and [c.name for c in calls] == ["now"]
    text, calls = run("llama3", "Paris is the capital of France.", 2)  # plain text
    assert text == "Paris is the capital of France." and calls == []


MALFORMED = {  # family -> outputs whose calls do not parse: the same text comes back
    "hermes": ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n"
               "</tool_call> after", "<tool_call>[1, 2]</tool_call>",
               "cut <tool_call>{\"name\": \"now\"", "a < b and <tool but no call"],
    "qwen3_coder": ["<tool_call>\nnot xml\n</tool_call>"],
    "llama3": ['{"name": "now", "parameters": {}} trailing words', "{not json"],
    "mistral": ["[TOOL_CALLS] nothing like a call", "[TOOL_CALLS][{\"name\": 3}]"],
    "gemma": ["<start_function_call>call:now{x:<escape>open}<end_function_call>",
              "<start_function_call>nonsense<end_function_call>"],
}


@pytest.mark.parametrize("family", sorted(MALFORMED))
def test_malformed_calls_come_back_as_text(family):
    for text in MALFORMED[family]:
        for size in (1, 4, len(text)):
            assert run(family, text, size) == (text, []), (text, size)


def test_family_of_templates():
    assert family_of(None).NAME == "hermes"
    assert family_of("{{ '<tool_call>\\n' + tool_call.name }}").NAME == "hermes"
    assert family_of("<tool_call>\n<function={{ name }}>").NAME == "qwen3_coder"
    assert family_of("<|start_header_id|>ipython<|end_header_id|>").NAME == "llama3"
    assert family_of("{{ '[TOOL_CALLS]' }}").NAME == "mistral"
    assert family_of("<start_function_call>call:").NAME == "gemma"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grammars_compile_and_accept_the_recorded_call(family):
    """Each family's forcing grammar compiles in llguidance and its language holds the
    family's own format (checked by parsing what a matching output looks like)."""
    lark = FAMILIES[family].grammar(SCHEMAS)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(lark))
    assert not is_error, messages
