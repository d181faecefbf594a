"""The front deployment: Ray Serve's ingress for tqserve, routing by prefix.

Ray Serve's HTTP proxy picks a replica before it reads a request's body, so it cannot route
by prompt. The front is the application's ingress: it reads each request (an HTTP body,
or one WebSocket generate frame), computes the prompt's prefix keys, and calls the replica
deployment through a handle; the replica deployment's request router
(api.rayserve.routing.PrefixRouter, or Ray's default to compare) chooses by those keys.

Keys and pins: api.rayserve.keys. WebSockets (/v1/stream, /v1/responses):
api.rayserve.front_ws.

HTTP: the reply is relayed message by message (SSE streams as they come). A replica that
dies under a request ends it with an error the client can read: 502 `backend_failed`
before the answer started, an error event in a stream after (OpenAI's `data: {"error"}`,
Anthropic's `event: error`, Responses' `event: error`). The client going away cancels the
call (the engine ends the row). A Responses request naming a stored response
(`previous_response_id`, GET /v1/responses/<id>) is pinned to the replica whose name the id
carries (api.rayserve.relay.response_id_prefix): the one that stored it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ray import serve
from ray.serve.exceptions import BackPressureError

from tqserve.api.httpconn import RETRY_AFTER_SECONDS
from tqserve.api.overload import refusal_body
from tqserve.api.rayserve.front_ws import serve_socket
from tqserve.api.rayserve.keys import FrontConfig, PromptRoute, response_pin, route_prompt
from tqserve.api.rayserve.relay import HttpCall, overload_message, plain_scope

log = logging.getLogger("tqserve.rayserve")
FRONT_NAME = "TqserveFront"


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


async def _send_json(send: Any, status: int, body: bytes,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _answer(send: Any, status: int, code: str, message: str) -> None:
    await _send_json(send, status, json.dumps({"error": {
        "message": message, "type": "server_error" if status >= 500 else
        "invalid_request_error", "param": None, "code": code}}).encode())


async def _overloaded(send: Any, path: str, exc: BackPressureError) -> None:
    """429 in the route's API shape, with Retry-After (as one server's overload answer)."""
    await _send_json(send, 429, refusal_body(path.encode("utf-8", "replace"),
                                             overload_message(exc)),
                     ((b"retry-after", str(RETRY_AFTER_SECONDS).encode()),))


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
            else:
                await serve_socket(self._replicas, self._config, self._tokenizer, scope,
                                   receive, send)

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
        route = PromptRoute()
        fields: Any = None
        if scope["method"] == "POST":
            try:
                fields = json.loads(body)
                route = route_prompt(scope["path"], fields, self._tokenizer, self._config)
            except ValueError:
                pass  # not JSON: the replica answers the 400
        call = HttpCall(scope=plain_scope(scope), body=body, prefix_keys=route.keys,
                        num_prompt_tokens=route.num_tokens,
                        pin=response_pin(scope["method"], scope["path"], fields))
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
        except BackPressureError as exc:  # the replicas are full and so is the queue here
            await _overloaded(send, scope["path"], exc)
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
