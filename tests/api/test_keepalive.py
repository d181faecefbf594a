"""Every answer leaves a keep-alive connection usable (or closes it, saying so).

A real keep-alive client (httpx, one connection) sends 200 requests in a loop over every
error path of `serve` and `route` (404, 405, 413, 415, 401, 400, 429) between good ones;
each must be answered within 10 s. hypercorn once blocked a connection's reader when the
app answered before reading the body (api.hardening): the next request hung.
"""

from __future__ import annotations

from collections import Counter

import httpx
import trio

from tests.api.routerkit import start_replica, start_router
from tests.conftest import start_server

KEY = "keep-alive-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"prompt": "x = 1", "max_tokens": 1, "temperature": 0}
LONG = {"prompt": "value = 1\n" * 60, "max_tokens": 1, "temperature": 0}  # > 64 queued tokens
LIMIT = 4096


def cases(*, with_429: bool) -> list[tuple[str, str, dict, bytes, int]]:
    """(method, path, headers, body, expected status) over every error path."""
    json = {"Content-Type": "application/json", **AUTH}
    good = httpx.Request("POST", "http://x", json=GOOD).content
    out = [
        ("POST", "/v1/completions", json, good, 200),
        ("POST", "/no/such/path", json, b'{"a": 1}' * 64, 404),
        ("PUT", "/v1/completions", json, good, 405),
        ("POST", "/v1/completions", json, b"x" * (LIMIT * 4), 413),
        ("POST", "/v1/completions", {**AUTH, "Content-Type": "text/plain"}, good, 415),
        ("POST", "/v1/completions", {"Content-Type": "application/json"}, good, 401),
        ("POST", "/v1/completions", json, b"{not json", 400),
        ("GET", "/health", {}, b"", 200),
    ]
    if with_429:
        out.append(("POST", "/v1/completions", json,
                    httpx.Request("POST", "http://x", json=LONG).content, 429))
    return out


def late(body: bytes):
    """The body as two chunks, the second sent after the server may have answered."""

    async def chunks():
        yield body[:len(body) // 2]
        await trio.sleep(0.005)
        yield body[len(body) // 2:]

    return chunks()


async def keep_alive_loop(url: str, plan: list[tuple[str, str, dict, bytes, int]],
                          n: int = 200) -> tuple[Counter, int]:
    """Send n requests cycling through `plan` on a one-connection client, every other
    round with the body arriving late; return the statuses seen (as (method, path,
    expected, got)) and the number of requests not answered within 10 s."""
    seen: Counter = Counter()
    hangs = 0
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        for i in range(n):
            method, path, headers, body, want = plan[i % len(plan)]
            content = late(body) if body and (i // len(plan)) % 2 else body
            with trio.move_on_after(10) as scope:
                response = await client.request(method, url + path, headers=headers,
                                                content=content)
            if scope.cancelled_caught:
                hangs += 1
                continue
            seen[(method, path, want, response.status_code)] += 1
    return seen, hangs


def assert_answered(seen: Counter, hangs: int, plan: list) -> None:
    assert hangs == 0, f"{hangs} of 200 requests hung"
    wrong = {k: v for k, v in seen.items() if k[2] != k[3]}
    assert not wrong, wrong
    assert sum(seen.values()) == 200 and len(seen) == len(plan)


async def test_serve_keep_alive_loop_over_every_error_path(nursery, draft_model):
    server = await start_server(nursery, draft_model, api_key=KEY, max_message_bytes=LIMIT,
                                max_queued_tokens=64)
    plan = cases(with_429=True)
    seen, hangs = await keep_alive_loop(server.url, plan)
    assert_answered(seen, hangs, plan)


async def test_route_keep_alive_loop_over_every_error_path(nursery, draft_model):
    replica = await start_replica(nursery, draft_model, max_queued_tokens=64)
    router = await start_router(nursery, [replica.url], api_key=KEY, max_message_bytes=LIMIT)
    plan = cases(with_429=True)
    seen, hangs = await keep_alive_loop(router.url, plan)
    assert_answered(seen, hangs, plan)


async def test_an_early_answer_to_an_unread_body_closes_the_connection(nursery, draft_model):
    """A 401 sent while the body is still arriving says `connection: close`, and the
    connection closes after it: the client never sends into a half-read request."""
    server = await start_server(nursery, draft_model, api_key=KEY)
    host, port = server.url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        await stream.send_all(head.encode() + b"{" * 1000)  # most of the body never comes
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                received += chunk
    status, _, rest = received.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 401"), received[:200]
    assert b"connection: close" in rest.lower(), received[:400]
