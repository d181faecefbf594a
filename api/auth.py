"""API key, WebSocket Origin allow-list, request ids and the access line of plain routes.

With `--api-key` (or TQSERVE_API_KEY) every HTTP route but `GET /health` and the
playground's page files, and the WebSocket upgrade, need the key, as `Authorization:
Bearer <key>` or as `x-api-key: <key>` (what Anthropic's clients send); keys are compared
in constant time. /health stays open so that load balancers and probes, which carry no
key, can check liveness; it tells nothing but "ok" and the model's name. The page files
(`/`, its script and style sheet) hold no data; the vocabulary and every API stay behind
the key. A browser cannot set headers on a WebSocket upgrade, so the upgrade also takes
the key as a subprotocol, `tqserve.bearer.<key as unpadded base64url>`, offered next to
`tqserve` (the playground does this; the server then selects `tqserve`). A refused upgrade
is an HTTP 401 (no WebSocket).

A WebSocket upgrade or HTTP request carrying an `Origin` header (a browser) is refused
with 403 unless that origin is the request's own (its host:port is the `Host` header), a
loopback one (localhost, 127.0.0.1, [::1], any port), or listed in `--allowed-origins`
(`*` allows any); clients that send no Origin (not browsers) are unaffected. So a page
the user visits elsewhere cannot drive a local server through its WebSocket.
POST bodies must be `Content-Type: application/json` (415 otherwise): a page on another
origin cannot send that without a CORS preflight, which this server never grants, so a
web page cannot make a local server generate behind its user's back.
"""

from __future__ import annotations

import base64
import binascii
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from quart import Response, g, request, websocket
from quart_trio import QuartTrio

from tqserve.api import gate_head
from tqserve.api.httpcommon import new_id
from tqserve.api.metrics import Metrics

OPEN_PATHS = frozenset({"/health", "/", "/static/playground.js", "/static/playground.css",
                        "/static/playground_chat.js"})
WS_PROTOCOL = "tqserve"  # the subprotocol a key-carrying upgrade offers and is given
KEY_PROTOCOL_PREFIX = "tqserve.bearer."


def presented_key(headers: Any) -> str | None:
    """The key a request carries, from Authorization: Bearer or x-api-key (the rule of
    api.gate_head, which the overload gates apply to raw heads)."""
    return gate_head.presented_key(headers.get("Authorization"), headers.get("x-api-key"))


def protocol_key(subprotocols: list[str]) -> str | None:
    """The key offered as a `tqserve.bearer.<base64url>` subprotocol, if any."""
    for offered in subprotocols:
        if offered.startswith(KEY_PROTOCOL_PREFIX):
            encoded = offered[len(KEY_PROTOCOL_PREFIX):]
            try:
                raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
                return raw.decode("utf-8")
            except (binascii.Error, ValueError):
                return None
    return None


def key_ok(expected: str, headers: Any, given: str | None = None) -> bool:
    """Whether the request carries `expected` (in its headers, or as `given`)."""
    return gate_head.key_matches(expected, presented_key(headers) if given is None else given)


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request with this Origin (None: not a browser) and Host may go on (the
    module docstring's rule; the router's too)."""
    if origin is None or "*" in allowed or origin.rstrip("/") in allowed:
        return True
    try:
        parts = urlsplit(origin)
        hostname = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not hostname:
        return False
    return parts.netloc.lower() == (host or "").lower() or hostname.lower() in LOOPBACK_HOSTS


def install(app: QuartTrio, api_key: str | None, allowed_origins: tuple[str, ...],
            metrics: Metrics, refusal: Callable[[str, int, str], Response]) -> None:
    """Register the hooks. `refusal(path, status, message)` builds the API-shaped error."""

    @app.before_request
    async def check_key() -> Response | None:
        g.request_id = new_id("req-")
        g.started = time.perf_counter()
        g.tracked = False
        if not (api_key is None or request.path in OPEN_PATHS
                or key_ok(api_key, request.headers)):
            return refusal(request.path, 401, "missing or invalid API key (send it as "
                                              "'Authorization: Bearer <key>')")
        origin = request.headers.get("Origin")
        if not origin_allowed(origin, request.headers.get("Host"), allowed_origins):
            return refusal(request.path, 403, f"origin {origin!r} is not allowed "
                                              "(--allowed-origins)")
        if (request.method == "POST" and request.url_rule is not None
                and request.mimetype != "application/json"):
            return refusal(request.path, 415, "send the body as JSON with "
                                              "'Content-Type: application/json'")
        return None

    @app.after_request
    async def log_plain(response: Response) -> Response:
        request_id = g.get("request_id") or new_id("req-")
        response.headers["X-Request-Id"] = request_id
        if not g.get("tracked", False):
            metrics.log_plain(request_id, f"{request.method} {request.path}",
                              response.status_code, g.get("started", time.perf_counter()))
        return response

    @app.before_websocket
    async def check_upgrade() -> Response | None:
        offered = protocol_key(websocket.requested_subprotocols)
        if api_key is not None and not key_ok(api_key, websocket.headers, offered):
            return Response('{"error": "missing or invalid API key"}', 401,
                            content_type="application/json")
        if not origin_allowed(websocket.headers.get("Origin"), websocket.headers.get("Host"),
                              allowed_origins):
            return Response('{"error": "origin not allowed (--allowed-origins)"}', 403,
                            content_type="application/json")
        return None
