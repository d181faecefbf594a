"""The cache classes' common ground: one position store (SlotRows), two views of it.

Every codec (plain, affine, TurboQuant, delayed TurboQuant) keeps its encoded planes in a
`SlotRows` (engine/kv/slot_rows.py): row i in slot i, LEFT-aligned at [0, lengths[i]).
There is no second position store: one sequence is a SlotRows of one row.

* `SlotsCache` is the batch view (prefill groups, the decode batch): mlx-lm's batch cache
  protocol with per-row lengths, an int32 `offset` array (per-row RoPE offsets), the
  per-row mask, `filter` / `trim_rows` / `extend` / `extract`.
* `OneRow` is mlx-lm's single-sequence view of the same store (what a model's own
  `make_prompt_cache` list holds, what a prefix snapshot holds): an int `offset`, the mask
  a KVCache at that offset makes, `trim` of the end, and a block of B > 1 rows accepted
  while the cache is empty (they then share the offset, as mlx-lm's single-row caches
  allow). A codec's one-row class is its slot class with this view in front
  (`TurboQuantKVCache(OneRow, TurboQuantSlotsKVCache)`): one encode, one fetch, one
  byte layout, so a row joins a batch and leaves it with the bytes it was written with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from tqserve.engine.kv.slot_rows import Planes, SlotRows, row_indices


class SlotsCache(_BaseCache):
    """What every slot batch shares: a SlotRows, the position side of the protocol."""

    slots: SlotRows

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (single rows or batches) in free slots."""
        raise NotImplementedError

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> Any:
        """A slot batch of the rows of `caches` (single rows or batches), in order."""
        out = cls()
        for cache in caches:
            out.extend(cache)
        return out

    @property
    def num_rows(self) -> int:
        return self.slots.num_rows

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row."""
        return self.slots.lengths

    @property
    def offset(self) -> mx.array:
        """Per-row lengths (RoPE offsets of the next positions)."""
        return self.slots.offset

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array | None:
        """(rows, 1, N, longest + N): query q of row i sees positions <= lengths[i] + q;
        None for one decode position of rows of equal length (SlotRows.mask)."""
        return self.slots.mask(N)

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep rows `batch_indices` in that order; only rows whose slot changes move."""
        self.slots.take(row_indices(batch_indices))

    def trim_rows(self, amounts: Sequence[int]) -> None:
        """Drop the last amounts[i] positions of row i (0 <= amounts[i] <= its length, else
        ValueError and nothing changes); no byte moves."""
        self.slots.trim_rows(amounts)

    def trim(self, n: int) -> int:
        """Uniform trim of every row, as far as the shortest allows; returns how many."""
        n = max(0, min([n, *self.slots.lengths]))
        self.slots.trim_rows([n] * self.num_rows)
        return n

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return max(self.slots.lengths, default=0)

    def empty(self) -> bool:
        return self.slots.empty

    @property
    def nbytes(self) -> int:
        """Allocated bytes of the slot planes (free slots and slack included)."""
        return self.slots.nbytes

    def _planes_state(self, names: Sequence[str]) -> tuple[Any, ...]:
        fetched = self.slots.fetch()
        return (*(fetched.get(n) for n in names), self.slots.offset)

    def _set_planes_state(self, names: Sequence[str], v: Sequence[Any]) -> None:
        lengths = [int(x) for x in v[len(names)].tolist()]
        self.slots = SlotRows()
        planes = {n: a for n, a in zip(names, v) if a is not None}
        self.slots.add_rows([{n: a[i:i + 1, :, :p] for n, a in planes.items()} if p and planes
                             else None for i, p in enumerate(lengths)])


class OneRow:
    """mlx-lm's single-sequence view of a slot cache (see the module doc). Put it before
    the codec's slot class: its `offset`, `make_mask`, `trim` and state planes win."""

    slots: SlotRows

    def _open(self, num_rows: int) -> None:
        """Before a write of `num_rows` rows: an empty cache takes that many rows."""
        if self.slots.empty and self.slots.num_rows != num_rows:
            self.slots = SlotRows.holding({}, num_rows)

    @property
    def offset(self) -> int:
        """Tokens held (every row of the block alike)."""
        return self.slots.lengths[0] if self.slots.lengths else 0

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None) -> Any:
        """The mask a KVCache at this offset makes: None, "causal" or an array."""
        return create_attention_mask(N, self.offset, return_array, window_size)

    def written(self) -> Planes:
        """The written planes (B, H, offset, W), as views ({} while empty)."""
        return self.slots.fetch()

    def _row_planes(self, names: Sequence[str]) -> tuple[mx.array | None, ...]:
        planes = self.written()
        return tuple(planes.get(n) for n in names)

    @staticmethod
    def _holding(names: Sequence[str], values: Sequence[Any], offset: Any) -> SlotRows:
        """The store of a single-row `state`: its planes (or Nones) at `offset`."""
        slots = SlotRows.holding({n: v for n, v in zip(names, values) if v is not None})
        if slots.lengths[0] != int(offset):
            raise ValueError(f"state planes of {slots.lengths[0]} positions for offset {offset}")
        return slots

    def append_written(self, kv_cache: Any) -> None:
        """Encode and append what a plain mlx-lm KVCache holds (its written positions)."""
        if kv_cache.keys is not None and kv_cache.offset > 0:
            end = kv_cache.offset
            self.update_and_fetch(kv_cache.keys[..., :end, :],  # type: ignore[attr-defined]
                                  kv_cache.values[..., :end, :])
