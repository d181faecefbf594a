"""--api-key on every route and the WebSocket upgrade, --allowed-origins, the access log."""

from __future__ import annotations

import base64
import logging

import anthropic
import httpx
import openai
import pytest
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.api.wsclient import Session
from tests.conftest import start_server

KEY = "sekret-key-1"
GOOD_ORIGIN = "http://good.example"
ROUTES = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/v1/messages"), ("GET", "/metrics"), ("GET", "/v1/stats"),
          ("GET", "/nope")]


async def ws_generate(url: str, headers: list[tuple[bytes, bytes]],
                      subprotocols: list[str] | None = None) -> str:
    async with open_websocket_url(url, extra_headers=headers, subprotocols=subprotocols) as ws:
        if subprotocols:
            assert ws.subprotocol == "tqserve"  # selected: a browser would fail otherwise
        session = Session(ws)
        await session.generate("a", prompt="x = 1", max_tokens=2, temperature=0)
        (result,) = await session.wait("a")
        return result.finish_reason


async def test_wrong_or_missing_keys_are_refused_everywhere(nursery, draft_model):
    server = await start_server(nursery, draft_model, api_key=KEY,
                                allowed_origins=(GOOD_ORIGIN,))
    async with httpx.AsyncClient(timeout=60) as raw:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"x-api-key": KEY + "x"}):
            for method, path in ROUTES:
                response = await raw.request(method, server.url + path, headers=headers,
                                             json={})
                assert response.status_code == 401, (headers, path, response.status_code)
                body = response.json()
                if path == "/v1/messages":
                    assert body["error"]["type"] == "authentication_error"
                else:
                    assert body["error"]["type"] == "authentication_error", body
        health = await raw.get(server.url + "/health")
        assert health.status_code == 200  # open for probes (documented)
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            ok = await raw.get(server.url + "/v1/models", headers=headers)
            assert ok.status_code == 200
            # a browser page on another origin: refused; on a listed one: served
            evil = await raw.post(server.url + "/v1/completions", json={"prompt": "a"},
                                  headers={**headers, "Origin": "http://evil.example"})
            assert evil.status_code == 403 and "origin" in evil.json()["error"]["message"]
            listed = await raw.get(server.url + "/v1/models",
                                   headers={**headers, "Origin": GOOD_ORIGIN})
            assert listed.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="wrong",
                                 max_retries=0).models.list()
    good = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert (await good.completions.create(model="m", prompt="a", max_tokens=2)).choices
    with pytest.raises(anthropic.AuthenticationError):
        await anthropic.AsyncAnthropic(base_url=server.url, api_key="wrong", max_retries=0
                                       ).messages.create(model="m", max_tokens=2,
                                                         messages=[{"role": "user",
                                                                    "content": "a"}])
    message = await anthropic.AsyncAnthropic(base_url=server.url, api_key=KEY, max_retries=0
                                             ).messages.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": "a"}],
        extra_body={"temperature": 0})
    assert message.usage.output_tokens == 2
    bearer = (b"Authorization", f"Bearer {KEY}".encode())
    for headers, status in (([], 401), ([(b"Authorization", b"Bearer nope")], 401),
                            ([bearer, (b"Origin", b"http://evil.example")], 403)):
        with pytest.raises(ConnectionRejected) as refused:
            await ws_generate(server.ws_url, headers)
        assert refused.value.status_code == status
    assert await ws_generate(server.ws_url, [bearer]) == "length"  # no Origin: not a browser
    assert await ws_generate(server.ws_url, [bearer, (b"Origin", GOOD_ORIGIN.encode())]) \
        == "length"


def key_protocol(key: str) -> str:
    return "tqserve.bearer." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


async def test_browsers_give_the_key_as_a_subprotocol_and_load_the_page_without_it(
        nursery, draft_model):
    """A browser cannot set headers on a WebSocket upgrade (the playground's case): the key
    rides as a subprotocol. The page's four files hold no data and load without the key;
    the vocabulary does not."""
    key = "sk?ey>="  # base64 writes it with "/", "+" and "=": the URL-safe form carries them
    server = await start_server(nursery, draft_model, api_key=key)
    async with httpx.AsyncClient(timeout=60) as raw:
        for path in ("/", "/static/playground.js", "/static/playground.css",
                     "/static/playground_chat.js"):
            assert (await raw.get(server.url + path)).status_code == 200, path
        assert (await raw.get(server.url + "/playground/vocab.json")).status_code == 401
        with_key = await raw.get(server.url + "/playground/vocab.json",
                                 headers={"Authorization": f"Bearer {key}"})
        assert with_key.status_code == 200 and with_key.json()["tokens"]
    assert await ws_generate(server.ws_url, [], ["tqserve", key_protocol(key)]) == "length"
    for offered in (["tqserve", key_protocol("wrong")], ["tqserve", "tqserve.bearer.%%%"],
                    ["tqserve"], ["tqserve.bearer."]):
        with pytest.raises(ConnectionRejected) as refused:
            await ws_generate(server.ws_url, [], offered)
        assert refused.value.status_code == 401, offered


async def test_a_server_without_a_key_selects_the_offered_protocol(server):
    assert await ws_generate(server.ws_url, [], ["tqserve"]) == "length"


async def test_access_log_has_one_line_per_request_and_no_prompt_text(server, caplog):
    secret = "zebra_unicorn_marker"
    caplog.set_level(logging.INFO, logger="tqserve.access")
    async with httpx.AsyncClient(timeout=60) as raw:
        ok = await raw.post(server.url + "/v1/completions", json={
            "prompt": f"{secret} = 1", "max_tokens": 3, "temperature": 0})
        bad = await raw.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": secret}], "max_tokens": 0})
        await raw.post(server.url + "/v1/messages", json={
            "max_tokens": 2, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": secret}]})
        await raw.get(server.url + "/v1/models")
    await ws_generate(server.ws_url, [])
    lines = [r.getMessage() for r in caplog.records if r.name == "tqserve.access"]
    assert len(lines) == 5, lines
    assert not any(secret in line for line in lines)
    completion, refused, messages, models, ws = lines
    assert completion.startswith(f"id={ok.json()['id']} route=POST /v1/completions status=200")
    assert "completion_tokens=3" in completion and "outcome=length" in completion
    assert "ttft_ms=" in completion and "ttft_ms=-" not in completion
    assert ok.headers["X-Request-Id"] == ok.json()["id"]
    assert "route=POST /v1/chat/completions status=400" in refused and bad.status_code == 400
    assert "route=POST /v1/messages status=200" in messages and "completion_tokens=2" in messages
    assert "route=GET /v1/models status=200" in models
    assert ws.startswith("id=a route=WS /v1/stream status=200") and "completion_tokens=2" in ws
