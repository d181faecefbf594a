"""The books of one request's row in the sans-io core (engine.scheduler): its lifecycle
state machine (QUEUED -> PREFILLING -> DECODING -> FINISHED), what it holds and has made,
and the prefill groups rows are batched into. Plain data; no I/O, no MLX.
"""

from __future__ import annotations

import enum

import attrs

from tqserve.engine.sampling import SamplingParams
from tqserve.engine.speculative.policy import RequestChoice
from tqserve.engine.structured import ResponseFormat


class RowState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


_TRANSITIONS = {
    RowState.QUEUED: {RowState.PREFILLING, RowState.FINISHED},
    RowState.PREFILLING: {RowState.DECODING, RowState.FINISHED},
    RowState.DECODING: {RowState.QUEUED, RowState.FINISHED},  # QUEUED: preempted
    RowState.FINISHED: set(),
}


class IllegalTransition(RuntimeError):
    """A row was asked to move along an edge the lifecycle does not have."""


@attrs.define
class Row:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    state: RowState = RowState.QUEUED
    row_id: int | None = None
    num_prefilled: int = 0
    num_generated: int = 0
    reuse: str | None = None
    cached: int = 0
    cached_tier: str | None = None
    generated: list[int] = attrs.Factory(list)
    response_format: ResponseFormat | None = None
    looked_up: bool = False  # the prefix cache was asked for a donor
    snapshot_prompt: bool = True  # with a prefix cache: snapshot the prompt when it joins
    held: bool = False       # queued, not schedulable: its donor's KV is loading
    num_proposed: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    speculative: RequestChoice = None
    group: int = 0           # its prefill group, once started
    # A preempted row (engine.kv_budget): `prompt` is its prompt and its output so far, the
    # last `resumed` tokens of it output (in `generated` too); `first_cached` the prefix
    # its first start reused (its usage)
    resumed: int = 0
    preemptions: int = 0
    first_cached: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """The request's own prompt (without output a preemption folded into `prompt`)."""
        return len(self.prompt) - self.resumed

    @property
    def tokens(self) -> tuple[int, ...]:
        """Its prompt and output so far: what its KV covers once fed."""
        return self.prompt + tuple(self.generated[self.resumed:])

    @property
    def positions(self) -> int:
        """The positions its KV holds once prefilled (prompt and output so far)."""
        return len(self.prompt) + self.num_generated - self.resumed

    def preempt(self) -> int:
        """Back to the queue: its output so far joins its prompt, to be reused from its
        snapshot (or prefilled) when it starts again. Returns the row id it gave back."""
        row_id = self.row_id
        assert row_id is not None and self.state is RowState.DECODING
        self.move(RowState.QUEUED)
        if self.first_cached is None:
            self.first_cached = self.cached
        self.prompt, self.resumed = self.tokens, self.num_generated
        self.preemptions += 1
        self.row_id, self.reuse, self.cached, self.num_prefilled = None, None, 0, 0
        self.looked_up, self.snapshot_prompt, self.group = False, True, 0
        return row_id

    def move(self, new: RowState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.request_id}: {self.state.value} -> {new.value}")
        self.state = new


@attrs.define
class Group:
    """Rows prefilled together (module doc): `done` of `width` columns are prefilled;
    `slots` the row slots of its store (engine.kv_budget charges them)."""

    group_id: int
    rows: list[str]
    width: int
    slots: int
    done: int = 0
