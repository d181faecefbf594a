"""OpenAI tool calling with the official client: auto, none, required and a named
function, streamed and not, and a tool loop (call -> result -> answer)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.api.chatkit import TOOLS
from tests.conftest import start_server

ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris?"}]


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                              timeout=600)  # a hang guard (the instruct model, a busy CPU)


def check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
    else:
        assert call.function.name == "get_time" and isinstance(args["zone"], str)
    assert name is None or call.function.name == name
    return args


async def streamed(api, **kwargs):
    """The streamed answer assembled: content, tool calls by index, finish_reason."""
    content, calls, finish = "", {}, None
    async for chunk in await api.chat.completions.create(stream=True, **kwargs):
        (choice,) = chunk.choices
        delta = choice.delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


async def test_required_and_named_calls_match_the_schema(nursery, chat_model):
    loaded, config = chat_model
    server = await start_server(nursery, loaded, **config)
    api = client(server)
    common = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0)
    for choice, name in (("required", None),
                         ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
                         ({"type": "function", "function": {"name": "get_weather"}},
                          "get_weather")):
        got = await api.chat.completions.create(tool_choice=choice, **common)
        (c,) = got.choices
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        args = check_call(call, name)
        content, calls, finish = await streamed(api, tool_choice=choice, **common)
        assert finish == "tool_calls" and content == ""
        assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [
            (call.function.name, args)]  # greedy: the same call streamed and not
        assert calls[0]["id"].startswith("call_")
    # a sampled call still matches the schema (the grammar, not luck)
    for seed in range(3):
        got = await api.chat.completions.create(tool_choice="required", seed=seed,
                                                **{**common, "temperature": 1.0})
        check_call(got.choices[0].message.tool_calls[0])


async def test_auto_and_none(nursery, chat_model):
    loaded, config = chat_model
    server = await start_server(nursery, loaded, **config)
    api = client(server)
    common = dict(model="m", messages=ASK, max_tokens=12, temperature=0)
    plain = await api.chat.completions.create(**common)
    none = await api.chat.completions.create(tools=TOOLS, tool_choice="none", **common)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
    auto = await api.chat.completions.create(tools=TOOLS, **common)  # auto: the default
    (c,) = auto.choices
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools were rendered
    content, calls, finish = await streamed(api, tools=TOOLS, tool_choice="auto", **common)
    if c.message.tool_calls:  # a model that called: streamed the same
        assert c.finish_reason == "tool_calls"
        assert [x["name"] for x in calls] == [t.function.name for t in c.message.tool_calls]
    else:
        assert c.finish_reason in ("stop", "length") and calls == []
        assert content == c.message.content and finish == c.finish_reason


async def test_three_turn_tool_loop(nursery, chat_model):
    loaded, config = chat_model
    server = await start_server(nursery, loaded, **config)
    api = client(server)
    first = await api.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                              tool_choice="required", max_tokens=120,
                                              temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].message.content is None
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    answer = await api.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                               max_tokens=12, temperature=0)
    (c,) = answer.choices
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 5  # call + result
    history += [c.message.model_dump(exclude_none=True),
                {"role": "user", "content": "And in Rome?"}]
    again = await api.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                              tool_choice="required", max_tokens=120,
                                              temperature=0)
    check_call(again.choices[0].message.tool_calls[0])
    assert again.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2


async def test_bad_tools_name_the_field(nursery, draft_model):
    from tests.api.chatkit import TEMPLATE

    server = await start_server(nursery, draft_model, chat_template=str(TEMPLATE))
    api = client(server)
    cases = [(dict(tools=TOOLS, tool_choice={"type": "function",
                                             "function": {"name": "nope"}}), "tool_choice"),
             (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
             (dict(tool_choice="required"), "tool_choice"),
             (dict(tools=[{"type": "function", "function": {}}]), "tools"),
             (dict(tools=[{"type": "function", "function": {
                 "name": "f", "parameters": {"type": "strin"}}}], tool_choice="required"),
              "tools"),
             (dict(tools=TOOLS, tool_choice="required",
                   response_format={"type": "json_object"}), "response_format")]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(model="m", messages=ASK, max_tokens=4, **kwargs)
        assert info.value.body["param"] == field, (kwargs, info.value.message)
    with pytest.raises(openai.BadRequestError, match="image"):
        await api.chat.completions.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "data:,"}}]}])
