"""Every message between actors: frozen attrs classes, one msgpack codec.

A message encodes as a msgpack map with its tag under "t" and its fields; nested
registered classes (SamplingParams) encode the same way. Tuples travel as
msgpack arrays and are restored through each class's converters. Mailboxes carry
the encoded bytes (see `actors.mailbox`), so nothing but data crosses an edge.

Client-facing events (`Queued`, `PromptLogprobs`, `Token`, `Done`, `Error`) are also what
`Engine.generate` yields and what the WebSocket sends (`to_wire()`).
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs
import msgpack

from tqserve.engine.sampling import SamplingParams
from tqserve.engine.speculative.policy import SpecChoice
from tqserve.engine.structured import ResponseFormat


def _as_tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    """`tuple` as a named converter (mypy's attrs plugin cannot type the generic class)."""
    return tuple(value)


def _tuple_of_pairs(value: Any) -> tuple[tuple[int, float], ...] | None:
    if value is None:
        return None
    return tuple((int(t), float(lp)) for t, lp in value)


@attrs.frozen(kw_only=True)
class Submit:
    """api -> admission: a new request, already tokenized and validated."""

    request_id: str
    prompt_tokens: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(t) for t in v))
    params: SamplingParams
    response_format: ResponseFormat | None = None  # validated; its grammar text travels
    speculative: SpecChoice | bool | None = None  # the request's choice (None: server default)


@attrs.frozen(kw_only=True)
class Cancel:
    """api -> admission -> scheduler: stop a request and free its row; its Done carries
    `reason` ("cancelled", or "shutdown" when the server ends in-flight requests, or "stop"
    from the hub when a stop string ended the stream after `num_tokens` delivered tokens:
    the Done then counts those)."""

    request_id: str
    reason: str = "cancelled"
    num_tokens: int | None = None


@attrs.frozen(kw_only=True)
class Dequeued:
    """scheduler -> admission (reply edge): a request left the queue."""

    request_id: str
    num_prompt_tokens: int


@attrs.frozen(kw_only=True)
class Lease:
    """scheduler -> cache_owner: request holds row `row_id`."""

    request_id: str
    row_id: int


@attrs.frozen(kw_only=True)
class Release:
    """scheduler -> cache_owner: the row is free again (finish, cancel, error)."""

    request_id: str
    row_id: int
    reason: str


@attrs.frozen(kw_only=True)
class KvUsage:
    """scheduler -> cache_owner: resident KV bytes after a step."""

    kv_bytes: int
    num_rows: int


@attrs.frozen(kw_only=True)
class Queued:
    """-> hub -> client: the request was admitted to the queue."""

    request_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "queued", "id": self.request_id}


@attrs.frozen(kw_only=True)
class Token:
    """-> hub -> client: one generated token."""

    request_id: str
    index: int
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = attrs.field(
        default=None, converter=_tuple_of_pairs)

    def to_wire(self) -> dict[str, Any]:
        top = [list(p) for p in self.top_logprobs] if self.top_logprobs is not None else None
        return {"type": "token", "id": self.request_id, "index": self.index,
                "token_id": self.token_id, "text": self.text, "logprob": self.logprob,
                "top_logprobs": top}


def _prompt_entries(value: Any) -> tuple[tuple[int, float | None, tuple], ...] | None:
    if value is None:
        return None
    return tuple((int(t), None if lp is None else float(lp), _tuple_of_pairs(top) or ())
                 for t, lp, top in value)


@attrs.frozen(kw_only=True)
class PromptLogprobs:
    """-> hub -> client, before a request's first token when it asked for prompt
    logprobs: per prompt position its token id, its logprob given the tokens before it
    and the top alternatives there (None at position 0: nothing precedes it)."""

    request_id: str
    token_ids: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(t) for t in v))
    logprobs: tuple[float | None, ...] = attrs.field(
        converter=lambda v: tuple(None if x is None else float(x) for x in v))
    top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] = attrs.field(
        converter=lambda v: tuple(_tuple_of_pairs(top) for top in v))

    @classmethod
    def of(cls, request_id: str, entries: tuple[tuple[int, float | None, tuple], ...]
           ) -> PromptLogprobs:
        """From the engine's entries (engine.step.PromptEntry)."""
        return cls(request_id=request_id, token_ids=[t for t, _, _ in entries],
                   logprobs=[lp for _, lp, _ in entries],
                   top_logprobs=[None if lp is None else top for _, lp, top in entries])

    def to_wire(self) -> dict[str, Any]:
        return {"type": "prompt_logprobs", "id": self.request_id,
                "token_ids": list(self.token_ids), "logprobs": list(self.logprobs),
                "top_logprobs": [None if top is None else [list(p) for p in top]
                                 for top in self.top_logprobs]}


def _tuple_of_floats(value: Any) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(v) for v in value)


def _tuple_of_tops(value: Any) -> tuple[tuple[tuple[int, float], ...], ...] | None:
    return None if value is None else tuple(_tuple_of_pairs(top) or () for top in value)


@attrs.frozen(kw_only=True)
class RowTokens:
    """One row's new tokens of one step (inside `StepTokens`): several when a speculative
    row accepted some. `index` numbers the first; `logprobs`/`top_logprobs` hold one entry
    per token when the request asked for them. `final`: the row finished with the last
    token (its held-back text is flushed); `stop_token`: that token is a stop token (its
    text is empty). `prompt_logprobs`: with a row's first token, when it asked for them
    (engine.prompt_logprobs' entries)."""

    request_id: str
    index: int
    token_ids: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(t) for t in v))
    logprobs: tuple[float, ...] | None = attrs.field(default=None, converter=_tuple_of_floats)
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = attrs.field(
        default=None, converter=_tuple_of_tops)
    final: bool = False
    stop_token: bool = False
    prompt_logprobs: tuple[tuple[int, float | None, tuple], ...] | None = attrs.field(
        default=None, converter=_prompt_entries)


@attrs.frozen(kw_only=True)
class StepTokens:
    """scheduler -> hub: every row's new tokens of one step, in one message. The hub
    detokenizes per stream and delivers one `Token` event per token."""

    rows: tuple[RowTokens, ...] = attrs.field(converter=_as_tuple)


def _optional_ints(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class Done:
    """-> hub -> client: the request finished; its row is released."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cached_tier: str | None = None  # "ram" or "ssd": where the reused prefix came from
    # speculation: tokens proposed, accepted, verify steps that proposed (None: it did not)
    speculative: tuple[int, int, int] | None = attrs.field(default=None,
                                                           converter=_optional_ints)

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        """Reused prompt tokens per tier, e.g. {"ram": 40, "ssd": 0}."""
        return {tier: self.cached_tokens if tier == self.cached_tier else 0
                for tier in ("ram", "ssd")}

    def to_wire(self) -> dict[str, Any]:
        return {"type": "done", "id": self.request_id, "finish_reason": self.finish_reason,
                "usage": {"prompt_tokens": self.prompt_tokens,
                          "completion_tokens": self.completion_tokens,
                          "cached_tokens": self.cached_tokens,
                          "cached_tokens_by_tier": self.cached_tokens_by_tier,
                          **self.speculative_usage()}}

    def speculative_usage(self) -> dict[str, Any]:
        """{"speculative": {proposed, accepted, mean_accepted_length}} or {}."""
        if self.speculative is None:
            return {}
        proposed, accepted, steps = self.speculative
        return {"speculative": {"proposed": proposed, "accepted": accepted,
                                "mean_accepted_length": accepted / steps if steps else 0.0}}


@attrs.frozen(kw_only=True)
class Error:
    """-> hub -> client: the request failed (code names whose fault and why)."""

    request_id: str | None
    code: str
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "error", "id": self.request_id, "code": self.code,
                "message": self.message}


@attrs.frozen(kw_only=True)
class SpecOpen:
    """Inside `SpecStep`: a row the runner opened this step, with its request's choice
    (a SpecChoice, False: never, None: the server's default)."""

    request_id: str
    choice: SpecChoice | bool | None = None


@attrs.frozen(kw_only=True)
class RowVerified:
    """Inside `SpecStep`: what the target kept of a row's proposal this step."""

    request_id: str
    num_proposed: int
    num_accepted: int


def _tuple_of_strs(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


@attrs.frozen(kw_only=True)
class SpecStep:
    """scheduler -> speculation: one per engine step. Rows opened and released, each
    proposing row's verified length, the rows decoding next (`batch`: what the answer is
    for), and the step's measurement: `decode_seconds` (None: not a steady decode step),
    whether rows proposed, the rows it decoded and the tokens they emitted. `step`
    numbers the engine's steps."""

    step: int
    opened: tuple[SpecOpen, ...] = attrs.field(default=(), converter=_as_tuple)
    released: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_strs)
    verified: tuple[RowVerified, ...] = attrs.field(default=(), converter=_as_tuple)
    batch: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_strs)
    decode_seconds: float | None = None
    speculative: bool = False
    num_rows: int = 0
    num_tokens: int = 0


def _tuple_of_proposals(value: Any) -> tuple[tuple[str, int], ...]:
    return tuple((str(rid), int(k)) for rid, k in value)


@attrs.frozen(kw_only=True)
class SpecDecision:
    """speculation -> scheduler (reply edge): tokens each row booked by step `step`
    proposes from the next step the scheduler plans (a row not named: 0, it decodes
    plainly); `new_rows`: whether rows opened after that step may propose their own k
    until a decision names them (the batch size allows speculation)."""

    step: int
    proposals: tuple[tuple[str, int], ...] = attrs.field(default=(),
                                                         converter=_tuple_of_proposals)
    new_rows: bool = True


Event = Queued | PromptLogprobs | Token | Done | Error

_CLASSES: dict[str, type] = {cls.__name__: cls for cls in (
    Submit, Cancel, Dequeued, Lease, Release, KvUsage, Queued, PromptLogprobs, Token,
    RowTokens, StepTokens,
    Done, Error, SpecOpen, RowVerified, SpecStep, SpecDecision, SamplingParams, ResponseFormat,
    SpecChoice)}


class CodecError(ValueError):
    """Bytes that are not a message of this codec."""


_SCALARS = (str, int, float, bool, bytes, type(None))
_FIELD_NAMES = {cls: tuple(f.name for f in attrs.fields(cls)) for cls in _CLASSES.values()}


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, _SCALARS):  # first: a step's message is mostly token ids
        return obj
    if isinstance(obj, (tuple, list)):
        return [_to_plain(v) for v in obj]
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        name = type(obj).__name__
        if attrs.has(type(obj)):
            raise TypeError(f"{name} is not a registered message class")
        return obj
    out = {"t": type(obj).__name__}
    for field in names:
        out[field] = _to_plain(getattr(obj, field))
    return out


def _from_plain(obj: Any) -> Any:
    if isinstance(obj, dict) and "t" in obj:
        cls = _CLASSES.get(obj["t"])
        if cls is None:
            raise CodecError(f"unknown message tag {obj['t']!r}")
        fields = {k: _from_plain(v) for k, v in obj.items() if k != "t"}
        return cls(**fields)
    if isinstance(obj, list):
        return [_from_plain(v) for v in obj]
    return obj


def encode(message: Any) -> bytes:
    """Encode a registered message to msgpack bytes."""
    return msgpack.packb(_to_plain(message), use_bin_type=True)


def decode(data: bytes) -> Any:
    """Decode msgpack bytes produced by `encode` back to the message object."""
    try:
        plain = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return _from_plain(plain)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CodecError(f"cannot decode message: {exc}") from exc
