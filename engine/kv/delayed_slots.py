"""Delayed TurboQuant KV in per-row slots: plain rows and converted rows, each in slots.

`DelayedTurboQuantSlotsKVCache` is the decode batch's cache for DelayedTurboQuantKVCache
layers (engine/kv/delayed.py has the semantics). It holds two slot parts that need not
share a position axis: plain rows (planes "keys"/"values", model dtype) in a `SlotRows`
and converted rows in a `TurboQuantSlotsKVCache`; batch row i is (converted[i], slot[i])
with its boundary `minimum_reusable_offsets[i]`. Every row is LEFT-aligned in its part.

* update_and_fetch first converts the plain rows whose length reached
  `quantized_kv_start` (the row's bytes encoded at its actual length, which becomes its
  boundary, written into a new converted slot; its plain slot retires, moving at most one
  plain row), then writes each part's rows and returns plain arrays, a RotatedKV or a
  `MixedRowsKV` (the parts' rows in slot order; attention restores batch order). A block
  that crosses the threshold is appended plain, so the conversion happens at the next
  append, at the actual offset; `trim_rows` never sets a boundary (rejected speculative
  tokens are gone before the next append converts).
* `make_mask` is built from the rows' lengths alone, so it holds for whichever part a row
  sits in; a part sees the mask's rows of its own rows, cut to its own longest row.
* `extend` writes only the joining rows, `filter` retires rows part by part with
  `retire_order` (at most one move per retired row), `trim_rows` lowers lengths and is
  CLAMPED by contract: amounts[i] <= length_i - boundary_i, else ValueError.
* `extract(i)` is row i as a DelayedTurboQuantKVCache (its bytes and its boundary).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.attention.sdpa import MixedRowsKV
from tqserve.engine.kv.delayed import (DelayedTurboQuantKVCache, _convert, _plain_cache,
                                       _plain_planes)
from tqserve.engine.kv.slot_cache import SlotsCache
from tqserve.engine.kv.slot_rows import (SlotRows, offsets_array, retire_order, row_indices,
                                         slots_mask)
from tqserve.engine.kv.turboquant import TurboQuantConfig, TurboQuantSlotsKVCache

Fetched = tuple[Any, Any]


class DelayedTurboQuantSlotsKVCache(SlotsCache):
    """A batch of delayed rows: a plain and a converted slot part (see the module doc)."""

    def __init__(self) -> None:
        """Empty; the settings are taken from the first row that joins."""
        self.quantized_kv_start: int | None = None
        self.config: TurboQuantConfig | None = None
        self.slots = SlotRows()  # the plain part
        self.quantized = TurboQuantSlotsKVCache()
        self.converted: list[bool] = []
        self.slot: list[int] = []
        self.minimum_reusable_offsets: list[int] = []
        self._offset: mx.array | None = None

    @property
    def num_rows(self) -> int:
        return len(self.converted)

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row."""
        parts = (self.slots.lengths, self.quantized.slots.lengths)
        return [parts[c][s] for c, s in zip(self.converted, self.slot)]

    @property
    def offset(self) -> mx.array:
        """Per-row lengths (RoPE offsets of the next positions)."""
        if self._offset is None:
            self._offset = offsets_array(tuple(self.lengths))
        return self._offset

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array | None:
        """(rows, 1, N, longest + N): query q of row i sees positions <= lengths[i] + q;
        None for one decode position of rows of equal length (slot_rows.slots_mask)."""
        return slots_mask(self.lengths, self.offset, N)

    def _rows(self, converted: bool) -> list[int]:
        """The batch rows of one part, in slot order."""
        rows = [i for i, c in enumerate(self.converted) if c == converted]
        return sorted(rows, key=lambda i: self.slot[i])

    def _place(self, converted: list[bool], slot: list[int], boundaries: list[int]) -> None:
        self.converted, self.slot, self.minimum_reusable_offsets = converted, slot, boundaries
        self._offset = None

    def _convert_due(self) -> None:
        assert self.quantized_kv_start is not None and self.config is not None
        for i in range(self.num_rows):
            length = self.slots.lengths[self.slot[i]] if not self.converted[i] else -1
            if length < self.quantized_kv_start:
                continue
            row = _convert(_plain_cache(self.slots.row(self.slot[i])), self.config)
            planes = row.written()
            mx.eval(planes)  # read the plain slot before another row moves into it
            gone = self.slot[i]
            keep = retire_order(self.slots.num_rows, [gone])
            self.slots.take(keep)
            new_slot = {old: j for j, old in enumerate(keep)}
            self.quantized.add(self.config, [planes])
            slot = [self.quantized.num_rows - 1 if r == i else s if c else new_slot[s]
                    for r, (c, s) in enumerate(zip(self.converted, self.slot))]
            converted = [c or r == i for r, c in enumerate(self.converted)]
            boundaries = list(self.minimum_reusable_offsets)
            boundaries[i] = length
            self._place(converted, slot, boundaries)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Fetched:
        """Convert due rows, write each part's rows, fetch for attention."""
        if keys.ndim != 4 or values.shape[:3] != keys.shape[:3] or keys.shape[0] != self.num_rows:
            raise ValueError(f"expected keys and values ({self.num_rows}, H, L, D), got "
                             f"{keys.shape} and {values.shape}")
        self._convert_due()
        plain_rows, quantized_rows = self._rows(False), self._rows(True)
        if plain_rows:
            index = mx.array(plain_rows, dtype=mx.int32)
            self.slots.append({"keys": keys[index], "values": values[index]})
        if quantized_rows:
            index = mx.array(quantized_rows, dtype=mx.int32)
            self.quantized.write(keys[index], values[index])
        self._offset = None
        in_order = list(range(self.num_rows))
        if not quantized_rows and plain_rows == in_order:
            planes = self.slots.fetch()
            return planes["keys"], planes["values"]
        rotated = self.quantized.fetch() if quantized_rows else None
        if rotated is not None and quantized_rows == in_order:
            return rotated, rotated
        planes = self.slots.fetch() if plain_rows else {}
        mixed = MixedRowsKV(plain_rows=tuple(plain_rows), plain_keys=planes.get("keys"),
                            plain_values=planes.get("values"),
                            rotated_rows=tuple(quantized_rows), rotated=rotated)
        return mixed, mixed

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (a single delayed row or another delayed slot
        batch): only their bytes are written."""
        if isinstance(other, DelayedTurboQuantKVCache):
            rows = [other]
        elif isinstance(other, DelayedTurboQuantSlotsKVCache):
            rows = [other.extract(i) for i in range(len(other.converted))]
        else:
            raise TypeError(f"a {type(other).__name__} cannot join a delayed slot batch")
        for row in rows:
            settings = (row.config, row.quantized_kv_start)
            if self.config is None:
                self.config, self.quantized_kv_start = settings
                self.quantized.config = self.config
            elif settings != (self.config, self.quantized_kv_start):
                raise ValueError("cannot combine delayed caches with different settings")
            if row.quantized is not None:
                self.quantized.add(self.config, [row.quantized.written()])
                slot = self.quantized.num_rows - 1
            else:
                assert row.plain is not None
                self.slots.add_rows([_plain_planes(row.plain) or None])
                slot = self.slots.num_rows - 1
            self._place([*self.converted, row.converted], [*self.slot, slot],
                        [*self.minimum_reusable_offsets, row.minimum_reusable_offset])

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep rows `batch_indices` in that order; each part retires its gone rows with
        `retire_order` (only rows whose slot changes move)."""
        keep = row_indices(batch_indices)
        if any(i not in range(self.num_rows) for i in keep) or len(set(keep)) != len(keep):
            raise ValueError(f"row indices {keep} are not distinct rows of 0..{self.num_rows - 1}")
        new_slot: list[dict[int, int]] = []
        for flag, part in ((False, self.slots), (True, self.quantized.slots)):
            gone = [self.slot[i] for i in range(self.num_rows)
                    if self.converted[i] == flag and i not in keep]
            order = retire_order(part.num_rows, gone)
            part.take(order)
            new_slot.append({old: j for j, old in enumerate(order)})
        self._place([self.converted[i] for i in keep],
                    [new_slot[self.converted[i]][self.slot[i]] for i in keep],
                    [self.minimum_reusable_offsets[i] for i in keep])

    def trim_rows(self, amounts: Sequence[int]) -> None:
        """Drop the last amounts[i] positions of row i; amounts[i] <= length_i - boundary_i
        (a converted row's boundary is never crossed), else ValueError, nothing changes."""
        room = [n - b for n, b in zip(self.lengths, self.minimum_reusable_offsets)]
        amounts = [int(a) for a in amounts]
        if len(amounts) != self.num_rows or any(not 0 <= a <= r for a, r in zip(amounts, room)):
            raise ValueError(f"cannot trim {amounts} from rows with room {room}")
        for flag, part in ((False, self.slots), (True, self.quantized.slots)):
            part.trim_rows([amounts[i] for i in self._rows(flag)])
        self._offset = None

    def trim(self, n: int) -> int:
        """Drop up to n positions of every row, never below any row's boundary."""
        room = [p - b for p, b in zip(self.lengths, self.minimum_reusable_offsets)]
        n = max(0, min([n, *room]))
        self.trim_rows([n] * self.num_rows)
        return n

    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return self.slots.empty and self.quantized.empty()

    @property
    def nbytes(self) -> int:
        """Allocated bytes of both parts."""
        return self.slots.nbytes + self.quantized.nbytes

    def extract(self, idx: int) -> DelayedTurboQuantKVCache:
        """Row idx as a single delayed row (a copy of its bytes, its boundary)."""
        if self.config is None or self.quantized_kv_start is None:
            raise ValueError("a delayed slot batch without rows has no settings")
        inner: KVCache | Any
        if self.converted[idx]:
            inner = self.quantized.extract(self.slot[idx])
        else:
            inner = _plain_cache(self.slots.extract(self.slot[idx]))
        return DelayedTurboQuantKVCache.of(self.quantized_kv_start, self.config, inner,
                                           self.minimum_reusable_offsets[idx])

    @property
    def state(self) -> tuple[Any, ...]:
        """Plain keys, values and lengths; the converted part's state; per row (converted,
        slot, boundary) as an (n, 3) int32 array; quantized_kv_start."""
        places = mx.array([list(t) for t in zip(self.converted, self.slot,
                                                 self.minimum_reusable_offsets)],
                          dtype=mx.int32).reshape(-1, 3)
        return (*self._planes_state(("keys", "values")), self.quantized.state, places,
                self.quantized_kv_start)

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        self._set_planes_state(("keys", "values"), v[:3])
        self.quantized = TurboQuantSlotsKVCache()
        self.quantized.state = v[3]
        self.config = self.quantized.config
        self.quantized_kv_start = None if v[5] is None else int(v[5])
        rows = v[4].tolist()
        self._place([bool(r[0]) for r in rows], [int(r[1]) for r in rows],
                    [int(r[2]) for r in rows])
