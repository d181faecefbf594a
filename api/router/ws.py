"""The router's WebSocket /v1/stream: the server's protocol, passed through to backends.

The router checks what it must to route and multiplex (frame size, JSON / msgpack, an
object with `type` generate or cancel, `id`, duplicate ids, concurrent streams per
connection) with the server's own error codes; every other field goes to the backend
untouched, and the backend's frames (its `error` frames for bad fields too) come back
with the client's id, in the frame kind the client used.

Fail-over, as on HTTP: only a request its backend never had moves to the next backend
(the link could not be opened, or the socket was closed before the frame went out), or
one the backend ended only because it is stopping (`shutting_down`, `engine_closed`,
finish_reason `shutdown`) before a token; the client gets one `queued` frame. A
backend whose socket breaks once it has the request (it died handling it: maybe of a
poison request, which would kill every backend in turn) ends it with an `error` frame,
code `backend_failed` before a token, `backend_lost` after one; never resent. No frame
for --backend-read-timeout seconds: code `backend_timeout`, the request is cancelled on
the backend and its link retired (api.router.backends). No backend left: code
`no_healthy_backend`; draining: `shutting_down`.
"""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from typing import Any

import msgpack
import trio

from tqserve.api.router.backends import BackendLost, BackendTimeout, SlowClient
from tqserve.api.router.core import NoHealthyBackend, Route
from tqserve.api.router.service import Router, ShuttingDown
from tqserve.ids import id_problem

log = logging.getLogger("tqserve.router")
OUTGOING_FRAMES = 64  # frames waiting for the client socket's writer (as the server's)


class FrameError(Exception):
    def __init__(self, code: str, message: str, rid: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.rid = code, message, rid


def encode(obj: dict[str, Any], binary: bool) -> str | bytes:
    return msgpack.packb(obj, use_bin_type=True) if binary else json.dumps(obj,
                                                                           ensure_ascii=False)


def decode(data: str | bytes, max_bytes: int) -> dict[str, Any]:
    """One client frame as an object with a valid type and id; FrameError otherwise."""
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise FrameError("message_too_large",
                         f"message of {size} bytes exceeds the limit of {max_bytes}")
    try:
        obj = (msgpack.unpackb(data, raw=False, strict_map_key=False)
               if isinstance(data, bytes) else json.loads(data))
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        kind = "msgpack" if isinstance(data, bytes) else "JSON"
        raise FrameError("bad_frame", f"frame is not valid {kind}: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError("bad_frame", "frame must be an object with a 'type' field")
    rid = obj.get("id")
    kind = obj.get("type")
    if kind not in ("generate", "cancel"):
        raise FrameError("unknown_type", f"type must be 'generate' or 'cancel', got {kind!r}",
                         rid if isinstance(rid, str) else None)
    problem = id_problem(rid)
    if problem is not None:
        raise FrameError("invalid_request", problem)
    return obj


RETRYABLE_CODES = ("shutting_down", "engine_closed")  # the backend is going away


def going_away(reply: dict[str, Any]) -> bool:
    """A frame that ends a request only because its backend is stopping: before the first
    token, the request can run elsewhere."""
    if reply.get("type") == "error":
        return reply.get("code") in RETRYABLE_CODES
    return reply.get("type") == "done" and reply.get("finish_reason") == "shutdown"


class ClientConnection:
    """One client WebSocket: its requests (client id -> cancel), its outgoing frames."""

    def __init__(self, router: Router, nursery: trio.Nursery,
                 out: trio.MemorySendChannel[str | bytes]) -> None:
        self._router = router
        self._nursery = nursery
        self._out = out
        self._active: dict[str, _Active] = {}

    async def send(self, obj: dict[str, Any], binary: bool) -> None:
        try:
            await self._out.send(encode(obj, binary))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def error(self, rid: str | None, code: str, message: str, binary: bool) -> None:
        if code != "unknown_id":
            self._router.reject(code)
        await self.send({"type": "error", "id": rid, "code": code, "message": message}, binary)

    async def handle(self, data: str | bytes) -> None:
        binary = isinstance(data, bytes)
        config = self._router.config
        try:
            obj = decode(data, config.max_message_bytes)
            rid = obj["id"]
            if obj["type"] == "cancel":
                active = self._active.get(rid)
                if active is None:
                    raise FrameError("unknown_id", f"no active request with id {rid!r}", rid)
                await active.cancel()
                return
            if rid in self._active:
                raise FrameError("duplicate_id", f"request id {rid!r} is already active", rid)
            if len(self._active) >= config.max_streams_per_connection:
                raise FrameError("too_many_streams", f"at most "
                                 f"{config.max_streams_per_connection} concurrent requests "
                                 "per connection", rid)
            if self._router.draining:
                raise FrameError("shutting_down", "the router is shutting down", rid)
        except FrameError as exc:
            await self.error(exc.rid, exc.code, exc.message, binary)
            return
        self._active[rid] = _Active()
        self._nursery.start_soon(self._run, rid, obj, binary)

    async def _run(self, rid: str, obj: dict[str, Any], binary: bool) -> None:
        router = self._router
        active = self._active[rid]
        keys = router.keys(obj)
        tried: list[str] = []
        try:
            while True:
                route = router.begin(keys, tried)
                try:
                    if await self._attempt(rid, obj, binary, route, active):
                        return
                finally:
                    router.end(route)
                log.warning("request %s: backend %s lost before it had the request; "
                            "retrying elsewhere", rid, route.backend)
                tried.append(route.backend)
        except SlowClient as exc:
            await self.error(rid, "slow_consumer", f"request {rid!r} {exc}", binary)
        except ShuttingDown as exc:
            await self.error(rid, "shutting_down", str(exc), binary)
        except NoHealthyBackend as exc:
            await self.error(rid, "no_healthy_backend", str(exc), binary)
        except Exception as exc:  # our bug: this request fails, the socket goes on
            log.exception("request %s failed", rid)
            await self.error(rid, "internal_error", f"{type(exc).__name__}: {exc}", binary)
        finally:
            self._active.pop(rid, None)

    async def _attempt(self, rid: str, obj: dict[str, Any], binary: bool, route: Route,
                       active: "_Active") -> bool:
        """One attempt on `route.backend`: True once the request has ended (its client got
        its last frame), False when the backend never had it (the next one may)."""
        router = self._router
        sent_token = False
        try:
            link = await router.link(route.backend)
            frame = {**obj, "id": router.pool.new_id()}
            active.bind(link, frame["id"])
            async with aclosing(link.request(frame)) as frames:
                async for reply in frames:
                    await active.started()
                    kind = reply.get("type")
                    if not sent_token and going_away(reply):
                        raise BackendLost(f"backend is going away: {reply}")
                    if kind == "queued" and active.sent_queued:
                        continue
                    active.sent_queued = active.sent_queued or kind == "queued"
                    sent_token = sent_token or kind == "token"
                    if kind == "done":
                        router.note_done(route.backend, reply)
                    await self.send({**reply, "id": rid}, binary)
            return True
        except BackendTimeout as exc:
            message = (f"backend {route.backend} sent nothing for request {rid!r} in "
                       f"{exc.seconds:g} s (--backend-read-timeout); it is not retried "
                       "elsewhere")
            log.warning("%s", message)
            await self.error(rid, "backend_timeout", message, binary)
            return True
        except BackendLost as exc:
            router.lost(route)
            if sent_token or active.cancelled:
                await self.error(rid, "backend_lost", f"backend {route.backend} was "
                                 f"lost after the stream started: {exc}", binary)
                return True
            if exc.sent:  # it had the request and died: maybe of it (a poison request)
                await self.error(rid, "backend_failed", f"backend {route.backend} "
                                 f"failed while handling the request ({exc}); it is "
                                 "not retried elsewhere", binary)
                return True
            return False


class _Active:
    """A request in flight: where it runs now, so that a cancel can follow it."""

    def __init__(self) -> None:
        self.link: Any = None
        self.backend_id: str | None = None
        self.cancelled = False
        self.sent_queued = False  # the client has its one `queued` frame
        self._forwarded = False  # the backend has seen the generate (it answered)

    def bind(self, link: Any, backend_id: str) -> None:
        """A new attempt, on `link` under `backend_id`: not forwarded there yet."""
        self.link, self.backend_id = link, backend_id
        self._forwarded = False

    async def started(self) -> None:
        """The backend answered: forward a cancel that came before it could."""
        if not self._forwarded:
            self._forwarded = True
            if self.cancelled:
                await self.link.cancel(self.backend_id)

    async def cancel(self) -> None:
        self.cancelled = True
        if self._forwarded:
            await self.link.cancel(self.backend_id)
