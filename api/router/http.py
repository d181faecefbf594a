"""The router's HTTP APIs: OpenAI and Anthropic requests passed through to a backend.

POST /v1/completions, /v1/chat/completions and /v1/messages are routed like WebSocket
requests (prefix keys from the JSON body's prompt or messages) and forwarded as they are,
with the client's Content-Type, anthropic-version and (without --backend-api-key, which
replaces them) Authorization / x-api-key headers; the backend's
status, body and errors come back unchanged, SSE streams chunk by chunk.

Fail-over: a backend that cannot be reached, or that answers 503 (it is shutting down),
is replaced by the next one. A backend whose connection breaks once it has the request
(it died handling it: maybe a poison request, which would kill every backend in turn)
gets it never resent: 502 `backend_failed`; no byte for --backend-read-timeout: 504
`backend_timeout`; an answer over --max-backend-bytes (or an SSE stream with no event
end within it): 502 `backend_failed`. For a stream, the router holds back the preamble
events that carry no token (OpenAI chat's role chunk; Anthropic's message_start,
content_block_start, ping) until the first token event, so a failure before it is still
an HTTP error status; a backend lost after that ends the stream with an error event in
the API's shape (code `backend_lost`). No backend: 503 in the API's error shape (code
`no_healthy_backend`); draining: 503 `shutting_down`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator

import httpx
import trio
from quart import Response, jsonify, request
from quart_trio import QuartTrio

from tqserve.api.router.core import NoHealthyBackend, Route
from tqserve.api.router.service import Router, ShuttingDown

log = logging.getLogger("tqserve.router")
FORWARD_HEADERS = ("authorization", "x-api-key", "anthropic-version", "content-type")
REPLY_HEADERS = ("content-type", "retry-after", "cache-control", "www-authenticate")
_PREAMBLE_EVENTS = (b"message_start", b"content_block_start", b"ping")
_ROLE_DELTA = {"role": "assistant", "content": ""}


def error_response(path: str, status: int, message: str, code: str) -> Response:
    """An error in the shape of the API that `path` belongs to (as the server's)."""
    if path.startswith("/v1/messages"):
        body: dict[str, Any] = {"type": "error", "error": {
            "type": "overloaded_error" if status == 503 else "api_error", "message": message}}
    elif path.startswith("/v1/"):
        body = {"error": {"message": message, "type": "service_unavailable"
                          if status == 503 else "server_error", "param": None, "code": code}}
    else:
        body = {"error": {"code": code, "message": message}}
    response = jsonify(body)
    response.status_code = status
    return response


def _lost_event(path: str, message: str) -> bytes:
    if path.startswith("/v1/messages"):
        data = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    data = {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "backend_lost"}}
    return f"data: {json.dumps(data)}\n\n".encode()


def is_preamble(event: bytes) -> bool:
    """Whether one SSE event carries no token (see the module docstring)."""
    lines = event.split(b"\n")
    if any(line.startswith(b"event: ") and line[7:] in _PREAMBLE_EVENTS for line in lines):
        return True
    for line in lines:
        if line.startswith(b"data: "):
            try:
                obj = json.loads(line[6:])
            except ValueError:
                return False
            choices = obj.get("choices") if isinstance(obj, dict) else None
            return bool(choices) and choices[0].get("delta") == _ROLE_DELTA
    return False


class GoingAway(Exception):
    """The backend refused the request before handling it (503: it is stopping)."""


class BadBackendAnswer(Exception):
    """The backend's answer broke a limit or the protocol (too large, no SSE events)."""


def backend_headers(router: Router, incoming: Any) -> dict[str, str]:
    """The client's headers a backend gets: with --backend-api-key, the router's key in
    place of the client's."""
    headers = {k: v for k, v in incoming.items() if k.lower() in FORWARD_HEADERS}
    if router.config.backend_api_key is not None:
        headers = {k: v for k, v in headers.items()
                   if k.lower() not in ("authorization", "x-api-key")}
        headers["Authorization"] = f"Bearer {router.config.backend_api_key}"
    return headers


async def read_bounded(response: httpx.Response, limit: int) -> bytes:
    """A backend's whole answer; BadBackendAnswer past `limit` bytes (read no further)."""
    parts, size = [], 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > limit:
            raise BadBackendAnswer(f"its answer exceeds {limit} bytes (--max-backend-bytes)")
        parts.append(chunk)
    return b"".join(parts)


def failed(router: Router, path: str, route: Route, exc: Exception) -> Response:
    """The answer when a backend failed while it handled the request. It is not sent to
    another backend: a request that kills a backend (a poison request) would kill them
    all. A read timeout is a 504 (backend_timeout), anything else a 502 (backend_failed)."""
    timeout = isinstance(exc, httpx.TimeoutException)
    code = "backend_timeout" if timeout else "backend_failed"
    if not timeout and not isinstance(exc, BadBackendAnswer):
        router.lost(route)  # its connection broke: no new requests until it is healthy
    router.reject(code)
    message = (f"backend {route.backend} sent nothing for --backend-read-timeout seconds"
               if timeout else f"backend {route.backend} failed while handling the request "
               f"({type(exc).__name__}: {exc}); it is not retried elsewhere")
    log.warning("%s: %s", path, message)
    return error_response(path, 504 if timeout else 502, message, code)


class _Sse:
    """Splits a byte stream into whole SSE events; BadBackendAnswer when more than
    `limit` bytes come without an event's end (a stream with no delimiters)."""

    def __init__(self, limit: int) -> None:
        self._buf = b""
        self._limit = limit

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        *events, self._buf = self._buf.split(b"\n\n")
        if len(self._buf) > self._limit:
            raise BadBackendAnswer(f"its event stream sent {len(self._buf)} bytes without "
                                   f"an event's end (--max-backend-bytes)")
        return [e + b"\n\n" for e in events]


class _Relay:
    """The rest of a backend's SSE stream, for the client. Its backend is released once:
    at the stream's end, when it breaks (the client then gets an error event), or when
    quart closes the body (a client gone, even before the first chunk was read)."""

    def __init__(self, router: Router, route: Route, path: str, response: httpx.Response,
                 chunks: AsyncIterator[bytes], first: bytes) -> None:
        self._router, self._route, self._path = router, route, path
        self._response, self._chunks = response, chunks
        self._next: bytes | None = first
        self._closed = False

    def __aiter__(self) -> "_Relay":
        return self

    async def __anext__(self) -> bytes:
        if self._next is not None:
            out, self._next = self._next, None
            return out
        if self._closed:
            raise StopAsyncIteration
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            await self.aclose()
            raise
        except httpx.TransportError as exc:
            self._router.lost(self._route)
            await self.aclose()
            return _lost_event(self._path, f"backend {self._route.backend} was lost after "
                               f"the stream started: {exc}")

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            await self._response.aclose()
        self._router.end(self._route)


def register(app: QuartTrio, router: Router) -> None:
    """Add the proxied HTTP routes to the router's app."""

    async def proxy(path: str) -> Response:
        body = await request.get_data(cache=False)
        limit = router.config.max_message_bytes
        if len(body) > limit:
            router.reject("too_large")
            return error_response(path, 413, f"request body of {len(body)} bytes exceeds the "
                                  f"limit of {limit}", "too_large")
        try:
            fields = json.loads(body)
        except ValueError:
            fields = None
        keys = router.keys(fields) if isinstance(fields, dict) else ()
        headers = backend_headers(router, request.headers)
        tried: list[str] = []
        try:
            while True:
                route = router.begin(keys, tried)
                try:
                    return await forward(path, route.backend, body, headers, route)
                except (httpx.ConnectError, httpx.ConnectTimeout, GoingAway) as exc:
                    router.lost(route)  # never handled there: the next backend may
                    log.warning("%s: backend %s unreachable or stopping (%s); retrying "
                                "elsewhere", path, route.backend, exc)
                    tried.append(route.backend)
                except (httpx.TransportError, BadBackendAnswer) as exc:
                    return failed(router, path, route, exc)
                finally:
                    router.end(route)
        except ShuttingDown as exc:
            router.reject("shutting_down")
            return error_response(path, 503, str(exc), "shutting_down")
        except NoHealthyBackend as exc:
            router.reject("no_healthy_backend")
            return error_response(path, 503, str(exc), "no_healthy_backend")

    async def forward(path: str, backend: str, body: bytes, headers: dict[str, str],
                      route: Route) -> Response:
        """One attempt; httpx.TransportError while no token has reached the client."""
        req = router.http.build_request("POST", backend + path, content=body, headers=headers)
        response = await router.http.send(req, stream=True)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() in REPLY_HEADERS}
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await read_bounded(response, router.config.max_backend_bytes)
            finally:
                await response.aclose()
            if response.status_code == 503:  # shutting down: the request can run elsewhere
                raise GoingAway(f"{backend} answered 503: {content[:200]!r}")
            return Response(content, status=response.status_code, headers=out_headers)
        chunks = response.aiter_raw()
        sse = _Sse(router.config.max_backend_bytes)
        held: list[bytes] = []
        try:
            while all(is_preamble(e) for e in held):
                try:
                    held.extend(sse.feed(await chunks.__anext__()))
                except StopAsyncIteration:
                    raise BadBackendAnswer("its stream ended before its first token") from None
        except BaseException:
            await response.aclose()
            raise
        # the attempt ends when proxy() returns: the stream counts in flight until it ends
        router.table.hold(backend)
        out = Response(_Relay(router, route, path, response, chunks, b"".join(held)),
                       status=response.status_code, headers=out_headers)
        out.timeout = None
        return out

    def view(path: str) -> Any:
        async def route() -> Response:
            return await proxy(path)
        return route

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        app.add_url_rule(path, f"proxy{path}", view(path), methods=["POST"])
