"""OpenAI-compatible HTTP: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

Non-streaming answers one JSON object; `"stream": true` answers server-sent events
(`data: {chunk}` ... `data: [DONE]`), with a final usage chunk when
`stream_options.include_usage` is true. Logprobs come in each endpoint's own shape, in
streamed chunks too: completions take `logprobs: N` (0..20 alternatives) and answer
`{tokens, token_logprobs, top_logprobs, text_offset}`; chat takes `logprobs: true` plus
`top_logprobs: N` and answers `{content: [{token, logprob, bytes, top_logprobs}]}`.
Every generated token is reported, the end-of-text token too (its text is empty).
finish_reason is "stop" or "length" only when true: an output cut short (the server's
shutdown, a cancel, an error: api.ending) is an error status when not streamed, and a
stream's last event before `[DONE]` is then `data: {"error": {...}}` (the official
client raises APIError on it) instead of a chunk with a finish_reason.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 names
the field, 401 a missing or wrong key, 429 (with Retry-After) a full admission queue.
Unknown fields are refused (a typo must not silently fall back to a default). The
`model` field is optional and not checked: one model is served, and answers name it.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable

from quart import Response, g, jsonify, request
from quart_trio import QuartTrio

from tqserve.actors.engine import Engine
from tqserve.actors.messages import Token
from tqserve.api.httpcommon import (SSE_HEADERS, ApiError, Body, Run, build_request,
                            new_id, sse, start_run, text_of_content,
                            token_text)
from tqserve.api.ending import complete
from tqserve.api.metrics import Metrics
from tqserve.engine.sampling import MAX_TOP_LOGPROBS

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error",
                429: "rate_limit_exceeded", 503: "service_unavailable"}
_COMMON = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n",
           "stop", "seed", "logprobs", "user", "presence_penalty", "frequency_penalty",
           "logit_bias", "response_format", "top_k", "min_p", "repetition_penalty",
           "stop_token_ids", "speculative")
COMPLETION_FIELDS = frozenset(_COMMON + ("prompt", "echo", "best_of", "suffix"))
CHAT_FIELDS = frozenset(_COMMON + ("messages", "max_completion_tokens", "top_logprobs",
                                   "tools", "tool_choice", "parallel_tool_calls"))
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant", "tool": "tool"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: an error response's body, and a stream's error event."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> Response:
    response = jsonify(error_body(status, message, param, code))
    response.status_code = status
    if status == 429:
        response.headers["Retry-After"] = ApiError(429, "").headers()["Retry-After"]
    return response


def _sampling(body: Body, default_max_tokens: int, max_tokens_field: str = "max_tokens",
              ) -> dict[str, Any]:
    body.n_is_one()
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name, float, 0.0) != 0.0:
            raise ApiError(400, f"{name} is not supported (use repetition_penalty)", name)
    if body.get("logit_bias", dict, {}):
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    body.get("user", str)
    body.get("model", str)
    max_tokens = body.get(max_tokens_field, int, None)
    if max_tokens is None:
        max_tokens = body.get("max_tokens", int, default_max_tokens)
    params: dict[str, Any] = {"max_tokens": max_tokens, "stop": body.stop("stop")}
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int),
                       ("min_p", float), ("repetition_penalty", float), ("seed", int)):
        value = body.get(name, kind)
        if value is not None:
            params[name] = value
    ids = body.get("stop_token_ids", list)
    if ids is not None:
        params["stop_token_ids"] = ids
    return params


def _stream_options(body: Body) -> bool:
    """include_usage from stream_options (only with stream: true, as OpenAI)."""
    stream = body.get("stream", bool, False)
    options = body.get("stream_options", dict)
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError(400, "stream_options.include_usage must be a boolean", "stream_options")
    return include


def _usage(run: Run) -> dict[str, Any]:
    done = run.outcome.done
    prompt = done.prompt_tokens if done is not None else 0
    completion = len(run.outcome.token_ids)
    cached = done.cached_tokens if done is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            **(done.speculative_usage() if done is not None else {})}


class _Logprobs:
    """Token logprobs in the completions shape or the chat shape."""

    def __init__(self, chat: bool, text_of: Callable[[int], str]) -> None:
        self.chat = chat
        self.text_of = text_of
        self.offset = 0

    def entry(self, tok: Token) -> dict[str, Any]:
        text = self.text_of(tok.token_id)
        top = tok.top_logprobs or ()
        if self.chat:
            return {"token": text, "logprob": tok.logprob, "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [{"token": self.text_of(t), "logprob": lp,
                                      "bytes": list(self.text_of(t).encode("utf-8"))}
                                     for t, lp in top]}
        return {"token": text, "logprob": tok.logprob, "offset": self.offset,
                "top": {self.text_of(t): lp for t, lp in top}}

    def block(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        if self.chat:
            return {"content": entries}
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries],
                "text_offset": [e["offset"] for e in entries]}


def register(app: QuartTrio, engine: Engine, metrics: Metrics) -> None:
    """Add the OpenAI routes to the app."""
    config = engine.config
    text_of = token_text(engine.model.tokenizer)
    model_name = engine.model.path.name

    async def read_body(fields: frozenset[str]) -> Body:
        body = Body(await request.get_data(cache=False), config.max_message_bytes)
        body.refuse_unknown(fields)
        return body

    async def respond(body: Body, chat: bool, prompt: dict[str, Any],
                      params: dict[str, Any]) -> Response:
        include_usage = _stream_options(body)
        stream = body.get("stream", bool, False)
        response_format = body.get("response_format", dict)
        gen = build_request(params, response_format=response_format,
                            speculative=body.get("speculative", (dict, bool)), **prompt)
        rid = new_id("chatcmpl-" if chat else "cmpl-")
        g.tracked = True
        g.request_id = rid
        route = f"POST {request.path}"
        run = await start_run(metrics.track(engine.generate(gen, rid), rid, route))
        want_logprobs = params.get("logprobs", False)
        lp = _Logprobs(chat, text_of)
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model_name}
        if not stream:
            entries = []
            async for tok in run.tokens():
                if want_logprobs:
                    entries.append(lp.entry(tok))
                    lp.offset += len(tok.text)
            done = complete(run.outcome)  # a cut output is an error status
            logprobs = lp.block(entries) if want_logprobs else None
            choice: dict[str, Any] = {"index": 0, "logprobs": logprobs,
                                      "finish_reason": done.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": run.outcome.text}
            else:
                choice["text"] = run.outcome.text
            return jsonify({**base, "choices": [choice], "usage": _usage(run)})
        chunk_base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(delta: Any, logprobs: Any = None, finish: str | None = None) -> bytes:
            choice = {"index": 0, ("delta" if chat else "text"): delta, "logprobs": logprobs,
                      "finish_reason": finish}
            out = {**chunk_base, "choices": [choice]}
            if include_usage:
                out["usage"] = None
            return sse(out)

        async def events() -> AsyncIterator[bytes]:
            try:
                if chat:
                    yield chunk({"role": "assistant", "content": ""})
                async for tok in run.tokens():
                    if not tok.text and not want_logprobs:
                        continue
                    logprobs = None
                    if want_logprobs:
                        logprobs = lp.block([lp.entry(tok)])
                        lp.offset += len(tok.text)
                    yield chunk({"content": tok.text} if chat else tok.text, logprobs)
                try:
                    done = complete(run.outcome)
                except ApiError as cut:  # no finish_reason: the client raises APIError
                    yield sse(error_body(cut.status, cut.message, cut.param, cut.code))
                else:
                    yield chunk({} if chat else "", None, done.finish_reason)
                    if include_usage:
                        yield sse({**chunk_base, "choices": [], "usage": _usage(run)})
                yield sse("[DONE]")
            finally:
                await run.aclose()

        response = Response(events(), headers=SSE_HEADERS)
        response.timeout = None  # a long generation is not a stuck response
        return response

    @app.post("/v1/completions")
    async def completions() -> Response:
        body = await read_body(COMPLETION_FIELDS)
        if body.get("echo", bool, False):
            raise ApiError(400, "echo is not supported", "echo")
        if body.get("best_of", int, 1) != 1:
            raise ApiError(400, "best_of must be 1", "best_of")
        if body.get("suffix", str):
            raise ApiError(400, "suffix is not supported", "suffix")
        prompt = body.get("prompt", (str, list), required=True)
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one prompt
            elif prompt and not all(isinstance(t, int) and not isinstance(t, bool)
                                    for t in prompt):
                raise ApiError(400, "prompt must be a string, a list of token ids, or a list "
                                    "of one of those (one prompt per request)", "prompt")
        params = _sampling(body, config.default_max_tokens)
        logprobs = body.get("logprobs", int)
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}",
                           "logprobs")
        if logprobs is not None:
            params.update(logprobs=True, top_logprobs=logprobs)
        key = "prompt" if isinstance(prompt, str) else "prompt_tokens"
        return await respond(body, False, {key: prompt}, params)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        body = await read_body(CHAT_FIELDS)
        if body.get("tools", list):
            raise ApiError(400, "tools are not supported", "tools")
        raw = body.get("messages", list, required=True)
        messages = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise ApiError(400, f"messages[{i}].role must be one of "
                                    f"{', '.join(CHAT_ROLES)}", "messages")
            content = text_of_content(m.get("content"), f"messages[{i}].content")
            messages.append({"role": CHAT_ROLES[m["role"]], "content": content})
        params = _sampling(body, config.default_max_tokens, "max_completion_tokens")
        if body.get("logprobs", bool, False):
            params.update(logprobs=True, top_logprobs=body.get("top_logprobs", int, 0))
        elif body.get("top_logprobs", int) is not None:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return await respond(body, True, {"messages": messages}, params)

    @app.get("/v1/models")
    async def models() -> Response:
        return jsonify({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "tqserve",
             "max_model_len": engine.model.context_length}]})  # vLLM's name: prompt + output
