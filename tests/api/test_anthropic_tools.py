"""Anthropic tool use with the official client: tool_use blocks streamed (input_json_delta)
and not, stop_reason tool_use, a tool_result round trip, count_tokens, beta headers."""

from __future__ import annotations

import anthropic

from tests.api.chatkit import TOOLS
from tests.conftest import start_server

TOOLS_A = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
            "input_schema": t["function"]["parameters"]} for t in TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"extra_body": {"temperature": 0}}


def client(server) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0,
                                    timeout=600)  # a hang guard (the instruct model, a busy CPU)


async def test_tool_use_round_trip(nursery, chat_model):
    loaded, config = chat_model
    server = await start_server(nursery, loaded, **config)
    api = client(server)
    common = dict(model="m", max_tokens=120, system="You are helpful.", tools=TOOLS_A, **GREEDY)
    first = await api.messages.create(messages=ASK, tool_choice={"type": "any"}, **common)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_") and use.name in ("get_weather", "get_time")
    assert set(use.input) == ({"city", "unit"} if use.name == "get_weather" else {"zone"})
    async with api.messages.stream(messages=ASK, tool_choice={"type": "any"},
                                   **common) as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input)
    named = await api.messages.create(messages=ASK, tool_choice={"type": "tool",
                                                                 "name": "get_time"}, **common)
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "18 C and sunny"}]}]
    answer = await api.messages.create(messages=history, **{**common, "max_tokens": 10})
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    count = await api.messages.count_tokens(model="m", messages=history, system="You are helpful.",
                                            tools=TOOLS_A)
    usage = answer.usage
    assert count.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    assert count.input_tokens > first.usage.input_tokens + first.usage.cache_read_input_tokens
    # Claude Code's shape: a system message inside messages joins the system prompt
    inline = await api.messages.create(model="m", max_tokens=2, **GREEDY, tools=TOOLS_A,
                                       messages=[ASK[0], {"role": "system",
                                                          "content": "You are helpful."}])
    placed = await api.messages.count_tokens(model="m", messages=ASK, tools=TOOLS_A,
                                             system="You are helpful.")
    assert inline.usage.input_tokens + inline.usage.cache_read_input_tokens \
        == placed.input_tokens
    beta = await api.beta.messages.create(messages=ASK, betas=["token-efficient-tools-2025-02-19"],
                                          **{**common, "max_tokens": 4})
    assert beta.stop_reason == "max_tokens"


async def test_anthropic_tool_errors(nursery, draft_model):
    from tests.api.chatkit import TEMPLATE

    server = await start_server(nursery, draft_model, chat_template=str(TEMPLATE))
    api = client(server)
    for kwargs, word in ((dict(tools=TOOLS_A, tool_choice={"type": "tool", "name": "nope"}),
                          "nope"),
                         (dict(tools=TOOLS_A, tool_choice={"type": "sometimes"}), "tool_choice"),
                         (dict(tools=[{"description": "no name"}]), "name"),
                         (dict(thinking={"type": "maybe"}), "thinking")):
        try:
            await api.messages.create(model="m", max_tokens=4, messages=ASK, **kwargs)
        except anthropic.BadRequestError as exc:
            assert word in exc.message and exc.body["type"] == "error", exc.message
        else:
            raise AssertionError(f"{kwargs} was accepted")
