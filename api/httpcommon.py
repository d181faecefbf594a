"""What the OpenAI and Anthropic HTTP APIs share: body fields, errors, the event run.

Both APIs ride `Engine.generate` (the same admission, prefix cache and batching as the
WebSocket). A route reads its JSON body with `Body` (every problem is an `ApiError`
naming the field), builds a `GenerateRequest`, and calls `start_run`, which pulls events
up to `Queued` before any response byte is sent: an invalid request or a full queue
becomes a 400 / 429 in the API's own error shape, never a 200 with an error inside.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, AsyncIterator, Callable

import attrs

from tqserve.actors.messages import Done, Error, Event, PromptLogprobs, Queued, Token
from tqserve.engine.request import GenerateRequest
from tqserve.api.gate_head import RETRY_AFTER_SECONDS

log = logging.getLogger("tqserve.api")
# engine error codes -> HTTP status (anything else is our fault: 500)
STATUS_BY_CODE = {"invalid_request": 400, "overloaded": 429, "engine_closed": 503,
                  "shutting_down": 503,
                  "slow_consumer": 500, "internal_error": 500}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
_FIELD_PREFIXES = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "repetition_penalty", "top_logprobs", "logprobs", "stop", "prompt_tokens",
                   "prompt", "messages", "response_format", "speculative", "presence_penalty",
                   "frequency_penalty", "logit_bias", "tools")


def param_of(message: str) -> str | None:
    """The request field an engine error message is about (it names it first)."""
    param = next((f for f in _FIELD_PREFIXES if message.startswith(f)), None)
    if param is None and "response_format" in message:
        return "response_format"
    return param


class ApiError(Exception):
    """A refused request: HTTP status, message, the field at fault (if one is)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def from_event(cls, event: Error) -> "ApiError":
        return cls(STATUS_BY_CODE.get(event.code, 500), event.message,
                   param_of(event.message), event.code)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_SECONDS)} if self.status == 429 else {}


_MISSING = object()
IMAGE_PARTS = ("image_url", "image", "input_image", "input_audio", "document")
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
               list: "an array", dict: "an object"}


class Body:
    """A JSON request body; `get` checks one field's type, naming it when wrong."""

    def __init__(self, raw: bytes, max_bytes: int) -> None:
        if len(raw) > max_bytes:
            raise ApiError(413, f"request body of {len(raw)} bytes exceeds the limit of "
                                f"{max_bytes}")
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "request body must be a JSON object")
        self.obj: dict[str, Any] = obj

    def refuse_unknown(self, known: frozenset[str], strict: bool = True) -> None:
        """Unknown fields: refused (strict, --strict-fields), else ignored with a warning."""
        extra = sorted(set(self.obj) - known)
        if extra and strict:
            raise ApiError(400, f"unknown field {extra[0]!r}", extra[0])
        if extra:
            log.warning("ignoring unknown request fields: %s", ", ".join(extra))
            for name in extra:
                del self.obj[name]

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None, *,
            required: bool = False) -> Any:
        """The field's value (default when absent or null); ApiError naming it otherwise."""
        value = self.obj.get(name, _MISSING)
        if value is _MISSING or value is None:
            if required:
                raise ApiError(400, f"{name} is required", name)
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            value = _MISSING
        if value is _MISSING or not isinstance(value, kinds):
            names = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            raise ApiError(400, f"{name} must be {names}", name)
        return value

    def stop(self, name: str) -> tuple[str, ...]:
        """A stop field: a string or a list of strings."""
        value = self.get(name, (str, list), ())
        if isinstance(value, str):
            return (value,)
        if not all(isinstance(s, str) for s in value):
            raise ApiError(400, f"{name} must be a string or a list of strings", name)
        return tuple(value)

    def n_is_one(self) -> None:
        n = self.get("n", int, 1)
        if n != 1:
            raise ApiError(400, f"n must be 1 (one choice per request), got {n}", "n")


def text_of_content(content: Any, where: str) -> str:
    """Message content as text: a string, or a list of text parts (OpenAI and Anthropic)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                raise ApiError(400, f"{where}[{i}] is an image ({part['type']}): this server "
                                    "serves a text-only model", where)
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where}[{i}] must be a text part "
                                    '({"type": "text", "text": ...})', where)
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", where)


def build_request(params: dict[str, Any], **prompt: Any) -> GenerateRequest:
    """GenerateRequest from checked fields; the engine's own ValueErrors become 400s."""
    from tqserve.engine.sampling import SamplingParams

    response_format = prompt.pop("response_format", None)
    speculative = prompt.pop("speculative", None)
    try:
        return GenerateRequest(params=SamplingParams(**params), response_format=response_format,
                               speculative=speculative, **prompt)
    except (ValueError, TypeError) as exc:
        raise ApiError(400, str(exc), param_of(str(exc))) from None


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@attrs.define
class Outcome:
    """What a finished run produced (for the final chunk, usage and the access log)."""

    text: str = ""
    token_ids: list[int] = attrs.Factory(list)
    prompt_logprobs: PromptLogprobs | None = None  # asked for (echo): before the first token
    done: Done | None = None
    error: Error | None = None


class Run:
    """One request on the engine, past admission: iterate `tokens()`, then read `outcome`."""

    def __init__(self, events: AsyncIterator[Event]) -> None:
        self._events = events
        self.outcome = Outcome()

    async def tokens(self) -> AsyncIterator[Token]:
        async for event in self._events:
            if isinstance(event, Token):
                self.outcome.text += event.text
                self.outcome.token_ids.append(event.token_id)
                yield event
            elif isinstance(event, PromptLogprobs):
                self.outcome.prompt_logprobs = event
            elif isinstance(event, Done):
                self.outcome.done = event
            elif isinstance(event, Error):
                self.outcome.error = event

    async def aclose(self) -> None:
        await self._events.aclose()  # type: ignore[attr-defined]


async def start_run(events: AsyncIterator[Event]) -> Run:
    """Pull events up to Queued; an Error before it raises ApiError (400, 429, ...)."""
    async for event in events:
        if isinstance(event, Queued):
            return Run(events)
        if isinstance(event, Error):
            await events.aclose()  # type: ignore[attr-defined]
            raise ApiError.from_event(event)
    raise ApiError(503, "engine shut down", code="engine_closed")


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event."""
    head = f"event: {event}\n" if event is not None else ""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"{head}data: {payload}\n\n".encode("utf-8")


def token_text(tokenizer: Any) -> Callable[[int], str]:
    """The text of one token id on its own (what logprobs entries name)."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])
    return text
