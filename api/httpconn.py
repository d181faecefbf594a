"""HTTP/1.1 connections of `serve` and `route`: how long a peer may take, how many it holds.

hypercorn 0.18 closes a connection only through its idle task, and that task dies at
birth half of the time: it is (re)started from the app's task, by the app's last send,
and quart-trio cancels that task's nursery when the request ends (`http.disconnect`);
trio's `nursery.start` then leaves the new task in the cancelled scope (trio:
"If the old nursery is cancelled, then quietly quit now"). The same cancellation cut the
close after `Connection: close` or an HTTP/1.0 answer (`send_eof` raised Cancelled before
the socket was closed). So idle sockets stayed open until the client left.

Here `LimitedH11Protocol` runs its own timer, one task per connection started from the
connection's task, and shields the end-of-request bookkeeping. Each connection is in one
phase with one deadline (docs/limits.md has the flags):

* idle: no byte of a next request within `idle_timeout` -> closed, nothing sent;
* head: the request line and headers not complete within `header_timeout` of the
  request's first byte -> 408 and closed;
* body: the body not complete within `body_timeout` of the head -> 408 (when nothing was
  answered yet) and closed; a body trickled in a byte at a time holds nothing longer;
* busy: the app is answering (a long SSE stream is not timed here); upgraded WebSockets
  have their own limits (api.hardening).

Every TCP connection (plain HTTP and WebSocket) counts against `connection_cap`; a request
that arrives on a connection over the cap is answered 503 `too_many_connections` (with
Retry-After) and the connection closed.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any, Callable

import attrs
import h11
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import Response
from hypercorn.protocol.h11 import H11Protocol, H11WSConnection
from tqserve.api.gate_head import RETRY_AFTER_SECONDS



def _seconds(inst: object, attr: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"--{attr.name.replace('_', '-')} must be a positive number of "
                         f"seconds, got {value!r}")


@attrs.frozen(kw_only=True)
class HttpLimits:
    """The HTTP connection limits `serve` and `route` share (docs/limits.md)."""

    http_idle_timeout: float = attrs.field(default=5.0, validator=_seconds)
    http_header_timeout: float = attrs.field(default=10.0, validator=_seconds)
    http_body_timeout: float = attrs.field(default=30.0, validator=_seconds)
    max_connections: int = attrs.field(default=1024, validator=attrs.validators.ge(1))


TIMEOUT_FLAGS = {  # HttpLimits / ServerConfig field -> help (both CLIs)
    "http_idle_timeout": "seconds an HTTP connection may stay idle between requests "
                         "(then it is closed)",
    "http_header_timeout": "seconds a request's line and headers may take from its first "
                           "byte (then 408 and close)",
    "http_body_timeout": "seconds a request body may take to arrive after its headers "
                         "(then 408 and close)",
}


def add_timeout_flags(parser: Any, defaults: Any) -> None:
    """Add the --http-*-timeout flags, defaults read from `defaults`' fields."""
    for name, text in TIMEOUT_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=float, metavar="SECONDS",
                            default=getattr(defaults, name), help=text)


class ConnectionCap:
    """Open HTTP connections (WebSockets included) of one server, against its limit.
    `on_refused()` is called for each connection refused over it (the server sets it to
    count the refusal in its statistics)."""

    def __init__(self, limit: int, on_refused: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self.num_open = 0
        self.num_refused = 0
        self.on_refused = on_refused

    def open(self) -> bool:
        """Count a new connection; False (not counted) when the cap is reached."""
        if self.num_open >= self.limit:
            return False
        self.num_open += 1
        return True

    def refused(self) -> None:
        self.num_refused += 1
        if self.on_refused is not None:
            self.on_refused()

    def closed(self) -> None:
        self.num_open -= 1


class LimitedConfig(HypercornConfig):
    """hypercorn's config plus the limits of this module and of api.hardening."""

    ws_message_timeout: float = 30.0
    idle_timeout: float = 5.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    connection_cap: ConnectionCap | None = None
    overload_gate: Any = None  # api.overload.OverloadGate: `serve` sets it, the router not


class _Phase(enum.Enum):
    IDLE = "idle"
    HEAD = "head"
    BODY = "body"
    BUSY = "busy"
    CLOSED = "closed"


def error_bytes(status: int, reason: str, code: str, message: str,
                headers: tuple[str, ...] = ()) -> bytes:
    """A complete HTTP/1.1 error answer that closes the connection (JSON body)."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def too_large_message(exc: Any, limit: int) -> str | None:
    """The message of a werkzeug HTTP error; a 413 (Quart's MAX_CONTENT_LENGTH, set to
    --max-message-bytes) names the limit and its flag."""
    if exc.code == 413:
        return f"request body exceeds the limit of {limit} bytes (--max-message-bytes)"
    return exc.description


def _has_body(request: h11.Request) -> bool:
    for name, value in request.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


class LimitedH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol with the timeouts and the cap of the module
    docstring, without the h2c upgrade or an HTTP/2 preface, whose answers given before
    the request body was read close the connection (api.hardening)."""

    _refuse_http2 = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limited = isinstance(self.config, LimitedConfig)
        self._phase = _Phase.IDLE
        self._deadline = math.inf
        self._wake = trio.Event()
        self._timed_out = False  # what the app still sends is dropped
        self._counted = False

    async def initiate(self) -> None:
        await super().initiate()
        if not self._limited:
            return
        cap = self.config.connection_cap
        self._counted = cap is None or cap.open()
        self._enter(_Phase.IDLE, self.config.idle_timeout)
        self.task_group.spawn(self._watch)

    def _enter(self, phase: _Phase, timeout: float | None) -> None:
        self._phase = phase
        self._deadline = math.inf if timeout is None else trio.current_time() + timeout
        self._wake.set()

    async def handle(self, event: Any) -> None:
        if self._limited:
            if isinstance(event, Closed) and self._phase is not _Phase.CLOSED:
                self._enter(_Phase.CLOSED, None)
                cap = self.config.connection_cap
                if cap is not None and self._counted:
                    cap.closed()
            elif isinstance(event, RawData) and event.data and self._phase is _Phase.IDLE:
                self._enter(_Phase.HEAD, self.config.header_timeout)
        await super().handle(event)

    async def stream_send(self, event: Any) -> None:
        if self._timed_out:
            return
        if (isinstance(event, Response) and event.status_code >= 200 and self._limited
                and self.connection.their_state is h11.SEND_BODY):
            event = dataclasses.replace(event, headers=[*event.headers,
                                                        (b"connection", b"close")])
        await super().stream_send(event)

    async def _check_protocol(self, event: h11.Request) -> None:
        if not self._limited:
            await super()._check_protocol(event)
        elif event.method == b"PRI" and event.http_version == b"2.0":
            self._refuse_http2 = True

    async def _create_stream(self, request: h11.Request) -> None:
        if self._refuse_http2:
            await self._send_error_response(505)
            await self.send(Closed())
            return
        if self._limited:
            if not self._counted:
                await self._refuse_over_cap()
                return
            body = _has_body(request)
            self._enter(_Phase.BODY if body else _Phase.BUSY,
                        self.config.body_timeout if body else None)
        await super()._create_stream(request)

    async def _refuse_over_cap(self) -> None:
        cap = self.config.connection_cap
        cap.refused()
        self._timed_out = True
        await self.send(RawData(error_bytes(
            503, "Service Unavailable", "too_many_connections",
            f"the server holds {cap.limit} connections already (--max-connections)",
            (f"retry-after: {RETRY_AFTER_SECONDS}",))))
        await self._close()

    async def _maybe_recycle(self) -> None:
        # Runs inside the app's last send, whose task quart-trio may have cancelled: the
        # close (or the next cycle's bookkeeping) must happen all the same.
        with trio.CancelScope(shield=True):
            await super()._maybe_recycle()
            if (self._limited and self._phase is not _Phase.CLOSED
                    and isinstance(self.connection, h11.Connection)
                    and self.connection.their_state is h11.IDLE):
                self._enter(_Phase.IDLE, self.config.idle_timeout)

    async def _watch(self) -> None:
        """The connection's one timer: act on the phase's deadline when it passes."""
        while self._phase is not _Phase.CLOSED:
            self._wake = trio.Event()
            deadline = self._deadline
            with trio.move_on_at(deadline):
                await self._wake.wait()
                continue
            if deadline == self._deadline:
                await self._expire()

    async def _expire(self) -> None:
        config = self.config
        if self._phase is _Phase.IDLE:
            if isinstance(self.connection, h11.Connection) and self.connection.trailing_data[0]:
                self._enter(_Phase.HEAD, config.header_timeout)  # a pipelined partial head
            else:
                await self._close()
        elif self._phase is _Phase.HEAD:
            await self._time_out(f"request head not complete within {config.header_timeout:g}"
                                 " s (--http-header-timeout)")
        elif self._phase is _Phase.BODY:
            if (not isinstance(self.connection, h11.Connection)
                    or self.connection.their_state is not h11.SEND_BODY):
                self._enter(_Phase.BUSY, None)  # the body is complete: the app answers
            else:
                await self._time_out(f"request body not complete within "
                                     f"{config.body_timeout:g} s (--http-body-timeout)")

    async def _time_out(self, message: str) -> None:
        """408 when nothing was answered yet, then close."""
        answered = (isinstance(self.connection, H11WSConnection)
                    or self.connection.our_state not in (h11.IDLE, h11.SEND_RESPONSE))
        self._timed_out = True
        if not answered:
            await self.send(RawData(error_bytes(408, "Request Timeout", "request_timeout",
                                                message)))
        await self._close()

    async def _close(self) -> None:
        self._enter(self._phase, None)
        await self.send(Closed())
        await self.can_read.set()  # a reader waiting for the answer's end wakes and ends
