"""Grammars and schemas that overflowed llguidance's native stack (issue 20 #1: a 3,000-rule
Lark chain or 3,000 `$defs` chained by `$ref` killed the server with SIGSEGV, every stream
lost). Over the limits: a 400 / error frame naming the limit. Under them, but past what
an 8 MiB stack holds (990 chained `$defs`; 950 crashed the event-loop thread): compiled on
the large-stack workers and served. The server answers the next request either way."""

from __future__ import annotations

import httpx
from trio_websocket import open_websocket_url

from tests.api.wsclient import Session, wait_stats

USER = [{"role": "user", "content": "x = 1"}]


def lark_chain(n: int) -> dict:
    lines = ["start: r0"] + [f'r{i}: "t{i}" r{i + 1}?' for i in range(n)] + [f'r{n}: "e"']
    return {"type": "grammar", "lark": "\n".join(lines)}


def defs_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["x"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "json_schema",
            "json_schema": {"name": "chain", "schema": {"$ref": "#/$defs/d0", "$defs": defs}}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return {"type": "json_schema", "json_schema": {"schema": schema}}


REFUSED = [(lark_chain(3000), "more than 1000"), (defs_chain(3000), "more than 1000"),
           (nested(150), "deeper than 100"),
           ({"type": "grammar", "lark": "start: " + "(" * 300 + '"a"' + ")" * 300},
            "deeper than 100")]


async def test_over_the_limits_is_a_400_naming_it_and_the_server_lives(server):
    async with httpx.AsyncClient(timeout=60) as client:
        for fmt, words in REFUSED:
            response = await client.post(server.url + "/v1/chat/completions", json={
                "messages": USER, "max_tokens": 4, "response_format": fmt})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert "response_format" in error["message"] and words in error["message"], error
        ok = await client.post(server.url + "/v1/chat/completions",
                               json={"messages": USER, "max_tokens": 4})
        assert ok.status_code == 200
        await wait_stats(client, server.url, rows_active=0, rows_queued=0)


async def test_a_chain_past_an_8_mib_stack_compiles_off_the_event_loop(server):
    async with httpx.AsyncClient(timeout=120) as client:
        response = await client.post(server.url + "/v1/chat/completions", json={
            "messages": USER, "max_tokens": 6, "temperature": 0,
            "response_format": defs_chain(990)})
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["message"]["content"]
        assert text.startswith('{"x": '), text  # the grammar holds the output
        ok = await client.post(server.url + "/v1/completions",
                               json={"prompt": "import os\n", "max_tokens": 2})
        assert ok.status_code == 200


async def test_over_the_limits_on_the_websocket_is_an_error_frame(server):
    async with open_websocket_url(server.ws_url) as ws:
        session = Session(ws)
        await session.generate("g", prompt="x = ", max_tokens=2,
                               response_format=lark_chain(3000))
        frame, _ = await session.reply("g")
        assert frame["type"] == "error" and frame["code"] == "invalid_request", frame
        assert "more than 1000" in frame["message"]
        await session.generate("h", prompt="x = ", max_tokens=2)
        (result,) = await session.wait("h")
        assert result.end["type"] == "done", result.frames
