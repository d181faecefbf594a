"""The overload gate (api.overload): while admission is full, a generation request gets a
canned 429 in its API's shape straight from the socket (in the acceptor process, or on
the server's loop with --acceptor off); everything else goes the normal way. A real server on loopback, raw sockets, the bundled model."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from tests.api.wsclient import LONG_PROMPT, Session, stats, wait_stats
from tests.conftest import start_server

IDLE = dict(rows_active=0, rows_queued=0, kv_bytes=0, streams_open=0)
KEY = "k" * 24


def _request(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _exchange(port: int, *parts: bytes, pause: float = 0.0) -> tuple[int, dict, bytes]:
    """Send `parts` (with `pause` between), read the answer to its end; status, headers
    (lower-case names) and body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        for i, part in enumerate(parts):
            if i and pause:
                await trio.sleep(pause)
            await stream.send_all(part)
        got = b""
        with trio.fail_after(30):
            while chunk := await stream.receive_some(65536):
                got += chunk
                if b"\r\n\r\n" in got:
                    head, _, body = got.partition(b"\r\n\r\n")
                    length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")]
                    if length and len(body) >= length[0]:
                        break
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in
                   (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), headers, body


async def _fill(session: Session) -> None:
    """r1 holds the only row, r2 the only queue slot: admission is full."""
    await session.generate("r1", prompt=LONG_PROMPT, max_tokens=300, temperature=0)
    await session.first_token("r1")
    await session.generate("r2", prompt=LONG_PROMPT, max_tokens=300, temperature=0)
    await session.queued("r2")


async def _release(session: Session, raw: httpx.AsyncClient, url: str) -> None:
    for rid in ("r2", "r1"):
        await session.send({"type": "cancel", "id": rid})
        await session.wait(rid)
    await wait_stats(raw, url, **IDLE)


@pytest.mark.parametrize("acceptor", ["process", "off"])  # the acceptor's gate, the loop's
async def test_generation_paths_refused_in_their_shape(nursery, draft_model, caplog, acceptor):
    caplog.set_level(logging.INFO, logger="tqserve.access")
    server = await start_server(nursery, draft_model, max_queued_requests=1, max_batch=1,
                                acceptor=acceptor)
    port = int(server.url.rsplit(":", 1)[1])
    chat = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    bodies = {"/v1/completions": json.dumps({"prompt": "x", "max_tokens": 2}),
              "/v1/chat/completions": chat, "/v1/responses": json.dumps({"input": "x"}),
              "/v1/messages": json.dumps({"max_tokens": 2, "messages": [
                  {"role": "user", "content": "x"}]})}
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as raw:
        session = Session(ws)
        await _fill(session)
        before = (await stats(raw, server.url))["rejections"].get("overloaded", 0)
        for path, body in bodies.items():
            status, headers, answer = await _exchange(port, _request(path, body.encode()))
            error = json.loads(answer)
            assert (status, headers["retry-after"], headers["connection"]) == (429, "1", "close")
            if path == "/v1/messages":
                assert error["type"] == "error"
                assert error["error"]["type"] == "rate_limit_error"
                assert "queue full" in error["error"]["message"]
            else:
                assert set(error["error"]) == {"message", "type", "param", "code"}
                assert error["error"]["code"] == "overloaded"
                assert "queue full" in error["error"]["message"]
        # a body far larger than one read, and a head that arrives in two parts: the
        # answer comes whole (no reset under it), the body is read away
        big = json.dumps({"prompt": "x" * 400_000, "max_tokens": 2}).encode()
        status, _, answer = await _exchange(port, _request("/v1/completions", big))
        assert status == 429 and json.loads(answer)["error"]["code"] == "overloaded"
        split = _request("/v1/completions", bodies["/v1/completions"].encode())
        status, _, _ = await _exchange(port, split[:20], split[20:], pause=0.2)
        assert status == 429
        # everything else is answered the normal way while full
        assert (await raw.get(server.url + "/health")).status_code == 200
        assert (await raw.get(server.url + "/v1/models")).status_code == 200
        bad = await raw.post(server.url + "/v1/completions", content=b"{",
                             headers={"content-type": "application/json"})
        assert bad.status_code in (400, 429)
        after = (await stats(raw, server.url))["rejections"].get("overloaded", 0)
        assert after - before >= len(bodies) + 2
        # the gate answered them (their access lines carry no request id: none was given)
        gated = [r.getMessage() for r in caplog.records if r.name == "tqserve.access"
                 and r.getMessage().startswith("id=- ")]
        assert {line.split()[2] for line in gated} == set(bodies)
        assert len(gated) == len(bodies) + 2 and all("status=429" in line for line in gated)
        await _release(session, raw, server.url)
        # room again: the same request is served. The acceptor's figure of the room may
        # be a poll (5 ms of the server's loop) older than /v1/stats: a 429 in that
        # window is its contract, so the request is sent again after one
        with trio.fail_after(30):
            while (got := await _exchange(port, _request(
                    "/v1/completions", bodies["/v1/completions"].encode(),
                    "Connection: close")))[0] == 429 and acceptor == "process":
                await trio.sleep(0.05)
        status, _, answer = got
        assert status == 200 and json.loads(answer)["choices"][0]["text"] is not None


async def test_key_and_origin_are_checked_before_the_gate_answers(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_queued_requests=1, max_batch=1,
                                api_key=KEY)
    port = int(server.url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    auth = {"Authorization": f"Bearer {KEY}"}
    async with open_websocket_url(server.ws_url, subprotocols=[_key_protocol()]) as ws, \
            httpx.AsyncClient(headers=auth) as raw:
        session = Session(ws)
        await _fill(session)
        status, _, _ = await _exchange(port, _request("/v1/completions", body))
        assert status == 401  # no key: the overload is not the stranger's business
        status, _, _ = await _exchange(port, _request("/v1/completions", body,
                                                      "Authorization: Bearer wrong-key"))
        assert status == 401
        for header in (f"Authorization: Bearer {KEY}", f"x-api-key: {KEY}"):
            status, _, _ = await _exchange(port, _request("/v1/completions", body, header))
            assert status == 429
        # a browser's request goes through the origin check first
        status, _, _ = await _exchange(port, _request(
            "/v1/completions", body, f"Authorization: Bearer {KEY}",
            "Origin: https://evil.example"))
        assert status == 403
        await _release(session, raw, server.url)


def _key_protocol() -> str:
    import base64

    from tqserve.api.auth import KEY_PROTOCOL_PREFIX
    return KEY_PROTOCOL_PREFIX + base64.urlsafe_b64encode(KEY.encode()).decode().rstrip("=")


def test_the_gate_answers_only_complete_generation_heads():
    from tqserve.api.overload import OverloadGate

    refused: list[int] = []
    gate = OverloadGate(lambda: "queue full", lambda: refused.append(1), api_key=None)
    ok = _request("/v1/completions?x=1", b"{}")
    assert gate.answer(ok, 0.0) is not None and refused == [1]
    for head in (ok.replace(b"POST", b"GET"), ok.replace(b"HTTP/1.1", b"HTTP/2.0"),
                 ok[:30], b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", _request("/v1/stats", b"{}"),
                 _request("/v1/completions", b"{}", "no colon here"),
                 _request("/v1/completions", b"{}", " folded: header"),
                 _request("/v1/completions", b"{}", "Origin: http://127.0.0.1")):
        assert gate.answer(head, 0.0) is None, head
    assert refused == [1]
    idle = OverloadGate(lambda: None, lambda: refused.append(1), api_key=None)
    assert idle.answer(ok, 0.0) is None and refused == [1]
