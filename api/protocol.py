"""WebSocket protocol, sans-io: frames in -> validated commands; events -> frames.

Text frames are JSON, binary frames msgpack; both carry the same objects, and the
server answers each request in the frame kind the client used for it.

Client -> server:
    {"type": "generate", "id": str, "prompt": str | "prompt_tokens": [int] |
     "messages": [{"role", "content"}], "max_tokens", "temperature", "top_p",
     "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
     "logit_bias", "seed", "logprobs", "top_logprobs", "prompt_logprobs", "stop",
     "stop_token_ids", "response_format", "speculative"}
    {"type": "cancel", "id": str}
Server -> client: queued, prompt_logprobs (asked for), token, done, error (actors.messages).

Every problem raises ProtocolError with a code and a message naming the field;
unknown fields are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import msgpack

from tqserve.engine.request import GenerateRequest
from tqserve.ids import id_problem
from tqserve.engine.sampling import SamplingParams

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                    "repetition_penalty", "seed", "logprobs", "top_logprobs", "stop",
                    "stop_token_ids", "presence_penalty", "frequency_penalty", "logit_bias",
                    "prompt_logprobs")
_PROMPT_FIELDS = ("prompt", "prompt_tokens", "messages")
_GENERATE_FIELDS = frozenset(("type", "id", "response_format", "speculative") + _PROMPT_FIELDS
                             + _SAMPLING_FIELDS)
_LIST_FIELDS = ("prompt_tokens", "messages", "stop", "stop_token_ids")


class ProtocolError(ValueError):
    """The client's fault: becomes an `error` frame; the socket goes on."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


@attrs.frozen(kw_only=True)
class GenerateCommand:
    request_id: str
    request: GenerateRequest


@attrs.frozen(kw_only=True)
class CancelCommand:
    request_id: str


Command = GenerateCommand | CancelCommand


def decode_frame(data: str | bytes, max_bytes: int) -> dict[str, Any]:
    """Decode one frame to an object; JSON for text, msgpack for binary."""
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ProtocolError("message_too_large",
                            f"message of {size} bytes exceeds the limit of {max_bytes}")
    try:
        if isinstance(data, str):
            obj = json.loads(data)
            # "\ud800" escapes decode to lone surrogates, which no reply could carry
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        else:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        kind = "JSON" if isinstance(data, str) else "msgpack"
        raise ProtocolError("bad_frame", f"frame is not valid {kind}: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_frame", "frame must be an object with a 'type' field")
    return obj


def encode_frame(event: dict[str, Any], binary: bool) -> str | bytes:
    if binary:
        return msgpack.packb(event, use_bin_type=True)
    return json.dumps(event, ensure_ascii=False)


def _request_id(obj: dict[str, Any]) -> str:
    rid = obj.get("id")
    problem = id_problem(rid)
    if problem is not None:
        raise ProtocolError("invalid_request", problem)
    assert isinstance(rid, str)
    return rid


def parse_command(obj: dict[str, Any], default_max_tokens: int) -> Command:
    """Validate a decoded frame into a command."""
    kind = obj.get("type")
    if kind == "cancel":
        extra = set(obj) - {"type", "id"}
        rid = _request_id(obj)
        if extra:
            raise ProtocolError("invalid_request",
                                f"unknown field {sorted(extra, key=str)[0]!r}", rid)
        return CancelCommand(request_id=rid)
    if kind != "generate":
        raise ProtocolError("unknown_type", f"type must be 'generate' or 'cancel', got {kind!r}",
                            obj.get("id") if isinstance(obj.get("id"), str) else None)
    rid = _request_id(obj)
    extra = set(obj) - _GENERATE_FIELDS
    if extra:
        raise ProtocolError("invalid_request",
                            f"unknown field {sorted(extra, key=str)[0]!r}", rid)
    for name in _LIST_FIELDS:
        if name in obj and obj[name] is not None and not isinstance(obj[name], list):
            raise ProtocolError("invalid_request", f"{name} must be a list", rid)
    sampling = {k: obj[k] for k in _SAMPLING_FIELDS if k in obj and obj[k] is not None}
    sampling.setdefault("max_tokens", default_max_tokens)
    if "seed" in obj:
        sampling["seed"] = obj["seed"]
    try:
        params = SamplingParams(**sampling)
        request = GenerateRequest(params=params, response_format=obj.get("response_format"),
                                  speculative=obj.get("speculative"),
                                  **{k: obj[k] for k in _PROMPT_FIELDS if obj.get(k) is not None})
    except (ValueError, TypeError) as exc:
        raise ProtocolError("invalid_request", str(exc), rid) from None
    return GenerateCommand(request_id=rid, request=request)
