"""HTTP connections of `serve` and `route` (api.httpconn): idle, header and body timeouts,
`Connection: close` and HTTP/1.0 honoured, the cap on open connections, the descriptor
limit raised to fit it.

hypercorn's idle timer died at birth for about half of the connections (its task was
started from the app's cancelled task), and so did the close after `Connection: close`:
150 clients that each sent one request and kept the socket stayed connected.
"""

from __future__ import annotations

import resource
import subprocess
import sys

import trio
from trio_websocket import open_websocket_url

from tests.api.routerkit import start_replica, start_router
from tests.conftest import start_server
from tqserve.tools.rawws import http_get

CLIENTS = 150
REQUESTS = (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            b"GET /health HTTP/1.0\r\n\r\n")
CLOSE_BOUND = 60.0  # seconds the test waits at most (the timeouts are far shorter)


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    try:
        while chunk := await stream.receive_some(65536):
            received += chunk
    except trio.BrokenResourceError:
        pass
    return received


async def idle_clients_are_closed(url: str) -> None:
    """CLIENTS sockets each send one request and keep the socket: every one is answered
    and closed by the server; /health and a WebSocket upgrade work meanwhile."""
    host, port = host_port(url)
    streams = []
    for i in range(CLIENTS):
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(REQUESTS[i % len(REQUESTS)])
        streams.append(stream)
    answers: list[bytes] = []

    async def wait(stream: trio.SocketStream) -> None:
        answers.append(await read_until_closed(stream))

    with trio.move_on_after(CLOSE_BOUND):
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(wait, stream)
            assert (await http_get(port, "/health"))[0] == 200
            async with open_websocket_url(url.replace("http://", "ws://") + "/v1/stream"):
                pass
    for stream in streams:
        await stream.aclose()
    assert len(answers) == CLIENTS, f"{CLIENTS - len(answers)} idle connections still open"
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), {a[:20] for a in answers}


async def test_serve_closes_idle_connections(nursery, draft_model):
    server = await start_server(nursery, draft_model)
    await idle_clients_are_closed(server.url)


async def test_route_closes_idle_connections(nursery, draft_model):
    replica = await start_replica(nursery, draft_model)
    router = await start_router(nursery, [replica.url])
    await idle_clients_are_closed(router.url)


async def test_a_head_and_a_body_that_never_complete_get_408(nursery, draft_model):
    """A request head sent in part, and a body trickled in a byte at a time: 408 naming
    the flag, then the connection is closed (its place is free again)."""
    server = await start_server(nursery, draft_model, http_header_timeout=1.0,
                                http_body_timeout=1.5)
    host, port = host_port(server.url)
    head = await trio.open_tcp_stream(host, port)
    await head.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-a: ")
    body = await trio.open_tcp_stream(host, port)
    await body.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 1000\r\n\r\n")
    got: dict[str, bytes] = {}

    async def trickle() -> None:
        try:
            while "body" not in got:
                await body.send_all(b" ")
                await trio.sleep(0.2)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def read(name: str, stream: trio.SocketStream) -> None:
        got[name] = await read_until_closed(stream)

    with trio.fail_after(CLOSE_BOUND):
        async with trio.open_nursery() as inner:
            inner.start_soon(trickle)
            inner.start_soon(read, "head", head)
            inner.start_soon(read, "body", body)
    for name, flag in (("head", b"--http-header-timeout"), ("body", b"--http-body-timeout")):
        assert got[name].startswith(b"HTTP/1.1 408"), got[name][:200]
        assert flag in got[name] and b"connection: close" in got[name].lower()
    assert (await http_get(port, "/health"))[0] == 200


async def test_max_connections_counts_http_connections(nursery, draft_model):
    """--max-connections counts plain HTTP connections too: with 3 held open, a request
    on a 4th is a 503 naming the flag (counted); closing one frees its place."""
    server = await start_server(nursery, draft_model, max_connections=3)
    host, port = host_port(server.url)
    held = [await trio.open_tcp_stream(host, port) for _ in range(3)]
    for stream in held:  # served: each is counted once it is accepted
        await stream.send_all(REQUESTS[0])
        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
    status, body = await http_get(port, "/health")
    assert status == 503 and b"too_many_connections" in body and b"--max-connections" in body
    await held.pop().aclose()
    with trio.fail_after(CLOSE_BOUND):
        while (await http_get(port, "/v1/stats"))[0] != 200:
            await trio.sleep(0.05)
    status, body = await http_get(port, "/v1/stats")
    assert b'"too_many_connections": 1' in body or b'"too_many_connections":1' in body, body
    for stream in held:
        await stream.aclose()


def test_descriptor_limit_is_raised_to_fit_the_cap_or_the_cap_lowered():
    """A soft RLIMIT_NOFILE below what the cap needs is raised; a hard limit too low
    lowers the cap with one warning line (each in a fresh process: limits stick). The
    limits are set after the import, as a server has imported mlx-lm before it listens."""
    code = ("import resource, sys\n"
            "from tqserve.api.hardening import fit_descriptor_limit\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))\n"
            "fits = fit_descriptor_limit(1024)\n"
            "print(fits, resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")

    def run(soft: int, hard: int) -> tuple[str, str]:
        done = subprocess.run([sys.executable, "-c", code, str(soft), str(hard)],
                              capture_output=True, text=True, timeout=60, check=True)
        return done.stdout.split(), done.stderr

    (fits, soft), warning = run(200, 4096)
    assert (fits, soft) == ("1024", str(1024 + 256)) and warning == ""
    (fits, soft), warning = run(200, 400)
    assert (fits, soft) == ("144", "400")
    assert "--max-connections lowered from 1024 to 144" in warning


def test_importing_mlx_lm_through_tqserve_keeps_the_users_descriptor_limits():
    """mlx_lm.utils sets (2048, 4096) at import: alone it dies where the hard limit is below
    4,096 and lowers one above it; imported after tqserve it only raises the soft limit
    within the hard one (tqserve/fdlimit.py)."""
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))\n"
            "if sys.argv[3] == 'tqserve':\n"
            "    import tqserve.engine.model\n"
            "import mlx_lm.utils\n"
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n")

    def run(soft: int, hard: int, first: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", code, str(soft), str(hard), first],
                              capture_output=True, text=True, timeout=120)

    alone = run(200, 400, "mlx_lm")
    assert alone.returncode != 0 and "not allowed to raise maximum limit" in alone.stderr
    kept = run(200, 400, "tqserve")
    assert kept.returncode == 0 and kept.stdout.split() == ["400", "400"], kept.stderr
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > 4096:
        high = 8192 if hard == resource.RLIM_INFINITY else hard
        assert run(300, high, "mlx_lm").stdout.split() == ["2048", "4096"]
        assert run(300, high, "tqserve").stdout.split() == ["2048", str(high)]
