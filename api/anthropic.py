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

from tqserve.actors.facade import Engine
from tqserve.actors.messages import Done
from tqserve.api.anthropic_stream import BlockStream, content_blocks
from tqserve.api.anthropic_tools import prompt_messages, tool_plan
from tqserve.api.chatout import ChatOutput
from tqserve.api.config import ServerConfig
from tqserve.api.chattools import tools_error
from tqserve.api.ending import complete
from tqserve.api.httpcommon import (SSE_HEADERS, ApiError, Body, Run, build_request, new_id,
                            param_of, sse, start_run)
from tqserve.api.served import ServedNames
from tqserve.api.metrics import Metrics

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                503: "overloaded_error"}
FIELDS = frozenset(("model", "max_tokens", "messages", "system", "stop_sequences", "stream",
                    "temperature", "top_p", "top_k", "metadata", "tools", "tool_choice",
                    "speculative", "thinking", "service_tier"))
COUNT_FIELDS = frozenset(("model", "messages", "system", "tools", "tool_choice", "thinking"))


def error_response(status: int, message: str) -> Response:
    response = jsonify({"type": "error", "error": {
        "type": _ERROR_TYPES.get(status, "api_error"), "message": message}})
    response.status_code = status
    if status == 429:
        response.headers["Retry-After"] = ApiError(429, "").headers()["Retry-After"]
    return response


def register(app: QuartTrio, engine: Engine, config: ServerConfig, metrics: Metrics) -> None:
    """Add POST /v1/messages to the app (`config`: the server's settings)."""
    tokenizer = engine.model.tokenizer
    served = ServedNames(engine, config.served_model_name)
    end_ids = set(engine.model.eos_token_ids)
    template = engine.chat_template or getattr(tokenizer, "chat_template", None)
    thinks = bool(template) and "<think>" in template

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

    async def read(fields: frozenset[str]) -> Body:
        body = Body(await request.get_data(cache=False), config.max_message_bytes)
        body.refuse_unknown(fields, config.strict_fields)
        served.check(body.get("model", str))
        return body

    async def prompt_tokens_of(gen: Any) -> int:
        try:
            return len(await engine.validate(gen))
        except ValueError as exc:
            raise ApiError(400, str(exc), param_of(str(exc)) or "messages") from None

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        body = await read(COUNT_FIELDS)
        plan = tool_plan(body, template)
        gen = build_request({"max_tokens": 1}, messages=prompt_messages(body), tools=plan.tools)
        return jsonify({"input_tokens": await prompt_tokens_of(gen)})

    @app.post("/v1/messages")
    async def messages() -> Response:
        body = await read(FIELDS)
        body.get("metadata", dict)
        plan = tool_plan(body, template)
        params: dict[str, Any] = {"max_tokens": body.get("max_tokens", int, required=True)}
        stops = body.stop("stop_sequences")
        params["stop"] = stops
        for name, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
            value = body.get(name, kind)
            if value is not None:
                params[name] = value
        forced = {"type": "grammar", "lark": plan.forced} if plan.forced else None
        gen = build_request(params, messages=prompt_messages(body), tools=plan.tools,
                            response_format=forced,
                            speculative=body.get("speculative", (dict, bool)))
        prompt_tokens = await prompt_tokens_of(gen)
        stream = body.get("stream", bool, False)
        rid = new_id("msg_")
        g.tracked = True
        g.request_id = rid
        try:
            run = await start_run(metrics.track(engine.generate(gen, rid), rid,
                                                "POST /v1/messages"))
        except ApiError as exc:
            raise tools_error(exc, plan) from None
        message = {"id": rid, "type": "message", "role": "assistant", "model": served.primary}
        out = ChatOutput(think=thinks, family=plan.family, schemas=plan.schemas)

        def reason_of(done: Done) -> tuple[str, str | None]:
            if out.calls and done.finish_reason == "stop":
                return "tool_use", None
            return stop_reason(run, done, stops, gen.params.stop_token_ids)

        if not stream:
            async for _ in run.tokens():
                pass
            done = complete(run.outcome)  # a cut output is an error status
            out.feed(run.outcome.text)
            out.finish()
            reason, sequence = reason_of(done)
            return jsonify({**message, "content": content_blocks(out),
                            "stop_reason": reason, "stop_sequence": sequence,
                            "usage": usage(run, prompt_tokens)})

        async def events() -> AsyncIterator[bytes]:
            blocks = BlockStream()
            try:
                start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
                         "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                                   "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 0}}
                yield sse({"type": "message_start", "message": start}, "message_start")
                async for tok in run.tokens():
                    for event in blocks.deltas(out.feed(tok.text)):
                        yield event
                try:
                    done = complete(run.outcome)
                except ApiError as cut:  # no stop_reason: the client raises
                    yield sse({"type": "error", "error": {
                        "type": _ERROR_TYPES.get(cut.status, "api_error"),
                        "message": cut.message}}, "error")
                    return
                for event in blocks.close(out.finish()):
                    yield event
                reason, sequence = reason_of(done)
                yield sse({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": sequence},
                           "usage": usage(run, prompt_tokens)}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
            finally:
                await run.aclose()

        response = Response(events(), headers=SSE_HEADERS)
        response.timeout = None
        return response
