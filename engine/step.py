"""The data of one engine step, between the sans-io core and the runner: the plan
(`StepPlan`: rows released, prefill chunks, new rows, decode rows, the prefix cache's and
speculation's orders), what the actors advise before it is made (`StepAdvice`), what the
runner reports (`StepResult`: each row's new tokens,
snapshots made, spill payloads) and the core's events (`Started`, `TokenOut`,
`Finished`). Plain frozen records; no MLX, no I/O (engine.scheduler decides them,
engine.runner executes them).
"""

from __future__ import annotations

from typing import Any

import attrs

from tqserve.engine.sampling import SamplingParams
from tqserve.engine.speculative.lookup import Draft
from tqserve.engine.speculative.policy import RequestChoice
from tqserve.engine.structured import ResponseFormat


# one prompt position's prompt logprob (engine.prompt_logprobs): (token id, its logprob or
# None for the first position, the top-N (id, logprob) there)
PromptEntry = tuple[int, float | None, tuple[tuple[int, float], ...]]


@attrs.frozen(kw_only=True)
class NewRow:
    """A row to create: from scratch, or (reuse set) from the first `cached` positions of
    the runner's snapshot `reuse`; its prefill then starts at `cached`."""

    request_id: str
    row_id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    reuse: str | None = None
    cached: int = 0
    response_format: ResponseFormat | None = None
    speculative: RequestChoice = None  # the request's SpecChoice, False (never), None (default)
    group: int = 0  # the prefill group (see the module doc)
    # a preempted row resumed (engine.kv_budget): the last `resumed` tokens of `prompt` are
    # its output so far (its sampler, grammar and proposer continue after them)
    resumed: int = 0


@attrs.frozen(kw_only=True)
class PrefillChunk:
    """Prompt positions [start, end) of one row; its group's forward this step is
    `columns` wide: the row's tokens come first in it, padding after them."""

    request_id: str
    start: int
    end: int
    group: int = 0
    columns: int = 0


@attrs.frozen(kw_only=True)
class StepPlan:
    """What the runner does in one step, in this order."""

    release: tuple[str, ...] = ()
    # per released row: the tokens its KV covers (prompt + generated) when it finished
    # normally (stop or length, at least one token), else (): what a prefix cache may keep
    release_tokens: tuple[tuple[int, ...], ...] = ()
    new_rows: tuple[NewRow, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    join: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()  # every decoding row after the joins, in batch order
    # Prefix cache orders, decided by the core (engine.scheduler) from the StepAdvice the
    # prefix cache sent: snapshot these released rows under the given keys before they
    # leave the batch; serialize then drop `spill` snapshots; drop `drop` snapshots after
    # the new rows are built. `prompt_snapshot` rows (rid, key) are snapshotted from their
    # own caches when their prefill is complete, before they join; with `persist`, every
    # snapshot made this step is also serialized for the SSD tier (write-through) and kept.
    snapshot: tuple[tuple[str, str], ...] = ()
    prompt_snapshot: tuple[tuple[str, str], ...] = ()
    persist: bool = False
    spill: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    # Speculation, decided by the core from the speculation actor's decision for the last step (in
    # the StepAdvice): (request id, k) of the decoding rows that propose up to k tokens
    # this step; a row not named decodes plainly, and a step where none proposes is plain.
    propose: tuple[tuple[str, int], ...] = ()
    # the speculation actor's lookup proposals for rows of `propose` (request id, context
    # length answered, tokens): the runner takes one for a row whose context is that long
    drafts: tuple[Draft, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.release or self.new_rows or self.prefill or self.join or self.decode
                    or self.snapshot or self.prompt_snapshot or self.spill or self.drop)


@attrs.frozen(kw_only=True)
class StepAdvice:
    """What the actors tell the core before it decides a step (engine.scheduler), so that
    no one edits a plan after the core made it.

    `prefix_cache`: snapshot released rows and the prompts of joining rows that asked
    (`set_reuse(snapshot_prompt=...)`); `write_through`: persist this step's snapshots;
    `spill` / `drop`: the prefix cache's pending orders. `proposals`: the speculation
    actor's decision for the last step (every row opened until then, its k), with its
    lookup rows' proposals (`drafts`); rows that join in this very plan propose their own
    k when `new_rows_propose`."""

    prefix_cache: bool = False
    write_through: bool = False
    spill: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    speculation: bool = False
    proposals: tuple[tuple[str, int], ...] = ()
    drafts: tuple[Draft, ...] = ()
    new_rows_propose: bool = True


NO_ADVICE = StepAdvice()


@attrs.frozen(kw_only=True)
class RowOutput:
    """One row's tokens of one step (several when speculation accepted some: the accepted
    proposals plus the target's next token, in order), with one logprob / top-logprobs
    entry per token when the row asked for them."""

    request_id: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    num_proposed: int = 0   # speculative tokens verified this step
    num_accepted: int = 0   # of which the target kept (len(tokens) - 1 when it proposed)
    grammar_done: bool = False  # the row's grammar is complete: nothing but EOS could follow
    error: str | None = None    # the row's grammar failed: finish it with this message
    # with the row's first token, when it asked: one entry per prompt position
    prompt_logprobs: tuple[PromptEntry, ...] | None = None


@attrs.frozen(kw_only=True)
class SnapshotMade:
    """A released row's snapshot now held by the runner under `key`; `state`: the identity
    of the proposer state paired with it ("" for none), `minimum_reusable_offset` the
    shortest reuse of both parts."""

    key: str
    request_id: str
    offset: int
    minimum_reusable_offset: int
    num_bytes: int
    state: str = ""


@attrs.frozen(kw_only=True)
class SpillPayload:
    """A snapshot serialized for the SSD tier (bytes only; it left the runner's RAM)."""

    key: str
    header: dict
    planes: tuple[tuple[str, bytes, tuple[int, ...], str], ...]


@attrs.frozen(kw_only=True)
class StepResult:
    outputs: tuple[RowOutput, ...]
    kv_bytes: int
    kv_capacity: tuple[int, int] = (0, 0)  # the decode batch's (row slots, positions)
    snapshots: tuple[SnapshotMade, ...] = ()
    spills: tuple[SpillPayload, ...] = ()
    writes: tuple[SpillPayload, ...] = ()  # the persisted snapshots' bytes (still held)
    # a steady decode step (no prefill, join or release; the same path as the step before):
    # seconds since the previous step ended, and whether rows proposed (a verify step)
    decode_seconds: float | None = None
    speculative: bool = False


@attrs.frozen(kw_only=True)
class Started:
    """A request left the queue and holds row `row_id`, charged for `kv_positions`
    positions of KV over its life (0 without a KV budget: engine.kv_budget)."""

    request_id: str
    row_id: int
    num_prompt_tokens: int
    kv_positions: int = 0
    resumed: bool = False  # a preempted row starting again (it left admission's queue before)


@attrs.frozen(kw_only=True)
class Preempted:
    """A decoding row gave its row back to the KV budget (engine.kv_budget: its KV leaves
    with this step's release, for the prefix cache); it waits at the queue's head."""

    request_id: str
    row_id: int


def _pairs(value: Any) -> tuple[tuple[int, float], ...]:
    return tuple((int(t), float(lp)) for t, lp in value or ())


def _floats(value: Any) -> tuple[float, ...] | None:
    return None if value is None else tuple(float(v) for v in value)


def _tops(value: Any) -> tuple[tuple[tuple[int, float], ...], ...] | None:
    return None if value is None else tuple(_pairs(top) for top in value)


def _prompt_entries(value: Any) -> tuple[PromptEntry, ...] | None:
    if value is None:
        return None
    return tuple((int(t), None if lp is None else float(lp), _pairs(top))
                 for t, lp, top in value)


@attrs.frozen(kw_only=True)
class TokenOut:
    """A row's new tokens of one step; `index` numbers the first (several when speculation
    accepted some), with one logprob / top-logprobs entry per token when the request asked
    for them. `final`: the row finished with the last one (its held-back text is flushed);
    `stop_token`: that one is a stop token (its text is empty); `prompt_logprobs`: with a
    row's first token, when it asked. The one shape of a step's tokens from the core to
    the hub (inside actors.messages.StepTokens); converters restore tuples after msgpack."""

    request_id: str
    index: int
    token_ids: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(t) for t in v))
    logprobs: tuple[float, ...] | None = attrs.field(default=None, converter=_floats)
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = attrs.field(
        default=None, converter=_tops)
    final: bool = False
    stop_token: bool = False
    prompt_logprobs: tuple[PromptEntry, ...] | None = attrs.field(
        default=None, converter=_prompt_entries)


@attrs.frozen(kw_only=True)
class Finished:
    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    row_id: int | None
    was_queued: bool
    cached_tier: str | None = None
    tokens: tuple[int, ...] = ()  # prompt + generated: what the row's KV may cover
    error: str | None = None  # set with finish_reason "error": what went wrong (client-facing)
    speculative: SpeculativeUsage | None = None  # set when the row verified proposals
    preemptions: int = 0  # times it was preempted (it left admission's queue once)


Event = Started | TokenOut | Finished | Preempted


@attrs.frozen(kw_only=True)
class SpeculativeUsage:
    """A request's speculation: tokens proposed, accepted, and verify steps that had a
    proposal (`mean_accepted_length` = accepted / verify steps)."""

    proposed: int
    accepted: int
    verify_steps: int

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted / self.verify_steps if self.verify_steps else 0.0
