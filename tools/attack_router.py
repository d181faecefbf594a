"""The attack's phase against `tqserve route` (tools.attack): backends it must not trust,
and its two keys.

A router runs in the attack's own process (`serve_router`, loopback) in front of two
misbehaving backends of its own (/health answers 200, so the router routes to them): one
never answers a POST, one answers with a 32 MiB body. Then a second router, with
`--api-key` and `--admin-key`, in front of the attack's real server. What must hold: the
silent backend is a 504 `backend_timeout` after the read timeout, the flood a 502
`backend_failed` read no further than the byte limit (the process's RSS after it within
64 MiB of before), the admin route takes the admin key only and `/v1/models` the client's key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from tqserve.api.router.app import serve_router
from tqserve.api.router.core import RoutingConfig
from tqserve.api.router.service import RouterConfig
from tqserve.tools.attack_engine import exchange, request

FLOOD_BYTES = 32 << 20
BYTE_LIMIT = 1 << 20
READ_TIMEOUT = 1.0


HEALTH_OK = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n"
             b"\r\n{\"status\":\"ok\"}")


async def read_head(stream: trio.SocketStream) -> bytes:
    """A request's bytes up to the end of its head (or the connection's end)."""
    head = b""
    while b"\r\n\r\n" not in head and (chunk := await stream.receive_some(65536)):
        head += chunk
    return head


async def _backend(stream: trio.SocketStream, mode: str) -> None:
    """A backend whose /health says ok and whose POSTs get `mode`: silent or flood."""
    try:
        if (await read_head(stream)).startswith(b"GET /health"):
            await stream.send_all(HEALTH_OK)
        elif mode == "silent":
            await trio.sleep_forever()
        else:
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                  b"content-length: %d\r\n\r\n" % FLOOD_BYTES)
            for _ in range(FLOOD_BYTES >> 16):
                await stream.send_all(b"x" * 65536)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


async def _exchange(url: str, raw: bytes) -> tuple[int, bytes]:
    """tools.attack_engine.exchange with a router's loopback URL."""
    return await exchange(int(url.rsplit(":", 1)[1]), raw)


def _rss_kb() -> int:
    """This process's resident set now (the router runs in it), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def _get(path: str, key: str | None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n".encode()


def _with_key(raw: bytes, key: str) -> bytes:
    return raw.replace(b"\r\n", f"\r\nAuthorization: Bearer {key}".encode() + b"\r\n", 1)


async def phase_router(server_port: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rss_before = _rss_kb()
    async with trio.open_nursery() as nursery:
        for mode in ("silent", "flood"):
            listeners = await nursery.start(lambda task_status, m=mode: trio.serve_tcp(
                lambda s: _backend(s, m), 0, host="127.0.0.1", task_status=task_status))
            backend = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            url = await nursery.start(lambda task_status, b=backend: serve_router(
                RouterConfig(backends=(b,), routing=RoutingConfig(), port=0,
                             backend_read_timeout=READ_TIMEOUT, max_backend_bytes=BYTE_LIMIT),
                task_status=task_status))
            with trio.fail_after(60):
                status, body = await _exchange(url, request("/v1/completions", {
                    "prompt": "x", "max_tokens": 2}))
            out[mode] = {"status": status, "code": json.loads(body)["error"]["code"],
                         "body_bytes": len(body)}
        out["rss_growth_mb"] = round((_rss_kb() - rss_before) / 1024, 1)
        keyed: dict[str, Any] = {"backends": (f"http://127.0.0.1:{server_port}",),
                                 "api_key": "client-key", "admin_key": "admin-key"}
        url = await nursery.start(lambda task_status: serve_router(
            RouterConfig(routing=RoutingConfig(), port=0, **keyed), task_status=task_status))
        drain = request("/admin/drain", {"backend": f"http://127.0.0.1:{server_port}",
                                         "drain": False})
        out["keys"] = {
            "models_client_key": (await _exchange(url, _get("/v1/models", "client-key")))[0],
            "models_no_key": (await _exchange(url, _get("/v1/models", None)))[0],
            "drain_admin_key": (await _exchange(url, _with_key(drain, "admin-key")))[0],
            "drain_client_key": (await _exchange(url, _with_key(drain, "client-key")))[0]}
        nursery.cancel_scope.cancel()
    return out
