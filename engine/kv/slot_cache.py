"""The cache classes' common ground: one position store (SlotRows), two views of it, and
the cache protocol written once for every codec.

Every codec (plain, affine, TurboQuant, delayed TurboQuant) keeps its encoded planes in a
`SlotRows` (engine/kv/slot_rows.py): row i in slot i, LEFT-aligned at [0, lengths[i]).
There is no second position store: one sequence is a SlotRows of one row.

* `SlotsCache` is the batch view (prefill groups, the decode batch): mlx-lm's batch cache
  protocol with per-row lengths, an int32 `offset` array (per-row RoPE offsets), the
  per-row mask, `filter` / `trim_rows` / `extend` / `extract` / `merge` / `state`.
* `OneRow` is mlx-lm's single-sequence view of the same store (what a model's own
  `make_prompt_cache` list holds, what a prefix snapshot holds): an int `offset`, the mask
  a KVCache at that offset makes, `trim` of the end, and a block of B > 1 rows accepted
  while the cache is empty (they then share the offset, as mlx-lm's single-row caches
  allow). A codec's one-row class is its slot class with this view in front
  (`TurboQuantKVCache(OneRow, TurboQuantSlotsKVCache)`): one encode, one fetch, one
  byte layout, so a row joins a batch and leaves it with the bytes it was written with.

A codec's slot class supplies only its own part: `KIND` (its name; rows join batches of
their own kind, else TypeError), `PLANES` (in `state` order), `ROW` (its one-row class),
`SETTINGS` (the class of its settings: `scalars()`, `from_scalars`, equality; None for
none), `encode(keys, values)` (the planes of a block) and `fetched()` (what
`update_and_fetch` returns). A batch takes the settings of the first row that joins and
refuses rows of others (ValueError naming both). `state` is the planes up to the longest
row (or Nones) and the lengths array for a batch, the written planes (or Nones) and the
offset for a row, then the settings' scalars.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Self

import mlx.core as mx
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from tqserve.engine.kv.slot_rows import Planes, SlotRows, row_indices


class SlotsCache(_BaseCache):
    """What every slot batch shares: a SlotRows and the protocol around it, over the
    codec's hooks (see the module doc)."""

    KIND: ClassVar[str] = ""
    PLANES: ClassVar[tuple[str, ...]] = ()
    SETTINGS: ClassVar[Any] = None
    ROW: ClassVar[type[OneRow]]
    settings: Any  # a SETTINGS value; None until the first row joins
    slots: SlotRows

    def __init__(self, settings: Any = None) -> None:
        """Empty; the settings are taken from the first row that joins, unless given."""
        self.settings = settings
        self.slots = SlotRows()

    def encode(self, keys: mx.array, values: mx.array) -> Planes:
        """The codec's planes of a (rows, H, L, D) block of keys and values."""
        raise NotImplementedError

    def fetched(self) -> Any:
        """What `update_and_fetch` returns: the rows' planes up to the longest row."""
        raise NotImplementedError

    def _batch_name(self) -> str:
        return f"{'an' if self.KIND[:1] in 'aeiou' else 'a'} {self.KIND} slot batch"

    def _settings(self) -> Any:
        if self.settings is None:
            raise ValueError(f"{self._batch_name()} without rows has no settings")
        return self.settings

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        """Encode (rows, H, L, D) keys and values, write each row at its own length; fetch
        every row up to the longest (`fetched`)."""
        if keys.ndim != 4 or values.ndim != 4 or values.shape[:3] != keys.shape[:3] or (
                keys.shape[0] != self.num_rows):
            raise ValueError(f"expected keys and values ({self.num_rows}, H, L, D), got "
                             f"{keys.shape} and {values.shape}")
        self.write(keys, values)
        return self.fetched()

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Encode and write a block of every row (no fetch)."""
        self.slots.append(self.encode(keys, values))

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (a row or slot batch of this kind) in free slots: only
        their bytes are written."""
        self.add(*self._joining(other))

    def _joining(self, other: Any) -> tuple[Any, list[Planes]]:
        """The settings and each row's written planes of a cache that joins."""
        if not isinstance(other, SlotsCache) or other.KIND != self.KIND:
            raise TypeError(f"a {type(other).__name__} cannot join {self._batch_name()}")
        return other.settings, [other.slots.row(i) for i in range(other.num_rows)]

    def add(self, settings: Any, rows: Sequence[Planes]) -> None:
        """Append rows given as plane dicts ({} for an empty row) written with `settings`."""
        if self.settings is None:
            self.settings = settings
        elif settings is not None and settings != self.settings:
            raise ValueError(f"cannot combine {self.KIND} caches {self.settings} and {settings}")
        self.slots.add_rows([r or None for r in rows])

    def extract(self, idx: int) -> Any:
        """Row idx as the codec's one-row cache (a copy of its bytes, same settings)."""
        return self.ROW.of(self._settings(), SlotRows.holding(self.slots.extract(idx)))

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

    @property
    def state(self) -> tuple[Any, ...]:
        """The planes up to the longest row (or Nones), `offset` (a batch's lengths array, a
        row's int), the settings' scalars (module doc)."""
        fetched = self.slots.fetch()
        scalars = self._settings().scalars() if self.SETTINGS is not None else ()
        return (*(fetched.get(n) for n in self.PLANES), self.offset, *scalars)

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        n = len(self.PLANES)
        self.settings = self.SETTINGS.from_scalars(v[n + 1:]) if self.SETTINGS is not None else None
        self._restore(v[:n], v[n])

    def _restore(self, planes: Sequence[Any], lengths: Any) -> None:
        """The store of a `state`: its planes (or Nones) up to `lengths` (an array)."""
        self._set_planes_state(self.PLANES, (*planes, lengths))

    def _planes_state(self, names: Sequence[str]) -> tuple[Any, ...]:
        fetched = self.slots.fetch()
        return (*(fetched.get(n) for n in names), self.slots.offset)

    def _set_planes_state(self, names: Sequence[str], v: Sequence[Any]) -> None:
        lengths = [int(x) for x in v[len(names)].tolist()]
        self.slots = SlotRows()
        planes = {n: a for n, a in zip(names, v) if a is not None}
        self.slots.add_rows([{n: a[i:i + 1, :, :p] for n, a in planes.items()} if p and planes
                             else None for i, p in enumerate(lengths)])


class OneSequence:
    """mlx-lm's single-sequence view of a slot store: an int `offset` and the mask a
    KVCache at that offset makes. A one-row class puts it before its slot class (OneRow;
    the delayed row, engine/kv/delayed.py); `is_slot_batch` tells rows from batches by it."""

    slots: SlotRows

    @property
    def offset(self) -> int:
        """Tokens held (every row of the block alike)."""
        return self.slots.lengths[0] if self.slots.lengths else 0

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None, **kwargs: Any) -> Any:
        """The mask a KVCache at this offset makes: None, "causal" or an array."""
        return create_attention_mask(N, self.offset, return_array, window_size)


class OneRow(OneSequence, SlotsCache):  # type: ignore[misc]  # int offset
    """A codec's one-row class over its slot class (see the module doc). Put it before
    the codec's slot class: its `offset`, `make_mask`, `update_and_fetch` and the restore
    of a `state` win."""

    def __init__(self, settings: Any) -> None:
        """An empty row written with `settings`."""
        super().__init__(settings)
        self.slots = SlotRows.holding({})

    @classmethod
    def of(cls, settings: Any, slots: SlotRows | None = None) -> Self:
        """A row written with `settings` holding `slots` (one fresh empty row by default)."""
        cache = cls.__new__(cls)
        OneRow.__init__(cache, settings)
        if slots is not None:
            cache.slots = slots
        return cache

    @classmethod
    def converted(cls, kv_cache: KVCache, settings: Any) -> Self:
        """A row written with `settings` holding what a plain mlx-lm KVCache holds (its
        written positions, encoded)."""
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"expected an mlx-lm KVCache, got {type(kv_cache).__name__}")
        cache = cls.of(settings)
        if kv_cache.keys is not None and kv_cache.offset > 0:
            end = kv_cache.offset
            cache.update_and_fetch(kv_cache.keys[..., :end, :], kv_cache.values[..., :end, :])
        return cache

    def written(self) -> Planes:
        """The written planes (B, H, offset, W), as views ({} while empty)."""
        return self.slots.fetch()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        """Encode and append (B, H, L, D) keys and values (an empty cache takes B rows);
        fetch all written ones."""
        if self.slots.empty and keys.ndim == 4 and self.slots.num_rows != keys.shape[0]:
            self.slots = SlotRows.holding({}, keys.shape[0])
        return super().update_and_fetch(keys, values)

    def _restore(self, planes: Sequence[Any], offset: Any) -> None:
        """The store of a row's `state`: its planes (or Nones), as they are, at `offset`."""
        slots = SlotRows.holding({n: a for n, a in zip(self.PLANES, planes) if a is not None})
        if slots.lengths[0] != int(offset):
            raise ValueError(f"state planes of {slots.lengths[0]} positions for offset {offset}")
        self.slots = slots
