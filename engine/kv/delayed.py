"""Delayed TurboQuant KV: rows stay plain until `quantized_kv_start`, then convert.

One row (`DelayedTurboQuantKVCache`) holds a plain mlx-lm KVCache (keys and values in the
model dtype) until its offset reaches `quantized_kv_start`; the NEXT append first converts
it through `TurboQuantKVCache.from_kv_cache`, then encodes as TurboQuant from then on. A
block that crosses the threshold is appended (and attended) plain, so the conversion
happens at the actual offset after that block. The offset at conversion is the row's
`minimum_reusable_offset`, an irreversible precision boundary (0 while the row is plain):
`trim` is CLAMPED so the offset never goes below it (trim returns how many positions it
really dropped, as mlx-lm's trim does); extract, merge, deepcopy and `state` keep it.

A batch (`BatchedDelayedTurboQuantKVCache`, what prefill groups use; the decode batch
keeps rows in slots: `DelayedTurboQuantSlotsKVCache`, delayed_slots.py) holds two parts
that share ONE position axis: plain rows in a KvTensorRows with planes "keys"/"values"
(model dtype), converted rows in a BatchedTurboQuantKVCache, plus a per-row `converted` flag and boundary. Invariants: both
parts have the batch's write index (a part may hold zero rows), and each part keeps its
rows in batch order; so one causal mask with per-row left padding serves both parts.
update_and_fetch first converts due rows (moving their bytes from the plain part to the
converted one, no position changes), then appends the block's rows to their parts and
returns plain arrays (no converted rows), the RotatedKV (all converted) or a MixedRowsKV
(attention then runs per part and restores batch order). Each row's bytes equal those of
the same row cached alone.

The fused-decode selection and the codec settings are one TurboQuantConfig per cache,
resolved at construction and carried by every copy, merge and extraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from tqserve.engine.codec.turboquant import DEFAULT_ROTATION
from tqserve.engine.kv.attention import MixedRowsKV, RotatedKV
from tqserve.engine.kv.rows import KvTensorRows, row_indices
from tqserve.engine.kv.turboquant import (
    BatchedTurboQuantKVCache,
    TurboQuantConfig,
    TurboQuantKVCache,
)

Fetched = tuple[Any, Any]


def _convert(plain: KVCache, config: TurboQuantConfig) -> TurboQuantKVCache:
    return TurboQuantKVCache.from_kv_cache(
        plain, config.k_bits, config.v_bits, head_dim=config.head_dim, seed=config.seed,
        rotation=config.rotation, fused_decode=config.fused_decode)


def _plain_cache(planes: dict[str, mx.array]) -> KVCache:
    cache = KVCache()
    if planes:
        cache.keys, cache.values = planes["keys"], planes["values"]
        cache.offset = cache.keys.shape[2]
    return cache


class DelayedTurboQuantKVCache(_BaseCache):
    """One row: plain until `quantized_kv_start`, TurboQuant after (see the module doc)."""

    def __init__(self, quantized_kv_start: int, k_bits: int, v_bits: int, head_dim: int,
                 seed: int = 0, rotation: str = DEFAULT_ROTATION,
                 fused_decode: bool | None = None) -> None:
        """`fused_decode` None reads TQSERVE_TURBOQUANT_FUSED_DECODE now, once."""
        if quantized_kv_start < 0:
            raise ValueError(f"quantized_kv_start must be >= 0, got {quantized_kv_start}")
        self.config = TurboQuantConfig.create(k_bits, v_bits, head_dim, seed, rotation,
                                              fused_decode)
        self.quantized_kv_start = quantized_kv_start
        self.inner: KVCache | TurboQuantKVCache = KVCache()
        self.minimum_reusable_offset = 0

    @classmethod
    def of(cls, start: int, config: TurboQuantConfig, inner: KVCache | TurboQuantKVCache,
           minimum_reusable_offset: int) -> DelayedTurboQuantKVCache:
        """A row holding `inner` (plain, or converted with its boundary)."""
        cache = cls(start, config.k_bits, config.v_bits, config.head_dim, config.seed,
                    config.rotation, config.fused_decode)
        cache.inner = inner
        cache.minimum_reusable_offset = minimum_reusable_offset
        return cache

    @property
    def converted(self) -> bool:
        """Whether the row holds TurboQuant codes (irreversible)."""
        return isinstance(self.inner, TurboQuantKVCache)

    @property
    def plain(self) -> KVCache | None:
        """The plain mlx-lm KVCache, until conversion."""
        return None if isinstance(self.inner, TurboQuantKVCache) else self.inner

    @property
    def quantized(self) -> TurboQuantKVCache | None:
        """The TurboQuant row, after conversion."""
        return self.inner if isinstance(self.inner, TurboQuantKVCache) else None

    @property
    def offset(self) -> int:
        """Tokens held."""
        return int(self.inner.offset)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Fetched:
        """Convert first if the offset reached the threshold; then append and fetch."""
        if isinstance(self.inner, KVCache) and self.inner.offset >= self.quantized_kv_start:
            self.minimum_reusable_offset = self.inner.offset
            self.inner = _convert(self.inner, self.config)
        return self.inner.update_and_fetch(keys, values)

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None) -> Any:
        """The mask a KVCache at this offset makes: None, "causal" or an array."""
        return create_attention_mask(N, self.offset, return_array, window_size)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return bool(self.inner.empty())

    @property
    def nbytes(self) -> int:
        """Allocated bytes of the plain KVCache or of the TurboQuant planes."""
        return int(self.inner.nbytes)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop up to n positions, never below `minimum_reusable_offset`; returns how many."""
        return int(self.inner.trim(max(0, min(n, self.offset - self.minimum_reusable_offset))))

    @classmethod
    def merge(cls, caches: Sequence[DelayedTurboQuantKVCache]) -> BatchedDelayedTurboQuantKVCache:
        """A batch of single rows (plain and converted rows may mix)."""
        return BatchedDelayedTurboQuantKVCache.merge(caches)

    @property
    def state(self) -> tuple[Any, ...]:
        if isinstance(self.inner, TurboQuantKVCache):
            arrays = self.inner.state[:4]
        else:
            planes = _plain_planes(self.inner)
            arrays = (planes.get("keys"), planes.get("values"), None, None)
        return (*arrays, self.offset, self.minimum_reusable_offset, self.quantized_kv_start,
                self.converted, *self.config.scalars())

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        self.config = TurboQuantConfig.from_scalars(v[8:])
        self.quantized_kv_start, self.minimum_reusable_offset = int(v[6]), int(v[5])
        if bool(v[7]):
            self.inner = TurboQuantKVCache.of(self.config)
            self.inner.state = (*v[:4], int(v[4]), *self.config.scalars())
        else:
            self.inner = _plain_cache({} if v[0] is None else {"keys": v[0], "values": v[1]})


class BatchedDelayedTurboQuantKVCache(_BaseCache):
    """A batch of delayed rows: a plain part and a converted part on one position axis."""

    def __init__(self, start: int, config: TurboQuantConfig, plain: KvTensorRows,
                 quantized: BatchedTurboQuantKVCache, converted: Sequence[bool],
                 boundaries: Sequence[int]) -> None:
        """Parts as described in the module doc; use `merge` to build from single rows."""
        if plain.idx != quantized.rows.idx or len(converted) != len(boundaries) or (
                sum(converted) != quantized.rows.num_rows
                or len(converted) - sum(converted) != plain.num_rows):
            raise ValueError("the plain and converted parts do not match the row flags")
        self.quantized_kv_start = start
        self.config = config
        self.plain = plain
        self.quantized = quantized
        self.converted = [bool(c) for c in converted]
        self.minimum_reusable_offsets = [int(b) for b in boundaries]

    def _rows(self, converted: bool) -> list[int]:
        return [i for i, c in enumerate(self.converted) if c == converted]

    def _per_row(self, plain: Sequence[int], quantized: Sequence[int]) -> list[int]:
        parts = (iter(plain), iter(quantized))
        return [next(parts[c]) for c in self.converted]

    def offsets(self) -> list[int]:
        """Tokens held per row."""
        return self._per_row(self.plain.offsets, self.quantized.rows.offsets)

    @property
    def offset(self) -> mx.array:
        """Tokens held per row (int32 array)."""
        return mx.array(self.offsets(), dtype=mx.int32)

    @property
    def left_padding(self) -> mx.array:
        """Physical left padding per row (int32 array)."""
        return mx.array(self._per_row(self.plain.left_padding, self.quantized.rows.left_padding),
                        dtype=mx.int32)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        """Causal mask over the shared positions, hiding each row's padding."""
        return create_causal_mask(N, offset=self.plain.idx, left_padding=self.left_padding,
                                  **kwargs)

    def _convert_due(self) -> None:
        due = [i for i, off in enumerate(self.offsets())
               if not self.converted[i] and off >= self.quantized_kv_start]
        for i in due:
            slot = self._rows(False).index(i)
            row = _convert(_plain_cache(self.plain.extract(slot)), self.config)
            self.plain.take([s for s in range(self.plain.num_rows) if s != slot])
            self.quantized.rows.extend(row.rows)
            self.converted[i] = True
            self.minimum_reusable_offsets[i] = row.offset
            order = self._rows(True)
            held = [r for r in order if r != i] + [i]  # the new row sits last
            if held != order:
                self.quantized.rows.take([held.index(r) for r in order])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Fetched:
        """Convert due rows, append each row's block to its part, fetch for attention."""
        self._convert_due()
        plain_rows, quantized_rows = self._rows(False), self._rows(True)
        rotated: RotatedKV | None = None
        if quantized_rows:
            index = mx.array(quantized_rows, dtype=mx.int32)
            rotated = self.quantized.update_and_fetch(keys[index], values[index])[0]
        else:
            self.quantized.rows.pad_to(self.quantized.rows.idx + keys.shape[2])
        if plain_rows:
            index = mx.array(plain_rows, dtype=mx.int32)
            self.plain.append({"keys": keys[index], "values": values[index]})
        else:
            self.plain.pad_to(self.plain.idx + keys.shape[2])
        if rotated is None:
            planes = self.plain.valid_planes()
            return planes["keys"], planes["values"]
        if not plain_rows:
            return rotated, rotated
        planes = self.plain.valid_planes()
        mixed = MixedRowsKV(plain_rows=tuple(plain_rows), plain_keys=planes["keys"],
                            plain_values=planes["values"], rotated_rows=tuple(quantized_rows),
                            rotated=rotated)
        return mixed, mixed

    @classmethod
    def merge(cls, caches: Sequence[DelayedTurboQuantKVCache]) -> BatchedDelayedTurboQuantKVCache:
        """One batch of single delayed rows, right-aligned (shorter rows left-padded)."""
        if not caches:
            raise ValueError("merge needs at least one cache")
        first = caches[0]
        for c in caches:
            if (c.config, c.quantized_kv_start) != (first.config, first.quantized_kv_start):
                raise ValueError("cannot merge delayed caches with different settings")
        target = max(c.offset for c in caches)
        plain = [KvTensorRows.from_planes(_plain_planes(c.plain))
                 for c in caches if c.plain is not None]
        quantized = [c.quantized.rows for c in caches if c.quantized is not None]
        parts = [KvTensorRows.merge(p) if p else KvTensorRows([]) for p in (plain, quantized)]
        for part in parts:
            part.pad_to(target)
        return cls(first.quantized_kv_start, first.config, parts[0],
                   BatchedTurboQuantKVCache.of(first.config, parts[1]),
                   [c.converted for c in caches], [c.minimum_reusable_offset for c in caches])

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep the given rows in that order (in place); shift away shared padding."""
        keep = row_indices(batch_indices)
        if any(i not in range(len(self.converted)) for i in keep):
            raise ValueError(f"row indices {keep} outside 0..{len(self.converted) - 1}")
        for flag, part in ((False, self.plain), (True, self.quantized.rows)):
            slots = {row: slot for slot, row in enumerate(self._rows(flag))}
            part.take([slots[i] for i in keep if self.converted[i] == flag])
        self.converted = [self.converted[i] for i in keep]
        self.minimum_reusable_offsets = [self.minimum_reusable_offsets[i] for i in keep]
        shared = min(self._per_row(self.plain.left_padding, self.quantized.rows.left_padding),
                     default=0)
        shared = min(shared, self.plain.idx, self.quantized.rows.idx)  # written positions only
        self.plain.unpad(shared)
        self.quantized.rows.unpad(shared)

    def extend(self, other: BatchedDelayedTurboQuantKVCache) -> None:
        """Append other's rows (in place); both parts stay aligned."""
        if (other.config, other.quantized_kv_start) != (self.config, self.quantized_kv_start):
            raise ValueError("cannot extend delayed caches with different settings")
        self.plain.extend(other.plain)
        self.quantized.extend(other.quantized)
        self.converted += other.converted
        self.minimum_reusable_offsets += other.minimum_reusable_offsets

    def extract(self, idx: int) -> DelayedTurboQuantKVCache:
        """Row idx as a single delayed row (its bytes, its boundary, same settings)."""
        slot = self._rows(self.converted[idx]).index(idx)
        inner: KVCache | TurboQuantKVCache
        if self.converted[idx]:
            inner = self.quantized.extract(slot)
        else:
            inner = _plain_cache(self.plain.extract(slot))
        return DelayedTurboQuantKVCache.of(self.quantized_kv_start, self.config, inner,
                                           self.minimum_reusable_offsets[idx])

    def trim(self, n: int) -> int:
        """Drop up to n positions of every row, never below any row's boundary."""
        room = [off - b for off, b in zip(self.offsets(), self.minimum_reusable_offsets)]
        n = max(0, min([n, *room]))
        self.plain.trim(n)
        self.quantized.trim(n)
        return n

    def trim_rows(self, amounts: Sequence[int]) -> None:
        """Drop the last amounts[i] positions of row i (speculative rollback), on encoded
        bytes. Contract: amounts[i] <= offset_i - minimum_reusable_offset_i (a converted
        row's boundary is never crossed), else ValueError and nothing changes. A plain row
        whose verify block crossed `quantized_kv_start` stays plain here and converts at
        its retained offset on the next append, so rejected tokens never set a boundary."""
        amounts = [int(a) for a in amounts]
        room = [off - b for off, b in zip(self.offsets(), self.minimum_reusable_offsets)]
        if len(amounts) != len(room) or any(not 0 <= a <= r for a, r in zip(amounts, room)):
            raise ValueError(f"cannot trim {amounts} from rows with room {room}")
        shared = min(amounts, default=0)
        self.plain.trim(shared)
        self.quantized.rows.trim(shared)
        for flag, part in ((False, self.plain), (True, self.quantized.rows)):
            part.shift_rows([amounts[i] - shared for i in self._rows(flag)])

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return self.plain.idx

    def empty(self) -> bool:
        return self.plain.empty and self.quantized.empty()

    @property
    def nbytes(self) -> int:
        """Allocated bytes of both parts."""
        return self.plain.nbytes + self.quantized.nbytes

    def prepare(self, *, left_padding: Sequence[int] | None = None,
                lengths: Sequence[int] | None = None,
                right_padding: Sequence[int] | None = None) -> None:
        """mlx-lm's batch prefill hook, split between the parts."""
        for flag, part in ((False, self.plain), (True, self.quantized.rows)):
            rows = self._rows(flag)
            part.prepare(
                left_padding=None if left_padding is None else [left_padding[i] for i in rows],
                right_padding=None if right_padding is None else [right_padding[i] for i in rows])

    def finalize(self) -> None:
        """Move right padding noted by `prepare` to the left, in both parts."""
        self.plain.finalize()
        self.quantized.finalize()

    @property
    def state(self) -> tuple[Any, ...]:
        plain = self.plain.valid_planes()
        return (plain.get("keys"), plain.get("values"), *self.quantized.state[:4],
                mx.array(self.converted, dtype=mx.int32),
                mx.array(self.minimum_reusable_offsets, dtype=mx.int32), self.left_padding,
                self.plain.idx, self.quantized_kv_start, *self.config.scalars())

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        config = TurboQuantConfig.from_scalars(v[11:])
        converted = [bool(c) for c in v[6].tolist()]
        padding, idx = v[8].tolist(), int(v[9])
        plain_padding = [p for p, c in zip(padding, converted) if not c]
        plain_planes = {} if v[0] is None else {"keys": v[0], "values": v[1]}
        plain = KvTensorRows.from_planes(plain_planes, plain_padding)
        plain.pad_to(idx)
        quantized = BatchedTurboQuantKVCache.of(config, KvTensorRows([]))
        quantized.state = (*v[2:6], mx.array([p for p, c in zip(padding, converted) if c]), idx,
                           *config.scalars())
        BatchedDelayedTurboQuantKVCache.__init__(
            self, int(v[10]), config, plain, quantized, converted, v[7].tolist())


def _plain_planes(plain: KVCache) -> dict[str, mx.array]:
    if plain.keys is None:
        return {}
    return {"keys": plain.keys[..., : plain.offset, :],
            "values": plain.values[..., : plain.offset, :]}
