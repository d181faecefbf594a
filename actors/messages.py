"""Every message between actors: frozen attrs classes, one msgpack codec (actors.codec:
`encode`, `decode`, with the snapshot planes' bytes out of band). Mailboxes carry the
encoded bytes (see `actors.mailbox`), so nothing but data crosses an edge.

Client-facing events (`Queued`, `PromptLogprobs`, `Token`, `Done`, `Error`) are also what
`Engine.generate` yields and what the WebSocket sends (`to_wire()`).
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs

from tqserve.actors.codec import Codec, CodecError  # noqa: F401 (the codec's error)
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.speculative.lookup import Draft
from tqserve.engine.speculative.policy import SpecChoice
from tqserve.engine.step import TokenOut
from tqserve.engine.structured import ResponseFormat


def _as_tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    """`tuple` as a named converter (mypy's attrs plugin cannot type the generic class)."""
    return tuple(value)


def _tuple_of_ints(value: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _tuple_of_emitted(value: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((str(rid), _tuple_of_ints(tokens)) for rid, tokens in value)


def _tuple_of_drafts(value: Any) -> tuple[Draft, ...]:
    return tuple((str(rid), int(at), _tuple_of_ints(tokens)) for rid, at, tokens in value)


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
class StopAdmitting:
    """api -> admission: the server is shutting down; refuse every later Submit."""


@attrs.frozen(kw_only=True)
class Lease:
    """scheduler -> cache_owner: request holds row `row_id`, charged by the core for
    `kv_positions` positions of KV over its life (0: no KV budget)."""

    request_id: str
    row_id: int
    kv_positions: int = 0


@attrs.frozen(kw_only=True)
class Release:
    """scheduler -> cache_owner: the row is free again (finish, cancel, error)."""

    request_id: str
    row_id: int
    reason: str


@attrs.frozen(kw_only=True)
class KvUsage:
    """scheduler -> cache_owner, after a step: the KV bytes resident, the rows decoding,
    and the bytes the core charges the running rows against the KV budget."""

    kv_bytes: int
    num_rows: int
    charged_bytes: int = 0


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


@attrs.frozen(kw_only=True)
class StepTokens:
    """scheduler -> hub: every row's new tokens of one step, in one message: the core's
    own TokenOut records (engine.step). The hub detokenizes per stream and delivers one
    `Token` event per token."""

    rows: tuple[TokenOut, ...] = attrs.field(converter=_as_tuple)


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
    # seconds it waited in the queue for a row (None: it never took one); not on the wire
    queue_seconds: float | None = None

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
    (a SpecChoice, False: never, None: the server's default) and, for a row that looks
    up (prompt lookup), its prompt: the context its lookup index starts from."""

    request_id: str
    choice: SpecChoice | bool | None = None
    context: tuple[int, ...] = attrs.field(default=(), converter=_tuple_of_ints)


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
    # the tokens each lookup row emitted this step (its index grows by them)
    emitted: tuple[tuple[str, tuple[int, ...]], ...] = attrs.field(
        default=(), converter=_tuple_of_emitted)


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
    # lookup rows' proposals: (row, the context length they answer, tokens); engine.orders
    drafts: tuple[Draft, ...] = attrs.field(
        default=(), converter=_tuple_of_drafts)


Event = Queued | PromptLogprobs | Token | Done | Error

def _optional_strs(value: Any) -> tuple[str, ...] | None:
    return None if value is None else _tuple_of_strs(value)


def _planes(value: Any) -> tuple[tuple[str, bytes, tuple[int, ...], str], ...]:
    return tuple((str(n), data, tuple(int(x) for x in shape), str(dtype))
                 for n, data, shape, dtype in value)


@attrs.frozen(kw_only=True)
class SpillWrite:
    """scheduler -> spill: write snapshot `ram_key` as file `key`. `header`: every field of
    the file's header; `planes`: (name, bytes, shape, dtype), the bytes out of band.
    `sync`: the scheduler waits for the answer (--ssd-flush sync). --distributed:
    `order` numbers the other ranks' write of it (0: none), `keep`: an earlier write of
    `key` was acknowledged (the other ranks keep their files should this one fail)."""

    ram_key: str
    key: str
    header: dict[str, Any]
    planes: tuple[tuple[str, bytes, tuple[int, ...], str], ...] = attrs.field(converter=_planes)
    sync: bool = False
    order: int = 0
    keep: bool = False


@attrs.frozen(kw_only=True)
class SpillLoad:
    """scheduler -> spill: rebuild SSD entry `key` in the runner as snapshot `temporary`,
    from its queued write's bytes when `pending` (`key` is then that write's RAM key), else
    from its file, refused above reuse bound `bound`; `state`: its proposer state's
    identity ("": none)."""

    key: str
    temporary: str
    bound: int
    state: str = ""
    pending: bool = False


@attrs.frozen(kw_only=True)
class SpillRemove:
    """scheduler -> spill: remove the files of `keys`, on every rank."""

    keys: tuple[str, ...] = attrs.field(converter=_tuple_of_strs)


@attrs.frozen(kw_only=True)
class SpillWritten:
    """spill -> scheduler (reply edge): the write of `ram_key` as file `key` ended: durable
    (`num_bytes`: the snapshot's size), or not (None) because of `problem` (`disk_error`:
    an OSError, logged once by the tier). `gone`: file
    keys the tier no longer holds (evicted, vanished, the tier gone cold); `live`: every
    key it still holds, when it lost some it cannot name (None: it did not)."""

    ram_key: str
    key: str
    num_bytes: int | None = None
    problem: str | None = None
    disk_error: bool = False
    gone: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_strs)
    live: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_strs)


@attrs.frozen(kw_only=True)
class SpillLoaded:
    """spill -> scheduler (reply edge): the load of `key` ended: the runner holds it as
    `temporary` (`num_bytes`), or not (None: it was gone, failed a check or did not fit
    this engine, and the request runs cold). `gone`: as SpillWritten's."""

    key: str
    temporary: str
    num_bytes: int | None = None
    gone: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_strs)
    live: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_strs)


_CLASSES: dict[str, type] = {cls.__name__: cls for cls in (
    Submit, Cancel, Dequeued, StopAdmitting, Lease, Release, KvUsage, Queued, PromptLogprobs,
    Token, TokenOut, StepTokens, Done, Error, SpecOpen, RowVerified, SpecStep, SpecDecision,
    SpillWrite, SpillLoad, SpillRemove, SpillWritten, SpillLoaded,
    SamplingParams, ResponseFormat, SpecChoice)}
_CODEC = Codec(_CLASSES.values())
encode = _CODEC.encode
decode = _CODEC.decode
