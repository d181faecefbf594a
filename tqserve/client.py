"""An async (trio) client of tqserve's WebSocket protocol; it needs no MLX.

    async with Client.connect("ws://127.0.0.1:8000/v1/stream") as client:
        async for event in client.generate(prompt="def f(x):", max_tokens=32, temperature=0):
            if isinstance(event, TokenEvent):
                print(event.text, end="")

* Multiplexing: any number of `generate()` calls share one socket, each under its own
  request id (chosen here unless given). One reader task files incoming frames by id.
* Frames: msgpack (binary) by default, JSON text with `binary=False`; the wire encoding is
  written here (no import of the server's packages).
* Events are typed: `QueuedEvent`, `PromptLogprobsEvent` (asked with `prompt_logprobs=N`),
  `TokenEvent`, `DoneEvent`, `ErrorEvent`. An `error`
  frame for a request is yielded as an `ErrorEvent` and ends its stream.
* Reconnect: when the socket drops, every request in flight on it fails with
  `ConnectionLost` (raised from its `generate()` loop); nothing is restarted silently,
  since the server has cancelled those requests. The next `generate()` opens a new socket
  (up to `reconnect_attempts` tries, doubling the pause from `reconnect_backoff`); with
  `reconnect=False` it raises `ConnectionLost` instead.
* Backpressure: each request buffers at most `STREAM_EVENTS` events; a consumer that falls
  further behind gets its request cancelled and `SlowConsumer` raised, so one slow loop
  never stalls the others on the socket.
* `api_key` sends `Authorization: Bearer <key>` on the WebSocket upgrade.
"""

from __future__ import annotations

import itertools
import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import attrs
import msgpack
import trio
from trio_websocket import (ConnectionClosed, HandshakeError, WebSocketConnection,
                            connect_websocket_url)

STREAM_EVENTS = 4096  # events one request may buffer before its consumer counts as stuck
CLOSE_TIMEOUT = 5.0   # seconds the close handshake may take when the client exits


class ClientError(Exception):
    """Base of the client's own errors."""


class ConnectionLost(ClientError):
    """The socket closed (or could not be opened) while the request was in flight."""


class SlowConsumer(ClientError):
    """The caller read events too slowly; the request was cancelled."""


@attrs.frozen(kw_only=True)
class QueuedEvent:
    request_id: str


@attrs.frozen(kw_only=True)
class TokenEvent:
    request_id: str
    index: int
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@attrs.frozen(kw_only=True)
class PromptLogprobsEvent:
    """Each prompt token's logprob given the tokens before it (None for the first) and
    its top alternatives, before the request's first token."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...]


@attrs.frozen(kw_only=True)
class DoneEvent:
    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = attrs.Factory(dict)
    speculative: dict[str, Any] | None = None  # usage.speculative: proposed, accepted, ...


@attrs.frozen(kw_only=True)
class ErrorEvent:
    request_id: str | None
    code: str
    message: str


Event = QueuedEvent | PromptLogprobsEvent | TokenEvent | DoneEvent | ErrorEvent


def parse_event(obj: dict[str, Any]) -> Event:
    """A decoded server frame (or an engine event's `to_wire()`) as a typed event."""
    kind = obj.get("type")
    rid = obj.get("id")
    if kind == "queued":
        return QueuedEvent(request_id=rid)
    if kind == "token":
        top = obj.get("top_logprobs")
        return TokenEvent(request_id=rid, index=obj["index"], token_id=obj["token_id"],
                          text=obj["text"], logprob=obj.get("logprob"),
                          top_logprobs=None if top is None else tuple(
                              (int(t), float(lp)) for t, lp in top))
    if kind == "prompt_logprobs":
        return PromptLogprobsEvent(
            request_id=rid, token_ids=tuple(obj["token_ids"]), logprobs=tuple(obj["logprobs"]),
            top_logprobs=tuple(None if top is None else tuple((int(t), float(lp))
                                                              for t, lp in top)
                               for top in obj["top_logprobs"]))
    if kind == "done":
        usage = obj.get("usage", {})
        return DoneEvent(request_id=rid, finish_reason=obj["finish_reason"],
                         prompt_tokens=usage.get("prompt_tokens", 0),
                         completion_tokens=usage.get("completion_tokens", 0),
                         cached_tokens=usage.get("cached_tokens", 0),
                         cached_tokens_by_tier=dict(usage.get("cached_tokens_by_tier", {})),
                         speculative=usage.get("speculative"))
    if kind == "error":
        return ErrorEvent(request_id=rid, code=obj.get("code", ""),
                          message=obj.get("message", ""))
    raise ValueError(f"unknown frame type {kind!r}")


def encode_frame(obj: dict[str, Any], binary: bool) -> str | bytes:
    """msgpack bytes (binary frame) or JSON text (text frame)."""
    return msgpack.packb(obj, use_bin_type=True) if binary else json.dumps(obj)


def decode_frame(data: str | bytes) -> dict[str, Any]:
    obj = msgpack.unpackb(data, raw=False) if isinstance(data, bytes) else json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("frame is not an object")
    return obj


@attrs.define
class _Stream:
    send: trio.MemorySendChannel[Event]
    failure: ClientError | None = None


@attrs.frozen(kw_only=True)
class ClientStatistics:
    num_active: int
    num_connects: int
    num_lost: int        # requests failed by a dropped socket
    num_unrouted: int    # frames for no active request (e.g. an error with id null)


class Client:
    """One WebSocket session (reopened on demand); see the module docstring.

    Use `Client.connect(url)`; or, to keep clients in a nursery you own (opening them
    from any task), `Client(nursery, url, ...)`, `await client.open()`, `await
    client.aclose()`."""

    def __init__(self, nursery: trio.Nursery, url: str, *, binary: bool = True,
                 api_key: str | None = None, reconnect: bool = True,
                 reconnect_attempts: int = 5, reconnect_backoff: float = 0.1) -> None:
        self.url = url
        self._nursery = nursery
        self._binary = binary
        self._headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        self._reconnect = reconnect
        self._attempts = reconnect_attempts
        self._backoff = reconnect_backoff
        self._ws: WebSocketConnection | None = None
        self._connect_lock = trio.Lock()
        self._send_lock = trio.Lock()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._num_connects = 0
        self._num_lost = 0
        self._num_unrouted = 0

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str, *, binary: bool = True, api_key: str | None = None,
                      reconnect: bool = True, reconnect_attempts: int = 5,
                      reconnect_backoff: float = 0.1) -> AsyncIterator["Client"]:
        """Open a session on `url` (ws://host:port/v1/stream); closes it on exit.

        Raises ConnectionLost when the first connection cannot be made. An exception
        from the block comes out as itself (not wrapped in an exception group)."""
        try:
            async with trio.open_nursery() as nursery:
                client = cls(nursery, url, binary=binary, api_key=api_key, reconnect=reconnect,
                             reconnect_attempts=reconnect_attempts,
                             reconnect_backoff=reconnect_backoff)
                await client.open()
                try:
                    yield client
                finally:
                    await client.aclose()
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1 and not isinstance(group.exceptions[0],
                                                             BaseExceptionGroup):
                raise group.exceptions[0]  # noqa: B904  the child itself, cause kept
            raise

    async def open(self) -> None:
        """Open the first socket (ConnectionLost when it cannot be made). For a client made
        with its own long-lived nursery; `Client.connect` does this for you."""
        await self._ensure_connected(first=True)

    async def aclose(self) -> None:
        """Close the socket (handshake bounded by CLOSE_TIMEOUT); requests in flight on it
        fail with ConnectionLost."""
        if self._ws is not None:  # close handshake first, while the reader runs
            with trio.move_on_after(CLOSE_TIMEOUT) as scope:
                scope.shield = True
                await self._ws.aclose()

    @property
    def connected(self) -> bool:
        """Whether a socket is open now (a dropped one is noticed by the reader task)."""
        return self._ws is not None and not self._ws.closed

    @property
    def num_active(self) -> int:
        """Requests in flight on this client."""
        return len(self._streams)

    def statistics(self) -> ClientStatistics:
        return ClientStatistics(num_active=len(self._streams), num_connects=self._num_connects,
                                num_lost=self._num_lost, num_unrouted=self._num_unrouted)

    async def _ensure_connected(self, first: bool = False) -> WebSocketConnection:
        async with self._connect_lock:
            if self._ws is not None and not self._ws.closed:
                return self._ws
            if not first and not self._reconnect:
                raise ConnectionLost(f"connection to {self.url} is closed (reconnect off)")
            pause = self._backoff
            for attempt in range(self._attempts):
                try:
                    ws = await connect_websocket_url(self._nursery, self.url,
                                                     extra_headers=self._headers)
                    break
                except (OSError, HandshakeError) as exc:
                    if attempt == self._attempts - 1:
                        raise ConnectionLost(f"cannot connect to {self.url}: {exc}") from exc
                    await trio.sleep(pause)
                    pause *= 2
            self._ws = ws
            self._num_connects += 1
            self._nursery.start_soon(self._read, ws)
            return ws

    async def _read(self, ws: WebSocketConnection) -> None:
        try:
            while True:
                obj = decode_frame(await ws.get_message())
                stream = self._streams.get(obj.get("id"))  # type: ignore[arg-type]
                if stream is None:
                    self._num_unrouted += 1
                    continue
                try:
                    stream.send.send_nowait(parse_event(obj))
                except trio.WouldBlock:
                    self._fail(obj["id"], SlowConsumer(
                        f"request {obj['id']!r} fell {STREAM_EVENTS} events behind"))
                    self._nursery.start_soon(self._send_cancel, obj["id"])
        except ConnectionClosed:
            pass
        finally:
            if self._ws is ws:
                self._ws = None
            for rid in list(self._streams):
                self._num_lost += 1
                self._fail(rid, ConnectionLost(f"connection to {self.url} closed while "
                                               f"request {rid!r} was in flight"))

    def _fail(self, rid: str, failure: ClientError) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.failure = failure
            stream.send.close()

    async def _send(self, obj: dict[str, Any]) -> None:
        ws = await self._ensure_connected()
        async with self._send_lock:
            await ws.send_message(encode_frame(obj, self._binary))

    async def _send_cancel(self, rid: str) -> None:
        """Best effort on the socket open now: a closed socket cancelled it already."""
        ws = self._ws
        if ws is None or ws.closed:
            return
        try:
            async with self._send_lock:
                await ws.send_message(encode_frame({"type": "cancel", "id": rid}, self._binary))
        except ConnectionClosed:
            pass

    async def generate(self, *, prompt: str | None = None,
                       prompt_tokens: list[int] | None = None,
                       messages: list[dict[str, str]] | None = None,
                       request_id: str | None = None, **params: Any) -> AsyncIterator[Event]:
        """Send a `generate` and yield its events until `done` or `error`.

        `params` are the protocol's sampling fields (max_tokens, temperature, seed, ...);
        None values are left out. Raises ConnectionLost or SlowConsumer (see module doc).
        Leaving the loop early sends a `cancel`."""
        rid = request_id if request_id is not None else f"c{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        frame: dict[str, Any] = {"type": "generate", "id": rid}
        for name, value in (("prompt", prompt), ("prompt_tokens", prompt_tokens),
                            ("messages", messages), *params.items()):
            if value is not None:
                frame[name] = list(value) if isinstance(value, tuple) else value
        send, receive = trio.open_memory_channel[Event](STREAM_EVENTS)
        stream = _Stream(send)
        self._streams[rid] = stream
        finished = False
        try:
            try:
                await self._send(frame)
            except ConnectionClosed as exc:
                raise ConnectionLost(f"connection to {self.url} closed: {exc}") from exc
            async for event in receive:
                finished = isinstance(event, (DoneEvent, ErrorEvent))
                yield event
                if finished:
                    return
            if stream.failure is not None:
                finished = True
                raise stream.failure
        finally:
            self._streams.pop(rid, None)
            if not finished and self._ws is not None:
                with trio.CancelScope(shield=True):
                    await self._send_cancel(rid)
