"""Executes a StepPlan on MLX. Runs on the one runner thread; holds every array.

Rows prefill in groups (engine.prefill: one left-padded forward per group and step,
into one batch cache that joins the decode batch at once through `extend`); a row that
reuses a snapshot, or any row when the cache kind cannot be batched, prefills on its
own single-row caches. The decode batch keeps plain, affine and TurboQuant layers in
per-row slots (engine.kv.slots.slot_batch): a joining row or group writes only its own
KV into free slots, `filter` with `retire_order` moves at most one row per retirement.
Other kinds (rotating sliding-window layers) join through their class's `merge` and
`extend` and keep physical left padding per row. The decode batch runs one forward per
step for all rows, then per-row sampling.

Pipelining (as mlx-lm's generate_step): at the end of a step the forward of the NEXT
step is built on the still-lazy sampled tokens and started (`mx.async_eval`) before
this step's tokens are read back, so graph building and the actors' round trip
overlap the computation. The next `execute` samples that forward's logits. A row
released in between is filtered out of those logits and of the cache (its extra
position goes with it); rows joining in between join after that step, so their
first forward is the following one. Sampling itself (keys, penalties, logprobs) always
runs inside `execute`, on host-known history.

Prefix cache (engine.snapshot): the runner holds the RAM tier's snapshots by key. A
released row named in `plan.snapshot` is extracted from the batch cache before `filter`
(its offset may include the extra position of its last sampled token; the scheduler
actor maps the offset back to tokens). `plan.spill` snapshots are serialized to bytes
(here, on this thread) and dropped; a new row with `reuse` starts from new cache objects
sliced from the snapshot (no copy) and prefills only the rest of its prompt. A row named
in `plan.prompt_snapshot` is snapshotted from its own caches once its prefill is complete,
before it joins (its prompt's KV, published while it decodes); with `plan.persist` every
snapshot made in the step is also serialized (write-through) and kept. A row whose
proposer keeps state (draft, MTP) pairs every snapshot with that state for the same
tokens (engine.speculative.state; no paired snapshot where none is exact), and a row built
from a paired snapshot gets both parts.

Prompt logprobs (engine.prompt_logprobs): a row asking for them prefills alone, and its
chunks' logits give its prompt's entries, handed out with its first token.

Failure: `step_hook(plan)`, when set, runs in the middle of each step (after the prefill,
before the joins): the place where a fault test raises. After a failed step `reset()`
drops every row; `retain(keys)` drops the snapshots nobody indexed.

Structured output (engine.structured): a row with a `response_format` gets a matcher
whose next-token mask is computed on the grammar worker thread (its first during the
row's prefill, each next one while the forward just launched runs); sampling applies
the batch's masks per row (unconstrained rows get all-ones masks, so their tokens are
unchanged). When a token completes the grammar the row's output says so
(`grammar_done`) and the scheduler stops it with finish_reason "stop".

Speculation (engine.speculative): a runner built with a `Speculator` runs a decode step
in which some row proposes (`plan.propose`, the speculation actor's decision) as one
verify step (Speculator.step: proposals, one forward of [last token + proposal] per row,
acceptance, per-row rollback) instead of the pipelined forward; a row then outputs
1..k+1 tokens per step. A step where no row proposes takes the plain pipelined path
(MTP rows still hand the target's hidden states to their head). A grammar row's proposal
is cut to the prefix its grammar accepts, and each verified position samples under the
mask after the proposals before it. Each steady decode step (no prefill, join or
release, the same path as the step before, a forward shape run before: the first run of a
shape may compile kernels on MLX-CUDA) reports its duration, the time since the previous
step ended (`StepResult.decode_seconds`): the time policy's measurement.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from tqserve.engine.fastpath import DecodeForward
from tqserve.engine.kv.slots import (as_decode_batch, is_slot_batch, retire_order,
                                     slot_capacity)
from tqserve.engine.prefill import PrefillGroups
from tqserve.engine.prompt_logprobs import PromptLogprobsBook
from tqserve.engine.sampling import LazySample, RowSampler, build_sample, finalize_sample
from tqserve.engine.step import (PrefillChunk, RowOutput, SnapshotMade, SpillPayload, StepPlan,
                                 StepResult)
from tqserve.engine.snapshot import (Snapshot, describe, extract_snapshot, from_planes,
                                     header_extra, layer_kind, row_from_snapshot,
                                     snapshot_kinds, snapshot_of_row, to_planes)
from tqserve.engine.snapshot_layout import PlaneLayout, plane_layout
from tqserve.engine.speculative.mtp import forward_with_hidden
from tqserve.engine.speculative.speculator import Plane, SpecRow, Speculator
from tqserve.engine.speculative.state import StateLayout
from tqserve.engine.structured import GrammarMasks, RowGrammar

CacheFactory = Callable[[Any], list[Any]]
STEP_GAPS_KEPT = 4096  # recent step gaps kept for tools/step_idle (a few seconds of steps)


@attrs.define
class _RowRuntime:
    sampler: RowSampler
    prompt: tuple[int, ...]
    cache: list[Any] | None
    last_token: int
    grammar: RowGrammar | None = None
    generated: list[int] = attrs.Factory(list)  # kept only when speculating


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
        self._rows: dict[str, _RowRuntime] = {}
        self._batch: list[str] = []
        self._batch_cache: list[Any] | None = None
        self._pending: tuple[mx.array, list[str]] | None = None  # in-flight logits, their rows
        self._num_forward_tokens = 0
        self._snapshots: dict[str, Snapshot] = {}
        self.step_hook: Callable[[StepPlan], None] | None = None
        self._layout: PlaneLayout | None = None
        self._last_end: float | None = None
        # the decode path of this step and of the last clean one (None: no steady decode):
        # "plain" (pipelined), "speculative" (a verify step), "switch" (finishing the
        # plain forward in flight before a verify step)
        self._step_mode: str | None = None
        self._last_mode: str | None = None
        # forward shapes run so far (mode, rows, positions per row): a step of a new one
        # is not reported as a measurement (its first run may include kernel compiles)
        self._shapes: set[tuple[str, int, int]] = set()
        self._step_shape: tuple[str, int, int] | None = None
        self._step_gaps: deque[float] = deque(maxlen=STEP_GAPS_KEPT)
        self._num_step_gaps = 0
        self._step_gap_seconds = 0.0
        self._groups = PrefillGroups(model)
        self._prompt_logprobs = PromptLogprobsBook()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: snapshot, release, spill, admit, prefill, join, decode.

        The time since the previous step returned is recorded as a step gap when a
        forward was in flight meanwhile (the trio side's time per step; `step_gaps`)."""
        if self._pending is not None and self._last_end is not None:
            gap = time.perf_counter() - self._last_end
            self._step_gaps.append(gap)
            self._num_step_gaps += 1
            self._step_gap_seconds += gap
        self._step_mode = None
        self._step_shape = None
        result = self._execute(plan)
        result = attrs.evolve(result, outputs=self._prompt_logprobs.attach(result.outputs))
        end = time.perf_counter()
        clean = self._step_mode is not None and not (
            plan.new_rows or plan.prefill or plan.join or plan.release or plan.spill
            or plan.snapshot or plan.prompt_snapshot)
        # the first step of a forward shape may compile kernels (MLX-CUDA): not measured
        first_of_shape = self._step_shape is not None and self._step_shape not in self._shapes
        if self._step_shape is not None:
            self._shapes.add(self._step_shape)
        if (clean and not first_of_shape and self._last_end is not None
                and self._step_mode == self._last_mode):
            result = attrs.evolve(result, decode_seconds=end - self._last_end,
                                  speculative=self._step_mode == "speculative")
        self._last_mode = self._step_mode if clean else None
        self._last_end = end
        return result

    @property
    def step_shape(self) -> tuple[str, int, int] | None:
        """The last step's decode forward: (plain | speculative, rows, positions per row),
        or None if it ran none."""
        return self._step_shape

    def step_gaps(self) -> list[float]:
        """The most recent step gaps in seconds (at most STEP_GAPS_KEPT), oldest first."""
        return list(self._step_gaps)

    def _execute(self, plan: StepPlan) -> StepResult:
        snapshots = self._snapshot(plan.snapshot)
        self._release(plan.release)
        spills = tuple(self._spill(key) for key in plan.spill)
        for new in plan.new_rows:
            if self.speculator is not None:
                self.speculator.open_row(new.request_id, new.speculative)
            if new.reuse is not None:
                snap = self._snapshots[new.reuse]
                cache = row_from_snapshot(snap, new.cached)
                if self.speculator is not None:  # its proposer's part of the snapshot
                    self.speculator.restore_state(new.request_id, snap.paired,
                                                  new.prompt[:new.cached])
            else:
                cache = self._make_cache(self._model)
                if new.group and PrefillGroups.can_batch(cache) and not (
                        self.speculator is not None
                        and self.speculator.wants_hidden(new.request_id)) and (
                        new.params.prompt_logprobs is None):
                    # (an MTP row prefills alone: its head reads the target's hidden states;
                    # so does a row asking for prompt logprobs: it reads its own logits)
                    self._groups.add(new.request_id, new.group, new.pad, cache)
                    cache = None
            self._rows[new.request_id] = _RowRuntime(
                sampler=RowSampler.create(new.params, new.prompt),
                prompt=new.prompt,
                cache=cache,
                last_token=new.prompt[-1],
                grammar=self._open_grammar(new.response_format),
            )
            self._prompt_logprobs.open(new.request_id, new.prompt, new.params.prompt_logprobs)
        for key in plan.drop:
            self._snapshots.pop(key, None)
        grouped = [c for c in plan.prefill if c.request_id in self._groups]
        self._num_forward_tokens += self._groups.run(
            grouped, {c.request_id: self._rows[c.request_id].prompt for c in grouped})
        self._prefill_alone(plan.prefill)
        snapshots += self._snapshot_prompts(plan.prompt_snapshot)
        writes = tuple(self._payload(s.key, self._snapshots[s.key])
                       for s in snapshots) if plan.persist else ()
        if self.step_hook is not None:
            self.step_hook(plan)
        ready = self._sample_pending()
        for rid in plan.join:
            self._join(rid)
        ks = self._proposal_sizes(plan.propose)
        if any(ks):
            # a forward still in flight from the plain path is read first, not followed
            self._step_mode = "switch" if ready is not None else "speculative"
            self._step_shape = ("speculative", len(self._batch), 1 + max(ks))
            outputs = self._finalize(ready) if ready is not None else self._speculate(ks)
            return StepResult(outputs=outputs, kv_bytes=self.kv_bytes(),
                              kv_capacity=slot_capacity(self._batch_cache),
                              snapshots=snapshots, spills=spills, writes=writes)
        if self._batch:
            self._step_mode = "plain" if ready is not None else "switch"
            self._step_shape = ("plain", len(self._batch), 1)
        if ready is None and self._batch:  # nothing in flight: this step's forward now
            self._launch(None)
            ready = self._sample_pending()
        if self._batch:
            self._launch(ready)
        outputs = self._finalize(ready) if ready is not None else ()
        return StepResult(outputs=outputs, kv_bytes=self.kv_bytes(),
                          kv_capacity=slot_capacity(self._batch_cache), snapshots=snapshots,
                          spills=spills, writes=writes)

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

    def _proposal_sizes(self, propose: tuple[tuple[str, int], ...]) -> list[int]:
        """Tokens each batch row proposes this step (the plan's sizes, cut to what the row
        may still emit: a verify step emits up to k + 1); all 0: a plain step."""
        wanted = dict(propose)
        if self.speculator is None or not wanted:
            return []
        sizes = []
        for rid in self._batch:
            sampler = self._rows[rid].sampler
            k = wanted.get(rid, 0) if self.speculator.choice(rid) is not None else 0
            sizes.append(max(0, min(k, sampler.params.max_tokens - sampler.num_sampled - 1)))
        return sizes

    def _speculate(self, ks: list[int]) -> tuple[RowOutput, ...]:
        """One verify step of the whole batch (see the module doc)."""
        if self.speculator is None or self._batch_cache is None:
            raise RuntimeError("a verify step without a speculator or a batch")
        rows = [self._rows[rid] for rid in self._batch]
        spec_rows = [SpecRow(request_id=rid, context=(*r.prompt, *r.generated),
                             sampler=r.sampler, grammar=r.grammar)
                     for rid, r in zip(self._batch, rows)]
        results = self.speculator.step(self._model, self._batch_cache, spec_rows,
                                       [r.last_token for r in rows],
                                       self._batch_masks(self._batch), ks)
        outputs = []
        for rid, row, res in zip(self._batch, rows, results):
            self._num_forward_tokens += 1 + res.num_proposed
            row.generated.extend(res.tokens)
            row.last_token = res.tokens[-1]
            if row.grammar is not None:
                row.grammar.advance_many(res.tokens)
            wants = row.sampler.params
            outputs.append(RowOutput(
                request_id=rid, tokens=res.tokens,
                logprobs=res.asked_logprobs() if wants.logprobs or wants.top_logprobs else None,
                top_logprobs=res.asked_top_logprobs() if wants.top_logprobs else None,
                num_proposed=res.num_proposed,
                num_accepted=res.num_accepted,
                grammar_done=row.grammar is not None and row.grammar.stopped,
                error=row.grammar.error if row.grammar is not None else None))
        return tuple(outputs)

    def _open_grammar(self, fmt: Any) -> RowGrammar | None:
        if fmt is None:
            return None
        if self.masks is None:
            raise RuntimeError("a constrained row reached a runner built without masks")
        return self.masks.open_row(fmt)

    def _batch_masks(self, rows: list[str]) -> np.ndarray | None:
        """The rows' grammar masks (all ones for unconstrained rows), or None if none is."""
        grammars = [self._rows[rid].grammar for rid in rows]
        if self.masks is None or not any(grammars):
            return None
        out = np.full((len(rows), self.masks.num_words), -1, dtype=np.int32)
        for i, grammar in enumerate(grammars):
            bits = grammar.mask() if grammar is not None else None
            if bits is not None:
                out[i] = bits
        return out

    def _snapshot(self, orders: tuple[tuple[str, str], ...]) -> tuple[SnapshotMade, ...]:
        """Released rows named in `orders`, snapshotted from the batch cache."""
        made = []
        for rid, key in orders:
            if rid in self._batch and self._batch_cache is not None:
                made.append(self._hold(key, rid, extract_snapshot(self._batch_cache,
                                                                  self._batch.index(rid))))
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

    def _hold(self, key: str, rid: str, snap: Snapshot | None) -> SnapshotMade | None:
        """Keep a non-empty snapshot under `key`, paired with the row's proposer state
        (none: no snapshot); what the step reports of it."""
        if snap is None or snap.offset == 0:
            return None
        state = self.speculator.state_identity(rid) if self.speculator is not None else ""
        if state and self.speculator is not None:
            row = self._rows[rid]
            paired = self.speculator.state_at(rid, (*row.prompt, *row.generated)[:snap.offset])
            if paired is None:
                return None
            snap = attrs.evolve(snap, paired=paired)
        self._snapshots[key] = snap
        return SnapshotMade(key=key, request_id=rid, offset=snap.offset,
                            minimum_reusable_offset=snap.reusable_from,
                            num_bytes=snap.nbytes, state=state)

    def _spill(self, key: str) -> SpillPayload:
        return self._payload(key, self._snapshots.pop(key))

    @staticmethod
    def _payload(key: str, snap: Snapshot) -> SpillPayload:
        header = {**describe(snap), "offset": snap.offset,
                  "minimum_reusable_offset": snap.minimum_reusable_offset,
                  "extra": header_extra(snap)}
        return SpillPayload(key=key, header=header, planes=tuple(to_planes(snap)))

    def restore(self, key: str, kinds: str, offset: int, boundary: int,
                planes: Mapping[str, Plane], state: str = "") -> int:
        """Hold a snapshot read from the SSD tier under `key`, with its proposer state
        `state` (an identity; "" for none); returns its bytes.

        ValueError if it does not fit this engine's caches or proposer."""
        paired, own = None, dict[str, Plane]()
        if state:  # both parts are checked before either is decoded
            if self.speculator is None:
                raise ValueError(f"no proposer here holds state {state!r:.80}")
            paired, own, planes = self.speculator.paired_planes(state, offset, planes)
        snap = from_planes(self._make_cache(self._model), kinds, offset, boundary, planes,
                           self.plane_layout())
        snap = attrs.evolve(snap, paired=paired.restore(offset, own) if paired else None)
        self._snapshots[key] = snap
        return snap.nbytes

    def state_layouts(self) -> dict[str, StateLayout]:
        """Per speculation method whose rows publish paired snapshots: its state's planes."""
        return self.speculator.state_layouts() if self.speculator is not None else {}

    def plane_layout(self) -> PlaneLayout | None:
        """What a restorable snapshot of this model holds (probed once; None if the caches
        cannot be snapshotted)."""
        if self._layout is None:
            self._layout = plane_layout(self._model, self._make_cache(self._model))
        return self._layout

    def unsnapshottable_caches(self) -> list[str]:
        """Class names of this model's layer caches that cannot be snapshotted (sliding
        windows, recurrent state ...), sorted; empty when the prefix cache can serve it."""
        caches = self._make_cache(self._model)
        refused = sorted({type(c).__name__ for c in caches if layer_kind(c) is None})
        if not refused and snapshot_kinds(caches) is None:  # recurrent layers only
            refused = sorted({type(c).__name__ for c in caches})
        return refused

    def drop_snapshot(self, key: str) -> None:
        """Forget a held snapshot (unknown keys are ignored)."""
        self._snapshots.pop(key, None)

    def snapshot_keys(self) -> set[str]:
        """Keys of the snapshots held now."""
        return set(self._snapshots)

    def retain(self, keys: Iterable[str]) -> set[str]:
        """Drop every held snapshot not in `keys`; returns the keys still held."""
        keep = set(keys)
        for key in [k for k in self._snapshots if k not in keep]:
            del self._snapshots[key]
        return set(self._snapshots)

    def _release(self, request_ids: tuple[str, ...]) -> None:
        gone = set(request_ids)
        for rid in request_ids:
            if self._rows.pop(rid, None) is not None and self.speculator is not None:
                self.speculator.close_row(rid)
        self._groups.release(request_ids)
        self._prompt_logprobs.drop(request_ids)
        if not gone.intersection(self._batch):
            return
        if all(is_slot_batch(c) for c in self._batch_cache or ()):
            keep = retire_order(len(self._batch), [i for i, rid in enumerate(self._batch)
                                                   if rid in gone])
        else:
            keep = [i for i, rid in enumerate(self._batch) if rid not in gone]
        self._batch = [self._batch[i] for i in keep]
        if self._pending is not None:
            logits, rows = self._pending
            self._pending = (logits[mx.array(keep)], [rows[i] for i in keep]) if keep else None
        if not keep:
            self._batch_cache = None
            return
        for c in self._batch_cache or ():
            c.filter(keep)

    def _join(self, request_id: str) -> None:
        if request_id in self._groups:
            self._join_group(request_id)
            return
        if request_id in self._batch:  # its group joined with an earlier row of it
            return
        row = self._rows[request_id]
        if row.cache is None:
            raise RuntimeError(f"{request_id} joined twice")
        if self._batch_cache is None:
            self._batch_cache = [as_decode_batch(c) for c in row.cache]
        else:
            for mine, theirs in zip(self._batch_cache, row.cache):
                mine.extend(theirs if is_slot_batch(mine) else type(theirs).merge([theirs]))
        row.cache = None
        self._batch.append(request_id)

    def _join_group(self, request_id: str) -> None:
        """The completed prefill group of `request_id` joins at once (one `extend`)."""
        taken = self._groups.take(request_id)
        if taken is None:
            return
        rows, cache = taken
        if self._batch_cache is None:
            self._batch_cache = [as_decode_batch(c, is_batch=True) for c in cache]
        else:
            for mine, theirs in zip(self._batch_cache, cache):
                mine.extend(theirs)
        self._batch += rows

    def _launch(self, ready: tuple[list[str], LazySample] | None) -> None:
        """The batch's next forward: sampled tokens feed their rows, joiners their last token."""
        sampled_rows = ready[0] if ready is not None else []
        if ready is not None:  # this step's tokens first, so reading them never waits for
            mx.async_eval(*ready[1].outputs)  # the next forward (issue 9's pipelining defect)
        joiners = [self._rows[rid].last_token for rid in self._batch[len(sampled_rows):]]
        parts = [ready[1].tokens.astype(mx.uint32)] if ready is not None else []
        if joiners:
            parts.append(mx.array(joiners, dtype=mx.uint32))
        inputs = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        if (cache := self._batch_cache) is None:
            raise RuntimeError("a forward launched with no batch cache")
        hidden_rows = [] if self.speculator is None else [
            i for i, rid in enumerate(self._batch) if self.speculator.wants_hidden(rid)]
        if hidden_rows and self.speculator is not None:  # MTP rows: the head reads the hidden
            logits, hidden = forward_with_hidden(self._model, inputs[:, None], cache)  # states
            for i in hidden_rows:
                self.speculator.record_hidden(self._batch[i], hidden[i:i + 1])
            logits = logits[:, -1, :]
        elif self._decode is not None:
            logits = self._decode(inputs[:, None], cache)[:, -1, :]
        else:
            logits = self._model(inputs[:, None], cache=cache)[:, -1, :]
        mx.async_eval(logits)
        self._pending = (logits, list(self._batch))
        self._num_forward_tokens += len(self._batch)

    def _sample_pending(self) -> tuple[list[str], LazySample] | None:
        if self._pending is None:
            return None
        logits, rows = self._pending
        self._pending = None
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
        self._batch = []
        self._batch_cache = None
        self._pending = None

    def close(self) -> None:
        """Drop every row and wait for MLX work already started (a pipelined forward that
        no step will read): nothing may still run in MLX's threads when the process exits."""
        self.reset()
        mx.synchronize()

    def kv_bytes(self) -> int:
        """Resident KV bytes: the batch cache plus every prefilling row's cache."""
        return _cache_nbytes(self._batch_cache) + self._groups.nbytes + sum(
            _cache_nbytes(r.cache) for r in self._rows.values())

    def statistics(self) -> RunnerStatistics:
        return RunnerStatistics(
            num_rows=len(self._rows), num_batch_rows=len(self._batch),
            kv_bytes=self.kv_bytes(), num_forward_tokens=self._num_forward_tokens,
            num_snapshots=len(self._snapshots),
            snapshot_bytes=sum(s.nbytes for s in self._snapshots.values()),
            num_step_gaps=self._num_step_gaps, step_gap_seconds=self._step_gap_seconds)
