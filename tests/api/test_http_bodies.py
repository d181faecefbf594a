"""Request bodies over --max-message-bytes are refused before they are read (413 naming
the limit), on `serve` and on `route`: by their Content-Length before any of the body
arrives, and a chunked body once it streams past the limit (not after buffering it all:
Quart used to read up to its own 16 MiB first)."""

from __future__ import annotations

import pytest
import trio

from tests.api.routerkit import start_replica, start_router
from tests.api.test_http_connections import host_port, read_until_closed
from tests.conftest import start_server

LIMIT = 64 << 10
CHUNK = 16 << 10
CHUNKED_TOTAL = 8 << 20  # what the chunked client would send if nobody stopped it
HEAD = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")


async def start(kind: str, nursery: trio.Nursery, loaded) -> str:
    if kind == "serve":
        return (await start_server(nursery, loaded, max_message_bytes=LIMIT)).url
    replica = await start_replica(nursery, loaded)
    return (await start_router(nursery, [replica.url], max_message_bytes=LIMIT)).url


def assert_refused(answer: bytes) -> None:
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert f"limit of {LIMIT} bytes (--max-message-bytes)".encode() in answer, answer[-300:]


@pytest.mark.parametrize("kind", ["serve", "route"])
async def test_content_length_over_the_limit_is_refused_unread(nursery, draft_model, kind):
    host, port = host_port(await start(kind, nursery, draft_model))
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all((HEAD + "Content-Length: 16000000\r\n\r\n").encode() + b"{" * 10)
    with trio.fail_after(30):  # the 16 MB never come: the answer may not wait for them
        answer = await read_until_closed(stream)
    await stream.aclose()
    assert_refused(answer)


@pytest.mark.parametrize("kind", ["serve", "route"])
async def test_a_chunked_body_is_refused_once_past_the_limit(nursery, draft_model, kind):
    host, port = host_port(await start(kind, nursery, draft_model))
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all((HEAD + "Transfer-Encoding: chunked\r\n\r\n").encode())
    sent = 0
    answered_at: list[int] = []

    async def send() -> None:
        nonlocal sent
        chunk = f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"
        try:
            while sent < CHUNKED_TOTAL and not answered_at:
                await stream.send_all(chunk)
                sent += CHUNK
                await trio.sleep(0.001)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    answer = b""

    async def receive() -> None:
        nonlocal answer
        first = await stream.receive_some(65536)
        answered_at.append(sent)
        answer = first + await read_until_closed(stream)

    with trio.fail_after(60):
        async with trio.open_nursery() as inner:
            inner.start_soon(send)
            inner.start_soon(receive)
    await stream.aclose()
    assert_refused(answer)
    assert answered_at[0] < CHUNKED_TOTAL // 2, f"answered after {answered_at[0]} bytes"
