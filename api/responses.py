"""OpenAI's Responses API: POST /v1/responses (streamed or not), GET /v1/responses/{id}.

A request is `input` (api.responses_input) with optional `instructions`, function
`tools` and `tool_choice` (parsed and forced as for chat: api.chattools),
`max_output_tokens`, `temperature`, `top_p`, `text.format` (json_schema / json_object,
enforced as response_format), `previous_response_id` (continue a stored response's
conversation) and `store` (default true: keep this one for previous_response_id, in this
process, bounded). The answer is a `response` object whose `output` holds reasoning,
message and function_call items (api.responses_output); `status` is "completed", or
"incomplete" with `incomplete_details.reason` "max_output_tokens". Streamed, its events
are response.created, response.in_progress, the items' events, and response.completed
(or response.incomplete); an output cut short (a shutdown, a cancel) ends with
response.failed instead, carrying the error.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

import trio

from quart import Response, g, jsonify, request
from quart_trio import QuartTrio

from tqserve.actors.facade import Engine
from tqserve.api.chatout import ChatOutput
from tqserve.api.config import ServerConfig
from tqserve.api.chattools import tools_error
from tqserve.api.ending import complete
from tqserve.api.httpcommon import (SSE_HEADERS, ApiError, Body, Run, build_request, new_id,
                                    sse, start_run)
from tqserve.api.metrics import Metrics
from tqserve.api.responses_input import (ResponseStore, input_messages,
                                         merge_leading_system, responses_tool_plan,
                                         text_format)
from tqserve.api.responses_output import OutputItems
from tqserve.api.served import ServedNames

FIELDS = frozenset(("model", "input", "instructions", "tools", "tool_choice", "stream",
                    "store", "previous_response_id", "max_output_tokens", "temperature",
                    "top_p", "parallel_tool_calls", "metadata", "reasoning", "text", "user",
                    "include", "truncation", "stream_options", "prompt_cache_key",
                    "service_tier", "safety_identifier", "background", "seed", "top_k"))


def _usage(run: Run) -> dict[str, Any]:
    done = run.outcome.done
    prompt = done.prompt_tokens if done is not None else 0
    output = len(run.outcome.token_ids)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": done.cached_tokens if done else 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _assistant_turn(out: ChatOutput) -> dict[str, Any]:
    """The output as the next request's history holds it."""
    import json

    turn: dict[str, Any] = {"role": "assistant", "content": out.content or None}
    if out.calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": json.loads(c.arguments)}} for c in out.calls]
    elif turn["content"] is None:
        turn["content"] = ""
    return turn


class Turn:
    """One admitted response: its run and what its output and events are built from."""

    def __init__(self, run: Run, out: ChatOutput, base: dict[str, Any], keep: bool,
                 conversation: list[dict[str, Any]], store: ResponseStore) -> None:
        self.run, self.out, self.base, self.keep = run, out, base, keep
        self.conversation = conversation
        self.store = store
        self.items = OutputItems()

    def _finished(self) -> dict[str, Any]:
        done = complete(self.run.outcome)  # a cut output raises ApiError
        whole = {**self.base, "output": self.items.items, "usage": _usage(self.run),
                 "status": "completed"}
        if done.finish_reason == "length" and not self.out.calls:
            whole.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        if self.keep:
            self.store.put(self.base["id"], self.conversation + [_assistant_turn(self.out)],
                           whole)
        return whole

    async def whole(self) -> dict[str, Any]:
        """The finished response (a cut output raises ApiError)."""
        try:
            async for _ in self.run.tokens():
                pass
        finally:
            await self.run.aclose()
        self.items.close(self.out.feed(self.run.outcome.text) + self.out.finish())
        return self._finished()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The stream's events, response.created to response.completed (or .failed)."""
        items, base = self.items, self.base
        try:
            yield items.event("response.created", response=base)
            yield items.event("response.in_progress", response=base)
            async for tok in self.run.tokens():
                for event in items.deltas(self.out.feed(tok.text)):
                    yield event
            try:
                ended = items.close(self.out.finish())
                whole = self._finished()
            except ApiError as cut:
                yield items.event("response.failed", response={
                    **base, "status": "failed", "output": items.items,
                    "error": {"code": cut.code or "server_error", "message": cut.message}})
                return
            for event in ended:
                yield event
            yield items.event(f"response.{whole['status']}", response=whole)
        finally:
            with trio.CancelScope(shield=True):
                await self.run.aclose()


class Responder:
    """Starts responses for both transports (HTTP here, api.responses_ws)."""

    def __init__(self, engine: Engine, config: ServerConfig, metrics: Metrics) -> None:
        self.engine, self.config, self.metrics = engine, config, metrics
        # what a response's id starts with: a Ray replica puts its own name in it, so that
        # `previous_response_id` can be routed back to the replica storing the response
        self.id_prefix = "resp_"
        self.served = ServedNames(engine, config.served_model_name)
        self.store = ResponseStore()
        self.template = engine.chat_template or getattr(engine.model.tokenizer,
                                                        "chat_template", None)
        self.thinks = bool(self.template) and "<think>" in self.template

    async def start(self, body: Body, rid: str, route: str) -> Turn:
        """Check the request, admit it (ApiError naming the field, 429 ...)."""
        config = self.config
        body.refuse_unknown(FIELDS, config.strict_fields)
        self.served.check(body.get("model", str))
        plan = responses_tool_plan(body, self.template, config.strict_fields)
        previous = body.get("previous_response_id", str)
        history = self.store.conversation(previous) if previous else []
        new = input_messages(body.get("input", (str, list), required=True))
        instructions = body.get("instructions", str)
        system = [{"role": "system", "content": instructions}] if instructions else []
        response_format = text_format(body)
        if plan.forced is not None:
            if response_format is not None:
                raise ApiError(400, "text.format cannot be combined with a forced "
                                    "tool_choice", "text")
            response_format = {"type": "grammar", "lark": plan.forced}
        params: dict[str, Any] = {"max_tokens": body.get("max_output_tokens", int,
                                                         config.engine.default_max_tokens)}
        for name, kind in (("temperature", float), ("top_p", float), ("top_k", int),
                           ("seed", int)):
            if body.get(name, kind) is not None:
                params[name] = body.get(name, kind)
        try:
            gen = build_request(params, messages=merge_leading_system(system + history + new),
                                tools=plan.tools, response_format=response_format)
        except ApiError as exc:  # the engine's limits name max_tokens: say the field given
            if exc.param != "max_tokens":
                raise
            raise ApiError(exc.status, exc.message.replace("max_tokens", "max_output_tokens"),
                           "max_output_tokens", exc.code) from None
        try:
            run = await start_run(self.metrics.track(self.engine.generate(gen, rid), rid,
                                                     route))
        except ApiError as exc:
            raise tools_error(exc, plan) from None
        keep = body.get("store", bool, True)
        base = {"id": rid, "object": "response", "created_at": int(time.time()),
                "model": self.served.primary, "instructions": instructions,
                "previous_response_id": previous, "store": keep,
                "tools": body.get("tools", list, []),
                "tool_choice": body.get("tool_choice", (str, dict), "auto"),
                "parallel_tool_calls": body.get("parallel_tool_calls", bool, True),
                "temperature": params.get("temperature", 1.0),
                "top_p": params.get("top_p", 1.0),
                "max_output_tokens": body.get("max_output_tokens", int),
                "metadata": body.get("metadata", dict, {}),
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "error": None, "incomplete_details": None, "usage": None, "output": [],
                "status": "in_progress"}
        out = ChatOutput(think=self.thinks, family=plan.family, schemas=plan.schemas)
        return Turn(run, out, base, keep, history + new, self.store)


def register(app: QuartTrio, engine: Engine, config: ServerConfig,
             metrics: Metrics) -> Responder:
    """Add the Responses API's HTTP routes to the app; its Responder (for the WebSocket)."""
    responder = Responder(engine, config, metrics)

    @app.get("/v1/responses/<rid>")
    async def get_response(rid: str) -> Response:
        found = responder.store.response(rid)
        if found is None:
            raise ApiError(404, f"Response with id {rid!r} not found", "response_id",
                           "not_found")
        return jsonify(found)

    @app.post("/v1/responses")
    async def create() -> Response:
        body = Body(await request.get_data(cache=False), config.max_message_bytes)
        rid = new_id(responder.id_prefix)
        g.tracked = True
        g.request_id = rid
        turn = await responder.start(body, rid, "POST /v1/responses")
        if not body.get("stream", bool, False):
            return jsonify(await turn.whole())

        async def events() -> AsyncIterator[bytes]:
            async for event in turn.events():
                yield sse(event, event["type"])

        response = Response(events(), headers=SSE_HEADERS)
        response.timeout = None
        return response

    return responder
