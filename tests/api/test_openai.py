"""The OpenAI-compatible HTTP API, driven by the official `openai` client on a live server."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from trio_websocket import open_websocket_url

from tests.api.wsclient import LONG_PROMPT, Session, run_alone, wait_stats
from tests.conftest import start_server

PROMPT = "def add(a, b):"
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def add(a, b):"}]
IDLE = dict(rows_active=0, rows_queued=0, kv_bytes=0, streams_open=0)


def client(server, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0,
                              timeout=60)


async def test_completions_and_chat_equal_the_websocket(server, draft_model):
    ws = await run_alone(server.ws_url, "w", prompt=PROMPT, max_tokens=12, temperature=0,
                         logprobs=True, top_logprobs=2)
    ws_chat = await run_alone(server.ws_url, "c", messages=MESSAGES, max_tokens=10,
                              temperature=0)
    api = client(server)
    got = await api.completions.create(model="any", prompt=PROMPT, max_tokens=12,
                                       temperature=0, logprobs=2)
    (choice,) = got.choices
    assert choice.text == ws.text and choice.finish_reason == "length"
    assert got.object == "text_completion" and got.model == draft_model.path.name
    assert got.usage.completion_tokens == 12 == len(ws.tokens)
    assert got.usage.prompt_tokens == ws.end["usage"]["prompt_tokens"]
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12
    # the same prompt again: its prefix came from the prefix cache
    assert got.usage.prompt_tokens_details.cached_tokens == got.usage.prompt_tokens - 1
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx([f["logprob"] for f in ws.tokens])
    assert "".join(lp.tokens) == ws.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    assert all(len(top) <= 2 and max(top.values()) >= lp.token_logprobs[i] - 1e-6
               for i, top in enumerate(lp.top_logprobs))
    chat = await api.chat.completions.create(model="any", messages=MESSAGES,
                                             max_completion_tokens=10, temperature=0)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == ws_chat.text
    assert chat.choices[0].logprobs is None and chat.usage.completion_tokens == 10
    models = await api.models.list()
    assert [m.id for m in models.data] == [draft_model.path.name]


async def test_streaming_with_logprobs_and_usage(server):
    api = client(server)
    plain = await api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=9,
                                              temperature=0)
    stream = await api.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=3)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks[1:] if c.choices and c.choices[0].finish_reason is None]
    assert "".join(c.choices[0].delta.content for c in body) == plain.choices[0].message.content
    entries = [e for c in body for e in c.choices[0].logprobs.content]
    assert len(entries) == 9 and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.logprob <= 0 and bytes(e.bytes) == e.token.encode() for e in entries)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 9
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    text = ""
    offsets = []
    async for c in await api.completions.create(model="m", prompt=PROMPT, max_tokens=6,
                                                temperature=0, stream=True, logprobs=1):
        if c.choices and c.choices[0].logprobs is not None:
            text += c.choices[0].text
            offsets += c.choices[0].logprobs.text_offset
            assert len(c.choices[0].logprobs.top_logprobs[0]) == 1
    assert len(offsets) == 6 and offsets[0] == 0 and offsets == sorted(offsets)
    whole = await api.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0)
    assert text == whole.choices[0].text


async def test_stop_and_seed(server):
    api = client(server)
    full = await api.completions.create(model="m", prompt=LONG_PROMPT, max_tokens=12,
                                        temperature=0)
    text = full.choices[0].text
    stop = text[4:8]
    cut = await api.completions.create(model="m", prompt=LONG_PROMPT, max_tokens=12,
                                       temperature=0, stop=[stop, "@@@"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    seeded = [await api.completions.create(model="m", prompt=PROMPT, max_tokens=10, seed=7,
                                           temperature=1.0, top_p=0.9) for _ in range(2)]
    assert seeded[0].choices[0].text == seeded[1].choices[0].text


async def test_bad_requests_name_the_field(server):
    api = client(server)
    cases = [(dict(n=17), "n"), (dict(n=0), "n"), (dict(temperature=-1), "temperature"),
             (dict(top_p=0), "top_p"), (dict(max_tokens=0), "max_tokens"),
             (dict(max_tokens=1_000_000), "max_tokens"),
             (dict(response_format={"type": "json_schema", "json_schema": {
                 "name": "x", "schema": {"type": "strin"}}}), "response_format")]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(model="m", messages=MESSAGES,
                                              **{"max_tokens": 4, **kwargs})
        assert info.value.status_code == 400
        assert field in info.value.message, (field, info.value.message)
        assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="prompt"):
        await api.completions.create(model="m", prompt=[[1, 2], "x", 3], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        await api.chat.completions.create(model="m", messages=[{"role": "x", "content": "y"}])
    async with httpx.AsyncClient() as raw:
        bad = await raw.post(server.url + "/v1/completions", content=b"{nope",
                             headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
        for method, path, status in (("GET", "/v1/nothing", 404),
                                     ("GET", "/v1/chat/completions", 405)):
            response = await raw.request(method, server.url + path)
            assert response.status_code == status
            assert response.headers["content-type"].startswith("application/json")
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    # nothing leaked
    async with httpx.AsyncClient() as raw:
        await wait_stats(raw, server.url, **IDLE)


async def test_overload_is_429_with_retry_after(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_queued_requests=1, max_batch=1)
    api = client(server)
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as raw:
        session = Session(ws)
        await session.generate("r1", prompt=LONG_PROMPT, max_tokens=300, temperature=0)
        await session.first_token("r1")      # r1 holds the only row
        await session.generate("r2", prompt=LONG_PROMPT, max_tokens=300, temperature=0)
        await session.queued("r2")           # r2 holds the only queue slot
        with pytest.raises(openai.RateLimitError) as info:
            await api.completions.create(model="m", prompt=PROMPT, max_tokens=4)
        assert info.value.status_code == 429
        assert info.value.response.headers["Retry-After"] == "1"
        assert "queue full" in info.value.message
        refused = await raw.post(server.url + "/v1/completions",
                                 json={"prompt": PROMPT, "stream": True})
        assert refused.status_code == 429 and refused.json()["error"]["type"]
        for rid in ("r1", "r2"):
            await session.send({"type": "cancel", "id": rid})
        await session.wait("r1", "r2")
        await wait_stats(raw, server.url, **IDLE)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
async def test_disconnect_mid_stream_frees_the_row(server, caplog, path):
    caplog.set_level(logging.INFO, logger="tqserve.access")
    body = {"max_tokens": 2000, "temperature": 0, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = LONG_PROMPT
    else:
        body["messages"] = [{"role": "user", "content": LONG_PROMPT}]
    async with httpx.AsyncClient(timeout=30) as raw:
        async with raw.stream("POST", server.url + path, json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 8:
                    break
        busy = (await raw.get(server.url + "/v1/stats")).json()
        assert busy["requests_total"] == 1
        await wait_stats(raw, server.url, **IDLE)
    (line,) = [r.getMessage() for r in caplog.records if f"route=POST {path} " in r.getMessage()]
    tokens = int(line.split("completion_tokens=")[1].split()[0])
    assert "outcome=disconnected" in line and tokens < 2000, line  # cut short, not run out


async def test_http_rows_share_the_batch_with_websocket_rows(server):
    api = client(server)
    alone = await api.completions.create(model="m", prompt=LONG_PROMPT, max_tokens=48, temperature=0)
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as raw:
        session = Session(ws)
        await session.generate("long", prompt=LONG_PROMPT, max_tokens=600, temperature=0)
        await session.first_token("long")
        text = ""
        chunks = await api.completions.create(model="m", prompt=LONG_PROMPT, max_tokens=200,
                                              temperature=0, stream=True)
        async for chunk in chunks:
            if not text:  # 200 tokens to go: both rows decode together now
                busy = (await raw.get(server.url + "/v1/stats")).json()
                assert busy["rows_active"] == 2 and busy["streams_open"] == 2
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason
        assert finish == "length"
        assert text.startswith(alone.choices[0].text)
        assert session.results["long"].end is None
        await session.send({"type": "cancel", "id": "long"})
        await session.wait("long")
        await wait_stats(raw, server.url, **IDLE)


async def test_structured_output_through_the_openai_client(server):
    """json_schema and json_object through chat and completions: valid JSON, every time."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "size": {"enum": ["small", "large"]}},
              "required": ["name", "size"], "additionalProperties": False}
    api = client(server)
    for seed in range(4):
        out = await api.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=48, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "thing", "schema": schema}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    stream = await api.completions.create(model="m", prompt=PROMPT, max_tokens=48, seed=1,
                                          stream=True, extra_body={"response_format": {
                                              "type": "json_schema",
                                              "json_schema": {"schema": schema}}})
    text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    jsonschema.validate(json.loads(text), schema)
