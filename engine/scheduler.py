"""Sans-io scheduling core: queue + running rows -> StepPlan; StepResult -> events.

No clock, no I/O, no MLX. The scheduler actor drives it:

    plan, started = core.schedule(advice)    # the whole step: rows, orders, proposals
    result = runner.execute(plan)            # on the runner thread
    events = core.postprocess(result)        # tokens, finishes

A request's row goes QUEUED -> PREFILLING -> DECODING -> FINISHED (or straight to
FINISHED when cancelled). A row prefills `prompt[:-1]`; it then joins the decode
batch with its last prompt token as input, exactly as mlx-lm's generate_step does,
so its first sampled token comes from the decode batch. Finished and cancelled rows
are released at the start of the next step.

Batched prefill under a token budget (engine.prefill_plan, which keeps the groups'
books): the rows that start prefilling from scratch in one `schedule` call form a prefill
group, prefilled together (as wide as its longest prompt); a row reusing a prefix
snapshot prefills alone.
Each step processes at most `max_step_tokens` tokens: one per decoding row, the rest
shared by the prefill groups oldest first, at most `prefill_chunk` columns per step.

Every generated token is reported, the stop token included; `completion_tokens` counts
them all. A row may emit several tokens in one step (speculation's accepted tokens): they
are reported together, cut after the first stop token or at max_tokens. Text is not made
here: the hub detokenizes per stream and matches stop strings there, and a stop string
comes back as `cancel(rid, "stop", num_tokens)` (actors.hub).

A row starts only while the running rows fit the KV budget (engine.kv_budget): for their
whole lives, or with `--kv-admission preempt` for now, the longest decoding row preempted
when the next step would not fit (it resumes where it stopped, from its snapshot).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Collection, Iterable, Iterator

import attrs

from tqserve.engine.kv_budget import SLOT_STEP, KvBudget, shrunk
from tqserve.engine.orders import proposal_drafts, propose_sizes, snapshot_orders
from tqserve.engine.prefill_plan import PrefillPlanner
from tqserve.engine.rows import IllegalTransition, Row, RowState  # noqa: F401 (re-exported)
from tqserve.engine.step import (NO_ADVICE, Event, Finished, NewRow, Preempted,
                                 SpeculativeUsage, Started, StepAdvice, StepPlan, StepResult,
                                 TokenOut)
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.speculative.policy import (RequestChoice, SpecChoice, check_speculative,
                                               resolve_choice)
from tqserve.engine.structured import ResponseFormat


@attrs.frozen(kw_only=True)
class SchedulerStatistics:
    num_queued: int
    num_prefilling: int
    num_decoding: int
    num_queued_tokens: int
    num_steps: int
    num_prefill_groups: int
    num_prefill_tokens: int  # padding included: what the prefill forwards processed
    num_preemptions: int = 0
    num_preempted_queued: int = 0  # in num_queued: preempted rows waiting to resume


class SchedulerCore:
    """Keeps the books of requests and rows; decides each step."""

    def __init__(
        self,
        *,
        max_batch: int,
        prefill_chunk: int,
        eos_token_ids: Iterable[int],
        speculative_methods: Iterable[str] = (),
        max_step_tokens: int | None = None,
        kv_budget: KvBudget | None = None,
        speculative_default: SpecChoice | None = None,
    ) -> None:
        """`max_step_tokens` None: `max(prefill_chunk, max_batch)` (the module doc);
        `kv_budget`: rows start only while their KV fits it (engine.kv_budget);
        `speculative_default`: the server's speculation (a new row's own k)."""
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        if max_step_tokens is None:
            max_step_tokens = max(prefill_chunk, max_batch)
        if max_step_tokens < max_batch:
            raise ValueError(f"max_step_tokens ({max_step_tokens}) must be >= max_batch "
                             f"({max_batch})")
        self._max_batch = max_batch
        self._prefill = PrefillPlanner(prefill_chunk=prefill_chunk, max_step_tokens=max_step_tokens)
        self._eos = frozenset(eos_token_ids)
        self._speculative_methods = frozenset(speculative_methods)
        self._rows: dict[str, Row] = {}
        self._queue: deque[str] = deque()
        self._prefilling: list[str] = []
        self._decoding: list[str] = []
        self._to_release: list[str] = []
        self._release_tokens: dict[str, tuple[int, ...]] = {}
        self._free_row_ids = list(range(max_batch - 1, -1, -1))
        self._num_steps = 0
        self._kv_budget = kv_budget
        self._kv_capacity = (0, 0)  # the decode batch's allocation, as the runner reported
        self._speculative_default = speculative_default
        self._snapshot_ids = itertools.count()  # engine.orders' snapshot keys
        self._num_preemptions = 0

    def add(self, request_id: str, prompt: tuple[int, ...], params: SamplingParams, *,
            reuse: str | None = None, cached: int = 0, cached_tier: str | None = None,
            response_format: ResponseFormat | None = None, speculative: RequestChoice = None) -> None:
        """Queue a request, optionally reusing `cached` positions of snapshot `reuse`,
        optionally constrained by `response_format`; `speculative` goes to its NewRow.

        Raises ValueError for a duplicate id, an empty prompt or a bad cached length."""
        if request_id in self._rows:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        check_speculative(self._speculative_methods, speculative)
        if not 0 <= cached <= len(prompt) - 1 or (cached > 0) != (reuse is not None):
            raise ValueError(f"cannot reuse {cached} tokens of a {len(prompt)}-token prompt")
        self._rows[request_id] = Row(request_id, tuple(prompt), params,
                                      num_prefilled=cached, reuse=reuse, cached=cached,
                                      cached_tier=cached_tier, response_format=response_format,
                                      speculative=speculative)
        self._queue.append(request_id)

    def next_to_start(self) -> list[tuple[str, tuple[int, ...]]]:
        """Queued requests that would take a row at the next `schedule` and were not yet
        looked up: (request id, prompt). The prefix cache answers each with `set_reuse`
        (a donor or none) or `hold` (its donor's KV is loading)."""
        return [(row.request_id, row.prompt) for row in self._startable(looking=True)
                if not row.looked_up and (row.params.prompt_logprobs is None or row.resumed)]

    def _startable(self, preempted: Collection[str] = (), looking: bool = False) -> Iterator[Row]:
        """The queued rows that take a row now, in order, while rows are free and they fit
        the KV budget together (first come, first served); held rows wait for their load;
        `looking`: a preempted row is looked up before it fits (its snapshot saves room)."""
        free = self._max_batch - len(self._prefilling) - len(self._decoding)
        taking: list[Row] = []
        for rid in list(self._queue):
            row = self._rows[rid]
            if free <= 0 or rid in preempted:
                return
            if row.held:
                continue
            if not self._kv_fits([*taking, row]) and not (looking and row.resumed):
                return
            free -= 1
            taking.append(row)
            yield row

    def set_reuse(self, request_id: str, *, reuse: str | None = None, cached: int = 0,
                  cached_tier: str | None = None, snapshot_prompt: bool = True) -> None:
        """A queued request's donor (or none); it is schedulable again. `snapshot_prompt`:
        with a prefix cache, snapshot its prompt when it joins (False: the cache has it).

        ValueError for an unknown or started request, or a bad cached length."""
        row = self._rows.get(request_id)
        if row is None or row.state is not RowState.QUEUED:
            raise ValueError(f"{request_id!r} is not queued")
        if not 0 <= cached <= len(row.prompt) - 1 or (cached > 0) != (reuse is not None):
            raise ValueError(f"cannot reuse {cached} tokens of a {len(row.prompt)}-token prompt")
        row.reuse, row.cached, row.num_prefilled = reuse, cached, cached
        row.cached_tier, row.snapshot_prompt = cached_tier, snapshot_prompt
        row.looked_up, row.held = True, False

    def hold(self, request_id: str) -> None:
        """Keep a queued request out of `schedule` until `set_reuse` or `unhold`."""
        row = self._rows[request_id]
        row.held = row.looked_up = True

    def unhold(self, request_id: str) -> None:
        """A held request's load failed: schedulable again, to be looked up anew."""
        row = self._rows.get(request_id)
        if row is not None and row.held:
            row.held, row.looked_up = False, False

    def prompt(self, request_id: str) -> tuple[int, ...]:
        """The prompt of a request not yet finished (KeyError otherwise)."""
        return self._rows[request_id].prompt

    def speculative(self, request_id: str) -> object:
        """The speculation choice of a request not yet finished (KeyError otherwise)."""
        return self._rows[request_id].speculative

    def is_held(self, request_id: str) -> bool:
        return (row := self._rows.get(request_id)) is not None and row.held

    def cancel(self, request_id: str, reason: str = "cancelled",
               num_tokens: int | None = None) -> list[Event]:
        """Cancel a request wherever it is, finishing it with `reason`; unknown or
        finished ids are a no-op. `num_tokens`: only that many generated tokens reached
        the client (a stop string ended its stream): the finish counts those."""
        row = self._rows.get(request_id)
        if row is None or row.state is RowState.FINISHED:
            return []
        if num_tokens is not None and 0 <= num_tokens < row.num_generated:
            row.num_generated = num_tokens
            del row.generated[num_tokens:]
        return [self._finish(row, reason)]

    def decoding_ids(self) -> list[str]:
        """The rows decoding now, in batch order."""
        return list(self._decoding)

    def active_ids(self) -> list[str]:
        """Every request not yet finished, queued ones included."""
        return list(self._rows)

    def fail_all(self) -> list[Event]:
        """Finish every request with reason "error" after the runner was reset."""
        events: list[Event] = [self._finish(self._rows[rid], "error") for rid in self.active_ids()]
        self._to_release.clear()
        self._release_tokens.clear()
        return events

    def has_work(self) -> bool:
        """Whether `schedule` would do something (held requests wait for their load)."""
        return bool(self._prefilling or self._decoding or self._to_release
                    or any(not self._rows[r].held for r in self._queue))

    def schedule(self, advice: StepAdvice = NO_ADVICE) -> tuple[StepPlan, list[Event]]:
        """Decide the next step, all of it (engine.orders: snapshots, spills, drops and
        proposals from the actors' `advice`). Rows released here finished earlier."""
        events: list[Event] = []
        started: list[Row] = []
        for row in self._startable(self._preempt_rows(events)):
            self._queue.remove(row.request_id)
            row.move(RowState.PREFILLING)
            row.row_id = self._free_row_ids.pop()
            self._prefilling.append(row.request_id)
            started.append(row)
            events.append(Started(request_id=row.request_id, row_id=row.row_id,
                                  num_prompt_tokens=row.num_prompt_tokens,
                                  kv_positions=self._kv_length(row), resumed=row.resumed > 0))
        self._prefill.form(started)
        new_rows = tuple(NewRow(request_id=row.request_id, row_id=row.row_id,  # type: ignore
                                prompt=row.prompt, params=row.params, reuse=row.reuse,
                                cached=row.cached, response_format=row.response_format,
                                speculative=row.speculative, group=row.group,
                                resumed=row.resumed)
                         for row in started)
        chunks, joins = self._prefill.plan(self._rows, self._prefilling, len(self._decoding))
        for rid in joins:
            self._rows[rid].move(RowState.DECODING)
            self._prefilling.remove(rid)
            self._decoding.append(rid)
        release = tuple(self._to_release)
        release_tokens = tuple(self._release_tokens.pop(r, ()) for r in release)
        propose = propose_sizes(advice, self._decoding,
                                frozenset(row.request_id for row in started), self._own_k)
        plan = StepPlan(
            release=release, release_tokens=release_tokens, new_rows=new_rows,
            prefill=tuple(chunks), join=tuple(joins), decode=tuple(self._decoding),
            **snapshot_orders(advice, self._snapshot_ids, release, release_tokens, joins,
                              self._wants_prompt_snapshot),
            propose=propose, drafts=proposal_drafts(advice, propose))
        self._to_release.clear()
        self._num_steps += 1
        return plan, events

    def _wants_prompt_snapshot(self, request_id: str) -> bool:
        return (row := self._rows[request_id]).snapshot_prompt and len(row.prompt) > 1

    def _own_k(self, request_id: str) -> int:
        choice = resolve_choice(self._rows[request_id].speculative, self._speculative_default)
        return choice.num_tokens if choice is not None else 0

    def _kv_fits(self, starting: list[Row]) -> bool:
        """Whether the running rows and `starting` (with their prefill groups) fit the KV
        budget."""
        return self.kv_charge(starting) <= (self._kv_budget.budget_bytes
                                            if self._kv_budget is not None else 0)

    def kv_charge(self, starting: list[Row] | None = None, growth: int = SLOT_STEP,
                  capacity: tuple[int, int] | None = None) -> int:
        """KV bytes charged for the rows running now (and `starting`), beside the slot
        store's `capacity` (default: as reported); 0 without a budget (engine.kv_budget:
        with preemption a row is charged its positions now plus `growth`)."""
        budget = self._kv_budget
        if budget is None:
            return 0
        starting = starting or []
        ids = {r.request_id for r in starting}
        rows = [self._rows[r] for r in (*self._prefilling, *self._decoding)
                if r not in ids] + starting
        lengths = [self._kv_length(r, growth) for r in rows]
        return budget.charge(lengths, self._prefill.stores(starting),
                             capacity=capacity or self._kv_capacity)

    def _kv_length(self, row: Row, growth: int = SLOT_STEP) -> int:
        """The positions a row is charged for (0 without a budget; engine.kv_budget)."""
        budget = self._kv_budget
        return 0 if budget is None else budget.row_length(
            len(row.prompt), row.params.max_tokens - row.resumed, row.positions, growth)

    def _preempt_rows(self, events: list[Event]) -> set[str]:
        """With preemption: while the running rows' next step (a verify block and the
        pipelined token included) does not fit beside the store (shrunk once a row taken
        here leaves it), the longest decoding row gives its row back (engine.kv_budget)."""
        budget, gone = self._kv_budget, set[str]()
        while budget is not None and budget.preempt and len(self._decoding) > 1:
            rows = [self._rows[r] for r in self._decoding]
            capacity = (shrunk(self._kv_capacity, len(rows), max(r.positions for r in rows))
                        if gone else self._kv_capacity)
            if self.kv_charge(growth=2, capacity=capacity) <= budget.budget_bytes:
                break
            row = max(reversed(rows), key=lambda r: r.positions)  # the newest of the longest
            rid = row.request_id
            self._release_tokens[rid] = row.tokens
            self._decoding.remove(rid)
            self._to_release.append(rid)
            self._free_row_ids.append(row_id := row.preempt())
            events.append(Preempted(request_id=rid, row_id=row_id))
            self._queue.appendleft(rid)
            self._num_preemptions += 1
            gone.add(rid)
        return gone

    def postprocess(self, result: StepResult) -> list[Event]:
        """Turn sampled tokens into events; finish rows that hit a stop token, their
        grammar's end or max_tokens (a row's tokens past that point are dropped)."""
        events: list[Event] = []
        self._kv_capacity = result.kv_capacity
        for out in result.outputs:
            row = self._rows.get(out.request_id)
            if row is None or row.state is not RowState.DECODING:
                continue
            if out.error is not None:  # its token was sampled without the grammar: dropped
                events.append(self._finish(row, "error", error=out.error))
                continue
            if out.num_proposed:
                row.num_proposed += out.num_proposed
                row.num_accepted += out.num_accepted
                row.num_verify_steps += 1
            first = row.num_generated
            reason, stop_token = None, False
            for token in out.tokens:
                row.num_generated += 1
                row.generated.append(token)
                if token in self._eos or token in row.params.stop_token_ids:
                    reason, stop_token = "stop", True
                elif row.num_generated >= row.params.max_tokens:
                    reason = "length"
                if reason is not None:  # tokens after a stop are dropped
                    break
            n = row.num_generated - first
            if out.grammar_done and n == len(out.tokens):  # the grammar ended on the last one
                reason = "stop"
            events.append(TokenOut(
                request_id=row.request_id, index=first, token_ids=tuple(out.tokens[:n]),
                logprobs=out.logprobs[:n] if out.logprobs is not None else None,
                top_logprobs=out.top_logprobs[:n] if out.top_logprobs is not None else None,
                final=reason is not None, stop_token=stop_token,
                prompt_logprobs=out.prompt_logprobs))
            if reason is not None:
                events.append(self._finish(row, reason))
        return events

    def _finish(self, row: Row, reason: str, error: str | None = None) -> Finished:
        was_queued = row.state is RowState.QUEUED
        if was_queued:
            self._queue.remove(row.request_id)
        elif row.state is RowState.PREFILLING:
            self._prefilling.remove(row.request_id)
            self._prefill.drop(row)
        else:
            self._decoding.remove(row.request_id)
        if not was_queued:
            self._to_release.append(row.request_id)
            if reason in ("stop", "length") and row.num_generated > 0:
                self._release_tokens[row.request_id] = row.tokens
        row.move(RowState.FINISHED)
        del self._rows[row.request_id]
        if row.row_id is not None:
            self._free_row_ids.append(row.row_id)
        return Finished(
            request_id=row.request_id, finish_reason=reason,
            prompt_tokens=row.num_prompt_tokens, completion_tokens=row.num_generated,
            cached_tokens=row.cached if row.first_cached is None else row.first_cached,
            row_id=row.row_id, was_queued=was_queued, cached_tier=row.cached_tier,
            tokens=row.tokens, error=error,
            preemptions=row.preemptions,
            speculative=SpeculativeUsage(proposed=row.num_proposed, accepted=row.num_accepted,
                                         verify_steps=row.num_verify_steps)
            if row.num_verify_steps else None)

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            num_queued=len(self._queue), num_prefilling=len(self._prefilling),
            num_decoding=len(self._decoding), num_steps=self._num_steps,
            num_queued_tokens=sum(len(self._rows[r].prompt) for r in self._queue),
            num_prefill_groups=self._prefill.num_groups,
            num_prefill_tokens=self._prefill.num_prefill_tokens,
            num_preemptions=self._num_preemptions,
            num_preempted_queued=sum(self._rows[r].resumed > 0 for r in self._queue))
