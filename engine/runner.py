"""Executes a StepPlan on MLX. Runs on the one runner thread; holds every array.

Rows prefill on their own single-row caches (mlx-lm's `make_prompt_cache`, so any
cache class on mlx-lm's protocol plugs in), then join the decode batch through
the cache class's `merge` (e.g. KVCache -> BatchKVCache) and `extend`. Physical
left padding stays per row inside the batch cache; `filter` retires rows. The
decode batch runs one forward per step for all rows, then per-row sampling.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.sampling import RowSampler, sample_rows
from engine.scheduler import RowOutput, StepPlan, StepResult

CacheFactory = Callable[[Any], list[Any]]


@attrs.define
class _RowRuntime:
    sampler: RowSampler
    prompt: tuple[int, ...]
    cache: list[Any] | None
    last_token: int


@attrs.frozen(kw_only=True)
class RunnerStatistics:
    num_rows: int
    num_batch_rows: int
    kv_bytes: int
    num_forward_tokens: int


def _cache_nbytes(cache: list[Any] | None) -> int:
    return sum(c.nbytes for c in cache) if cache else 0


class Runner:
    """Owns the model, the per-row caches and the batch cache."""

    def __init__(self, model: Any, make_cache: CacheFactory | None = None) -> None:
        self._model = model
        self._make_cache = make_cache or make_prompt_cache
        self._rows: dict[str, _RowRuntime] = {}
        self._batch: list[str] = []
        self._batch_cache: list[Any] | None = None
        self._num_forward_tokens = 0

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step: release, admit, prefill, join, decode; return sampled tokens."""
        self._release(plan.release)
        for new in plan.new_rows:
            self._rows[new.request_id] = _RowRuntime(
                sampler=RowSampler.create(new.params, new.prompt),
                prompt=new.prompt,
                cache=self._make_cache(self._model),
                last_token=new.prompt[-1],
            )
        for chunk in plan.prefill:
            row = self._rows[chunk.request_id]
            if row.cache is None:
                raise RuntimeError(f"{chunk.request_id} prefilled after joining the batch")
            tokens = mx.array(row.prompt[chunk.start:chunk.end])[None]
            self._model(tokens, cache=row.cache)
            mx.eval([c.state for c in row.cache])
            self._num_forward_tokens += chunk.end - chunk.start
        for rid in plan.join:
            self._join(rid)
        outputs: tuple[RowOutput, ...] = ()
        if self._batch:
            outputs = self._decode()
        return StepResult(outputs=outputs, kv_bytes=self.kv_bytes())

    def _release(self, request_ids: tuple[str, ...]) -> None:
        gone = set(request_ids)
        for rid in request_ids:
            self._rows.pop(rid, None)
        if not gone.intersection(self._batch):
            return
        keep = [i for i, rid in enumerate(self._batch) if rid not in gone]
        self._batch = [self._batch[i] for i in keep]
        if not keep:
            self._batch_cache = None
            return
        for c in self._batch_cache or ():
            c.filter(keep)

    def _join(self, request_id: str) -> None:
        row = self._rows[request_id]
        if row.cache is None:
            raise RuntimeError(f"{request_id} joined twice")
        merged = [type(c).merge([c]) for c in row.cache]
        if self._batch_cache is None:
            self._batch_cache = merged
        else:
            for mine, theirs in zip(self._batch_cache, merged):
                mine.extend(theirs)
        row.cache = None
        self._batch.append(request_id)

    def _decode(self) -> tuple[RowOutput, ...]:
        rows = [self._rows[rid] for rid in self._batch]
        inputs = mx.array([r.last_token for r in rows])[:, None]
        logits = self._model(inputs, cache=self._batch_cache)[:, -1, :]
        self._num_forward_tokens += len(rows)
        sampled = sample_rows(logits, [r.sampler for r in rows])
        outputs = []
        for i, (rid, row) in enumerate(zip(self._batch, rows)):
            row.last_token = sampled.tokens[i]
            top = sampled.top_logprobs[i]
            outputs.append(RowOutput(
                request_id=rid, token=sampled.tokens[i], logprob=sampled.logprobs[i],
                top_logprobs=tuple((int(t), float(v)) for t, v in top) if top else None))
        return tuple(outputs)

    def reset(self) -> None:
        """Drop every row and the batch (after a failed step)."""
        self._rows.clear()
        self._batch = []
        self._batch_cache = None

    def kv_bytes(self) -> int:
        """Resident KV bytes: the batch cache plus every prefilling row's cache."""
        return _cache_nbytes(self._batch_cache) + sum(
            _cache_nbytes(r.cache) for r in self._rows.values())

    def statistics(self) -> RunnerStatistics:
        return RunnerStatistics(
            num_rows=len(self._rows), num_batch_rows=len(self._batch),
            kv_bytes=self.kv_bytes(), num_forward_tokens=self._num_forward_tokens)
