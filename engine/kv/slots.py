"""Plain (float) KV in per-row slots: rows join and leave without copying the other rows.

`RowSlotsKVCache` is the decode batch's cache for plain KVCache layers. It holds
preallocated planes (rows capacity, heads, positions capacity, head dim); batch row i
lives in slot i with its own length `lengths[i]`, its KV LEFT-aligned at positions
[0, lengths[i]) (no padding). So:

* a step's new positions are written per row at [lengths[i], lengths[i] + L) (one
  scatter), and attention reads positions [0, max length) with a mask that keeps, for
  each row, the positions below its own length (plus causality inside the block);
  RoPE takes the per-row offsets (`offset` is the lengths as an array);
* joining (`extend`) writes only the joining rows into free slots [n, n + m);
* retiring (`filter(keep)`) moves only the rows whose slot changes: the runner keeps
  rows in "swap the last row into the hole" order (`retire_order`), so one retirement
  moves at most one row; a suffix of rows leaving moves nothing (a move evaluates the
  moved row first, one host sync on that step: see `filter`);
* `trim_rows(amounts)` rolls back each row by its own amount (speculative rollback),
  by lowering its length: nothing moves.
Capacities grow by doubling (rows) and by STEP positions; only growth copies every row.
Lengths are kept on the host (the runner knows every append), so no step reads them back.
Positions beyond a row's length hold stale values that the mask never lets through.

`merge`, `extract`, `state` and `trim` follow mlx-lm's batch cache protocol; `extract`
returns a plain KVCache (what prefix snapshots hold).

Affine, TurboQuant and delayed TurboQuant rows have slot batches of their own
(engine/kv/quant_slots.py, engine/kv/delayed_slots.py, on engine/kv/slot_rows.py);
`slot_batch(cache)` is the one place that picks the slot class for a row or batch, and
`is_slot_batch` says whether a batch cache keeps rows in slots (then `retire_order`).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, _BaseCache

from tqserve.engine.kv.affine import AffineKVCache, BatchedAffineKVCache
from tqserve.engine.kv.delayed import BatchedDelayedTurboQuantKVCache, DelayedTurboQuantKVCache
from tqserve.engine.kv.delayed_slots import DelayedTurboQuantSlotsKVCache
from tqserve.engine.kv.quant_slots import AffineSlotsKVCache, SlotsCache, TurboQuantSlotsKVCache
from tqserve.engine.kv.slot_rows import retire_order
from tqserve.engine.kv.turboquant import BatchedTurboQuantKVCache, TurboQuantKVCache

STEP = 256  # positions added when a row outgrows the planes (as mlx-lm's KVCache.step)
__all__ = ["RowSlotsKVCache", "is_slot_batch", "retire_order", "slot_batch"]


class RowSlotsKVCache(_BaseCache):
    """A batch of plain KV rows in slots (module doc)."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths: list[int] = []
        self._offset: mx.array | None = None

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def offset(self) -> mx.array:
        """Per-row lengths (RoPE offsets of the next positions)."""
        if self._offset is None:
            self._offset = mx.array(self.lengths, dtype=mx.int32)
        return self._offset

    def _set_lengths(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self._offset = None

    def _reserve(self, rows: int, positions: int, like: Any, values_like: Any) -> None:
        """Make the planes hold `rows` slots of `positions` (growing copies everything)."""
        if self.keys is None:
            shape_k = (max(rows, 1), like.shape[1], STEP * -(-positions // STEP), like.shape[3])
            shape_v = (*shape_k[:3], values_like.shape[3])
            self.keys = mx.zeros(shape_k, like.dtype)
            self.values = mx.zeros(shape_v, values_like.dtype)
            return
        assert self.values is not None
        cap_rows, _, cap_pos, _ = self.keys.shape
        if rows > cap_rows:
            more = max(rows, 2 * cap_rows) - cap_rows
            self.keys = mx.concatenate(
                [self.keys, mx.zeros((more, *self.keys.shape[1:]), self.keys.dtype)])
            self.values = mx.concatenate(
                [self.values, mx.zeros((more, *self.values.shape[1:]), self.values.dtype)])
        if positions > cap_pos:
            more = STEP * -(-(positions - cap_pos) // STEP)
            k, v = self.keys, self.values
            self.keys = mx.concatenate([k, mx.zeros((*k.shape[:2], more, k.shape[3]), k.dtype)],
                                       axis=2)
            self.values = mx.concatenate(
                [v, mx.zeros((*v.shape[:2], more, v.shape[3]), v.dtype)], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write L new positions of every row (row i at its own length); return the
        planes up to the longest row."""
        n, _, length, _ = keys.shape
        if n != self.num_rows:
            raise ValueError(f"{n} rows of keys for a batch of {self.num_rows}")
        end = max(self.lengths) + length
        self._reserve(n, end, keys, values)
        assert self.keys is not None and self.values is not None
        rows = mx.arange(n)[:, None]
        pos = self.offset[:, None] + mx.arange(length)[None, :]
        self.keys[rows, :, pos] = keys.transpose(0, 2, 1, 3)
        self.values[rows, :, pos] = values.transpose(0, 2, 1, 3)
        self._set_lengths([p + length for p in self.lengths])
        return self.keys[:n, :, :end], self.values[:n, :, :end]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        """(rows, 1, N, max length + N): query q of row i sees positions <= lengths[i] + q."""
        end = max(self.lengths) + N
        limit = self.offset[:, None, None, None] + mx.arange(N)[None, None, :, None]
        return mx.arange(end)[None, None, None, :] <= limit

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (a BatchKVCache, KVCache or RowSlotsKVCache) in free
        slots: only their KV is written."""
        rows = _rows_of(other)
        n = self.num_rows
        written = [(j, k, v) for j, (k, v) in enumerate(rows) if k is not None]
        if written:
            longest = max(k.shape[2] for _, k, _ in written)
            self._reserve(n + len(rows), longest, written[0][1], written[0][2])
        elif self.keys is not None:  # empty rows (one-token prompts): slots, no positions
            self._reserve(n + len(rows), 0, self.keys, self.values)
        for j, k, v in written:
            self.keys[n + j:n + j + 1, :, :k.shape[2]] = k  # type: ignore[index]
            self.values[n + j:n + j + 1, :, :v.shape[2]] = v  # type: ignore[index]
        self._set_lengths(self.lengths + [0 if k is None else k.shape[2] for k, _ in rows])

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> RowSlotsKVCache:
        """A batch of the rows of `caches` (single rows or batches)."""
        out = cls()
        for cache in caches:
            out.extend(cache)
        return out

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep rows `batch_indices`, in that order: row j takes slot j; only the rows
        whose slot changes move (see `retire_order`)."""
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array)
                                 else batch_indices)]
        moves = [(j, src) for j, src in enumerate(keep) if j != src]
        if moves and self.keys is not None and self.values is not None:
            # The moved rows are evaluated into their own buffers first: an update whose
            # value still reads the planes cannot write them in place (MLX then copies
            # every row, which is what the slots avoid). One sync, on retirement only.
            moved = [(mx.contiguous(self.keys[s:s + 1]), mx.contiguous(self.values[s:s + 1]))
                     for _, s in moves]
            mx.eval(moved)
            for (j, _), (k, v) in zip(moves, moved):
                self.keys[j:j + 1] = k
                self.values[j:j + 1] = v
        self._set_lengths([self.lengths[i] for i in keep])

    def trim_rows(self, amounts: Sequence[int]) -> list[int]:
        """Roll row i back by amounts[i] positions (at most its length); nothing moves.
        Returns what each row lost."""
        if len(amounts) != self.num_rows:
            raise ValueError(f"{len(amounts)} trim amounts for {self.num_rows} rows")
        if any(a < 0 for a in amounts):
            raise ValueError(f"trim amounts must be >= 0, got {list(amounts)}")
        done = [min(a, p) for a, p in zip(amounts, self.lengths)]
        self._set_lengths([p - d for p, d in zip(self.lengths, done)])
        return done

    def trim(self, n: int) -> int:
        """Uniform trim of every row (mlx-lm's protocol), as far as the shortest allows."""
        n = min([n, *self.lengths])
        self.trim_rows([n] * self.num_rows)
        return n

    def is_trimmable(self) -> bool:
        return True

    def extract(self, idx: int) -> KVCache:
        """Row `idx` as a plain KVCache (a copy of its valid positions)."""
        cache = KVCache()
        if self.keys is not None and self.values is not None and self.lengths[idx] > 0:
            length = self.lengths[idx]
            cache.keys = mx.array(self.keys[idx:idx + 1, :, :length])
            cache.values = mx.array(self.values[idx:idx + 1, :, :length])
            cache.offset = length
        return cache

    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        self.keys, self.values = v[0], v[1]
        self._set_lengths([int(x) for x in v[2].tolist()])


def _rows_of(cache: Any) -> list[tuple[Any, Any]]:
    """Each row's valid (keys, values), (1, H, length, D), of a plain cache or batch;
    (None, None) for a row that holds no position yet."""
    if isinstance(cache, RowSlotsKVCache):
        if cache.keys is None or cache.values is None:
            return [(None, None)] * cache.num_rows
        return [(cache.keys[i:i + 1, :, :p], cache.values[i:i + 1, :, :p]) if p else (None, None)
                for i, p in enumerate(cache.lengths)]
    if isinstance(cache, BatchKVCache):
        pads = cache.left_padding.tolist()
        if cache.keys is None:
            return [(None, None)] * len(pads)
        return [(cache.keys[i:i + 1, :, p:cache._idx], cache.values[i:i + 1, :, p:cache._idx])
                if cache._idx > p else (None, None) for i, p in enumerate(pads)]
    if type(cache) is KVCache:
        if cache.keys is None or cache.offset == 0:
            return [(None, None)]
        return [(cache.keys[..., :cache.offset, :], cache.values[..., :cache.offset, :])]
    raise TypeError(f"a {type(cache).__name__} cannot join a plain slot batch")


_SLOT_CLASSES: tuple[tuple[tuple[type, ...], Any], ...] = (
    ((AffineKVCache, BatchedAffineKVCache), AffineSlotsKVCache),
    ((TurboQuantKVCache, BatchedTurboQuantKVCache), TurboQuantSlotsKVCache),
    ((DelayedTurboQuantKVCache, BatchedDelayedTurboQuantKVCache), DelayedTurboQuantSlotsKVCache),
)


def slot_batch(cache: Any) -> Any | None:
    """A slot batch holding the rows of `cache` (one row or a batch of a kind that has
    slots: plain, affine, TurboQuant, delayed TurboQuant); None for other kinds."""
    if type(cache) in (KVCache, BatchKVCache):
        return RowSlotsKVCache.merge([cache])
    for kinds, slots in _SLOT_CLASSES:
        if isinstance(cache, kinds):
            return slots.merge([cache])
    return None


def is_slot_batch(cache: Any) -> bool:
    """Whether a batch cache keeps its rows in slots (joins take single rows as they are,
    retirements want `retire_order`)."""
    return isinstance(cache, (RowSlotsKVCache, SlotsCache))
