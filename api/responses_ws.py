"""The Responses API's WebSocket mode: WS /v1/responses, one response at a time.

As OpenAI documents it: the client sends `{"type": "response.create", ...}` text frames
carrying the fields of POST /v1/responses (`stream` is implied and ignored), and gets
the same events the SSE stream carries, one JSON text frame each, response.created to
response.completed (or .incomplete, .failed). The next `response.create` is read only
once the current response has ended (one at a time per connection);
`previous_response_id` continues a stored response as over HTTP. A request the server
refuses is one `{"type": "error", "status", "error": {"type", "code", "message",
"param"}}` frame and the socket goes on. The socket counts against --max-connections
and closes with 1001 at shutdown once its response in progress has ended.
"""

from __future__ import annotations

import json

import trio
from quart import websocket

from tqserve.api.httpcommon import ApiError, Body, new_id
from tqserve.api.responses import Responder

GOING_AWAY = 1001
_WS_ONLY = ("type", "stream", "stream_id", "generate")  # not fields of a POST body


def error_frame(exc: ApiError) -> str:
    from tqserve.api.openai import error_body

    return json.dumps({"type": "error", "status": exc.status,
                       **error_body(exc.status, exc.message, exc.param, exc.code)})


async def _one(responder: Responder, data: str | bytes) -> None:
    """Answer one client frame: a response's events, or an error frame."""
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    try:
        body = Body(raw, responder.config.max_message_bytes)
        if body.obj.get("type") != "response.create":
            raise ApiError(400, "a frame must be {\"type\": \"response.create\", ...}", "type")
        for name in _WS_ONLY:
            body.obj.pop(name, None)
        turn = await responder.start(body, new_id(responder.id_prefix), "WS /v1/responses")
    except ApiError as exc:
        await websocket.send(error_frame(exc))
        return
    async for event in turn.events():
        await websocket.send(json.dumps(event, ensure_ascii=False))


async def serve_responses_socket(responder: Responder, closing: trio.Event) -> None:
    """One accepted socket until the client leaves or the server shuts down."""
    await websocket.accept()
    busy = trio.Lock()  # held while a response is under way

    async def close_at_shutdown() -> None:
        await closing.wait()
        async with busy:
            await websocket.close(GOING_AWAY, "server shutting down")
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close_at_shutdown)
        try:
            while True:
                data = await websocket.receive()
                async with busy:
                    await _one(responder, data)
        finally:
            nursery.cancel_scope.cancel()
