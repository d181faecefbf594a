"""Executes a StepPlan on MLX. Runs on the one runner thread; holds every array.

Rows prefill in groups (engine.prefill: one right-padded forward per group and step, into
slot batches that join the decode batch at once); a row that reuses a snapshot, asks
for prompt logprobs (engine.prompt_logprobs: its chunks' logits give them), feeds an MTP
head, or whose cache kind cannot be batched, prefills alone on its own caches. The decode
batch (engine.decode_batch) runs one forward per step for all rows, then per-row sampling.

Pipelining (as mlx-lm's generate_step): at the end of a step the forward of the NEXT step
is built on the still-lazy sampled tokens and started (`mx.async_eval`) before this
step's tokens are read back, so graph building and the actors' round trip overlap the
computation. The next `execute` samples that forward's logits. A row released in between
leaves those logits with its cache; rows joining in between join after that step, so
their first forward is the following one. Sampling itself (keys, penalties, logprobs)
always runs inside `execute`, on host-known history.

Prefix cache: the RAM tier's snapshots are held by key in `snapshots`
(engine.snapshot_store). A released row named in `plan.snapshot` is extracted from the
batch cache before `filter` (its offset may include the extra position of its last
sampled token; the scheduler actor maps the offset back to tokens); a row named in
`plan.prompt_snapshot` is snapshotted from its own caches once its prefill is complete,
before it joins. A new row with `reuse` starts from new cache objects sliced from the
snapshot (no copy), with its proposer's paired part, and prefills only the rest of its
prompt. `plan.spill` and, with `plan.persist`, every snapshot made are serialized here.

Failure: `step_hook(plan)`, when set, runs in the middle of each step (after the prefill,
before the joins): the place where a fault test raises. After a failed step `reset()`
drops every row; `retain(keys)` drops the snapshots nobody indexed.

Structured output (engine.structured): a row with a `response_format` gets a matcher
whose next mask is computed on the grammar worker thread while the forward runs; when a
token completes the grammar the row's output says so (`grammar_done`) and the scheduler
stops it with finish_reason "stop".

Speculation (engine.speculative): a decode step in which some row proposes
(`plan.propose`) runs as one verify step (Speculator.step: proposals, one forward of
[last token + proposal] per row, acceptance, per-row rollback) instead of the pipelined
forward; a row then outputs 1..k+1 tokens. MTP rows hand the target's hidden states to
their head on plain steps too. A grammar row's proposal is cut to the prefix its grammar
accepts. Steady decode steps report their duration (engine.step_clock).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from tqserve.engine.fastpath import DecodeForward
from tqserve.engine.decode_batch import DecodeBatch, RowState
from tqserve.engine.prefill import PrefillGroups
from tqserve.engine.prompt_logprobs import PromptLogprobsBook
from tqserve.engine.sampling import LazySample, RowSampler, build_sample, finalize_sample
from tqserve.engine.snapshot import extract_snapshot, row_from_snapshot, snapshot_of_row
from tqserve.engine.snapshot_layout import PlaneLayout
from tqserve.engine.snapshot_store import SnapshotStore
from tqserve.engine.speculative.mtp import forward_with_hidden
from tqserve.engine.speculative.batch_step import proposal_sizes, verify_step
from tqserve.engine.speculative.lookup import Draft
from tqserve.engine.speculative.speculator import Plane, Speculator
from tqserve.engine.step import (NewRow, PrefillChunk, RowOutput, SnapshotMade, StepPlan,
                                 StepResult)
from tqserve.engine.step_clock import StepClock
from tqserve.engine.structured import GrammarMasks, RowGrammar

CacheFactory = Callable[[Any], list[Any]]


@attrs.frozen(kw_only=True)
class RunnerStatistics:
    num_rows: int
    num_batch_rows: int
    kv_bytes: int
    num_forward_tokens: int
    num_snapshots: int
    snapshot_bytes: int
    num_step_gaps: int        # gaps timed: a forward was in flight between two steps
    step_gap_seconds: float   # their sum: the runner thread idled, the trio side worked
    num_drafts_taken: int = 0  # proposals the speculation actor made (lookup), taken
    num_proposals_made: int = 0  # proposals made on the runner thread


def _cache_nbytes(cache: list[Any] | None) -> int:
    return sum(c.nbytes for c in cache) if cache else 0


class Runner:
    """Owns the model, the per-row caches and the batch cache."""

    def __init__(self, model: Any, make_cache: CacheFactory | None = None,
                 masks: GrammarMasks | None = None,
                 speculator: Speculator | None = None, *, fast_decode: bool = False) -> None:
        self._model = model
        # the pipelined decode forward: the model itself, or its compiled decode layers
        # (engine.fastpath; Qwen3-style models only, others keep the model's own forward)
        self._decode = DecodeForward(model) if fast_decode and DecodeForward.supports(
            model) else None
        self.speculator = speculator
        self._make_cache = make_cache or make_prompt_cache
        self.masks = masks
        self._rows: dict[str, RowState] = {}
        self._batch = DecodeBatch()
        self._num_forward_tokens = 0
        self.snapshots = SnapshotStore(model, self._make_cache, speculator)
        self.step_hook: Callable[[StepPlan], None] | None = None
        self._clock = StepClock()
        self._groups = PrefillGroups(model)
        self._prompt_logprobs = PromptLogprobsBook()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: snapshot, release, spill, admit, prefill, join, decode.

        The time since the previous step returned is recorded as a step gap when a
        forward was in flight meanwhile (the trio side's time per step; `step_gaps`)."""
        self._clock.start(in_flight=self._batch.pending is not None)
        result = self._execute(plan)
        result = attrs.evolve(result, outputs=self._prompt_logprobs.attach(result.outputs))
        return self._clock.end(plan, result)

    @property
    def step_shape(self) -> tuple[str, int, int] | None:
        """The last step's decode forward: (plain | speculative, rows, positions per row),
        or None if it ran none."""
        return self._clock.shape

    def step_gaps(self) -> list[float]:
        """The most recent step gaps in seconds, oldest first (engine.step_clock)."""
        return self._clock.gaps()

    def _execute(self, plan: StepPlan) -> StepResult:
        snapshots = self._snapshot(plan.snapshot)
        self._release(plan.release)
        spills = tuple(self.snapshots.spill(key) for key in plan.spill)
        for new in plan.new_rows:
            if self.speculator is not None:
                self.speculator.open_row(new.request_id, new.speculative)
            if new.reuse is not None:
                snap = self.snapshots[new.reuse]
                cache = row_from_snapshot(snap, new.cached)
                if self.speculator is not None:  # its proposer's part of the snapshot
                    self.speculator.restore_state(new.request_id, snap.paired,
                                                  new.prompt[:new.cached])
            else:
                cache = self._make_cache(self._model)
                if new.group and PrefillGroups.can_batch(cache) and not (
                        self.speculator is not None
                        and self.speculator.wants_hidden(new.request_id)) and (
                        new.params.prompt_logprobs is None or new.resumed):
                    # (an MTP row prefills alone: its head reads the target's hidden states;
                    # so does a row asking for prompt logprobs: it reads its own logits)
                    self._groups.add(new.request_id, new.group, cache)
                    cache = None
            self._rows[new.request_id] = self._row_state(new, cache)
        for key in plan.drop:
            self.snapshots.drop(key)
        grouped = [c for c in plan.prefill if c.request_id in self._groups]
        self._num_forward_tokens += self._groups.run(
            grouped, {c.request_id: self._rows[c.request_id].prompt for c in grouped})
        self._prefill_alone(plan.prefill)
        snapshots += self._snapshot_prompts(plan.prompt_snapshot)
        writes = tuple(self.snapshots.payload(s.key) for s in snapshots) if plan.persist else ()
        if self.step_hook is not None:
            self.step_hook(plan)
        ready = self._sample_pending()
        for rid in plan.join:
            self._join(rid)
        ks = proposal_sizes(self.speculator, self._batch_rows(), plan.propose)
        if any(ks):
            # a forward still in flight from the plain path is read first, not followed
            self._clock.mode = "switch" if ready is not None else "speculative"
            self._clock.shape = ("speculative", len(self._batch.ids), 1 + max(ks))
            outputs = (self._finalize(ready) if ready is not None
                       else self._speculate(ks, plan.drafts))
            return StepResult(outputs=outputs, kv_bytes=self.kv_bytes(),
                              kv_capacity=self._batch.capacity,
                              snapshots=snapshots, spills=spills, writes=writes)
        if self._batch.ids:
            self._clock.mode = "plain" if ready is not None else "switch"
            self._clock.shape = ("plain", len(self._batch.ids), 1)
        if ready is None and self._batch.ids:  # nothing in flight: this step's forward now
            self._launch(None)
            ready = self._sample_pending()
        if self._batch.ids:
            self._launch(ready)
        outputs = self._finalize(ready) if ready is not None else ()
        return StepResult(outputs=outputs, kv_bytes=self.kv_bytes(),
                          kv_capacity=self._batch.capacity, snapshots=snapshots,
                          spills=spills, writes=writes)

    def _row_state(self, new: NewRow, cache: list[Any] | None) -> RowState:
        """A new row's host state. A resumed row (engine.kv_budget's preemption) continues
        after its output so far, the end of its prompt: its sampler has drawn those tokens
        (same seeded keys, penalties and counts), its grammar has consumed them, and its
        prompt logprobs were given already."""
        own = len(new.prompt) - new.resumed
        sampler = RowSampler.create(new.params, new.prompt[:own])
        grammar = self._open_grammar(new.response_format, new.prompt[own:])
        if new.resumed:
            sampler = sampler.advanced(new.prompt[own:])
        self._prompt_logprobs.open(new.request_id, new.prompt,
                                   None if new.resumed else new.params.prompt_logprobs)
        return RowState(sampler=sampler, prompt=new.prompt, cache=cache,
                        last_token=new.prompt[-1], grammar=grammar)

    def _prefill_alone(self, chunks: Iterable[PrefillChunk]) -> None:
        """The chunks of rows prefilling on their own caches (not in a group)."""
        for chunk in chunks:
            if chunk.request_id in self._groups or chunk.start == chunk.end:
                continue
            row = self._rows[chunk.request_id]
            if row.cache is None:
                raise RuntimeError(f"{chunk.request_id} prefilled after joining the batch")
            tokens = mx.array(row.prompt[chunk.start:chunk.end])[None]
            if self.speculator is not None:
                logits = self.speculator.prefill(self._model, chunk.request_id, tokens,
                                                 row.cache)
            else:
                logits = self._model(tokens, cache=row.cache)
            mx.eval([c.state for c in row.cache])
            self._prompt_logprobs.add(chunk.request_id, logits, row.prompt, chunk.start,
                                      chunk.end)
            self._num_forward_tokens += chunk.end - chunk.start

    def _speculate(self, ks: list[int], drafts: tuple[Draft, ...]
                   ) -> tuple[RowOutput, ...]:
        if self.speculator is None or self._batch.cache is None:
            raise RuntimeError("a verify step without a speculator or a batch")
        outputs, positions = verify_step(self.speculator, self._model, self._batch.cache,
                                         self._batch_rows(), self._batch_masks(self._batch.ids),
                                         ks, drafts)
        self._num_forward_tokens += positions
        return outputs

    def _batch_rows(self) -> list[tuple[str, RowState]]:
        return [(rid, self._rows[rid]) for rid in self._batch.ids]

    def _open_grammar(self, fmt: Any, consumed: tuple[int, ...]) -> RowGrammar | None:
        if fmt is None:
            return None
        if self.masks is None:
            raise RuntimeError("a constrained row reached a runner built without masks")
        return self.masks.open_row(fmt, consumed)

    def _batch_masks(self, rows: list[str]) -> np.ndarray | None:
        if self.masks is None:
            return None
        return self.masks.batch_masks([self._rows[rid].grammar for rid in rows])

    def _snapshot(self, orders: tuple[tuple[str, str], ...]) -> tuple[SnapshotMade, ...]:
        """Released rows named in `orders`, snapshotted from the batch cache."""
        made = []
        for rid, key in orders:
            if rid in self._batch.ids and self._batch.cache is not None:
                made.append(self._hold(key, rid, extract_snapshot(self._batch.cache,
                                                                  self._batch.ids.index(rid))))
        return tuple(m for m in made if m is not None)

    def _snapshot_prompts(self, orders: tuple[tuple[str, str], ...]) -> tuple[SnapshotMade, ...]:
        """Rows whose prefill just completed, snapshotted from their own caches."""
        made = []
        for rid, key in orders:
            row = self._rows.get(rid)
            if rid in self._groups:
                made.append(self._hold(key, rid, self._groups.snapshot(rid)))
            elif row is not None and row.cache is not None:
                made.append(self._hold(key, rid, snapshot_of_row(row.cache)))
        return tuple(m for m in made if m is not None)

    def _hold(self, key: str, rid: str, snap: Any) -> SnapshotMade | None:
        row = self._rows[rid]
        return self.snapshots.hold(key, rid, snap, lambda: (*row.prompt, *row.generated))

    # the snapshot store's doors that LeaderRunner extends to the other ranks (the rest:
    # `runner.snapshots`)
    def restore(self, key: str, kinds: str, offset: int, boundary: int,
                planes: Mapping[str, Plane], state: str = "") -> int:
        return self.snapshots.restore(key, kinds, offset, boundary, planes, state)

    def plane_layout(self) -> PlaneLayout | None:
        return self.snapshots.plane_layout()

    def drop_snapshot(self, key: str) -> None:
        self.snapshots.drop(key)

    def retain(self, keys: Iterable[str]) -> set[str]:
        return self.snapshots.retain(keys)

    def _release(self, request_ids: tuple[str, ...]) -> None:
        for rid in request_ids:
            if self._rows.pop(rid, None) is not None and self.speculator is not None:
                self.speculator.close_row(rid)
        self._groups.release(request_ids)
        self._prompt_logprobs.drop(request_ids)
        self._batch.release(set(request_ids))

    def _join(self, request_id: str) -> None:
        if request_id in self._groups:
            self._join_group(request_id)
            return
        if request_id in self._batch.ids:  # its group joined with an earlier row of it
            return
        row = self._rows[request_id]
        if row.cache is None:
            raise RuntimeError(f"{request_id} joined twice")
        self._batch.join(request_id, row.cache)
        row.cache = None

    def _join_group(self, request_id: str) -> None:
        """The completed prefill group of `request_id` joins at once (one `extend`)."""
        if (taken := self._groups.take(request_id)) is not None:
            self._batch.join_group(*taken)

    def _launch(self, ready: tuple[list[str], LazySample] | None) -> None:
        """The batch's next forward: sampled tokens feed their rows, joiners their last token."""
        sampled_rows = ready[0] if ready is not None else []
        if ready is not None:  # this step's tokens first, so reading them never waits for
            mx.async_eval(*ready[1].outputs)  # the next forward (issue 9's pipelining defect)
        joiners = [self._rows[rid].last_token for rid in self._batch.ids[len(sampled_rows):]]
        parts = [ready[1].tokens.astype(mx.uint32)] if ready is not None else []
        if joiners:
            parts.append(mx.array(joiners, dtype=mx.uint32))
        inputs = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        if (cache := self._batch.cache) is None:
            raise RuntimeError("a forward launched with no batch cache")
        hidden_rows = [] if self.speculator is None else [
            i for i, rid in enumerate(self._batch.ids) if self.speculator.wants_hidden(rid)]
        if hidden_rows and self.speculator is not None:  # MTP rows: the head reads the hidden
            logits, hidden = forward_with_hidden(self._model, inputs[:, None], cache)  # states
            for i in hidden_rows:
                self.speculator.record_hidden(self._batch.ids[i], hidden[i:i + 1])
            logits = logits[:, -1, :]
        elif self._decode is not None:
            logits = self._decode(inputs[:, None], cache)[:, -1, :]
        else:
            logits = self._model(inputs[:, None], cache=cache)[:, -1, :]
        mx.async_eval(logits)
        self._batch.pending = (logits, list(self._batch.ids))
        self._num_forward_tokens += len(self._batch.ids)

    def _sample_pending(self) -> tuple[list[str], LazySample] | None:
        if (pending := self._batch.take_pending()) is None:
            return None
        logits, rows = pending
        return rows, build_sample(logits, [self._rows[rid].sampler for rid in rows],
                                  self._batch_masks(rows))

    def _finalize(self, ready: tuple[list[str], LazySample]) -> tuple[RowOutput, ...]:
        rows, lazy = ready
        sampled = finalize_sample(lazy, [self._rows[rid].sampler for rid in rows])
        outputs = []
        for i, rid in enumerate(rows):
            top = sampled.top_logprobs[i]
            grammar = self._rows[rid].grammar
            if grammar is not None:
                grammar.advance(sampled.tokens[i])
            if self.speculator is not None:  # a later verify step needs the context
                self._rows[rid].generated.append(sampled.tokens[i])
                self._rows[rid].last_token = sampled.tokens[i]
            lp = sampled.logprobs[i]
            outputs.append(RowOutput(
                request_id=rid, tokens=(sampled.tokens[i],),
                logprobs=(lp,) if lp is not None else None,
                top_logprobs=(tuple((int(t), float(v)) for t, v in top),) if top else None,
                grammar_done=grammar is not None and grammar.stopped,
                error=grammar.error if grammar is not None else None))
        return tuple(outputs)

    def reset(self) -> None:
        """Drop every row and the batch (after a failed step)."""
        if self.speculator is not None:
            self.speculator.close_all(list(self._rows))
        self._rows.clear()
        self._groups.clear()
        self._prompt_logprobs.clear()
        self._batch.clear()

    def close(self) -> None:
        """Drop every row and wait for MLX work already started (a pipelined forward that
        no step will read): nothing may still run in MLX's threads when the process exits."""
        self.reset()
        mx.synchronize()

    def kv_bytes(self) -> int:
        """Resident KV bytes: the batch cache plus every prefilling row's cache."""
        return self._batch.nbytes + self._groups.nbytes + sum(
            _cache_nbytes(r.cache) for r in self._rows.values())

    def statistics(self) -> RunnerStatistics:
        return RunnerStatistics(
            num_rows=len(self._rows), num_batch_rows=len(self._batch.ids),
            kv_bytes=self.kv_bytes(), num_forward_tokens=self._num_forward_tokens,
            num_snapshots=len(self.snapshots), snapshot_bytes=self.snapshots.nbytes,
            num_step_gaps=self._clock.num_gaps, step_gap_seconds=self._clock.gap_seconds,
            num_drafts_taken=getattr(self.speculator, "num_drafts_taken", 0),
            num_proposals_made=getattr(self.speculator, "num_proposals_made", 0))
