"""The router's connections to its backends: multiplexed WebSockets and health checks.

* `BackendLink`: one WebSocket to a backend's /v1/stream carrying many requests under
  router-chosen ids (msgpack frames); one reader task files each incoming frame, as is
  (a dict), into its request's bounded channel (`STREAM_FRAMES`). When the socket drops,
  every request on it fails with `BackendLost`. A request whose channel is full (its
  client reads too slowly) fails with `SlowClient` and is cancelled on the backend. A
  request that gets no frame for `read_timeout` seconds (--backend-read-timeout) fails
  with `BackendTimeout` and is cancelled on the backend; its link is retired (it may be
  wedged): it takes no new request and closes once its last request has ended.
* `LinkPool`: per backend, the links open now; a request takes one with a free stream
  slot (`streams_per_link`, the backends' --max-streams-per-connection) that is not
  retired, or opens another.
* `check_health`: GET /health under a `trio.fail_after`; True only for a 200.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, AsyncIterator

import attrs
import httpx
import msgpack
import trio
from trio_websocket import (ConnectionClosed, HandshakeError, WebSocketConnection,
                            connect_websocket_url)

log = logging.getLogger("tqserve.router")
STREAM_FRAMES = 256  # frames one request may buffer: a client that far behind is cut off
CLOSE_TIMEOUT = 2.0  # seconds a link's close handshake may take
CONNECT_TIMEOUT = 5.0  # seconds opening a link may take (a blackholed host fails here)


class BackendLost(Exception):
    """The backend's socket closed (or could not be opened) under a request; `sent`:
    after the request had reached the backend."""

    sent = False


class SlowClient(Exception):
    """The request's client fell STREAM_FRAMES frames behind; it was cancelled."""


class BackendTimeout(Exception):
    """The backend sent no frame for the request in `seconds`; it was cancelled."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no frame for {seconds:g} s")
        self.seconds = seconds


def ws_url(base: str) -> str:
    """The /v1/stream URL of a backend given as http(s)://host:port."""
    return base.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/v1/stream"


@attrs.define
class _Stream:
    send: trio.MemorySendChannel[dict[str, Any]]
    failure: Exception | None = None


class BackendLink:
    """One multiplexed WebSocket to a backend (see the module docstring)."""

    def __init__(self, ws: WebSocketConnection, url: str, nursery: trio.Nursery,
                 read_timeout: float) -> None:
        self.url = url
        self.read_timeout = read_timeout
        self._ws = ws
        self._nursery = nursery
        self._streams: dict[str, _Stream] = {}
        self._send_lock = trio.Lock()
        self.closed = False
        self.retired = False  # takes no new request; closes when its last one ends

    @classmethod
    async def open(cls, nursery: trio.Nursery, url: str, headers: list[tuple[bytes, bytes]],
                   read_timeout: float) -> "BackendLink":
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                ws = await connect_websocket_url(nursery, url, extra_headers=headers)
        except trio.TooSlowError:
            raise BackendLost(f"cannot connect to {url}: no answer in {CONNECT_TIMEOUT:g} s"
                              ) from None
        except (OSError, HandshakeError, ConnectionClosed) as exc:
            raise BackendLost(f"cannot connect to {url}: {exc}") from exc
        link = cls(ws, url, nursery, read_timeout)
        nursery.start_soon(link._read)
        return link

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def _read(self) -> None:
        try:
            while True:
                data = await self._ws.get_message()
                try:
                    obj = msgpack.unpackb(data, raw=False) if isinstance(data, bytes) else None
                except (ValueError, TypeError, msgpack.UnpackException):
                    obj = None
                if not isinstance(obj, dict):
                    log.warning("%s sent a frame that is not a msgpack object; ignored",
                                self.url)
                    continue
                stream = self._streams.get(obj.get("id"))  # type: ignore[arg-type]
                if stream is None:
                    continue
                try:
                    stream.send.send_nowait(obj)
                except trio.WouldBlock:
                    self._fail(obj["id"], SlowClient(f"fell {STREAM_FRAMES} frames behind"))
                    await self.cancel(obj["id"])
        except ConnectionClosed:
            pass
        finally:
            self.closed = True
            for rid in list(self._streams):
                self._fail(rid, BackendLost(f"connection to {self.url} closed"))

    def _fail(self, rid: str, failure: Exception) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.failure = failure
            stream.send.close()

    async def _send(self, obj: dict[str, Any]) -> None:
        try:
            async with self._send_lock:
                await self._ws.send_message(msgpack.packb(obj, use_bin_type=True))
        except ConnectionClosed as exc:
            raise BackendLost(f"connection to {self.url} closed: {exc}") from exc

    async def cancel(self, rid: str) -> None:
        """Best effort: a closed socket has cancelled the request already. A backend that
        takes no cancel within CLOSE_TIMEOUT (it reads nothing) retires the link."""
        if self.closed:
            return
        with trio.move_on_after(CLOSE_TIMEOUT) as scope:
            try:
                await self._send({"type": "cancel", "id": rid})
            except BackendLost:
                pass
        if scope.cancelled_caught:
            self.retired = True

    async def request(self, frame: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Send a generate frame (its `id` is the router's) and yield the backend's frames
        for it up to `done` or `error`. Raises BackendLost or SlowClient; leaving early
        cancels the request on the backend."""
        rid = frame["id"]
        send, receive = trio.open_memory_channel[dict[str, Any]](STREAM_FRAMES)
        stream = _Stream(send)
        self._streams[rid] = stream
        finished = False
        try:
            if self.closed:
                raise BackendLost(f"connection to {self.url} closed")
            await self._send(frame)
            while not finished:
                obj = await self._next(receive, stream)
                finished = obj.get("type") in ("done", "error")
                yield obj
        finally:
            self._streams.pop(rid, None)
            if not finished:
                with trio.CancelScope(shield=True):
                    await self.cancel(rid)
            self._close_if_retired()

    async def _next(self, receive: trio.MemoryReceiveChannel[dict[str, Any]],
                    stream: _Stream) -> dict[str, Any]:
        """A request's next frame; its stream's failure once the reader ended it (the
        request had reached the backend), BackendTimeout after `read_timeout` seconds."""
        with trio.move_on_after(self.read_timeout):
            try:
                return await receive.receive()
            except trio.EndOfChannel:
                failure = stream.failure or BackendLost(f"connection to {self.url} closed")
                if isinstance(failure, BackendLost):
                    failure.sent = True
                raise failure from None
        self.retired = True  # the socket may be wedged: new requests open another
        raise BackendTimeout(self.read_timeout)

    def _close_if_retired(self) -> None:
        if self.retired and not self._streams and not self.closed:
            self.closed = True
            self._nursery.start_soon(self.aclose)

    async def aclose(self) -> None:
        self.closed = True
        with trio.move_on_after(CLOSE_TIMEOUT) as scope:
            scope.shield = True
            await self._ws.aclose()


@attrs.frozen(kw_only=True)
class PoolStatistics:
    num_links: dict[str, int]    # open WebSockets per backend
    num_streams: dict[str, int]  # requests on them now


class LinkPool:
    """Open links per backend; `link(backend)` returns one with a free stream slot."""

    def __init__(self, nursery: trio.Nursery, streams_per_link: int,
                 api_key: str | None = None, read_timeout: float = 600.0) -> None:
        self._nursery = nursery
        self._limit = streams_per_link
        self._read_timeout = read_timeout
        self._headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else []
        self._links: dict[str, list[BackendLink]] = {}
        self._locks: dict[str, trio.Lock] = {}  # per backend: a slow one holds up no other
        self._ids = itertools.count()

    def new_id(self) -> str:
        """A request id no other request of this router uses."""
        return f"r{next(self._ids)}"

    async def link(self, backend: str) -> BackendLink:
        async with self._locks.setdefault(backend, trio.Lock()):
            links = [x for x in self._links.get(backend, []) if not x.closed]
            self._links[backend] = links
            for x in links:
                if x.num_active < self._limit and not x.retired:
                    return x
            x = await BackendLink.open(self._nursery, ws_url(backend), self._headers,
                                       self._read_timeout)
            links.append(x)
            return x

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(
            num_links={b: sum(not x.closed for x in links) for b, links in self._links.items()},
            num_streams={b: sum(x.num_active for x in links if not x.closed)
                         for b, links in self._links.items()})

    async def aclose(self) -> None:
        for links in self._links.values():
            for x in links:
                await x.aclose()
        self._links = {}


async def check_health(client: httpx.AsyncClient, backend: str, timeout: float) -> bool:
    """Whether GET {backend}/health answers 200 within `timeout` seconds."""
    try:
        with trio.fail_after(timeout):
            response = await client.get(backend + "/health")
    except (trio.TooSlowError, httpx.HTTPError, OSError):
        return False
    return response.status_code == 200
