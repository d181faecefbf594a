"""HTTP endpoints: /health, /v1/stats, and 404 for anything else."""

from __future__ import annotations

import httpx
from trio_websocket import open_websocket_url

from tests.api.wsclient import LONG_PROMPT, Session, stats, wait_stats

STATS_INT_FIELDS = ("rows_active", "rows_queued", "kv_bytes", "requests_total",
                    "requests_rejected", "streams_open")


async def test_health(server, draft_model):
    async with httpx.AsyncClient() as client:
        response = await client.get(server.url + "/health")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["status"] == "ok" and body["model"] == draft_model.path.name


async def test_stats_on_an_idle_server(server, draft_model):
    async with httpx.AsyncClient() as client:
        response = await client.get(server.url + "/v1/stats")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    for name in STATS_INT_FIELDS:
        assert type(body[name]) is int and body[name] == 0, (name, body[name])
    assert body["model"] == draft_model.path.name and body["dtype"] == "float32"


async def test_stats_while_a_request_runs(server):
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as client:
        session = Session(ws)
        await session.generate("long", prompt=LONG_PROMPT, max_tokens=400, temperature=0)
        await session.first_token("long")
        busy = await stats(client, server.url)
        assert busy["kv_bytes"] > 0
        assert (busy["rows_active"], busy["rows_queued"], busy["streams_open"]) == (1, 0, 1)
        assert (busy["requests_total"], busy["requests_rejected"]) == (1, 0)
        assert session.results["long"].end is None
        await session.send({"type": "cancel", "id": "long"})
        (result,) = await session.wait("long")
        assert result.finish_reason == "cancelled"
        await wait_stats(client, server.url, rows_active=0, rows_queued=0, kv_bytes=0,
                         streams_open=0)


def assert_json_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, (response.url, response.status_code)
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]


async def test_unknown_paths_and_methods_answer_json(server):
    async with httpx.AsyncClient() as client:
        for path in ("/nope", "/v1/statsx", "/v1/stream/x"):
            assert_json_error(await client.get(server.url + path), 404, "not_found")
        assert_json_error(await client.post(server.url + "/health"), 405,
                          "method_not_allowed")
        assert_json_error(await client.delete(server.url + "/v1/stats"), 405,
                          "method_not_allowed")
