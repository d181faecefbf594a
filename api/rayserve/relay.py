"""The calls the front deployment makes to a replica, and the replica's side of them.

A call is one HTTP request (`HttpCall`: the ASGI scope, the whole body) or one WebSocket
request, a `generate` or a Responses `response.create` (`WsCall`: the upgrade's scope and
the one client frame), with the prompt's prefix keys for the request router
(api.rayserve.routing) and, for a Responses follow-up, the replica it is pinned to. The
replica answers through a Ray Serve streaming call: `serve_http` yields the ASGI messages
the app sends (`http.response.start`, `http.response.body` ...), `WsRequests.serve` the
frames of the one request, ending after its last (LAST_FRAMES). Both run the replica's
own quart-trio app (api.app) in the trio guest, so validation, errors, auth and
metrics are the server's.

Cancel and disconnect: when the front cancels a streaming call (its client went away), the
app's call is cancelled: for HTTP that is the client's disconnect, for a WebSocket request
the virtual socket's close; the engine ends the row either way. A WebSocket `cancel` frame
goes to the same replica as its request (`CancelCall`, pinned by replica id), which puts it
on that request's socket: the engine's own `done` frame (finish_reason `cancelled`) follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, Callable

import attrs
import msgpack

from tqserve.api.rayserve.guest import GuestRun, Message


# the frames that end one request: /v1/stream's, and the Responses socket's (api.responses_ws)
LAST_FRAMES = frozenset(("done", "error", "response.completed", "response.incomplete",
                         "response.failed"))


@attrs.frozen(kw_only=True)
class HttpCall:
    scope: Message           # the client's HTTP scope (plain values: picklable)
    body: bytes
    prefix_keys: tuple[Any, ...] = ()
    num_prompt_tokens: int | None = None  # None: the front could not tokenize it
    pin: str | None = None   # the replica that must answer (it stores the response named)


def overload_message(exc: Exception) -> str:
    """What a request refused by Ray's backpressure (BackPressureError) is told."""
    queued = exc.args[1] if len(exc.args) > 1 else "--max-queued-requests"
    return (f"the server is overloaded: every replica is full and {queued} requests already "
            "wait for one (--max-queued-requests); retry later")


def response_id_prefix(replica: str) -> str:
    """What a replica's Responses API ids start with: `resp_<replica>_` (its Ray name)."""
    return f"resp_{replica}_"


def replica_of_response(rid: object) -> str | None:
    """The replica named in a response id of `response_id_prefix`'s form, else None."""
    if not isinstance(rid, str) or not rid.startswith("resp_"):
        return None
    replica, sep, rest = rid[5:].partition("_")
    return replica if sep and replica.isalnum() and rest else None


@attrs.frozen(kw_only=True)
class WsCall:
    scope: Message           # the client's upgrade scope
    frame: str | bytes       # one generate frame (the client's id kept)
    token: str               # the front's name for this request (a cancel names it)
    prefix_keys: tuple[Any, ...] = ()
    num_prompt_tokens: int | None = None  # None: the front could not tokenize it
    pin: str | None = None   # the replica that must answer (it stores the response named)


@attrs.frozen(kw_only=True)
class CancelCall:
    replica: str             # the replica that has the request (the router sends it there)
    token: str
    frame: str | bytes       # the client's cancel frame

    @property
    def pin(self) -> str:
        return self.replica


def plain_scope(scope: Message) -> Message:
    """The parts of an ASGI scope a replica needs, as plain picklable values."""
    keep = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path",
            "query_string", "root_path", "headers", "client", "server", "subprotocols")
    out = {k: scope[k] for k in keep if k in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", ())]
    out["root_path"] = ""
    return out


def frame_kind(frame: str | bytes) -> tuple[str | None, str | None]:
    """(type, id) of a frame the app sent (JSON text or msgpack bytes)."""
    try:
        obj = (msgpack.unpackb(frame, raw=False, strict_map_key=False)
               if isinstance(frame, bytes) else json.loads(frame))
    except (ValueError, TypeError, msgpack.UnpackException):
        return None, None
    if not isinstance(obj, dict):
        return None, None
    return obj.get("type"), obj.get("id")


async def _pump(run: Callable[[Callable[[Message], Awaitable[None]]], Awaitable[None]],
                ) -> AsyncIterator[Message]:
    """Run `run(send)` as a task; yield what it sends, in order, until it returns (its
    error re-raised); cancel it if the consumer stops early."""
    out: asyncio.Queue[Message] = asyncio.Queue()
    task = asyncio.ensure_future(run(out.put))
    try:
        while True:
            getter = asyncio.ensure_future(out.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
                continue
            getter.cancel()
            while not out.empty():
                yield out.get_nowait()
            task.result()
            return
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def serve_http(guest: GuestRun, app: Any, call: HttpCall) -> AsyncIterator[Message]:
    """The app's answer to one HTTP request, message by message."""
    given = False

    async def receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await asyncio.Event().wait()  # the client stays until the call is cancelled
        raise AssertionError("unreachable")

    async for message in _pump(lambda send: guest.asgi(app, call.scope, receive, send)):
        yield message


class WsRequests:
    """A replica's WebSocket requests in flight: token -> the queue of its socket."""

    def __init__(self) -> None:
        self._inbox: dict[str, asyncio.Queue[Message]] = {}

    async def serve(self, guest: GuestRun, app: Any, call: WsCall) -> AsyncIterator[str | bytes]:
        """The frames of one generate request, through a socket of its own on the app."""
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        key = "bytes" if isinstance(call.frame, bytes) else "text"
        inbox.put_nowait({"type": "websocket.connect"})
        inbox.put_nowait({"type": "websocket.receive", key: call.frame})
        self._inbox[call.token] = inbox
        try:
            async for message in _pump(lambda out: guest.asgi(
                    app, call.scope, inbox.get, lambda m: _ws_out(m, out))):
                if message["type"] == "refused":  # closed or answered before the accept
                    yield _refused(call, message["detail"])
                    break
                frame = message.get("text") or message.get("bytes") or b""
                yield frame
                if frame_kind(frame)[0] in LAST_FRAMES:
                    break
        finally:
            self._inbox.pop(call.token, None)

    def cancel(self, call: CancelCall) -> bool:
        """Put a client's cancel frame on its request's socket; False if it has ended."""
        inbox = self._inbox.get(call.token)
        if inbox is None:
            return False
        key = "bytes" if isinstance(call.frame, bytes) else "text"
        inbox.put_nowait({"type": "websocket.receive", key: call.frame})
        return True


def _refused(call: WsCall, detail: str) -> str:
    """The error frame for a socket the replica refused, in its protocol's shape."""
    text = f"the replica refused the WebSocket ({detail})"
    if str(call.scope.get("path", "")).rstrip("/").endswith("/responses"):
        from tqserve.api.httpcommon import ApiError
        from tqserve.api.responses_ws import error_frame

        return error_frame(ApiError(503, text, code="refused"))
    return json.dumps({"type": "error", "id": frame_kind(call.frame)[1], "code": "refused",
                       "message": text})


async def _ws_out(message: Message, out: Callable[[Message], Awaitable[None]]) -> None:
    """Frames to the request's stream; the accept dropped; a close or an HTTP answer
    before the accept becomes one `refused` item."""
    if message["type"] == "websocket.send":
        await out(message)
    elif message["type"] != "websocket.accept":
        status = message.get("status") or message.get("code")
        await out({"type": "refused", "detail": f"{message['type']} {status}"})
