"""Plain (float) KV in per-row slots: rows join and leave without copying the other rows.

`RowSlotsKVCache` is the decode batch's cache for plain KVCache layers: plain KV as a
codec of SlotsCache (engine/kv/slot_cache.py), without settings, its planes "keys" and
"values" stored as they come. Batch row i lives in slot i of a SlotRows
(engine/kv/slot_rows.py) at its own length, LEFT-aligned at [0, lengths[i]) (no padding):
a step writes each row at its own length and attention reads [0, max length) under a
per-row mask (RoPE takes the lengths as `offset`); `extend` writes only the joining rows,
`filter` with `retire_order` moves at most one row per retirement, and `trim_rows`
(speculative rollback) lowers each row's length, here CLAMPED at it, returning what each
row lost. Nothing moves but a retirement's row; only growth copies every row. Its rows
are mlx-lm KVCaches: one joins with its written positions, and `extract` returns one
(what prefix snapshots hold).

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

from tqserve.engine.kv.affine import AffineSlotsKVCache
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.delayed_slots import DelayedTurboQuantSlotsKVCache
from tqserve.engine.kv.slot_rows import Planes, retire_order
from tqserve.engine.kv.slot_cache import OneSequence, SlotsCache
from tqserve.engine.kv.turboquant import TurboQuantSlotsKVCache

__all__ = ["RowSlotsKVCache", "is_slot_batch", "retire_order", "slot_batch", "slot_batch_of",
           "slot_kind"]


class RowSlotsKVCache(SlotsCache):
    """A batch of plain KV rows in slots (module doc): planes "keys" and "values", no
    settings; its rows are mlx-lm KVCaches."""

    KIND = "plain"
    PLANES = ("keys", "values")

    @property
    def keys(self) -> mx.array | None:
        """The rows' allocated key planes (rows, H, positions capacity, D); None while empty."""
        return self.slots.planes().get("keys")

    @property
    def values(self) -> mx.array | None:
        """The rows' allocated value planes; None while empty."""
        return self.slots.planes().get("values")

    def encode(self, keys: mx.array, values: mx.array) -> Planes:
        """Plain KV is stored as it comes."""
        return {"keys": keys, "values": values}

    def fetched(self) -> tuple[mx.array, mx.array]:
        """Keys and values up to the longest row."""
        fetched = self.slots.fetch()
        return fetched["keys"], fetched["values"]

    def _joining(self, other: Any) -> tuple[Any, list[Planes]]:
        """A KVCache joins with its written positions; a plain slot batch with its rows."""
        if type(other) is not KVCache:
            return super()._joining(other)
        if other.keys is None or other.offset == 0:
            return None, [{}]
        return None, [{"keys": other.keys[..., :other.offset, :],
                       "values": other.values[..., :other.offset, :]}]

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


_SLOT_CLASSES = (RowSlotsKVCache, AffineSlotsKVCache, TurboQuantSlotsKVCache,
                 DelayedTurboQuantSlotsKVCache)  # affine and TurboQuant rows are their own


def slot_kind(cache: Any) -> Any | None:
    """The slot batch class for a row or slot batch of this kind (plain, affine,
    TurboQuant, delayed TurboQuant); None for other kinds."""
    if type(cache) is KVCache:
        return RowSlotsKVCache
    if isinstance(cache, DelayedTurboQuantKVCache):
        return DelayedTurboQuantSlotsKVCache
    return next((slots for slots in _SLOT_CLASSES if isinstance(cache, slots)), None)


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
    retirements want `retire_order`); a one-row cache (`OneSequence`) is no batch."""
    return isinstance(cache, SlotsCache) and not isinstance(cache, OneSequence)


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
