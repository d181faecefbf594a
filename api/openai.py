"""OpenAI-compatible HTTP: POST /v1/completions, POST /v1/chat/completions, GET /v1/models
and /v1/models/{id}. `n` choices and lists of prompts are answered by api.openai_choices.

Non-streaming answers one JSON object; `"stream": true` answers server-sent events
(`data: {chunk}` ... `data: [DONE]`), with a final usage chunk when
`stream_options.include_usage` is true. Logprobs come in each endpoint's own shape, in
streamed chunks too: completions take `logprobs: N` (0..20 alternatives) and answer
`{tokens, token_logprobs, top_logprobs, text_offset}` (with `echo`, the prompt's tokens
first: engine.prompt_logprobs); chat takes `logprobs: true` plus
`top_logprobs: N` and answers `{content: [{token, logprob, bytes, top_logprobs}]}`.
Every generated token is reported, the end-of-text token too (its text is empty).
finish_reason is "stop", "length" (or "tool_calls") only when true: an output cut short (the server's
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

from typing import Any

from quart import Response, g, jsonify, request
from quart_trio import QuartTrio

from tqserve.actors.facade import Engine
from tqserve.api.chatout import ChatOutput
from tqserve.api.config import ServerConfig
from tqserve.api.chattools import ToolPlan, chat_messages, tool_plan, tools_error
from tqserve.api.httpcommon import ApiError, Body, build_request, new_id, token_text
from tqserve.api.openai_choices import Choice, admit, base_of, streamed, whole
from tqserve.api.served import ServedNames, model_card
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


MAX_CHOICES = 16  # choices one request may ask for (n x prompts): rows of one batch


def _sampling(body: Body, default_max_tokens: int, max_tokens_field: str = "max_tokens",
              ) -> dict[str, Any]:
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


def _echo_params(params: dict[str, Any], echo: bool, logprobs: int | None) -> bool:
    """Completions' `echo` into `params`: with logprobs, the prompt's too
    (engine.prompt_logprobs). True for echo with max_tokens 0, which only scores the
    prompt (eval harnesses): one token is generated (the engine's rows make at least one)
    and left out of the answer and its usage."""
    if echo and logprobs is not None:
        params["prompt_logprobs"] = logprobs
    if echo and params["max_tokens"] == 0:
        params["max_tokens"] = 1
        return True
    return False


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


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt: str | list[Any]) -> list[dict[str, Any]]:
    """`prompt` as one request field per prompt: a string, token ids, or a list of those."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [{"prompt" if isinstance(prompt, str) else "prompt_tokens": prompt}]
    if prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return [{"prompt" if isinstance(p, str) else "prompt_tokens": p} for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those",
                   "prompt")


def register(app: QuartTrio, engine: Engine, config: ServerConfig, metrics: Metrics) -> None:
    """Add the OpenAI routes to the app (`config`: the server's settings)."""
    text_of = token_text(engine.model.tokenizer)
    served = ServedNames(engine, config.served_model_name)
    template = engine.chat_template or getattr(engine.model.tokenizer, "chat_template", None)
    thinks = bool(template) and "<think>" in template

    async def read_body(fields: frozenset[str]) -> Body:
        body = Body(await request.get_data(cache=False), config.max_message_bytes)
        body.refuse_unknown(fields, config.strict_fields)
        served.check(body.get("model", str))
        return body

    async def respond(body: Body, chat: bool, prompts: list[dict[str, Any]],
                      params: dict[str, Any], plan: ToolPlan | None = None,
                      echoes: list[str] | None = None, echo_logprobs: bool = False,
                      score_only: bool = False) -> Response:
        """Admit one request per choice (each prompt n times), then answer them."""
        include_usage = _stream_options(body)
        n = body.get("n", int, 1)
        if not 1 <= n <= MAX_CHOICES:
            raise ApiError(400, f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
        response_format = body.get("response_format", dict)
        if plan is not None and plan.forced is not None:
            if response_format is not None:
                raise ApiError(400, "response_format cannot be combined with a forced "
                                    "tool_choice", "response_format")
            response_format = {"type": "grammar", "lark": plan.forced}
        if len(prompts) * n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={n} choices exceed the limit of "
                                f"{MAX_CHOICES}", "n")
        gens = []
        for prompt in prompts:
            for j in range(n):
                seeded = {**params, "seed": params["seed"] + j} if j and "seed" in params \
                    else params
                gens.append(build_request(seeded, response_format=response_format,
                                          speculative=body.get("speculative", (dict, bool)),
                                          **prompt))
        rid = new_id("chatcmpl-" if chat else "cmpl-")
        g.tracked = True
        g.request_id = rid
        route = f"POST {request.path}"
        ids = [rid if i == 0 else f"{rid}-{i}" for i in range(len(gens))]
        try:
            runs = await admit([metrics.track(engine.generate(gen, cid), cid, route)
                                for gen, cid in zip(gens, ids)])
        except ApiError as exc:
            raise tools_error(exc, plan) from None

        def output() -> ChatOutput:
            return ChatOutput(think=thinks, family=plan.family if plan else None,
                              schemas=plan.schemas if plan else None)

        choices = [Choice(i, run, chat, text_of, output, (echoes or [""] * len(runs))[i // n],
                          echo_logprobs, score_only) for i, run in enumerate(runs)]
        base = base_of(rid, chat, served.primary)
        firsts = list(range(0, len(runs), n))
        want_logprobs = params.get("logprobs", False)
        if body.get("stream", bool, False):
            return streamed(choices, base, want_logprobs, include_usage, firsts, error_body)
        return await whole(choices, base, want_logprobs, firsts)

    @app.post("/v1/completions")
    async def completions() -> Response:
        body = await read_body(COMPLETION_FIELDS)
        if body.get("best_of", int, 1) != 1:
            raise ApiError(400, "best_of must be 1", "best_of")
        if body.get("suffix", str):
            raise ApiError(400, "suffix is not supported (no fill-in-the-middle template)",
                           "suffix")
        prompts = _prompts(body.get("prompt", (str, list), required=True))
        params = _sampling(body, config.engine.default_max_tokens)
        logprobs = body.get("logprobs", int)
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}",
                           "logprobs")
        if logprobs is not None:
            params.update(logprobs=True, top_logprobs=logprobs)
        echo = body.get("echo", bool, False)
        score_only = _echo_params(params, echo, logprobs)
        echoes = [p.get("prompt") or engine.model.tokenizer.decode(list(p["prompt_tokens"]))
                  for p in prompts] if echo else None
        return await respond(body, False, prompts, params, echoes=echoes,
                             echo_logprobs=echo and logprobs is not None, score_only=score_only)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        body = await read_body(CHAT_FIELDS)
        plan = tool_plan(body, template)
        body.get("reasoning_effort", str)  # accepted; the chat template decides on thinking
        messages = chat_messages(body.get("messages", list, required=True))
        params = _sampling(body, config.engine.default_max_tokens, "max_completion_tokens")
        if body.get("logprobs", bool, False):
            params.update(logprobs=True, top_logprobs=body.get("top_logprobs", int, 0))
        elif body.get("top_logprobs", int) is not None:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return await respond(body, True, [{"messages": messages, "tools": plan.tools}], params,
                             plan)

    @app.get("/v1/models")
    async def models() -> Response:
        return jsonify({"object": "list", "data": [model_card(n, engine.model.context_length)
                                                          for n in served.names]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id not in served.names:
            raise ApiError(404, f"The model {model_id!r} does not exist; this server serves "
                                f"{', '.join(served.names)}", "model", "model_not_found")
        return jsonify(model_card(model_id, engine.model.context_length))
