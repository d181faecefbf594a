"""The front deployment: Ray Serve's ingress for tqserve, routing by prefix.

Ray Serve's HTTP proxy picks a replica before it reads a request's body, so it cannot route
by prompt. The front is the application's ingress: it reads each request (an HTTP body,
or one WebSocket generate frame), computes the prompt's prefix keys, and calls the replica
deployment through a handle; the replica deployment's request router
(api.rayserve.routing.PrefixRouter, or Ray's default to compare) chooses by those keys.

Keys: token prompts (`prompt_tokens`, a token-list `prompt`) and, with the model's
tokenizer loaded here (mlx-lm directories), text prompts, chat `messages` (+ Anthropic's
`system`, with `tools` through the chat template) and Responses `input` are tokenized as
the engine does and cut into engine.kvevents' 16-token blocks, the hashes the replicas'
KV events carry. Without a tokenizer (a GGUF model) text prompts get `tqserve route`'s
text keys: affinity by what was routed before, not by KV events.

HTTP: the reply is relayed message by message (SSE streams as they come). A replica that
dies under a request ends it with an error the client can read: 502 `backend_failed`
before the answer started, an error event in a stream after (OpenAI's `data: {"error"}`,
Anthropic's `event: error`, Responses' `event: error`). The client going away cancels the
call (the engine ends the row).

WebSocket /v1/stream: the front speaks the protocol's framing (JSON or msgpack, `generate`
and `cancel`, ids, --max-streams-per-connection: api.router.ws's checks), checks the key
and Origin at the upgrade as the server does, and sends each generate request on its own
(so one socket's requests spread by their prefixes); a `cancel` follows its request to its
replica. A replica lost under a request: an `error` frame, code `backend_failed` (no token
yet) or `backend_lost`. The Responses WebSocket (/v1/responses) is not relayed here (HTTP
/v1/responses is): it closes with 1008 naming the HTTP route.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from typing import Any

import attrs
from ray import serve

from tqserve.api.auth import WS_PROTOCOL, key_ok, origin_allowed, protocol_key
from tqserve.api.rayserve.relay import CancelCall, HttpCall, WsCall, frame_kind, plain_scope
from tqserve.api.router.core import prefix_keys, token_keys
from tqserve.api.router.ws import FrameError, decode, encode

log = logging.getLogger("tqserve.rayserve")
FRONT_NAME = "TqserveFront"
BLOCK_CHARS = 64  # text keys' block, as `tqserve route`'s default
_TOKENS = itertools.count()


@attrs.frozen(kw_only=True)
class FrontConfig:
    block_tokens: int = 16  # engine.kvevents.BLOCK_TOKENS: the KV events' block
    max_body_bytes: int = 1 << 20
    max_message_bytes: int = 1 << 20
    max_streams_per_connection: int = 16
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    chat_template: str | None = None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prompt_ids(path: str, fields: dict[str, Any], tokenizer: Any,
               template: str | None) -> tuple[int, ...] | None:
    """The prompt's token ids as the engine builds them (engine.request's token_ids on the
    request's prompt or turns); None where that cannot be told here, and a ValueError (the
    caller falls back to text keys) for turns or tools the engine would refuse."""
    prompt = fields.get("prompt_tokens", fields.get("prompt"))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    if tokenizer is None:
        return None
    from tqserve.engine.request import GenerateRequest

    if isinstance(prompt, str):
        return GenerateRequest(prompt=prompt).token_ids(tokenizer, template)
    messages = fields.get("messages")
    if path.endswith("/responses"):
        given = fields.get("input")
        messages = ([{"role": "user", "content": given}] if isinstance(given, str) else
                    [m for m in given if isinstance(m, dict) and "role" in m]
                    if isinstance(given, list) else None)
        if isinstance(fields.get("instructions"), str) and messages is not None:
            messages = [{"role": "system", "content": fields["instructions"]}, *messages]
    if not isinstance(messages, list) or not messages:
        return None
    turns = [{"role": m.get("role"), "content": _text(m.get("content"))}
             for m in messages if isinstance(m, dict)]
    if isinstance(fields.get("system"), (str, list)):
        turns = [{"role": "system", "content": _text(fields["system"])}, *turns]
    tools = fields.get("tools")
    request = GenerateRequest(messages=turns,
                              tools=tools if isinstance(tools, list) and tools else None)
    return request.token_ids(tokenizer, template)  # the engine's own: template or fallback


def route_keys(path: str, fields: Any, tokenizer: Any, config: FrontConfig) -> tuple[Any, ...]:
    """The prefix keys of a request body (none for what is not a generation request)."""
    if not isinstance(fields, dict):
        return ()
    try:
        ids = prompt_ids(path, fields, tokenizer, config.chat_template)
    except Exception:  # turns, tools or a template the engine refuses: the replica says why
        ids = None
    if ids is not None:
        return token_keys(ids, config.block_tokens)
    return prefix_keys(fields, block_tokens=config.block_tokens, block_chars=BLOCK_CHARS)


def _stream_error(path: str, message: str) -> bytes:
    if path.endswith("/messages"):
        body = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    if path.endswith("/responses"):
        body = {"type": "error", "code": "backend_failed", "message": message}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    body = {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "backend_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def _answer(send: Any, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


@serve.ingress()
class TqserveFront:
    """The ingress: reads each request, keys it, calls the replicas (module doc)."""

    def __init__(self, replicas: Any, config: FrontConfig, model: str) -> None:
        from tqserve.engine.model import load_tokenizer

        self._replicas = replicas
        self._config = config
        self._tokenizer = load_tokenizer(model)

    async def __serve_build_asgi_app__(self) -> Any:
        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                while (await receive())["type"] != "lifespan.shutdown":
                    await send({"type": "lifespan.startup.complete"})
                await send({"type": "lifespan.shutdown.complete"})
            elif scope["type"] == "http":
                await self._http(scope, receive, send)
            elif scope["path"].rstrip("/").endswith("/v1/stream"):
                await self._ws(scope, receive, send)
            else:
                await receive()
                await send({"type": "websocket.close", "code": 1008, "reason":
                            "not relayed by the Ray front (use HTTP /v1/responses)"})

        return app

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self._config.max_body_bytes:
                await _answer(send, 413, "body_too_large", f"request body over "
                              f"{self._config.max_body_bytes} bytes (--max-message-bytes)")
                return
        body = b"".join(chunks)
        keys: tuple[Any, ...] = ()
        if scope["method"] == "POST":
            try:
                keys = route_keys(scope["path"], json.loads(body), self._tokenizer,
                                  self._config)
            except ValueError:
                pass  # not JSON: the replica answers the 400
        call = HttpCall(scope=plain_scope(scope), body=body, prefix_keys=keys)
        stream = self._replicas.options(stream=True).http.remote(call)
        watch = asyncio.ensure_future(self._gone(receive, stream))
        started = streaming = False
        try:
            async for message in stream:
                if message["type"] == "http.response.start":
                    started = True
                    streaming = any(k.lower() == b"content-type" and b"event-stream" in v
                                    for k, v in message.get("headers", ()))
                await send(message)
        except Exception as exc:  # the replica died (or was lost) under the request
            if watch.done():
                return  # the client went away and the call was cancelled: nobody to tell
            text = f"the replica serving this request failed: {type(exc).__name__}"
            log.warning("%s %s: %s", scope["method"], scope["path"], text)
            if not started:
                await _answer(send, 502, "backend_failed", text)
            else:
                await send({"type": "http.response.body", "more_body": False,
                            "body": _stream_error(scope["path"], text) if streaming else b""})
        finally:
            watch.cancel()

    @staticmethod
    async def _gone(receive: Any, stream: Any) -> None:
        """Cancel the call when the client disconnects."""
        while (await receive())["type"] != "http.disconnect":
            pass
        stream.cancel()

    async def _ws(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        offered = list(scope.get("subprotocols", ()))
        config = self._config
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
        await send({"type": "websocket.accept",
                    "subprotocol": WS_PROTOCOL if WS_PROTOCOL in offered else None})
        socket = _Socket(self._replicas, plain_scope(scope), send, config, self._tokenizer)
        try:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                data = message.get("text")
                await socket.handle(data if data is not None else message.get("bytes", b""))
        finally:
            socket.close()


def _own_request_id() -> None:
    """Give the calls of this task (one WebSocket request) a Ray request id of their own.
    Handle calls inherit the id of the request that makes them (the socket's), and Ray's
    router books pending calls by it: requests multiplexed on one socket would overwrite
    each other there, and all but one never be routed."""
    from ray.serve.context import _set_request_context

    _set_request_context(_internal_request_id=uuid.uuid4().hex)


class _Headers(dict):  # type: ignore[type-arg]
    """Lower-cased headers that answer mixed-case lookups (api.auth's)."""

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(key.lower(), default)


class _Socket:
    """One client WebSocket: its requests in flight, each a call of its own."""

    def __init__(self, replicas: Any, scope: dict[str, Any], send: Any,
                 config: FrontConfig, tokenizer: Any) -> None:
        self._replicas, self._scope, self._send, self._config = replicas, scope, send, config
        self._tokenizer = tokenizer
        self._active: dict[str, tuple[asyncio.Task[None], dict[str, Any]]] = {}

    async def out(self, frame: str | bytes) -> None:
        await self._send({"type": "websocket.send", "bytes": frame} if isinstance(frame, bytes)
                         else {"type": "websocket.send", "text": frame})

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
        call = WsCall(scope=self._scope, frame=data, token=f"ws-{next(_TOKENS)}",
                      prefix_keys=route_keys("/v1/stream", obj, self._tokenizer,
                                             self._config))
        where: dict[str, Any] = {"call": call}
        self._active[rid] = (asyncio.ensure_future(self._run(rid, call, binary, where)), where)

    async def _run(self, rid: str, call: WsCall, binary: bool, where: dict[str, Any]) -> None:
        sent_token = False
        stream: Any = None
        try:
            _own_request_id()
            stream = self._replicas.options(stream=True).ws.remote(call)
            async for item in stream:
                if isinstance(item, dict):  # the replica's name, first
                    where["replica"] = item["replica"]
                    continue
                sent_token = sent_token or frame_kind(item)[0] == "token"
                await self.out(item)
        except asyncio.CancelledError:
            if stream is not None:  # the client went, or cancelled before a replica had it
                stream.cancel()
            raise
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
        if replica is None:  # not started on a replica yet: end it here
            task, _ = self._active.pop(rid)
            task.cancel()
            await self.out(encode({"type": "done", "id": rid, "finish_reason": "cancelled"},
                                  isinstance(frame, bytes)))
            return
        _own_request_id()
        await self._replicas.cancel.remote(CancelCall(replica=replica,
                                                      token=where["call"].token, frame=frame))

    def close(self) -> None:
        for task, _ in self._active.values():
            task.cancel()
