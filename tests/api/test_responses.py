"""The Responses API with the official client: text and function calls, streamed and
not, previous_response_id, store: false, instructions, input items."""

from __future__ import annotations

import json

import openai
import pytest

from tests.api.chatkit import TEMPLATE, TOOLS
from tests.conftest import start_server

FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta"]


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                              timeout=600)  # a hang guard (the instruct model, a busy CPU)


async def test_text_streamed_and_not(nursery, chat_model):
    loaded, config = chat_model
    server = await start_server(nursery, loaded, **config)
    api = client(server)
    got = await api.responses.create(model="m", input="Say hello.", instructions="Be brief.",
                                     max_output_tokens=10, temperature=0)
    assert got.object == "response" and got.id.startswith("resp_")
    assert got.status in ("completed", "incomplete") and got.output[0].type == "message"
    assert got.output_text and got.usage.output_tokens <= 10
    if got.status == "incomplete":
        assert got.incomplete_details.reason == "max_output_tokens"
    chat = await api.chat.completions.create(model="m", max_tokens=10, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}])
    assert got.output_text == chat.choices[0].message.content  # the same prompt and tokens
    stream = await api.responses.create(model="m", input="Say hello.", instructions="Be brief.",
                                        max_output_tokens=10, temperature=0, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:5] == STREAM_ORDER and kinds[-1] == f"response.{got.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == got.output_text == events[-1].response.output_text
    assert {"response.output_text.done", "response.content_part.done",
            "response.output_item.done"} <= set(kinds)


async def test_function_call_loop_with_previous_response(nursery, chat_model):
    loaded, config = chat_model
    server = await start_server(nursery, loaded, **config)
    api = client(server)
    common = dict(model="m", tools=FUNCTIONS, max_output_tokens=120, temperature=0)
    first = await api.responses.create(input="Weather in Paris?", tool_choice="required",
                                       **common)
    (call,) = [o for o in first.output if o.type == "function_call"]
    args = json.loads(call.arguments)
    assert call.name in ("get_weather", "get_time") and call.call_id.startswith("call_")
    assert set(args) == ({"city", "unit"} if call.name == "get_weather" else {"zone"})
    stream = await api.responses.create(input="Weather in Paris?", tool_choice="required",
                                        stream=True, **common)
    events = [e async for e in stream]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads("".join(deltas)) == args
    (streamed,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert streamed.name == call.name and events[-1].type == "response.completed"
    named = await api.responses.create(input="Time in Oslo?", **common,
                                       tool_choice={"type": "function", "name": "get_time"})
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_time"]
    # the result, continuing the stored conversation
    answer = await api.responses.create(
        model="m", previous_response_id=first.id, max_output_tokens=8, temperature=0,
        tools=FUNCTIONS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert answer.previous_response_id == first.id and answer.output[0].type == "message"
    assert answer.usage.input_tokens > first.usage.input_tokens
    # the stored conversation's prefix came from the prefix cache
    assert answer.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2
    # the same conversation sent whole, as items: the same prompt
    whole = await api.responses.create(model="m", max_output_tokens=8, temperature=0,
                                       tools=FUNCTIONS, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        store=False)
    assert whole.usage.input_tokens == answer.usage.input_tokens
    assert whole.output_text == answer.output_text
    fetched = await api.responses.retrieve(answer.id)
    assert fetched.output_text == answer.output_text
    with pytest.raises(openai.BadRequestError, match="not found"):
        await api.responses.create(model="m", input="x", previous_response_id=whole.id)


async def test_responses_bad_input(nursery, draft_model):
    server = await start_server(nursery, draft_model, chat_template=str(TEMPLATE))
    api = client(server)
    for kwargs, field in ((dict(input=[{"type": "nonsense"}]), "input"),
                          (dict(input=[{"role": "user", "content": [
                              {"type": "input_image", "image_url": "data:,"}]}]), "input"),
                          (dict(input="x", tools=[{"type": "function"}]), "tools"),
                          (dict(input="x", previous_response_id="resp_nope"),
                           "previous_response_id"),
                          (dict(input="x", tools=FUNCTIONS, tool_choice="required",
                                text={"format": {"type": "json_object"}}), "text")):
        with pytest.raises(openai.BadRequestError) as info:
            await api.responses.create(model="m", max_output_tokens=4, **kwargs)
        assert info.value.body["param"] == field, info.value.message
    # what Codex sends: developer messages, namespaced functions, a web_search tool (skipped)
    got = await api.responses.create(model="m", max_output_tokens=120, input=[
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        tools=[{"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": FUNCTIONS}],
        tool_choice={"type": "function", "name": "get_time"}, store=False,
        extra_body={"client_metadata": {"turn_id": "t"}})
    assert [o.name for o in got.output if o.type == "function_call"] == ["get_time"]
    strict = await start_server(nursery, draft_model, chat_template=str(TEMPLATE),
                                strict_fields=True)
    with pytest.raises(openai.BadRequestError, match="web_search"):
        await client(strict).responses.create(model="m", input="x", max_output_tokens=2,
                                              tools=[{"type": "web_search"}])
