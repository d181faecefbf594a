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
Unknown fields are ignored with a logged warning, as vLLM and mlx-lm do (--strict-fields
refuses them: a typo must not silently fall back to a default). `model` is checked
against --served-model-name where it is given (api.served). Chat requests may carry
tools (api.chattools) and get reasoning split out (api.chatout); docs/agents.md.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable

from quart import Response, g, jsonify, request
from quart_trio import QuartTrio

from tqserve.actors.engine import Engine
from tqserve.actors.messages import Token
from tqserve.api.chatout import ChatOutput, Delta
from tqserve.api.chattools import ToolPlan, chat_messages, tool_plan
from tqserve.api.httpcommon import (SSE_HEADERS, ApiError, Body, Run, build_request,
                            new_id, sse, start_run, token_text)
from tqserve.api.served import ServedNames, model_card
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
                                   "tools", "tool_choice", "parallel_tool_calls", "store",
                                   "reasoning_effort", "metadata"))


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
    body.get("user", str)
    max_tokens = body.get(max_tokens_field, int, None)
    if max_tokens is None:
        max_tokens = body.get("max_tokens", int, default_max_tokens)
    params: dict[str, Any] = {"max_tokens": max_tokens, "stop": body.stop("stop")}
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int),
                       ("min_p", float), ("repetition_penalty", float), ("seed", int),
                       ("presence_penalty", float), ("frequency_penalty", float),
                       ("logit_bias", dict)):
        value = body.get(name, kind)
        if value is not None:
            params[name] = value
    ids = body.get("stop_token_ids", list)
    if ids is not None:
        params["stop_token_ids"] = ids
    return params


def _stream_options(body: Body) -> bool:
    """include_usage from stream_options (ignored without stream: true, as vLLM)."""
    stream = body.get("stream", bool, False)
    options = body.get("stream_options", dict)
    if options is None or not stream:
        return False
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError(400, "stream_options.include_usage must be a boolean", "stream_options")
    return include


def tool_call_json(call: Any, index: int | None = None) -> dict[str, Any]:
    """A parsed call in OpenAI's shape (with its index in a streamed delta)."""
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _chat_delta(delta: Delta, index: int) -> dict[str, Any]:
    if delta.kind == "call":
        return {"tool_calls": [tool_call_json(delta.call, index)]}
    if delta.kind == "reasoning":
        return {"reasoning_content": delta.text, "reasoning": delta.text}
    return {"content": delta.text}


def _chat_message(out: ChatOutput) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant",
                               "content": out.content if out.content or not out.calls else None}
    if out.reasoning:
        message["reasoning_content"] = message["reasoning"] = out.reasoning
    if out.calls:
        message["tool_calls"] = [tool_call_json(c) for c in out.calls]
    return message


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
    served = ServedNames(engine)
    template = engine.chat_template or getattr(engine.model.tokenizer, "chat_template", None)
    thinks = bool(template) and "<think>" in template

    async def read_body(fields: frozenset[str]) -> Body:
        body = Body(await request.get_data(cache=False), config.max_message_bytes)
        body.refuse_unknown(fields, config.strict_fields)
        served.check(body.get("model", str))
        return body

    async def respond(body: Body, chat: bool, prompt: dict[str, Any], params: dict[str, Any],
                      plan: ToolPlan | None = None) -> Response:
        include_usage = _stream_options(body)
        stream = body.get("stream", bool, False)
        response_format = body.get("response_format", dict)
        if plan is not None and plan.forced is not None:
            if response_format is not None:
                raise ApiError(400, "response_format cannot be combined with a forced "
                                    "tool_choice", "response_format")
            response_format = {"type": "grammar", "lark": plan.forced}
        gen = build_request(params, response_format=response_format,
                            speculative=body.get("speculative", (dict, bool)), **prompt)
        rid = new_id("chatcmpl-" if chat else "cmpl-")
        g.tracked = True
        g.request_id = rid
        route = f"POST {request.path}"
        run = await start_run(metrics.track(engine.generate(gen, rid), rid, route))
        want_logprobs = params.get("logprobs", False)
        lp = _Logprobs(chat, text_of)
        out = ChatOutput(think=thinks, family=plan.family if plan else None,
                         schemas=plan.schemas if plan else None)
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": served.primary}

        def finish_reason(done: Any) -> str:
            return "tool_calls" if out.calls and done.finish_reason == "stop" \
                else done.finish_reason

        if not stream:
            entries = []
            async for tok in run.tokens():
                if want_logprobs:
                    entries.append(lp.entry(tok))
                    lp.offset += len(tok.text)
            done = complete(run.outcome)  # a cut output is an error status
            logprobs = lp.block(entries) if want_logprobs else None
            choice: dict[str, Any] = {"index": 0, "logprobs": logprobs}
            if chat:
                out.feed(run.outcome.text)
                out.finish()
                choice["message"] = _chat_message(out)
            else:
                choice["text"] = run.outcome.text
            choice["finish_reason"] = finish_reason(done)
            return jsonify({**base, "choices": [choice], "usage": _usage(run)})
        chunk_base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(delta: Any, logprobs: Any = None, finish: str | None = None) -> bytes:
            choice = {"index": 0, ("delta" if chat else "text"): delta, "logprobs": logprobs,
                      "finish_reason": finish}
            body = {**chunk_base, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return sse(body)

        num_calls = 0  # tool calls streamed so far: the next one's index

        def chat_chunks(deltas: list[Delta], logprobs: Any = None) -> list[bytes]:
            nonlocal num_calls
            chunks = []
            for d in deltas:
                chunks.append(chunk(_chat_delta(d, num_calls), logprobs))
                num_calls += d.kind == "call"
                logprobs = None
            if logprobs is not None:
                chunks.append(chunk({"content": ""}, logprobs))
            return chunks

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
                    if chat:
                        for piece in chat_chunks(out.feed(tok.text), logprobs):
                            yield piece
                    else:
                        yield chunk(tok.text, logprobs)
                try:
                    done = complete(run.outcome)
                except ApiError as cut:  # no finish_reason: the client raises APIError
                    yield sse(error_body(cut.status, cut.message, cut.param, cut.code))
                else:
                    if chat:
                        for piece in chat_chunks(out.finish()):
                            yield piece
                    yield chunk({} if chat else "", None, finish_reason(done))
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
        plan = tool_plan(body, template)
        body.get("reasoning_effort", str)  # accepted; the chat template decides on thinking
        messages = chat_messages(body.get("messages", list, required=True))
        params = _sampling(body, config.default_max_tokens, "max_completion_tokens")
        if body.get("logprobs", bool, False):
            params.update(logprobs=True, top_logprobs=body.get("top_logprobs", int, 0))
        elif body.get("top_logprobs", int) is not None:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return await respond(body, True, {"messages": messages, "tools": plan.tools}, params,
                             plan)

    @app.get("/v1/models")
    async def models() -> Response:
        return jsonify({"object": "list", "data": [model_card(n) for n in served.names]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id not in served.names:
            raise ApiError(404, f"The model {model_id!r} does not exist; this server serves "
                                f"{', '.join(served.names)}", "model", "model_not_found")
        return jsonify(model_card(model_id))
