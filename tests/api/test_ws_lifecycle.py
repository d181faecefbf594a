"""Limits and lifecycle: streams per connection, admission overload, cancel, disconnect."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.api.wsclient import (LONG_PROMPT, STATS_POLL_SLEEP, STATS_POLLS, Session,
                                assert_well_formed, run_alone, stats,
                                wait_stats)
from tests.conftest import start_server

LONG = dict(prompt=LONG_PROMPT, max_tokens=400, temperature=0)  # runs until cancelled here
SHORT = dict(prompt="def add(a, b):", max_tokens=8, temperature=0)
IDLE = dict(rows_active=0, rows_queued=0, kv_bytes=0, streams_open=0)


async def test_max_connections_refuses_the_next_upgrade_with_503(nursery, draft_model):
    """--max-connections bounds open WebSockets: one more upgrade is an HTTP 503 naming the
    flag (counted in stats' rejections); the open sockets keep working, and a closed one
    frees its place."""
    server = await start_server(nursery, draft_model, max_connections=2)
    async with open_websocket_url(server.ws_url) as first, \
            open_websocket_url(server.ws_url) as second:
        with pytest.raises(ConnectionRejected) as refused:
            async with open_websocket_url(server.ws_url):
                pass
        assert refused.value.status_code == 503
        assert dict(refused.value.headers)[b"retry-after"] == b"1"
        body = json.loads(refused.value.body)["error"]
        assert body["code"] == "too_many_connections" and "--max-connections" in body["message"]
        for ws in (first, second):
            session = Session(ws)
            await session.generate("a", **SHORT)
            (result,) = await session.wait("a")
            assert result.finish_reason == "length"
    async with httpx.AsyncClient() as client:
        assert (await stats(client, server.url))["rejections"] == {"too_many_connections": 1}
    for _ in range(STATS_POLLS):  # the server sees the two closes soon after they happen
        try:
            assert (await run_alone(server.ws_url, "b", **SHORT)).finish_reason == "length"
            return
        except ConnectionRejected:
            await trio.sleep(STATS_POLL_SLEEP)
    raise AssertionError("a closed connection never freed its place")


async def test_max_streams_per_connection(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_streams_per_connection=2)
    tok = draft_model.tokenizer
    async with open_websocket_url(server.ws_url) as ws:
        session = Session(ws)
        await session.generate("a", **LONG)
        await session.generate("b", True, **LONG)
        await session.generate("c", **SHORT)
        frame, binary = await session.reply("c")
        assert (frame["type"], frame["code"], binary) == ("error", "too_many_streams", False)
        assert "2" in frame["message"]
        assert "c" not in session.results
        # the limit is per connection: another socket is served meanwhile
        other = await run_alone(server.ws_url, "e", **SHORT)
        assert_well_formed(other, tok, binary=False)
        await session.send({"type": "cancel", "id": "a"})
        (a,) = await session.wait("a")
        assert a.finish_reason == "cancelled" and session.results["b"].end is None
        await session.generate("d", True, **SHORT)  # a's slot is free again
        (d,) = await session.wait("d")
        assert_well_formed(d, tok, binary=True)
        assert d.token_ids == other.token_ids
        await session.send({"type": "cancel", "id": "b"}, True)
        (b,) = await session.wait("b")
        assert b.finish_reason == "cancelled"


async def test_admission_overload_rejects_at_once(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_queued_requests=1, max_batch=1)
    tok = draft_model.tokenizer
    first = dict(LONG, max_tokens=150)
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as client:
        session = Session(ws)
        await session.generate("r1", **first)
        await session.first_token("r1")        # r1 holds the only row
        await session.generate("r2", True, **SHORT)
        await session.queued("r2")             # r2 holds the only queue slot
        await session.generate("r3", **SHORT)
        await session.generate("r4", True, **SHORT)
        for rid, binary in (("r3", False), ("r4", True)):
            frame, got_binary = await session.reply(rid)
            assert (frame["code"], got_binary) == ("overloaded", binary), frame
            assert "queue" in frame["message"]
        # rejected while r1 still runs and r2 still waits: nothing had to finish first
        assert session.results["r1"].end is None and session.results["r2"].tokens == []
        busy = await stats(client, server.url)
        assert (busy["rows_active"], busy["rows_queued"]) == (1, 1)
        r1, r2 = await session.wait("r1", "r2")
        assert_well_formed(r1, tok, binary=False)
        assert r1.finish_reason == "length" and len(r1.tokens) == first["max_tokens"]
        assert_well_formed(r2, tok, binary=True, stop_ids=draft_model.eos_token_ids)
        alone = await run_alone(server.ws_url, "r2", **SHORT)
        assert alone.token_ids == r2.token_ids
        assert alone.finish_reason == r2.finish_reason
        head = await run_alone(server.ws_url, "r1", **dict(first, max_tokens=16))
        assert r1.token_ids[:16] == head.token_ids
        final = await wait_stats(client, server.url, **IDLE)
        # r1..r4 and the two runs alone reached admission; r3 and r4 were turned away
        assert (final["requests_total"], final["requests_rejected"]) == (6, 2)


async def test_cancel_running_request(server, draft_model):
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as client:
        session = Session(ws)
        await session.generate("long", **LONG)
        await session.first_token("long")
        await session.send({"type": "cancel", "id": "long"}, True)
        (result,) = await session.wait("long")
        assert_well_formed(result, draft_model.tokenizer, binary=False, check_text=False)
        assert result.finish_reason == "cancelled"
        assert 1 <= result.end["usage"]["completion_tokens"] < LONG["max_tokens"]
        assert draft_model.tokenizer.decode(result.token_ids).startswith(result.text)
        # the id is free now: cancelling it again is an unknown id
        await session.send({"type": "cancel", "id": "long"})
        frame, _ = await session.reply("long")
        assert frame["code"] == "unknown_id"
        final = await wait_stats(client, server.url, **IDLE)
        assert (final["requests_total"], final["requests_rejected"]) == (1, 0)


async def test_cancel_queued_request(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_batch=1)
    prompt_len = len(draft_model.tokenizer.encode(SHORT["prompt"]))
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as client:
        session = Session(ws)
        await session.generate("running", **LONG)
        await session.first_token("running")
        await session.generate("waiting", True, **SHORT)
        await session.queued("waiting")
        await session.send({"type": "cancel", "id": "waiting"})
        (waiting,) = await session.wait("waiting")
        assert waiting.finish_reason == "cancelled" and waiting.kinds == [True, True]
        assert waiting.end["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 0,
                                        "cached_tokens": 0,
                                        "cached_tokens_by_tier": {"ram": 0, "ssd": 0}}
        mid = await wait_stats(client, server.url, rows_queued=0)
        assert mid["rows_active"] == 1 and session.results["running"].end is None
        await session.send({"type": "cancel", "id": "running"})
        (running,) = await session.wait("running")
        assert running.finish_reason == "cancelled"
        await wait_stats(client, server.url, **IDLE)


async def test_closing_the_socket_frees_the_rows(server, draft_model):
    async with httpx.AsyncClient() as client:
        async with open_websocket_url(server.ws_url) as ws:
            session = Session(ws)
            await session.generate("a", **LONG)
            await session.generate("b", True, **LONG)
            await session.first_token("a")
            await session.first_token("b")
            busy = await stats(client, server.url)
            assert busy["rows_active"] == 2 and busy["streams_open"] == 2
            assert busy["kv_bytes"] > 0
        # the socket is closed mid-generation; both rows must come back
        await wait_stats(client, server.url, **IDLE)
        after = await run_alone(server.ws_url, "after", **SHORT)
        assert_well_formed(after, draft_model.tokenizer, binary=False,
                           stop_ids=draft_model.eos_token_ids)
        final = await wait_stats(client, server.url, **IDLE)
        assert (final["requests_total"], final["requests_rejected"]) == (3, 0)
