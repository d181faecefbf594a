"""The Anthropic-compatible /v1/messages, driven by the official `anthropic` client."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from trio_websocket import open_websocket_url

from tests.api.wsclient import LONG_PROMPT, Session, run_alone, wait_stats
from tests.conftest import start_server

SYSTEM = "You write Python."
USER = [{"role": "user", "content": "def add(a, b):"}]
WS_MESSAGES = [{"role": "system", "content": SYSTEM}, *USER]
GREEDY = {"extra_body": {"temperature": 0}}  # the client has no sampling arguments of its own
EVENTS = ["message_start", "content_block_start", "ping", "content_block_delta",
          "content_block_stop", "message_delta", "message_stop"]


def client(server, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=api_key, max_retries=0,
                                    timeout=60)


async def test_messages_equal_the_websocket(server, draft_model):
    ws = await run_alone(server.ws_url, "w", messages=WS_MESSAGES, max_tokens=10, temperature=0)
    api = client(server)
    message = await api.messages.create(model="any", max_tokens=10, **GREEDY,
                                        system=SYSTEM, messages=USER)
    assert message.type == "message" and message.role == "assistant"
    assert message.model == draft_model.path.name and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == ws.text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    prompt = ws.end["usage"]["prompt_tokens"]
    assert usage.output_tokens == 10
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt
    assert usage.cache_read_input_tokens == prompt - 1  # the WebSocket run left it cached
    assert usage.cache_creation_input_tokens == 0
    # system as text blocks, content as text blocks: the same prompt
    blocks = await api.messages.create(
        model="any", max_tokens=10, **GREEDY, system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}]}])
    assert blocks.content[0].text == ws.text


async def test_streaming_events_in_anthropic_order(server):
    api = client(server)
    plain = await api.messages.create(model="m", max_tokens=12, **GREEDY, messages=USER)
    async with api.messages.stream(model="m", max_tokens=12, **GREEDY,
                                   messages=USER) as stream:
        final = await stream.get_final_message()
    seen = []  # the client hides ping events: read the wire
    async with httpx.AsyncClient(timeout=60) as raw:
        async with raw.stream("POST", server.url + "/v1/messages", json={
                "max_tokens": 12, "temperature": 0, "messages": USER, "stream": True}) as sse:
            async for line in sse.aiter_lines():
                if line.startswith("event: "):
                    seen.append(line[len("event: "):])
    deltas = seen.count("content_block_delta")
    assert deltas >= 1
    assert seen == EVENTS[:3] + ["content_block_delta"] * deltas + EVENTS[4:]
    assert final.content[0].text == plain.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    text = plain.content[0].text
    stop = text[3:7]
    cut = await api.messages.create(model="m", max_tokens=12, **GREEDY, messages=USER,
                                    stop_sequences=["@@@", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    async with api.messages.stream(model="m", max_tokens=12, **GREEDY, messages=USER,
                                   stop_sequences=[stop]) as stream:
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop
    assert streamed.content[0].text == cut.content[0].text


async def test_errors_are_anthropic_exceptions(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_queued_requests=1, max_batch=1,
                                strict_fields=True)
    api = client(server)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        await api.messages.create(model="m", max_tokens=0, messages=USER)
    with pytest.raises(anthropic.BadRequestError, match="role"):
        await api.messages.create(model="m", max_tokens=4,
                                  messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="bogus") as info:
        await api.messages.create(model="m", max_tokens=4, messages=USER,
                                  extra_body={"bogus": True})
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    async with httpx.AsyncClient() as raw:
        missing = await raw.post(server.url + "/v1/messages", json={"messages": USER})
        assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
        wrong = await raw.get(server.url + "/v1/messages")
        assert wrong.status_code == 405 and wrong.json()["type"] == "error"
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as raw:
        session = Session(ws)
        await session.generate("r1", prompt=LONG_PROMPT, max_tokens=300, temperature=0)
        await session.first_token("r1")
        await session.generate("r2", prompt=LONG_PROMPT, max_tokens=300, temperature=0)
        await session.queued("r2")
        with pytest.raises(anthropic.RateLimitError) as limited:
            await api.messages.create(model="m", max_tokens=4, messages=USER)
        assert limited.value.response.headers["Retry-After"] == "1"
        assert limited.value.body["error"]["type"] == "rate_limit_error"
        for rid in ("r1", "r2"):
            await session.send({"type": "cancel", "id": rid})
        await session.wait("r1", "r2")
        await wait_stats(raw, server.url, rows_active=0, rows_queued=0, streams_open=0)
