"""Hostile WebSocket and HTTP peers, over raw sockets against a real server.

Compression is never negotiated (a deflate bomb is a protocol error before it inflates),
oversize and never-finished messages close the socket with 1009 / 1008 and drop it,
invalid UTF-8 closes with 1007, and HTTP/2 is not served. After each, the server answers
/health and serves a normal request.
"""

from __future__ import annotations

import httpx
import trio
from trio_websocket import open_websocket_url

from tests.api.wsclient import FRAME_TIMEOUT, Session, assert_well_formed
from tests.conftest import start_server
from tqserve.tools.rawws import (OP_BINARY, OP_TEXT, connect, deflate_bomb, frame, read_close,
                         send_quietly)

SHORT = dict(prompt="def add(a, b):", max_tokens=4, temperature=0)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def still_serving(server, draft_model) -> None:
    async with httpx.AsyncClient() as client:
        assert (await client.get(server.url + "/health")).status_code == 200
    async with open_websocket_url(server.ws_url) as ws:
        session = Session(ws)
        await session.generate("ok", **SHORT)
        (result,) = await session.wait("ok")
    assert_well_formed(result, draft_model.tokenizer, binary=False,
                       stop_ids=draft_model.eos_token_ids)


async def closed_with(stream: trio.SocketStream) -> tuple[int | None, bool]:
    """The close code the server sent, and whether it then dropped the connection
    (EOF) without waiting for this client's close frame."""
    with trio.fail_after(FRAME_TIMEOUT):
        code = await read_close(stream)
        dropped = await stream.receive_some(65536) == b""
    await stream.aclose()
    return code, dropped


async def test_compression_is_never_negotiated_and_a_bomb_never_inflates(nursery, draft_model):
    server = await start_server(nursery, draft_model)
    port = port_of(server.url)
    stream, head = await connect(
        port, extensions="permessage-deflate; client_max_window_bits")
    assert head.startswith(b"HTTP/1.1 101"), head
    assert b"sec-websocket-extensions" not in head.lower(), head
    bomb = deflate_bomb(64 << 20)  # ~64 KB that would inflate to 64 MiB
    assert len(bomb) < 128 << 10
    await send_quietly(stream, frame(OP_BINARY, bomb, rsv1=True))
    assert await closed_with(stream) == (1002, True)
    await still_serving(server, draft_model)


async def test_oversize_message_closes_1009_and_drops_the_connection(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_message_bytes=1024)
    port = port_of(server.url)
    for fragmented in (False, True):
        stream, head = await connect(port)
        assert head.startswith(b"HTTP/1.1 101"), head
        if fragmented:  # many small fragments of one message, over the cap in total
            for i in range(40):
                if not await send_quietly(stream, frame(OP_BINARY if i == 0 else 0,
                                                        b"x" * 4096, fin=False)):
                    break
        else:  # one frame declaring 1 MiB, of which 128 KiB are sent
            await send_quietly(stream, frame(OP_BINARY, b"x" * (128 << 10), length=1 << 20)[
                :(128 << 10) + 14])
        assert await closed_with(stream) == (1009, True)
    await still_serving(server, draft_model)


async def test_incomplete_messages_time_out(nursery, draft_model):
    server = await start_server(nursery, draft_model, ws_message_timeout=0.5)
    port = port_of(server.url)
    half_frame = frame(OP_TEXT, b"{}" * 50)[:20]
    first_fragment = frame(OP_TEXT, b'{"type": ', fin=False)
    header_only = frame(OP_BINARY, b"", length=4096)
    for partial in (half_frame, first_fragment, header_only):
        stream, head = await connect(port)
        assert head.startswith(b"HTTP/1.1 101"), head
        await stream.send_all(partial)
        assert await closed_with(stream) == (1008, True)
    await still_serving(server, draft_model)


async def test_invalid_utf8_text_frame_closes_1007(nursery, draft_model):
    server = await start_server(nursery, draft_model)
    stream, _ = await connect(port_of(server.url))
    await stream.send_all(frame(OP_TEXT, b'{"type": "generate", "id": "\xff\xfe"}'))
    assert await closed_with(stream) == (1007, True)
    await still_serving(server, draft_model)


async def test_http2_is_not_served(nursery, draft_model):
    server = await start_server(nursery, draft_model)
    port = port_of(server.url)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, "
                          b"HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__"
                          b"\r\n\r\n")
    reply = b""
    with trio.fail_after(FRAME_TIMEOUT):
        while b'"status"' not in reply:
            data = await stream.receive_some(4096)
            assert data, reply
            reply += data
    assert reply.startswith(b"HTTP/1.1 200"), reply  # answered in HTTP/1.1, no 101
    await stream.aclose()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    reply = b""
    with trio.fail_after(FRAME_TIMEOUT):
        while data := await stream.receive_some(4096):
            reply += data
    assert reply.startswith(b"HTTP/1.1 505"), reply  # and the connection is closed
    await still_serving(server, draft_model)
