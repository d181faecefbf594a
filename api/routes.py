"""Wires the HTTP APIs into the app: OpenAI, Anthropic, /metrics, auth, their errors.

An `ApiError` raised by a route, and a 404/405 under the HTTP APIs' paths, answer in
the shape of the API the path belongs to: Anthropic's for /v1/messages, OpenAI's for
the other /v1/ paths, `{"error": {...}}` elsewhere.
"""

from __future__ import annotations

import attrs
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import MethodNotAllowed, NotFound, RequestEntityTooLarge

from tqserve.actors.facade import Engine
from tqserve.api import anthropic, auth, extras, openai, responses
from tqserve.api.config import ServerConfig
from tqserve.api.httpcommon import ApiError
from tqserve.api.httpconn import too_large_message
from tqserve.api.metrics import Metrics
from tqserve.api.responses import Responder

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def api_error(path: str, status: int, message: str, param: str | None = None,
              code: str | None = None) -> Response:
    """An error in the shape of the API that `path` belongs to."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return anthropic.error_response(status, message)
    return openai.error_response(status, message, param, code)


@attrs.frozen
class HttpApis:
    metrics: Metrics        # shared with the WebSocket
    responder: Responder    # the Responses API's, for its WebSocket mode


def register_http_apis(app: QuartTrio, engine: Engine, config: ServerConfig,
                       response_id_prefix: str = "resp_") -> HttpApis:
    """Add the HTTP APIs, /metrics and auth to `app`; what the WebSockets share.
    `response_id_prefix` starts the Responses API's ids (a Ray replica's name goes there)."""
    metrics = Metrics(engine)
    auth.install(app, config.api_key, config.allowed_origins, metrics,
                 lambda path, status, message: api_error(path, status, message))
    openai.register(app, engine, config, metrics)
    anthropic.register(app, engine, config, metrics)
    responder = responses.register(app, engine, config, metrics)
    responder.id_prefix = response_id_prefix
    extras.register(app, engine, config)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), content_type=PROMETHEUS_CONTENT_TYPE)

    @app.errorhandler(ApiError)
    async def refused(exc: ApiError) -> Response:
        return api_error(request.path, exc.status, exc.message, exc.param, exc.code)

    @app.errorhandler(NotFound)
    async def not_found(exc: NotFound) -> Response:
        return api_error(request.path, 404, f"no route {request.path}", code="not_found")

    @app.errorhandler(MethodNotAllowed)
    async def not_allowed(exc: MethodNotAllowed) -> Response:
        response = api_error(request.path, 405,
                             f"method {request.method} not allowed on {request.path}",
                             code="method_not_allowed")
        response.headers["Allow"] = ", ".join(sorted(exc.valid_methods or ()))
        return response

    @app.errorhandler(RequestEntityTooLarge)  # Quart's MAX_CONTENT_LENGTH (api.app)
    async def too_large(exc: RequestEntityTooLarge) -> Response:
        return api_error(request.path, 413, too_large_message(exc, config.max_message_bytes)
                         or "request body too large", code="too_large")

    return HttpApis(metrics, responder)
