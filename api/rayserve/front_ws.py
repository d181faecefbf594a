"""The Ray front's WebSockets: /v1/stream and the Responses API's /v1/responses.

Both check the key and Origin at the upgrade as the server does, then send each request
to a replica as a call of its own (api.rayserve.relay's WsCall), routed by its prompt's
prefix keys (api.rayserve.keys).

/v1/stream: the front speaks the protocol's framing (JSON or msgpack, `generate` and
`cancel`, ids, --max-streams-per-connection: api.router.ws's checks), and sends each
generate request on its own (so one socket's requests spread by their prefixes); a
`cancel` follows its request to its replica, whose engine answers `done`. A request
cancelled before a replica had it ends here, with the `done` one server sends: its usage
has the prompt tokens the front counted (0 where it cannot tokenize: a GGUF model's text)
and no completion or cached token. A replica lost under a request: an `error`
frame, code `backend_failed` (no token yet) or `backend_lost`.

/v1/responses: one response at a time, as the server's own socket (api.responses_ws): each
`response.create` frame is relayed whole to a replica, pinned to the one that stored its
`previous_response_id`, and its events come back to the end (response.completed,
.incomplete, .failed, or an error). A replica lost under a response: an `error` frame
(status 502, code `backend_failed`), and the socket goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from typing import Any

from ray.serve.exceptions import BackPressureError

from tqserve.actors.messages import Done
from tqserve.api.auth import WS_PROTOCOL, key_ok, origin_allowed, protocol_key
from tqserve.api.httpcommon import ApiError
from tqserve.api.rayserve.keys import FrontConfig, route_prompt
from tqserve.api.rayserve.progress import note_first_token
from tqserve.api.rayserve.relay import (CancelCall, WsCall, frame_kind, overload_message,
                                        plain_scope, replica_of_response)
from tqserve.api.responses_ws import error_frame
from tqserve.api.router.ws import FrameError, decode, encode

log = logging.getLogger("tqserve.rayserve")
_TOKENS = itertools.count()


async def serve_socket(replicas: Any, config: FrontConfig, tokenizer: Any,
                       scope: dict[str, Any], receive: Any, send: Any) -> None:
    """One client WebSocket, from its upgrade to its close."""
    if (await receive())["type"] != "websocket.connect":
        return
    headers = {k.decode("latin-1").lower(): v.decode("latin-1")
               for k, v in scope.get("headers", ())}
    offered = list(scope.get("subprotocols", ()))
    if config.api_key is not None and not key_ok(
            config.api_key, _Headers(headers), protocol_key(offered)):
        await send({"type": "websocket.close", "code": 1008, "reason": "missing or "
                    "invalid API key"})
        return
    if not origin_allowed(headers.get("origin"), headers.get("host"),
                          config.allowed_origins):
        await send({"type": "websocket.close", "code": 1008, "reason": "origin not "
                    "allowed (--allowed-origins)"})
        return
    path = scope["path"].rstrip("/")
    kind = (_StreamSocket if path.endswith("/v1/stream") else
            _ResponsesSocket if path.endswith("/v1/responses") else None)
    if kind is None:
        await send({"type": "websocket.close", "code": 1008, "reason": "no WebSocket "
                    "here (the sockets are /v1/stream and /v1/responses)"})
        return
    await send({"type": "websocket.accept",
                "subprotocol": WS_PROTOCOL if WS_PROTOCOL in offered else None})
    socket = kind(replicas, plain_scope(scope), send, config, tokenizer)
    try:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text")
            await socket.handle(data if data is not None else message.get("bytes", b""))
    finally:
        socket.close()


async def _send_frame(send: Any, frame: str | bytes) -> None:
    await send({"type": "websocket.send", "bytes": frame} if isinstance(frame, bytes)
               else {"type": "websocket.send", "text": frame})


def _own_request_id() -> str:
    """Give the calls of this task (one WebSocket request) a Ray request id of their own,
    and return it. Handle calls inherit the id of the request that makes them (the
    socket's), and Ray's router books pending calls by it: requests multiplexed on one
    socket would overwrite each other there, and all but one never be routed."""
    from ray.serve.context import _set_request_context

    request_id = uuid.uuid4().hex
    _set_request_context(_internal_request_id=request_id)
    return request_id


class _Headers(dict):  # type: ignore[type-arg]
    """Lower-cased headers that answer mixed-case lookups (api.auth's)."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)


class _StreamSocket:
    """One client WebSocket /v1/stream: its requests in flight, each a call of its own."""

    def __init__(self, replicas: Any, scope: dict[str, Any], send: Any,
                 config: FrontConfig, tokenizer: Any) -> None:
        self._replicas, self._scope, self._send, self._config = replicas, scope, send, config
        self._tokenizer = tokenizer
        self._active: dict[str, tuple[asyncio.Task[None], dict[str, Any]]] = {}

    async def out(self, frame: str | bytes) -> None:
        await _send_frame(self._send, frame)

    async def handle(self, data: str | bytes) -> None:
        binary = isinstance(data, bytes)
        try:
            obj = decode(data, self._config.max_message_bytes)
            rid = obj["id"]
            if obj["type"] == "cancel":
                if rid not in self._active:
                    raise FrameError("unknown_id", f"no active request with id {rid!r}", rid)
                await self._cancel(rid, data)
                return
            if rid in self._active:
                raise FrameError("duplicate_id", f"request id {rid!r} is already active", rid)
            if len(self._active) >= self._config.max_streams_per_connection:
                raise FrameError("too_many_streams", f"at most "
                                 f"{self._config.max_streams_per_connection} concurrent "
                                 "requests per connection", rid)
        except FrameError as exc:
            await self.out(encode({"type": "error", "id": exc.rid, "code": exc.code,
                                   "message": exc.message}, binary))
            return
        route = route_prompt("/v1/stream", obj, self._tokenizer, self._config)
        call = WsCall(scope=self._scope, frame=data, token=f"ws-{next(_TOKENS)}",
                      prefix_keys=route.keys, num_prompt_tokens=route.num_tokens)
        where: dict[str, Any] = {"call": call}
        self._active[rid] = (asyncio.ensure_future(self._run(rid, call, binary, where)), where)

    async def _run(self, rid: str, call: WsCall, binary: bool, where: dict[str, Any]) -> None:
        sent_token = False
        stream: Any = None
        try:
            request_id = _own_request_id()
            stream = self._replicas.options(stream=True).ws.remote(call)
            async for item in stream:
                if isinstance(item, dict):  # the replica's name, first
                    where["replica"] = item["replica"]
                    continue
                if not sent_token and frame_kind(item)[0] == "token":
                    sent_token = True  # its prompt is computed: the router's to know
                    note_first_token(request_id)
                await self.out(item)
        except asyncio.CancelledError:
            if stream is not None:  # the client went, or cancelled before a replica had it
                stream.cancel()
            raise
        except BackPressureError as exc:  # every replica full, and the queue here too
            await self.out(encode({"type": "error", "id": rid, "code": "overloaded",
                                   "message": overload_message(exc)}, binary))
        except Exception as exc:
            log.warning("WebSocket request %s failed: %r", rid, exc)
            code = "backend_lost" if sent_token else "backend_failed"
            await self.out(encode({"type": "error", "id": rid, "code": code, "message":
                                   f"the replica serving request {rid!r} failed: "
                                   f"{type(exc).__name__}; it is not retried"}, binary))
        finally:
            self._active.pop(rid, None)

    async def _cancel(self, rid: str, frame: str | bytes) -> None:
        _, where = self._active[rid]
        replica = where.get("replica")
        if replica is None:  # not started on a replica yet: end it here, as one server
            task, _ = self._active.pop(rid)  # would (nothing relayed: the name comes first)
            task.cancel()
            done = Done(request_id=rid, finish_reason="cancelled", completion_tokens=0,
                        prompt_tokens=where["call"].num_prompt_tokens or 0)
            await self.out(encode(done.to_wire(), isinstance(frame, bytes)))
            return
        _own_request_id()
        await self._replicas.cancel.remote(CancelCall(replica=replica,
                                                      token=where["call"].token, frame=frame))

    def close(self) -> None:
        for task, _ in self._active.values():
            task.cancel()


class _ResponsesSocket:
    """One client WebSocket /v1/responses: its responses one after another (module doc)."""

    def __init__(self, replicas: Any, scope: dict[str, Any], send: Any,
                 config: FrontConfig, tokenizer: Any) -> None:
        self._replicas, self._scope, self._send, self._config = replicas, scope, send, config
        self._tokenizer = tokenizer
        self._last: asyncio.Task[None] | None = None

    async def handle(self, data: str | bytes) -> None:
        """Queue one client frame behind the response under way (one at a time)."""
        self._last = asyncio.ensure_future(self._after(self._last, data))

    async def _after(self, previous: asyncio.Task[None] | None, data: str | bytes) -> None:
        if previous is not None:
            await previous
        fields: Any = None
        if len(data) <= self._config.max_message_bytes:  # else the replica refuses it
            try:
                fields = json.loads(data)
            except ValueError:
                pass  # the replica answers the error frame
        route = route_prompt("/v1/responses", fields, self._tokenizer, self._config)
        pin = (replica_of_response(fields.get("previous_response_id"))
               if isinstance(fields, dict) else None)
        call = WsCall(scope=self._scope, frame=data, token=f"ws-{next(_TOKENS)}",
                      prefix_keys=route.keys, num_prompt_tokens=route.num_tokens, pin=pin)
        _own_request_id()
        stream = self._replicas.options(stream=True).ws.remote(call)
        try:
            async for item in stream:
                if not isinstance(item, dict):  # the replica's name comes first
                    await self._out(item)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except BackPressureError as exc:
            await self._out(error_frame(ApiError(429, overload_message(exc),
                                                 code="overloaded")))
        except Exception as exc:
            log.warning("WebSocket response failed: %r", exc)
            await self._out(error_frame(ApiError(
                502, f"the replica serving this response failed: {type(exc).__name__}; "
                     "it is not retried", code="backend_failed")))

    async def _out(self, frame: str | bytes) -> None:
        await _send_frame(self._send, frame)

    def close(self) -> None:
        if self._last is not None:
            self._last.cancel()
