"""Anthropic-compatible HTTP: POST /v1/messages, non-streaming and streaming.

Streaming sends Anthropic's events in Anthropic's order: message_start,
content_block_start, ping, content_block_delta..., content_block_stop, message_delta
(stop_reason, stop_sequence, usage), message_stop; a failure after the stream began is an
`error` event, and so is an output cut short (a shutdown, a cancel: api.ending), which
has no stop_reason. `max_tokens` is required, `system` is a string or text blocks,
`stop_sequences` end the text before them.

Usage follows Anthropic's split: `input_tokens` counts the prompt tokens that were
computed, `cache_read_input_tokens` those reused from the prefix cache (their sum is the
prompt), `cache_creation_input_tokens` is always 0 (caching is automatic, not billed).
message_start carries the whole prompt as input_tokens (the reuse is known only once the
request has a row); message_delta carries the final split.
stop_reason: "end_turn" (end-of-text token or a stop token id), "stop_sequence" (with the
sequence), "max_tokens".

Errors are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from quart import Response, g, jsonify, request
from quart_trio import QuartTrio

from tqserve.actors.engine import Engine
from tqserve.actors.messages import Done
from tqserve.api.ending import complete
from tqserve.api.httpcommon import (SSE_HEADERS, ApiError, Body, Run, build_request, new_id,
                            param_of, sse, start_run, text_of_content)
from tqserve.api.metrics import Metrics

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                503: "overloaded_error"}
FIELDS = frozenset(("model", "max_tokens", "messages", "system", "stop_sequences", "stream",
                    "temperature", "top_p", "top_k", "metadata", "tools", "tool_choice",
                    "speculative"))


def error_response(status: int, message: str) -> Response:
    response = jsonify({"type": "error", "error": {
        "type": _ERROR_TYPES.get(status, "api_error"), "message": message}})
    response.status_code = status
    if status == 429:
        response.headers["Retry-After"] = ApiError(429, "").headers()["Retry-After"]
    return response


def _prompt(body: Body) -> list[dict[str, str]]:
    messages = []
    system = body.get("system", (str, list))
    if system is not None:
        messages.append({"role": "system", "content": text_of_content(system, "system")})
    raw = body.get("messages", list, required=True)
    if not raw:
        raise ApiError(400, "messages must not be empty", "messages")
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be 'user' or 'assistant'", "messages")
        messages.append({"role": m["role"],
                         "content": text_of_content(m.get("content"), f"messages[{i}].content")})
    return messages


def register(app: QuartTrio, engine: Engine, metrics: Metrics) -> None:
    """Add POST /v1/messages to the app."""
    config = engine.config
    tokenizer = engine.model.tokenizer
    model_name = engine.model.path.name
    end_ids = set(engine.model.eos_token_ids)

    def stop_reason(run: Run, done: Done, stops: tuple[str, ...],
                    stop_ids: tuple[int, ...]) -> tuple[str, str | None]:
        """stop_reason and stop_sequence of a complete run (api.ending)."""
        if done.finish_reason == "length":
            return "max_tokens", None
        ids = run.outcome.token_ids
        if not stops or (ids and (ids[-1] in end_ids or ids[-1] in stop_ids)):
            return "end_turn", None
        tail = tokenizer.decode(ids)[len(run.outcome.text):]
        found = [(tail.find(s), i, s) for i, s in enumerate(stops) if s in tail]
        return "stop_sequence", min(found)[2] if found else stops[0]

    def usage(run: Run, prompt_tokens: int) -> dict[str, int]:
        done = run.outcome.done
        cached = done.cached_tokens if done is not None else 0
        return {"input_tokens": prompt_tokens - cached, "output_tokens":
                len(run.outcome.token_ids), "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached}

    @app.post("/v1/messages")
    async def messages() -> Response:
        body = Body(await request.get_data(cache=False), config.max_message_bytes)
        body.refuse_unknown(FIELDS)
        if body.get("tools", list):
            raise ApiError(400, "tools are not supported", "tools")
        body.get("model", str)
        body.get("metadata", dict)
        params: dict[str, Any] = {"max_tokens": body.get("max_tokens", int, required=True)}
        stops = body.stop("stop_sequences")
        params["stop"] = stops
        for name, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
            value = body.get(name, kind)
            if value is not None:
                params[name] = value
        gen = build_request(params, messages=_prompt(body),
                            speculative=body.get("speculative", (dict, bool)))
        try:
            prompt_tokens = len(await engine.validate(gen))
        except ValueError as exc:
            raise ApiError(400, str(exc), param_of(str(exc)) or "messages") from None
        stream = body.get("stream", bool, False)
        rid = new_id("msg_")
        g.tracked = True
        g.request_id = rid
        run = await start_run(metrics.track(engine.generate(gen, rid), rid,
                                            "POST /v1/messages"))
        message = {"id": rid, "type": "message", "role": "assistant", "model": model_name}
        if not stream:
            async for _ in run.tokens():
                pass
            done = complete(run.outcome)  # a cut output is an error status
            reason, sequence = stop_reason(run, done, stops, gen.params.stop_token_ids)
            return jsonify({**message, "content": [{"type": "text", "text": run.outcome.text}],
                            "stop_reason": reason, "stop_sequence": sequence,
                            "usage": usage(run, prompt_tokens)})

        async def events() -> AsyncIterator[bytes]:
            try:
                start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
                         "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                                   "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 0}}
                yield sse({"type": "message_start", "message": start}, "message_start")
                yield sse({"type": "content_block_start", "index": 0,
                           "content_block": {"type": "text", "text": ""}}, "content_block_start")
                yield sse({"type": "ping"}, "ping")
                async for tok in run.tokens():
                    if tok.text:
                        yield sse({"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": tok.text}},
                                  "content_block_delta")
                try:
                    done = complete(run.outcome)
                except ApiError as cut:  # no stop_reason: the client raises
                    yield sse({"type": "error", "error": {
                        "type": _ERROR_TYPES.get(cut.status, "api_error"),
                        "message": cut.message}}, "error")
                    return
                yield sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                reason, sequence = stop_reason(run, done, stops, gen.params.stop_token_ids)
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": sequence},
                           "usage": usage(run, prompt_tokens)}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
            finally:
                await run.aclose()

        response = Response(events(), headers=SSE_HEADERS)
        response.timeout = None
        return response
