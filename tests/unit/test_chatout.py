"""api.chatout: <think> spans and tool calls split out of text fed in chunks; the
Anthropic block events and the Responses items built from its deltas."""

from __future__ import annotations

import json

from tqserve.api.anthropic_stream import BlockStream, content_blocks
from tqserve.api.chatout import ChatOutput
from tqserve.api.responses_output import OutputItems
from tqserve.api.toolcalls import FAMILIES

TEXT = ('<think>The user wants the weather.\nCall it.</think>Checking.<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def feed(out: ChatOutput, text: str, size: int) -> list:
    deltas = []
    for i in range(0, len(text), size):
        deltas += out.feed(text[i:i + size])
    return deltas + out.finish()


def test_reasoning_content_and_calls_in_any_chunks():
    for size in (1, 2, 3, 8, len(TEXT)):
        out = ChatOutput(think=True, family=FAMILIES["hermes"], schemas={})
        deltas = feed(out, TEXT, size)
        assert out.reasoning == "The user wants the weather.\nCall it."
        assert out.content == "Checking."
        assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
            ("get_weather", {"city": "Paris"})]
        kinds = [d.kind for d in deltas]
        assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
        assert kinds[-1] == "call"
    plain = ChatOutput(think=False)  # no <think> in the template: text stays text
    feed(plain, "<think>x</think>y", 3)
    assert plain.content == "<think>x</think>y" and plain.reasoning == ""
    open_end = ChatOutput(think=True)  # cut inside a span: what came is reasoning
    feed(open_end, "<think>still thinking", 4)
    assert open_end.reasoning == "still thinking" and open_end.content == ""


def sse_events(chunks: list[bytes]) -> list[dict]:
    return [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks]


def test_anthropic_blocks_and_responses_items():
    out = ChatOutput(think=True, family=FAMILIES["hermes"], schemas={})
    blocks = BlockStream()
    events = sse_events(blocks.deltas(out.feed(TEXT[:30])) + blocks.deltas(out.feed(TEXT[30:]))
                        + blocks.close(out.finish()))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert events[1] == {"type": "ping"}
    (args,) = [e["delta"]["partial_json"] for e in events
               if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert json.loads(args) == {"city": "Paris"}
    assert [b["type"] for b in content_blocks(out)] == ["thinking", "text", "tool_use"]
    out = ChatOutput(think=True, family=FAMILIES["hermes"], schemas={})
    items = OutputItems()
    events = items.deltas(out.feed(TEXT)) + items.close(out.finish())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [i["type"] for i in items.items] == ["reasoning", "message", "function_call"]
    assert items.items[1]["content"][0]["text"] == "Checking."
    assert items.items[2]["name"] == "get_weather" and items.items[2]["status"] == "completed"
    assert [e["type"] for e in events if e["type"].endswith(".done")] == [
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done"]
