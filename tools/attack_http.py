"""The HTTP-connection phase of tools.attack: idle sockets, trickled bodies, oversized
Content-Length, hostile Origin (api.httpconn, api.auth; docs/limits.md)."""

from __future__ import annotations

import time
from typing import Any

import trio

from tqserve.tools.rawws import connect, http_get

CLOSE_WAIT = 60.0  # seconds the server gets to close every idle or trickling socket
TRICKLE_SLEEP = 0.5  # seconds between the bytes of a trickled body
BIG_LENGTH = 16_000_000  # the Content-Length an oversized request declares
HEAD = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")


async def _until_closed(stream: trio.SocketStream) -> bytes:
    received = b""
    try:
        while chunk := await stream.receive_some(65536):
            received += chunk
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    return received


async def _closing(streams: list[trio.SocketStream], feed: Any = None) -> tuple[list, float]:
    """(answers, seconds until the last closed) for sockets the server must close."""
    start = time.perf_counter()
    answers: list[bytes] = []
    done = trio.Event()

    async def wait(stream: trio.SocketStream) -> None:
        answers.append(await _until_closed(stream))
        if len(answers) == len(streams):
            done.set()

    with trio.move_on_after(CLOSE_WAIT):
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(wait, stream)
                if feed is not None:
                    nursery.start_soon(feed, stream, done)
            await done.wait()
            nursery.cancel_scope.cancel()
    for stream in streams:
        await stream.aclose()
    return answers, round(time.perf_counter() - start, 2)


async def phase_http(port: int, idle: int, trickle: int, oversize: int) -> dict[str, Any]:
    """Each kind of hostile HTTP client, counted; /health and a WebSocket meanwhile."""
    held = []
    for i in range(idle):  # one request each, then nothing, the socket kept open
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" if i % 2 else
                         b"GET /health HTTP/1.0\r\n\r\n")
        held.append(s)
    health = (await http_get(port, "/health"))[0] == 200
    ws, ws_head = await connect(port)
    await ws.aclose()
    idle_answers, idle_s = await _closing(held)
    bodies = []
    for _ in range(trickle):
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all((HEAD + "Content-Length: 100000\r\n\r\n").encode())
        bodies.append(s)

    async def trickle_bytes(stream: trio.SocketStream, done: trio.Event) -> None:
        try:
            while not done.is_set():
                await stream.send_all(b" ")
                await trio.sleep(TRICKLE_SLEEP)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    trickle_answers, trickle_s = await _closing(bodies, trickle_bytes)
    refused, slowest = 0, 0.0
    for _ in range(oversize):
        start = time.perf_counter()
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all((HEAD + f"Content-Length: {BIG_LENGTH}\r\n\r\n{{").encode())
        with trio.move_on_after(CLOSE_WAIT):
            answer = await s.receive_some(65536)
            refused += answer.startswith(b"HTTP/1.1 413")
        slowest = max(slowest, time.perf_counter() - start)
        await s.aclose()
    origins = {}
    for origin in ("http://evil.example", "http://localhost:3000"):
        s, head = await connect(port, origin=origin)
        origins[origin] = int(head.split(b" ", 2)[1])
        await s.aclose()
    return {"idle_sockets": idle, "idle_closed": len(idle_answers), "idle_close_s": idle_s,
            "health_answered": health, "websocket_accepted": ws_head.startswith(b"HTTP/1.1 101"),
            "trickled_bodies": trickle, "trickle_closed": len(trickle_answers),
            "trickle_408": sum(a.startswith(b"HTTP/1.1 408") for a in trickle_answers),
            "trickle_close_s": trickle_s, "oversize_requests": oversize,
            "oversize_413": refused, "oversize_slowest_s": round(slowest, 3),
            "origin_status": origins}
