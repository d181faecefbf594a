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
  moved row first, one host sync on that step: see `SlotRows.take`);
* `trim_rows(amounts)` rolls back each row by its own amount (speculative rollback),
  by lowering its length: nothing moves.
Capacities grow by doubling (rows) and by STEP positions; only growth copies every row.
Lengths are kept on the host (the runner knows every append), so no step reads them back.
Positions beyond a row's length hold stale values that the mask never lets through.

`merge`, `extract`, `state` and `trim` follow mlx-lm's batch cache protocol; `extract`
returns a plain KVCache (what prefix snapshots hold).

Affine, TurboQuant and delayed TurboQuant rows have slot batches of their own
(engine/kv/affine.py, turboquant.py, delayed_slots.py, on engine/kv/slot_cache.py); a
single row of those kinds is its slot class seen as one sequence (`OneRow`), so it joins a
batch as it is;
`slot_kind(cache)` is the one place that picks the slot class for a row or slot batch,
`slot_batch_of(caches)` puts rows into one slot batch (a prefill group's, engine.prefill,
or the decode batch's), and `is_slot_batch` says whether a batch cache keeps rows in
slots (then `retire_order`). Prefill groups are slot batches from their first chunk:
there is no padded batch family.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.kv.affine import AffineKVCache, AffineSlotsKVCache
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.delayed_slots import DelayedTurboQuantSlotsKVCache
from tqserve.engine.kv.slot_rows import SlotRows, retire_order
from tqserve.engine.kv.slot_cache import OneRow, SlotsCache
from tqserve.engine.kv.turboquant import TurboQuantKVCache, TurboQuantSlotsKVCache

__all__ = ["RowSlotsKVCache", "is_slot_batch", "retire_order", "slot_batch", "slot_batch_of",
           "slot_kind"]


class RowSlotsKVCache(SlotsCache):
    """A batch of plain KV rows in slots (module doc): planes "keys" and "values"."""

    def __init__(self) -> None:
        self.slots = SlotRows()

    @property
    def keys(self) -> mx.array | None:
        """The rows' allocated key planes (rows, H, positions capacity, D); None while empty."""
        return self.slots.planes().get("keys")

    @property
    def values(self) -> mx.array | None:
        """The rows' allocated value planes; None while empty."""
        return self.slots.planes().get("values")

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write L new positions of every row (row i at its own length); return the
        planes up to the longest row."""
        if keys.shape[0] != self.num_rows:
            raise ValueError(f"{keys.shape[0]} rows of keys for a batch of {self.num_rows}")
        self.slots.append({"keys": keys, "values": values})
        fetched = self.slots.fetch()
        return fetched["keys"], fetched["values"]

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (a KVCache or RowSlotsKVCache) in free slots: only
        their KV is written."""
        self.slots.add_rows([None if k is None else {"keys": k, "values": v}
                             for k, v in _rows_of(other)])

    def trim_rows(self, amounts: Sequence[int]) -> list[int]:  # type: ignore[override]
        """Roll row i back by amounts[i] positions (CLAMPED at its length); nothing moves.
        Returns what each row lost."""
        if len(amounts) != self.num_rows:
            raise ValueError(f"{len(amounts)} trim amounts for {self.num_rows} rows")
        if any(a < 0 for a in amounts):
            raise ValueError(f"trim amounts must be >= 0, got {list(amounts)}")
        done = [min(a, p) for a, p in zip(amounts, self.lengths)]
        self.slots.trim_rows(done)
        return done

    def extract(self, idx: int) -> KVCache:
        """Row `idx` as a plain KVCache (a copy of its valid positions)."""
        cache = KVCache()
        planes = self.slots.extract(idx)
        if planes:
            cache.keys, cache.values = planes["keys"], planes["values"]
            cache.offset = self.lengths[idx]
        return cache

    @property
    def state(self) -> tuple[Any, ...]:
        """Keys and values up to the longest row (or Nones), the lengths array."""
        return self._planes_state(("keys", "values"))

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        self._set_planes_state(("keys", "values"), v)


def _rows_of(cache: Any) -> list[tuple[Any, Any]]:
    """Each row's valid (keys, values), (1, H, length, D), of a plain cache or batch;
    (None, None) for a row that holds no position yet."""
    if isinstance(cache, RowSlotsKVCache):
        if cache.keys is None or cache.values is None:
            return [(None, None)] * cache.num_rows
        return [(cache.keys[i:i + 1, :, :p], cache.values[i:i + 1, :, :p]) if p else (None, None)
                for i, p in enumerate(cache.lengths)]
    if type(cache) is KVCache:
        if cache.keys is None or cache.offset == 0:
            return [(None, None)]
        return [(cache.keys[..., :cache.offset, :], cache.values[..., :cache.offset, :])]
    raise TypeError(f"a {type(cache).__name__} cannot join a plain slot batch")


_SLOT_CLASSES: tuple[tuple[type, Any], ...] = (
    (AffineKVCache, AffineSlotsKVCache),
    (TurboQuantKVCache, TurboQuantSlotsKVCache),
    (DelayedTurboQuantKVCache, DelayedTurboQuantSlotsKVCache),
)


def slot_kind(cache: Any) -> Any | None:
    """The slot batch class for a row or slot batch of this kind (plain, affine,
    TurboQuant, delayed TurboQuant); None for other kinds."""
    if type(cache) is KVCache or isinstance(cache, RowSlotsKVCache):
        return RowSlotsKVCache
    for kind, slots in _SLOT_CLASSES:
        if isinstance(cache, (kind, slots)):
            return slots
    return None


def slot_batch_of(caches: Sequence[Any]) -> Any:
    """One slot batch holding the rows of `caches` (rows or slot batches of one kind with
    slots), in order; TypeError for a kind without slots."""
    kind = slot_kind(caches[0]) if caches else None
    if kind is None:
        raise TypeError(f"a {type(caches[0]).__name__ if caches else 'missing'} cache has "
                        "no slot batch")
    return kind.merge(list(caches))


def slot_batch(cache: Any) -> Any | None:
    """A slot batch holding the rows of `cache` (one row or a slot batch of a kind that
    has slots); None for other kinds."""
    return slot_batch_of([cache]) if slot_kind(cache) is not None else None


def is_slot_batch(cache: Any) -> bool:
    """Whether a batch cache keeps its rows in slots (joins take single rows as they are,
    retirements want `retire_order`); a one-row cache (`OneRow`) is no batch."""
    return isinstance(cache, (RowSlotsKVCache, SlotsCache)) and not isinstance(cache, OneRow)


def as_decode_batch(cache: Any) -> Any:
    """One row's cache as the decode batch's cache: plain, affine and TurboQuant layers go
    into per-row slots (later joins and retirements move only their own rows); other kinds
    through their class's `merge`."""
    slots = slot_batch(cache)
    return slots if slots is not None else type(cache).merge([cache])


def slot_capacity(cache: list[Any] | None) -> tuple[int, int]:
    """(row slots, positions) allocated by the decode batch's slot store (the first
    layer's; a delayed batch's plain and converted parts together), (0, 0) for none."""
    layer = cache[0] if cache else None
    parts = [getattr(layer, "slots", None),
             getattr(getattr(layer, "quantized", None), "slots", None)]
    stats = [p.statistics() for p in parts if p is not None]
    return (sum(s.row_capacity for s in stats), max((s.position_capacity for s in stats),
                                                    default=0))
