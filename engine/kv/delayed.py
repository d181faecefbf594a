"""Delayed TurboQuant KV: rows stay plain until `quantized_kv_start`, then convert.

A row holds its keys and values in the model dtype until its offset reaches
`quantized_kv_start`; the NEXT append first converts it (its written positions encoded
as `TurboQuantKVCache.from_kv_cache` encodes a plain KVCache's), then encodes as
TurboQuant from then on. A block that crosses the threshold is appended (and attended)
plain, so the conversion happens at the actual offset after that block. The offset at
conversion is the row's `minimum_reusable_offset`, an irreversible precision boundary (0
while the row is plain): `trim` is CLAMPED so the offset never goes below it (trim returns
how many positions it really dropped, as mlx-lm's trim does); extract, slot batches,
deepcopy and `state` keep it.

One class implements this: `DelayedTurboQuantSlotsKVCache` (delayed_slots.py), a plain
and a converted slot part, which holds the rows of prefill groups and of the decode
batch. One row, `DelayedTurboQuantKVCache`, is that class seen as one sequence (`OneSequence`,
engine/kv/slot_cache.py), as TurboQuantKVCache is TurboQuant's: its row sits in one of the
two parts, so conversion, trim, `state` (one flat layout) and deepcopy are the slot
class's; it joins a batch (`extend`) with the bytes it holds, and a batch's `extract(i)`
gives row i back with the same bytes and boundary. A plain row fetches plain keys and
values, a converted one a RotatedKV, never a MixedRowsKV (a block of B > 1 rows, taken
while empty, shares one offset: its rows convert together).

The decode path and the codec settings are one TurboQuantConfig per cache,
resolved at construction and carried by every copy, slot batch and extraction.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.codec.turboquant import DEFAULT_ROTATION
from tqserve.engine.kv.delayed_slots import (DelayedTurboQuantSlotsKVCache, Fetched,
                                             _plain_cache)
from tqserve.engine.kv.slot_cache import OneSequence
from tqserve.engine.kv.slot_rows import Planes, SlotRows
from tqserve.engine.kv.turboquant import TurboQuantConfig, TurboQuantKVCache


class DelayedTurboQuantKVCache(OneSequence, DelayedTurboQuantSlotsKVCache):  # type: ignore[misc]
    """One row: plain until `quantized_kv_start`, TurboQuant after (see the module doc)."""

    config: TurboQuantConfig  # always set: a row is made with its settings
    quantized_kv_start: int

    def __init__(self, quantized_kv_start: int, k_bits: int, v_bits: int, head_dim: int,
                 seed: int = 0, rotation: str = DEFAULT_ROTATION,
                 decode: str = "auto") -> None:
        """An empty row; `decode` is its TurboQuant decode path (engine/kv/turboquant.py)."""
        if quantized_kv_start < 0:
            raise ValueError(f"quantized_kv_start must be >= 0, got {quantized_kv_start}")
        super().__init__(quantized_kv_start, TurboQuantConfig.create(k_bits, v_bits, head_dim,
                                                                     seed, rotation, decode))
        self._hold(SlotRows.holding({}), converted=False)

    @classmethod
    def holding(cls, quantized_kv_start: int, config: TurboQuantConfig,
                planes: Mapping[str, mx.array], converted: bool,
                minimum_reusable_offset: int = 0) -> DelayedTurboQuantKVCache:
        """A row holding `planes` (1, H, T, W) as they are (no copy): plain keys and
        values, or the TurboQuant planes of a row converted at `minimum_reusable_offset`."""
        cache = cls.__new__(cls)
        DelayedTurboQuantSlotsKVCache.__init__(cache, quantized_kv_start, config)
        cache._hold(SlotRows.holding(planes), converted, minimum_reusable_offset)
        return cache

    def _hold(self, rows: SlotRows, converted: bool, boundary: int = 0) -> None:
        """Hold `rows` (one row, or a block of rows of one offset) in one part."""
        self.slots, self._quantized.slots = (SlotRows(), rows) if converted else (rows, SlotRows())
        self._place([converted] * rows.num_rows, list(range(rows.num_rows)),
                    [boundary] * rows.num_rows)

    @property
    def offset(self) -> int:  # type: ignore[override]
        """Tokens held (every row of the block alike)."""
        return self.lengths[0]

    @property
    def converted(self) -> bool:  # type: ignore[override]
        """Whether the row holds TurboQuant codes (irreversible)."""
        return self._converted[0]

    @property
    def minimum_reusable_offset(self) -> int:
        """The offset at conversion (0 while plain): `trim` never goes below it."""
        return self.minimum_reusable_offsets[0]

    @property
    def plain(self) -> KVCache | None:
        """The row as a plain mlx-lm KVCache over its planes (no copy), until conversion."""
        return None if self.converted else _plain_cache(self.written())

    @property
    def quantized(self) -> TurboQuantKVCache | None:  # type: ignore[override]
        """The row as a TurboQuantKVCache on the same store, after conversion."""
        return TurboQuantKVCache.of(self.config, self._quantized.slots) if self.converted \
            else None

    def written(self) -> Planes:
        """The written planes of the part holding the row, as views ({} while empty):
        keys and values, or the four TurboQuant planes."""
        return (self._quantized.slots if self.converted else self.slots).fetch()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Fetched:
        """Convert first if the offset reached `quantized_kv_start`, then append (B, H, L,
        D) keys and values (B > 1 while empty) and fetch: plain arrays, or a RotatedKV."""
        rows = keys.shape[0] if keys.ndim == 4 else 1
        if self.empty() and self.num_rows != rows:
            self._hold(SlotRows.holding({}, rows), converted=False)
        return super().update_and_fetch(keys, values)
