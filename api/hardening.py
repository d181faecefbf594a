"""hypercorn hardening: what a hostile peer can make the server hold, and for how long.

hypercorn 0.18 has no settings for these, so `install()` (idempotent) puts two small
subclasses in place of hypercorn's HTTP/1.1 protocol and WebSocket stream. They act only
on servers whose hypercorn config is a `LimitedConfig` (api.server makes one); any other
hypercorn server in the process keeps hypercorn's own behaviour.

* WebSocket compression (permessage-deflate) is never negotiated: the offer is ignored,
  so a compressed (RSV1) frame is a protocol error (close 1002) before its payload is
  read, and no frame can inflate. Frames here are small JSON/msgpack; compression would
  buy little and cost a decompression bomb's worth of memory and CPU.
* A message over `websocket_max_message_size` closes with 1009 and the TCP connection is
  dropped at once, with the partial message's buffer: nothing more of it is read.
* A message (or a frame of it) not completed within `ws_message_timeout` seconds of its
  first byte closes with 1008: a half-sent frame never holds the socket open.
* A frame that fails to parse (invalid UTF-8 in a text frame: 1007; reserved bits, bad
  opcodes: 1002) is answered with a close frame carrying that code, then dropped
  (hypercorn drops the TCP connection without one).
* HTTP/2 is not served: `Upgrade: h2c` is ignored and the request answered in HTTP/1.1
  (RFC 9110 7.8 lets a server ignore an upgrade); a prior-knowledge `PRI * HTTP/2.0`
  preface gets 505 and the connection is closed.
* Idle, header and body timeouts, `Connection: close` and HTTP/1.0 honoured, and the
  cap on open connections: api.httpconn (its LimitedH11Protocol is put in place here).
* An answer given before the request's body was read (a 401, 404, 405, 413, 429 ...) never
  leaves the connection stuck. hypercorn hands body chunks to the app through a queue of
  `max_app_queue_size` messages that nobody reads once the app has returned, so the next
  chunk (or the closing `http.disconnect`) blocked the connection's reader forever and the
  next request on a keep-alive connection hung. Here a stream drops what it would queue
  once its app has returned (and unblocks a put already waiting), and such an early answer
  says `connection: close`: h11 then reads and discards the rest of the body and the
  connection closes after the answer, which the client knows before it sends again.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
from typing import Any, Callable

import hypercorn.protocol
import hypercorn.protocol.h11
import hypercorn.trio.run
import trio
from hypercorn.config import Sockets
from hypercorn.protocol.events import Request, StreamClosed
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.protocol.ws_stream import FrameTooLargeError, WSStream
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection, Message, Ping
from wsproto.frame_protocol import CloseReason

from tqserve.api.httpconn import ConnectionCap, HttpLimits, LimitedConfig, LimitedH11Protocol
from tqserve.api.overload import GatedTCPServer

log = logging.getLogger("tqserve.server")

_EXTENSIONS_HEADER = b"sec-websocket-extensions"


class LimitedWSStream(WSStream):
    """hypercorn's WebSocket stream with the limits of the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limited = isinstance(self.config, LimitedConfig)
        self._incomplete_since: float | None = None
        self._progress = trio.Event()

    async def handle(self, event: Any) -> None:
        if self._limited and isinstance(event, Request):
            headers = [(n, v) for n, v in event.headers if n.lower() != _EXTENSIONS_HEADER]
            event = dataclasses.replace(event, headers=headers)
        elif isinstance(event, StreamClosed):
            self.buffer.clear()
            self._incomplete_since = None
            self._progress.set()
        await super().handle(event)

    async def _accept(self, message: Any) -> None:
        await super()._accept(message)
        if self._limited:
            self.task_group.spawn(self._watch_incomplete)

    async def _handle_events(self) -> None:
        if not self._limited:
            await super()._handle_events()
            return
        for event in self.connection.events():
            if isinstance(event, Message):
                try:
                    self.buffer.extend(event)
                except FrameTooLargeError:
                    await self._fail(CloseReason.MESSAGE_TOO_BIG, "message exceeds "
                                     f"{self.config.websocket_max_message_size} bytes")
                    return
                if event.message_finished:
                    await self.app_put(self.buffer.to_message())
                    self.buffer.clear()
            elif isinstance(event, Ping):
                await self._send_wsproto_event(event.response())
            elif isinstance(event, CloseConnection):
                if self.connection.state == ConnectionState.REMOTE_CLOSING:
                    await self._send_wsproto_event(event.response())
                    await self.send(StreamClosed(stream_id=self.stream_id))
                else:  # a frame that failed to parse: say why before dropping
                    await self._fail(event.code, event.reason or "")
                return
        self._note_progress()

    def _incomplete(self) -> bool:
        decoder = self.connection._proto._frame_decoder  # wsproto 1.x internals
        return (self.buffer.value is not None or decoder.header is not None
                or len(decoder.buffer) > 0)

    def _note_progress(self) -> None:
        if not self._incomplete():
            self._incomplete_since = None
        elif self._incomplete_since is None:
            self._incomplete_since = trio.current_time()
            self._progress.set()

    async def _watch_incomplete(self) -> None:
        """Close the connection when a message stays incomplete too long."""
        timeout = self.config.ws_message_timeout
        while not self.closed:
            self._progress = trio.Event()
            since = self._incomplete_since
            if since is None:
                await self._progress.wait()
                continue
            with trio.move_on_at(since + timeout):
                await self._progress.wait()
                continue
            if self._incomplete_since == since and not self.closed:
                await self._fail(CloseReason.POLICY_VIOLATION,
                                 f"message not completed within {timeout:g} s")
                return

    async def _fail(self, code: int, reason: str) -> None:
        """Send a close frame with `code`, drop buffers, close the TCP connection."""
        self.buffer.clear()
        self._incomplete_since = None
        await self._send_wsproto_event(CloseConnection(code=int(code), reason=reason[:120]))
        await self.send(StreamClosed(stream_id=self.stream_id))


class LimitedHTTPStream(HTTPStream):
    """hypercorn's HTTP stream whose queue to the app cannot block the connection: what
    would be queued once the app returned is dropped, a put waiting then is cancelled, and
    the closing `http.disconnect` is queued in the background (the stream closes inside
    the app's own last send, so waiting there for the app to read would be a deadlock)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app_returned = False
        self._puts: set[trio.CancelScope] = set()

    async def handle(self, event: Any) -> None:
        await super().handle(event)
        if (isinstance(event, Request) and isinstance(self.config, LimitedConfig)
                and getattr(self, "app_put", None) is not None):
            queue_put = self.app_put

            async def put(message: Any) -> None:
                if message.get("type") == "http.disconnect":
                    self.task_group.spawn(self._put, queue_put, message)
                else:
                    await self._put(queue_put, message)

            self.app_put = put

    async def _put(self, queue_put: Any, message: Any) -> None:
        if self._app_returned:
            return  # nobody reads the queue any more: drop it
        with trio.CancelScope() as scope:
            self._puts.add(scope)
            try:
                await queue_put(message)
            finally:
                self._puts.discard(scope)

    async def app_send(self, message: Any) -> None:
        if message is None:  # the app returned: no one will read what is queued for it
            self._app_returned = True
            for scope in self._puts:
                scope.cancel()
        await super().app_send(message)


def install() -> None:
    """Put the subclasses in place of hypercorn's (idempotent)."""
    hypercorn.protocol.H11Protocol = LimitedH11Protocol  # type: ignore[misc]
    hypercorn.protocol.h11.WSStream = LimitedWSStream  # type: ignore[misc]
    hypercorn.protocol.h11.HTTPStream = LimitedHTTPStream  # type: ignore[misc]
    hypercorn.trio.run.TCPServer = GatedTCPServer  # type: ignore[misc]


# Connections the kernel queues before accept (capped by net.core.somaxconn): with
# hypercorn's default of 100, the connects of a burst past 100 that the loop has not yet
# accepted are dropped and wait for the client's SYN retransmits (1 s, then 3 s).
LISTEN_BACKLOG = 4096


# Descriptors a process needs besides its client connections: model and cache files, the
# router's connections to its backends, stdio, the listening sockets, the event loop.
RESERVED_FDS = 256


def fit_descriptor_limit(max_connections: int, reserved: int = RESERVED_FDS) -> int:
    """Raise RLIMIT_NOFILE's soft limit to what `max_connections` client connections
    need; return the cap that fits under it (lowered, with one warning line, where the
    hard limit is too low)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + reserved
    if hard != resource.RLIM_INFINITY and need > hard:
        need = hard
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        soft = need
    fits = max_connections if soft == resource.RLIM_INFINITY else min(
        max_connections, max(1, soft - reserved))
    if fits < max_connections:
        log.warning("the descriptor limit (ulimit -n) is %d: --max-connections lowered from "
                    "%d to %d (%d kept for files and backends)", soft, max_connections, fits,
                    reserved)
    return fits


def listen_hardened(host: str, port: int, *, hard_message_bytes: int, ws_message_timeout: float,
                    limits: HttpLimits, app_queue: int | None = None,
                    on_refused: Callable[[], None] | None = None
                    ) -> tuple[LimitedConfig, Sockets]:
    """A hardened hypercorn config and its bound, listening sockets (the server's and the
    router's). `hard_message_bytes`: a WebSocket message over it closes 1009; `limits`:
    the HTTP timeouts and connection cap (api.httpconn; the descriptor limit is raised to
    fit the cap); `app_queue`: messages queued for the app (hypercorn's default when
    None); `on_refused`: called for each connection refused over the cap. ValueError
    naming host:port when the address is taken or invalid."""
    install()
    hc = LimitedConfig()
    hc.bind = [f"{host}:{port}"]
    hc.websocket_max_message_size = hard_message_bytes
    if app_queue is not None:
        hc.max_app_queue_size = app_queue
    hc.idle_timeout = limits.http_idle_timeout
    hc.header_timeout = limits.http_header_timeout
    hc.body_timeout = limits.http_body_timeout
    # hypercorn's own idle timer: a backstop behind api.httpconn's (which decides first);
    # it also closes idle connections at once when the server stops
    hc.keep_alive_timeout = limits.http_idle_timeout + limits.http_header_timeout + 1.0
    hc.connection_cap = ConnectionCap(fit_descriptor_limit(limits.max_connections), on_refused)
    hc.ws_message_timeout = ws_message_timeout
    hc.accesslog = None
    hc.loglevel = "WARNING"  # hypercorn's "Running on" lines: the CLIs print their own
    hc.graceful_timeout = 1.0
    hc.backlog = LISTEN_BACKLOG
    try:
        sockets = hc.create_sockets()
        for sock in sockets.insecure_sockets:
            sock.listen(hc.backlog)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return hc, sockets
