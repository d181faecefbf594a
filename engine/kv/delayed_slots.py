"""Delayed TurboQuant KV in per-row slots: plain rows and converted rows, each in slots.

`DelayedTurboQuantSlotsKVCache` is the one implementation of delayed TurboQuant rows
(engine/kv/delayed.py has the semantics): the cache of prefill groups and of the decode
batch, and, seen as one sequence, the single row DelayedTurboQuantKVCache. It holds two
slot parts that need not share a position axis: plain rows (planes "keys"/"values", model
dtype) in a `SlotRows` and converted rows in a `TurboQuantSlotsKVCache` (`quantized`);
row i is (converted[i], slot[i]) with its boundary `minimum_reusable_offsets[i]`. Every
row is LEFT-aligned in its part.

* update_and_fetch first converts the plain rows whose length reached
  `quantized_kv_start` (the row's written positions encoded as
  `TurboQuantKVCache.converted` encodes a plain KVCache's, at its actual length,
  which becomes its boundary, written into a new converted slot; its plain slot retires,
  moving at most one plain row), then writes each part's rows and returns plain arrays, a
  RotatedKV or a `MixedRowsKV` (the parts' rows in slot order; attention restores batch
  order). `trim_rows` never sets a boundary (rejected speculative tokens are gone before
  the next append converts).
* `make_mask` is built from the rows' lengths alone, so it holds for whichever part a row
  sits in; a part sees the mask's rows of its own rows, cut to its own longest row.
* `extend` writes only the joining rows, `filter` retires rows part by part with
  `retire_order` (at most one move per retired row), `trim_rows` lowers lengths and is
  CLAMPED by contract: amounts[i] <= length_i - boundary_i, else ValueError.
* `extract(i)` is row i as a DelayedTurboQuantKVCache (its bytes and its boundary).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.attention.sdpa import MixedRowsKV
from tqserve.engine.kv.slot_cache import SlotsCache
from tqserve.engine.kv.slot_rows import (Planes, SlotRows, offsets_array, retire_order,
                                         row_indices, slots_mask)
from tqserve.engine.kv.turboquant import (TurboQuantConfig, TurboQuantKVCache,
                                          TurboQuantSlotsKVCache)

if TYPE_CHECKING:
    from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache

Fetched = tuple[Any, Any]
PLAIN = ("keys", "values")  # the plain part's planes


def _plain_cache(planes: Planes) -> KVCache:
    """A plain mlx-lm KVCache over written keys and values ({}: an empty one)."""
    cache = KVCache()
    if planes:
        cache.keys, cache.values = planes["keys"], planes["values"]
        cache.offset = cache.keys.shape[2]
    return cache


def _gather(x: mx.array, rows: list[int], everyone: list[int]) -> mx.array:
    """Rows `rows` of a block (the block itself when they are all of it, in order)."""
    return x if rows == everyone else x[mx.array(rows, dtype=mx.int32)]


class DelayedTurboQuantSlotsKVCache(SlotsCache):
    """Delayed rows: a plain and a converted slot part (see the module doc)."""

    def __init__(self, quantized_kv_start: int | None = None,
                 config: TurboQuantConfig | None = None) -> None:
        """Empty; the settings are taken from the first row that joins, unless given."""
        self.quantized_kv_start = quantized_kv_start
        self.config = config
        self.slots = SlotRows()  # the plain part
        self._quantized = TurboQuantSlotsKVCache(config)
        self._converted: list[bool] = []
        self.slot: list[int] = []
        self.minimum_reusable_offsets: list[int] = []
        self._offset: mx.array | None = None

    @property
    def quantized(self) -> TurboQuantSlotsKVCache:
        """The converted part."""
        return self._quantized

    @property
    def converted(self) -> list[bool]:
        """Per row: whether it holds TurboQuant codes (irreversible)."""
        return self._converted

    @property
    def num_rows(self) -> int:
        return len(self._converted)

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row."""
        parts = (self.slots.lengths, self._quantized.slots.lengths)
        return [parts[c][s] for c, s in zip(self._converted, self.slot)]

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

    def _part(self, converted: bool) -> SlotRows:
        """The store of the converted part or of the plain part."""
        return self._quantized.slots if converted else self.slots

    def _rows(self, converted: bool) -> list[int]:
        """The rows of one part, in slot order."""
        rows = [i for i, c in enumerate(self._converted) if c == converted]
        return sorted(rows, key=lambda i: self.slot[i])

    def _place(self, converted: list[bool], slot: list[int], boundaries: list[int]) -> None:
        self._converted, self.slot, self.minimum_reusable_offsets = converted, slot, boundaries
        self._offset = None

    @staticmethod
    def _retire(part: SlotRows, gone: list[int]) -> dict[int, int]:
        """Retire slots `gone` of a part (`retire_order`); the new slot of each kept one."""
        order = retire_order(part.num_rows, gone)
        part.take(order)
        return {old: j for j, old in enumerate(order)}

    def _convert_due(self) -> None:
        assert self.quantized_kv_start is not None and self.config is not None
        for i in range(self.num_rows):
            length = -1 if self._converted[i] else self.slots.lengths[self.slot[i]]
            if length < self.quantized_kv_start:
                continue
            row = TurboQuantKVCache.converted(_plain_cache(self.slots.row(self.slot[i])),
                                              self.config)
            planes = row.written()
            mx.eval(planes)  # read the plain slot before another row moves into it
            moved = self._retire(self.slots, [self.slot[i]])
            self._quantized.add(self.config, [planes])
            self._place([c or r == i for r, c in enumerate(self._converted)],
                        [self._quantized.num_rows - 1 if r == i else s if c else moved[s]
                         for r, (c, s) in enumerate(zip(self._converted, self.slot))],
                        [length if r == i else b
                         for r, b in enumerate(self.minimum_reusable_offsets)])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Fetched:
        """Convert due rows, write each part's rows, fetch for attention."""
        if keys.ndim != 4 or values.shape[:3] != keys.shape[:3] or keys.shape[0] != self.num_rows:
            raise ValueError(f"expected keys and values ({self.num_rows}, H, L, D), got "
                             f"{keys.shape} and {values.shape}")
        self._convert_due()
        everyone = list(range(self.num_rows))
        plain_rows, quantized_rows = self._rows(False), self._rows(True)
        if plain_rows:
            self.slots.append({"keys": _gather(keys, plain_rows, everyone),
                               "values": _gather(values, plain_rows, everyone)})
        if quantized_rows:
            self._quantized.write(_gather(keys, quantized_rows, everyone),
                                  _gather(values, quantized_rows, everyone))
        self._offset = None
        if plain_rows == everyone:
            planes = self.slots.fetch()
            return planes["keys"], planes["values"]
        rotated = self._quantized.fetch() if quantized_rows else None
        if quantized_rows == everyone:
            return rotated, rotated
        planes = self.slots.fetch() if plain_rows else {}
        mixed = MixedRowsKV(plain_rows=tuple(plain_rows), plain_keys=planes.get("keys"),
                            plain_values=planes.get("values"),
                            rotated_rows=tuple(quantized_rows), rotated=rotated)
        return mixed, mixed

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (a single delayed row or another delayed slot
        batch): only their bytes are written."""
        if not isinstance(other, DelayedTurboQuantSlotsKVCache):
            raise TypeError(f"a {type(other).__name__} cannot join a delayed slot batch")
        settings = (other.config, other.quantized_kv_start)
        if self.config is None:
            self.config, self.quantized_kv_start = settings
            self._quantized.config = self.config
        elif other.num_rows and settings != (self.config, self.quantized_kv_start):
            raise ValueError("cannot combine delayed caches with different settings")
        for converted, slot, boundary in zip(other._converted, other.slot,
                                             other.minimum_reusable_offsets):
            part = self._part(converted)
            part.add_rows([other._part(converted).row(slot) or None])
            self._place([*self._converted, converted], [*self.slot, part.num_rows - 1],
                        [*self.minimum_reusable_offsets, boundary])

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep rows `batch_indices` in that order; each part retires its gone rows with
        `retire_order` (only rows whose slot changes move)."""
        keep = row_indices(batch_indices)
        if any(i not in range(self.num_rows) for i in keep) or len(set(keep)) != len(keep):
            raise ValueError(f"row indices {keep} are not distinct rows of 0..{self.num_rows - 1}")
        moved = [self._retire(self._part(flag), [self.slot[i] for i in self._rows(flag)
                                                 if i not in keep]) for flag in (False, True)]
        self._place([self._converted[i] for i in keep],
                    [moved[self._converted[i]][self.slot[i]] for i in keep],
                    [self.minimum_reusable_offsets[i] for i in keep])

    def trim_rows(self, amounts: Sequence[int]) -> None:
        """Drop the last amounts[i] positions of row i; amounts[i] <= length_i - boundary_i
        (a converted row's boundary is never crossed), else ValueError, nothing changes."""
        room = [n - b for n, b in zip(self.lengths, self.minimum_reusable_offsets)]
        amounts = [int(a) for a in amounts]
        if len(amounts) != self.num_rows or any(not 0 <= a <= r for a, r in zip(amounts, room)):
            raise ValueError(f"cannot trim {amounts} from rows with room {room}")
        for flag in (False, True):
            self._part(flag).trim_rows([amounts[i] for i in self._rows(flag)])
        self._offset = None

    def trim(self, n: int) -> int:
        """Drop up to n positions of every row, never below any row's boundary; returns
        how many."""
        room = [p - b for p, b in zip(self.lengths, self.minimum_reusable_offsets)]
        n = max(0, min([n, *room]))
        self.trim_rows([n] * self.num_rows)
        return n

    def size(self) -> int:
        return max(self.lengths, default=0)

    def empty(self) -> bool:
        return self.slots.empty and self._quantized.empty()

    @property
    def nbytes(self) -> int:
        """Allocated bytes of both parts."""
        return self.slots.nbytes + self._quantized.nbytes

    def extract(self, idx: int) -> DelayedTurboQuantKVCache:
        """Row idx as a single delayed row (a copy of its bytes, its boundary)."""
        from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache  # a view of this class

        if self.config is None or self.quantized_kv_start is None:
            raise ValueError("a delayed slot batch without rows has no settings")
        converted = self._converted[idx]
        return DelayedTurboQuantKVCache.holding(
            self.quantized_kv_start, self.config, self._part(converted).extract(self.slot[idx]),
            converted, self.minimum_reusable_offsets[idx])

    @property
    def state(self) -> tuple[Any, ...]:
        """Plain keys, values and lengths; the converted part's state (its four planes,
        lengths and config fields); per row (converted, slot, boundary) as an (n, 3) int32
        array; quantized_kv_start. One flat tuple, a single row's too."""
        places = mx.array([list(t) for t in zip(self._converted, self.slot,
                                                 self.minimum_reusable_offsets)],
                          dtype=mx.int32).reshape(-1, 3)
        return (*self._planes_state(PLAIN), *self._quantized.state, places,
                self.quantized_kv_start)

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        self._set_planes_state(PLAIN, v[:3])
        self._quantized = TurboQuantSlotsKVCache.from_state(v[3:-2])
        self.config = self._quantized.config
        self.quantized_kv_start = None if v[-1] is None else int(v[-1])
        rows = v[-2].tolist()
        self._place([bool(r[0]) for r in rows], [int(r[1]) for r in rows],
                    [int(r[2]) for r in rows])
