"""The router and what it trusts: backends that hang, flood or die under a request
(poison requests are never resent), browser origins, and its two keys.

The misbehaving backends are real HTTP servers on loopback (`Misbehaving`): /health
answers 200, so the router routes to them, and every POST gets one kind of bad answer.
"""

from __future__ import annotations

import httpx
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.api.routerkit import start_replica, start_router
from tests.conftest import start_server
from tqserve.tools.attack_router import HEALTH_OK, read_head

LIMIT = 1 << 20


class Misbehaving:
    """A backend on loopback whose POST answers are `mode`: `silent` (never a byte),
    `huge` (a JSON body of `size` bytes, 32 MiB), `undelimited` (an SSE stream with no event end)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.bytes_sent = 0
        self.size = 32 << 20

    async def start(self, nursery: trio.Nursery) -> str:
        listeners = await nursery.start(
            lambda task_status: trio.serve_tcp(self.handle, 0, host="127.0.0.1",
                                               task_status=task_status))
        return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"

    async def handle(self, stream: trio.SocketStream) -> None:
        try:
            if (await read_head(stream)).startswith(b"GET /health"):
                await stream.send_all(HEALTH_OK)
            elif self.mode == "silent":
                await trio.sleep_forever()
            else:
                sse = self.mode == "undelimited"
                kind = b"text/event-stream" if sse else b"application/json"
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: " + kind +
                                      b"\r\ncontent-length: %d\r\n\r\n" % (self.size))
                piece = (b"data: " if sse else b"") + b"x" * 65536
                while self.bytes_sent < (self.size):
                    await stream.send_all(piece)
                    self.bytes_sent += len(piece)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()


@pytest.mark.parametrize("mode, status, code", [("silent", 504, "backend_timeout"),
                                                ("huge", 502, "backend_failed"),
                                                ("undelimited", 502, "backend_failed")])
async def test_a_backend_that_hangs_or_floods_gets_a_clear_error(nursery, mode, status, code):
    backend = Misbehaving(mode)
    router = await start_router(nursery, [await backend.start(nursery)],
                                backend_read_timeout=1.0, max_backend_bytes=LIMIT)
    body = {"prompt": "x", "max_tokens": 2, "stream": mode == "undelimited"}
    async with httpx.AsyncClient(timeout=60) as client:
        with trio.fail_after(60):
            response = await client.post(router.url + "/v1/completions", json=body)
    assert response.status_code == status, response.text[:300]
    assert response.json()["error"]["code"] == code
    assert len(response.content) < 4096
    if mode != "silent":  # the router stopped reading soon after the limit
        assert "--max-backend-bytes" in response.json()["error"]["message"]


async def test_a_request_its_backend_died_on_is_not_resent(nursery, draft_model):
    """A backend killed while it handles an HTTP request: the client gets 502
    backend_failed; the request never reaches the other backend, which stays up."""
    replicas = [await start_replica(nursery, draft_model) for _ in range(2)]
    router = await start_router(nursery, [r.url for r in replicas], health_interval=3600)
    answer: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=120) as client:
        async def ask() -> None:
            answer.append(await client.post(router.url + "/v1/completions", json={
                "prompt": "def main():", "max_tokens": 4000, "temperature": 0}))

        async with trio.open_nursery() as inner:
            inner.start_soon(ask)
            victim = None
            with trio.fail_after(60):
                while victim is None:
                    for r in replicas:
                        if (await client.get(r.url + "/v1/stats")).json()["rows_active"]:
                            victim = r
                    await trio.sleep(0.01)
            victim.kill()
        other = next(r for r in replicas if r is not victim)
        stats = (await client.get(other.url + "/v1/stats")).json()
        assert (await client.get(other.url + "/health")).status_code == 200
    (response,) = answer
    assert response.status_code == 502, response.text[:300]
    assert response.json()["error"]["code"] == "backend_failed"
    assert "not retried" in response.json()["error"]["message"]
    assert stats["requests_total"] == 0  # never resent to the other backend


async def ws_status(url: str, origin: str | None) -> int:
    headers = [] if origin is None else [(b"Origin", origin.encode())]
    try:
        async with open_websocket_url(url, extra_headers=headers):
            return 101
    except ConnectionRejected as exc:
        return exc.status_code


async def test_websocket_origins_default_to_same_origin_and_loopback(nursery, draft_model):
    server = await start_server(nursery, draft_model)
    open_server = await start_server(nursery, draft_model, allowed_origins="*")
    router = await start_router(nursery, [server.url])
    for url in (server.ws_url, router.ws_url):
        assert await ws_status(url, "http://evil.example") == 403
        assert await ws_status(url, None) == 101  # not a browser
        for origin in ("http://localhost:3000", "http://127.0.0.1:9", "http://[::1]:80"):
            assert await ws_status(url, origin) == 101, origin
    host = server.url.removeprefix("http://")
    assert await ws_status(server.ws_url, f"http://{host}") == 101  # its own origin
    assert await ws_status(open_server.ws_url, "http://evil.example") == 101  # opted in
    async with httpx.AsyncClient() as client:
        refused = await client.get(router.url + "/v1/stats",
                                   headers={"Origin": "https://evil.example"})
        assert refused.status_code == 403 and "--allowed-origins" in refused.text


async def test_router_admin_key_and_models_with_keys(nursery, draft_model):
    """With --api-key and --admin-key, /admin/drain takes the admin key; GET /v1/models
    with the client's key answers from a backend that needs --backend-api-key."""
    replica = await start_replica(nursery, draft_model, api_key="backend-key")
    router = await start_router(nursery, [replica.url], api_key="client-key",
                                admin_key="admin-key", backend_api_key="backend-key")
    async with httpx.AsyncClient() as client:
        models = await client.get(router.url + "/v1/models",
                                  headers={"Authorization": "Bearer client-key"})
        assert models.status_code == 200, models.text
        assert models.json()["data"][0]["id"]
        assert (await client.get(router.url + "/v1/models")).status_code == 401
        drain = await client.post(router.url + "/admin/drain",
                                  headers={"Authorization": "Bearer admin-key"},
                                  json={"backend": replica.url, "drain": True})
        assert drain.status_code == 200, drain.text
        assert drain.json()["state"] == "draining"
        wrong = await client.post(router.url + "/admin/drain",
                                  headers={"Authorization": "Bearer client-key"},
                                  json={"backend": replica.url})
        assert wrong.status_code == 401
