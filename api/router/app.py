"""The router's quart-trio app and its hypercorn server (`serve_router`).

Routes: WebSocket /v1/stream (api.router.ws), POST /v1/completions,
/v1/chat/completions, /v1/messages (api.router.http), GET /v1/models (from the first
healthy backend), GET /health (200 while a backend is healthy and the router admits;
503 otherwise, with every backend's state), GET /v1/stats (the route table's
statistics), GET /metrics (Prometheus text, one series per backend), and with
--admin-key, POST /admin/drain {"backend": URL, "drain": true|false} (Authorization:
Bearer KEY): that backend takes no new requests while its in-flight ones finish.

With --api-key, every route but /health and the WebSocket upgrade need the key
(Authorization: Bearer KEY or x-api-key: KEY), as on the server.

Shutdown (`shutdown_trigger`, set by `tqserve route` on SIGTERM/SIGINT): the router
drains (new requests get `shutting_down`, /health 503), in-flight requests get
`shutdown_timeout` seconds to finish, then every socket closes with 1001 and hypercorn
stops.
"""

from __future__ import annotations

import hmac
from typing import Any

import attrs
import httpx
import trio
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
from quart import Response, jsonify, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from tqserve.api.httpconn import too_large_message
from tqserve.api.auth import origin_allowed
from tqserve.api.hardening import listen_hardened
from tqserve.api.router import http
from tqserve.api.router.core import HealthEvent
from tqserve.api.router.metrics import exposition
from tqserve.api.router.service import HTTP_CONNECTIONS, Router, RouterConfig
from tqserve.api.router.ws import OUTGOING_FRAMES, ClientConnection

GOING_AWAY = 1001
CLOSE_GRACE = 5.0  # seconds sockets get to flush and close at shutdown
FLUSH_SECONDS = 2.0  # at shutdown, seconds a WebSocket gets to send the frames it queued
WS_MESSAGE_TIMEOUT = 30.0  # seconds one WebSocket message may take to arrive (as the server)
BACKEND_CONNECT_TIMEOUT = 5.0  # seconds a connection to a backend may take to open
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def create_app(router: Router) -> QuartTrio:
    """The ASGI app in front of a running Router."""
    app = QuartTrio("tqserve-router")
    closing = trio.Event()
    app.extensions["router_closing"] = closing

    app.config["MAX_CONTENT_LENGTH"] = router.config.max_message_bytes  # as the server's

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Any:
        code = (exc.name or "error").lower().replace(" ", "_")
        if exc.code == 413:
            router.reject("too_large")
        return http.error_response(_path(), exc.code or 500, too_large_message(
            exc, router.config.max_message_bytes) or code, code)

    api_key = router.config.api_key

    @app.before_request
    async def check_key() -> Response | None:
        if (api_key is None or request.path == "/health" or request.path.startswith("/admin/")
                or key_ok(api_key, request.headers)):  # /admin/: the admin key (below)
            return origin_refused(request.path, request.headers)
        return http.error_response(request.path, 401, "missing or invalid API key (send it "
                                   "as 'Authorization: Bearer <key>')", "unauthorized")

    def origin_refused(path: str, headers: Any) -> Response | None:
        origin = headers.get("Origin")
        if origin_allowed(origin, headers.get("Host"), router.config.allowed_origins):
            return None
        return http.error_response(path, 403, f"origin {origin!r} is not allowed "
                                   "(--allowed-origins)", "forbidden")

    @app.before_websocket
    async def check_upgrade() -> Response | None:
        if api_key is None or key_ok(api_key, websocket.headers):
            return origin_refused("/v1/stream", websocket.headers)
        return Response('{"error": "missing or invalid API key"}', 401,
                        content_type="application/json")

    @app.get("/health")
    async def health() -> Any:
        stats = router.table.statistics()
        states = {name: b.state for name, b in stats.backends.items()}
        if router.draining:
            return jsonify({"status": "shutting_down", "backends": states}), 503
        if not router.table.routable():
            return jsonify({"status": "no_healthy_backend", "backends": states}), 503
        return jsonify({"status": "ok", "backends": states})

    @app.get("/v1/stats")
    async def stats() -> Any:
        """The route table's statistics at the top level, the rest of the router's next
        to them."""
        record = attrs.asdict(router.statistics())
        return jsonify({**record.pop("routing"), **record})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(exposition(router), content_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Any:
        for backend in router.table.routable():
            try:
                response = await router.http.get(
                    backend + "/v1/models", timeout=router.config.health_timeout,
                    headers=http.backend_headers(router, request.headers))
            except httpx.TransportError:
                continue
            return Response(response.content, status=response.status_code,
                            content_type=response.headers.get("content-type"))
        return http.error_response("/v1/models", 503, "no healthy backend",
                                   "no_healthy_backend")

    @app.post("/admin/drain")
    async def drain_backend() -> Any:
        """Drain one backend (no new requests; in-flight ones finish) or undrain it."""
        key = router.config.admin_key
        if key is None:
            return http.error_response("/admin", 404, "no --admin-key is set", "not_found")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return http.error_response("/admin", 401, "wrong or missing admin key",
                                       "unauthorized")
        body = await request.get_json(force=True, silent=True)
        if not isinstance(body, dict) or body.get("backend") not in router.table.names:
            return http.error_response("/admin", 400, "backend must be one of the router's "
                                       f"--backend URLs: {list(router.table.names)}",
                                       "invalid_request")
        drain = body.get("drain", True)
        if not isinstance(drain, bool):
            return http.error_response("/admin", 400, "drain must be true or false",
                                       "invalid_request")
        state = router.table.set_health(body["backend"], HealthEvent.DRAIN if drain
                                        else HealthEvent.UNDRAIN)
        return jsonify({"backend": body["backend"], "state": state.value,
                        "in_flight": router.table.num_in_flight(body["backend"])})

    http.register(app, router)

    @app.websocket("/v1/stream")
    async def stream() -> Any:
        if router.draining:
            return jsonify({"error": {"code": "shutting_down",
                                      "message": "the router is shutting down"}}), 503
        await websocket.accept()
        send, receive = trio.open_memory_channel[str | bytes](OUTGOING_FRAMES)

        async with trio.open_nursery() as nursery:
            _start_writer(nursery, send, receive, closing)
            conn = ClientConnection(router, nursery, send)
            try:
                while True:
                    await conn.handle(await websocket.receive())
            finally:
                nursery.cancel_scope.cancel()
        return None

    return app


def _start_writer(nursery: trio.Nursery, send: Any, receive: Any, closing: trio.Event) -> None:
    """The WebSocket's writer of queued frames, and its close at shutdown: the frames
    already queued (a request's Done) are sent first, for at most FLUSH_SECONDS."""
    flushed = trio.Event()

    async def writer() -> None:
        async for frame in receive:
            await websocket.send(frame)
        flushed.set()

    async def close_at_shutdown() -> None:
        await closing.wait()
        send.close()
        with trio.move_on_after(FLUSH_SECONDS):
            await flushed.wait()
        await websocket.close(GOING_AWAY, "router shutting down")
        nursery.cancel_scope.cancel()

    nursery.start_soon(writer)
    nursery.start_soon(close_at_shutdown)


def key_ok(expected: str, headers: Any) -> bool:
    """Whether the request carries `expected` as a Bearer token or x-api-key (constant
    time), as the server's api.auth checks."""
    auth = headers.get("Authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key")
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def _path() -> str:
    try:
        return request.path
    except RuntimeError:
        return "/"


async def serve_router(config: RouterConfig, *, shutdown_trigger: trio.Event | None = None,
                       task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> Router:
    """Run the router until `shutdown_trigger` (forever without one); report its URL once
    the first round of health checks is done. Returns the Router (its statistics)."""
    hc, sockets = listen_hardened(  # the server's hardening of hypercorn (api.hardening)
        config.host, config.port, hard_message_bytes=2 * config.max_message_bytes + (64 << 10),
        limits=config.http, ws_message_timeout=WS_MESSAGE_TIMEOUT)
    limits = httpx.Limits(max_connections=HTTP_CONNECTIONS)
    timeout = httpx.Timeout(config.backend_read_timeout, connect=BACKEND_CONNECT_TIMEOUT,
                            pool=None)  # read/write: between bytes, not the whole answer
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async with trio.open_nursery() as nursery:
            router = Router(config, nursery, client)
            hc.connection_cap.on_refused = lambda: router.reject("too_many_connections")
            await nursery.start(router.run_health_checks)
            app = create_app(router)
            stop_http = trio.Event()
            http_done = trio.Event()

            async def run_http(*, task_status: trio.TaskStatus[list[str]]) -> None:
                try:
                    await worker_serve(wrap_app(app, hc.wsgi_max_body_size, None), hc,
                                       sockets=sockets, shutdown_trigger=stop_http.wait,
                                       task_status=task_status)
                finally:
                    http_done.set()

            binds = await nursery.start(run_http)
            task_status.started(binds[0])
            if shutdown_trigger is None:
                await trio.sleep_forever()
            else:
                await shutdown_trigger.wait()
            router.drain()
            with trio.move_on_after(config.shutdown_timeout):
                await router.wait_idle()
            app.extensions["router_closing"].set()
            stop_http.set()
            with trio.move_on_after(CLOSE_GRACE):
                await http_done.wait()
            await router.pool.aclose()
            nursery.cancel_scope.cancel()
    return router
