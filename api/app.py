"""quart-trio app: WebSocket /v1/stream, GET /health, GET /v1/stats; the HTTP APIs,
/metrics and auth come from api.routes.

One connection multiplexes many requests by client-chosen id. Each request runs
as a task in the connection's nursery; all frames leave through one writer task
fed by a bounded channel (OUTGOING_FRAMES), so a slow client backs up into its
requests' hub streams, which cancel the request at once and end it with a
`slow_consumer` error instead of growing a buffer. An exception in one request
(our bug) is an `internal_error` frame for that request; the socket goes on. A disconnect cancels the connection's nursery, which
cancels every request on it (their rows are freed within one engine step).

Shutdown (api.server): once the engine stops admitting, /health answers 503 and a new
WebSocket upgrade is refused with 503; `Connections.close_all()` then has each open
socket send what its ended requests still owe and close with code 1001 (going away).
Every HTTP error (404, 405, ...) is a JSON body `{"error": {"code", "message"}}`.
"""

from __future__ import annotations

import itertools
import logging
from contextlib import aclosing
from typing import Any

import attrs
import trio
from quart import jsonify, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from tqserve.actors.facade import Engine
from tqserve.actors.messages import Error
from tqserve.api.auth import WS_PROTOCOL
from tqserve.api.config import ServerConfig
from tqserve.api.playground import add_playground
from tqserve.api.metrics import Metrics
from tqserve.api.protocol import (CancelCommand, GenerateCommand, ProtocolError, decode_frame,
                          encode_frame, parse_command)
from tqserve.api.responses_ws import serve_responses_socket
from tqserve.api.routes import register_http_apis

log = logging.getLogger("tqserve.api")
OUTGOING_FRAMES = 64  # frames waiting for the socket writer; a full queue backs up requests
_CONNECTION_IDS = itertools.count()  # never reused, unlike id(): engine ids stay unique
GOING_AWAY = 1001  # WebSocket close code sent to every socket at shutdown


class Connections:
    """The server's open WebSocket connections, so that shutdown can close them."""

    def __init__(self) -> None:
        self.closing = trio.Event()
        self.num_open = 0
        self._changed = trio.Event()  # replaced after every close

    def close_all(self) -> None:
        """Ask every connection to flush its frames and close with 1001."""
        self.closing.set()

    def opened(self) -> None:
        self.num_open += 1

    def closed(self) -> None:
        self.num_open -= 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_closed(self) -> None:
        """Wait until no connection is open."""
        while self.num_open:
            await self._changed.wait()


class _Connection:
    """One WebSocket connection: its requests and its writer."""

    def __init__(self, engine: Engine, config: ServerConfig, nursery: trio.Nursery,
                 out: trio.MemorySendChannel[str | bytes], metrics: Metrics) -> None:
        self._engine = engine
        self._config = config
        self._metrics = metrics
        self._nursery = nursery
        self._out = out
        self._conn_id = next(_CONNECTION_IDS)
        self._next_seq = 0
        self._active: dict[str, str] = {}
        self._changed = trio.Event()  # replaced whenever a request ends
        self.closing = False  # set at shutdown: frames that arrive now are not answered

    async def wait_no_requests(self) -> None:
        """Wait until every request of this connection has sent its last frame."""
        while self._active:
            await self._changed.wait()

    async def send_event(self, event: dict[str, Any], binary: bool) -> None:
        try:
            await self._out.send(encode_frame(event, binary))
        except trio.ClosedResourceError:  # the socket is closing at shutdown
            pass

    async def error(self, exc: ProtocolError, binary: bool) -> None:
        if exc.code != "unknown_id":  # a late cancel refuses no request
            self._engine.note_rejection(exc.code)
        await self.send_event(Error(request_id=exc.request_id, code=exc.code,
                                    message=exc.message).to_wire(), binary)

    async def handle(self, data: str | bytes) -> None:
        if self.closing:
            return
        binary = isinstance(data, bytes)
        config = self._config
        try:
            obj = decode_frame(data, config.max_message_bytes)
            command = parse_command(obj, config.engine.default_max_tokens)
            if isinstance(command, CancelCommand):
                engine_id = self._active.get(command.request_id)
                if engine_id is None:
                    raise ProtocolError("unknown_id", f"no active request with id "
                                        f"{command.request_id!r}", command.request_id)
                await self._engine.cancel(engine_id)
                return
            rid = command.request_id
            if rid in self._active:
                raise ProtocolError("duplicate_id", f"request id {rid!r} is already active", rid)
            if len(self._active) >= config.max_streams_per_connection:
                raise ProtocolError("too_many_streams", f"at most "
                                    f"{config.max_streams_per_connection} concurrent requests "
                                    "per connection", rid)
        except ProtocolError as exc:
            await self.error(exc, binary)
            return
        except Exception as exc:  # our bug: this frame fails, the socket goes on
            log.exception("frame handling failed")
            await self.error(ProtocolError("internal_error", f"{type(exc).__name__}: {exc}"),
                             binary)
            return
        engine_id = f"{self._conn_id:x}:{self._next_seq}:{rid}"
        self._next_seq += 1
        self._active[rid] = engine_id
        self._nursery.start_soon(self._run, command, engine_id, binary)

    async def _run(self, command: GenerateCommand, engine_id: str, binary: bool) -> None:
        rid = command.request_id
        try:
            events = self._engine.generate(command.request, engine_id)
            tracked = self._metrics.track(events, rid, "WS /v1/stream")
            async with aclosing(tracked) as stream:
                async for event in stream:
                    wire = event.to_wire()
                    wire["id"] = rid
                    await self.send_event(wire, binary)
        except Exception as exc:  # our bug: it fails this request only, never the socket
            log.exception("request %s failed", engine_id)
            await self.send_event(Error(request_id=rid, code="internal_error",
                                        message=f"{type(exc).__name__}: {exc}").to_wire(), binary)
        finally:
            self._active.pop(rid, None)
            self._changed.set()
            self._changed = trio.Event()


def create_app(engine: Engine, config: ServerConfig, connections: Connections | None = None,
               *, response_id_prefix: str = "resp_") -> QuartTrio:
    """The ASGI app bound to a running engine, the server's settings and connections."""
    app = QuartTrio("tqserve")
    connections = connections if connections is not None else Connections()

    # Quart refuses a body whose Content-Length is over it before reading any, and stops
    # buffering one that streams past it (its own default is 16 MiB, read before our check)
    app.config["MAX_CONTENT_LENGTH"] = config.max_message_bytes

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Any:
        code = (exc.name or "error").lower().replace(" ", "_")
        return jsonify({"error": {"code": code, "message": exc.description}}), exc.code

    apis = register_http_apis(app, engine, config, response_id_prefix)  # after: its 404/405 win
    metrics = apis.metrics

    @app.get("/health")
    async def health() -> Any:
        if engine.shutting_down:
            return jsonify({"status": "shutting_down", "model": engine.model.path.name}), 503
        return jsonify({"status": "ok", "model": engine.model.path.name})

    @app.get("/v1/stats")
    async def stats() -> Any:
        return jsonify(attrs.asdict(engine.statistics()))

    add_playground(app, engine)  # GET /, its static files, the vocabulary it shows

    def refused() -> Any:
        """Why a WebSocket upgrade is refused now (a 503), or None."""
        if engine.shutting_down or connections.closing.is_set():
            return jsonify({"error": {"code": "shutting_down",
                                      "message": "the server is shutting down"}}), 503
        limit = config.max_connections
        if connections.num_open >= limit:  # checked and counted with no await between
            engine.note_rejection("too_many_connections")
            return jsonify({"error": {"code": "too_many_connections",
                                      "message": f"the server holds {limit} WebSocket "
                                                 "connections already (--max-connections)"}}
                           ), 503, {"Retry-After": "1"}
        return None

    @app.websocket("/v1/stream")
    async def stream() -> Any:
        if (answer := refused()) is not None:
            return answer
        connections.opened()
        try:
            await _serve_socket(engine, config, connections, metrics)
        finally:
            connections.closed()
        return None

    @app.websocket("/v1/responses")
    async def responses_socket() -> Any:
        if (answer := refused()) is not None:
            return answer
        connections.opened()
        try:
            await serve_responses_socket(apis.responder, connections.closing)
        finally:
            connections.closed()
        return None

    return app


async def _serve_socket(engine: Engine, config: ServerConfig, connections: Connections,
                        metrics: Metrics) -> None:
    """One accepted WebSocket: its frames, its requests, its writer, its close at shutdown."""
    chosen = WS_PROTOCOL if WS_PROTOCOL in websocket.requested_subprotocols else None
    await websocket.accept(subprotocol=chosen)
    send, receive = trio.open_memory_channel[str | bytes](OUTGOING_FRAMES)
    flushed = trio.Event()

    async def writer() -> None:
        async for frame in receive:
            await websocket.send(frame)
        flushed.set()

    async def close_at_shutdown(conn: _Connection) -> None:
        await connections.closing.wait()
        await conn.wait_no_requests()  # the engine ended them all before close_all
        conn.closing = True
        send.close()
        await flushed.wait()
        await websocket.close(GOING_AWAY, "server shutting down")
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer)
        conn = _Connection(engine, config, nursery, send, metrics)
        nursery.start_soon(close_at_shutdown, conn)
        try:
            while True:
                await conn.handle(await websocket.receive())
        finally:
            nursery.cancel_scope.cancel()
