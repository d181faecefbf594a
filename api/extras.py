"""Small endpoints clients expect next to the APIs (vLLM's shapes).

    POST /tokenize    {"prompt": str} or {"messages": [...], "tools"?}
                      -> {"tokens": [int], "count": int, "max_model_len": int}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}
    POST /v1/embeddings   404 naming what is not served (a generative model only)
    GET /v1/kv_events?since=N  the prefix cache's KV events after batch N (engine.kvevents;
                      docs/http-apis.md); 404 when the prefix cache is off

Messages are rendered by the chat template exactly as /v1/chat/completions renders them.
"""

from __future__ import annotations

import re

from quart import Response, jsonify, request
from quart_trio import QuartTrio

from tqserve.actors.facade import Engine
from tqserve.api.chattools import chat_messages, tool_plan
from tqserve.api.config import ServerConfig
from tqserve.api.httpcommon import ApiError, Body, build_request, param_of
from tqserve.api.served import ServedNames

TOKENIZE_FIELDS = frozenset(("model", "prompt", "messages", "tools", "tool_choice",
                             "add_special_tokens", "add_generation_prompt"))
_SINCE = re.compile(r"[0-9]{1,20}")  # a KV event batch seq: decimal digits only


def register(app: QuartTrio, engine: Engine, config: ServerConfig) -> None:
    served = ServedNames(engine, config.served_model_name)
    tokenizer = engine.model.tokenizer
    template = engine.chat_template or getattr(tokenizer, "chat_template", None)

    async def read(fields: frozenset[str]) -> Body:
        body = Body(await request.get_data(cache=False), config.max_message_bytes)
        body.refuse_unknown(fields, config.strict_fields)
        served.check(body.get("model", str))
        return body

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = await read(TOKENIZE_FIELDS)
        if body.get("messages", list) is not None:
            plan = tool_plan(body, template)
            gen = build_request({"max_tokens": 1}, messages=chat_messages(
                body.get("messages", list)), tools=plan.tools)
        else:
            gen = build_request({"max_tokens": 1},
                                prompt=body.get("prompt", str, required=True))
        try:
            tokens = await engine.validate(gen)
        except ValueError as exc:
            raise ApiError(400, str(exc), param_of(str(exc))) from None
        return jsonify({"tokens": list(tokens), "count": len(tokens),
                        "max_model_len": engine.model.context_length})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        body = await read(frozenset(("model", "tokens")))
        tokens = body.get("tokens", list, required=True)
        vocab = engine.model.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise ApiError(400, f"tokens must be token ids in [0, {vocab})", "tokens")
        return jsonify({"prompt": tokenizer.decode(tokens)})

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        raise ApiError(404, f"embeddings are not served: {served.primary} is served for "
                            "generation only (/v1/chat/completions, /v1/completions, "
                            "/v1/responses, /v1/messages)", "model", "model_not_found")

    @app.get("/v1/kv_events")
    async def kv_events() -> Response:
        since = request.args.get("since", "0")
        if not _SINCE.fullmatch(since):
            raise ApiError(400, f"since must be a non-negative integer (a batch seq), got "
                                f"{since[:40]!r}", "since")
        page = engine.kv_events(int(since))
        if page is None:
            raise ApiError(404, "the prefix cache is off (--no-prefix-cache): no KV events",
                           code="not_found")
        return jsonify(page.as_json())
