"""Affine KV caches (mlx-lm's `kv_bits`) on mlx-lm's cache protocol: one row, and a batch.

Both store keys and values as `mx.quantize` planes of a `KvTensorRows` (the same bytes
mlx-lm's QuantizedKVCache holds): key_wq (uint32, head_dim*bits/32 words), key_scales and
key_biases (the input dtype, head_dim/group_size), and the same three for values. Each
cache exposes `bits` and `group_size`, so mlx-lm's `scaled_dot_product_attention`
dispatches to `quantized_scaled_dot_product_attention`, and `update_and_fetch` returns
what that expects: the written (wq, scales, biases) of keys and of values.

* `AffineKVCache` is one row (int `offset`, no padding), like QuantizedKVCache; a block
  with B > 1 rows is accepted while the cache is empty (they then share the offset).
  `AffineKVCache.from_kv_cache` converts a plain mlx-lm KVCache.
* `BatchedAffineKVCache` is a batch (per-row `offset` and `left_padding` arrays) like
  BatchKVCache; `AffineKVCache.merge` returns it (prefill groups; the decode batch keeps
  rows in slots instead: `AffineSlotsKVCache`, quant_slots.py). Its mask hides each row's left padding
  (quantized attention takes boolean masks of shape (B, 1, L, T)). merge, filter, extend,
  extract, trim, prepare and finalize move encoded bytes (KvTensorRows), so a row holds
  the same bytes serially and in any batch.

Caches with different bits or group sizes refuse to merge (ValueError). `state` is the six
planes of the written positions (None while empty), then single rows the offset, batches
the left_padding array and the write index, then bits and group_size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.kv.rows import (BatchRowsView, KvTensorRows, PlanesCache, SingleRowView,
                             row_indices)

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)
PLANES = ("key_wq", "key_scales", "key_biases", "value_wq", "value_scales", "value_biases")
Quantized = tuple[mx.array, mx.array, mx.array]


def check_affine_settings(bits: int, group_size: int) -> None:
    """ValueError unless bits is in KV_BITS and group_size in KV_GROUP_SIZES."""
    if type(bits) is not int or bits not in KV_BITS:
        raise ValueError(f"affine KV bits must be one of {KV_BITS}, got {bits!r}")
    if type(group_size) is not int or group_size not in KV_GROUP_SIZES:
        raise ValueError(f"affine KV group size must be one of {KV_GROUP_SIZES}, "
                         f"got {group_size!r}")


class _AffineCache(PlanesCache):
    """What one row and a batch share: bits, group size, the six planes, encode + append."""

    PLANES = PLANES

    def __init__(self, bits: int, group_size: int, rows: KvTensorRows) -> None:
        check_affine_settings(bits, group_size)
        self.bits = bits
        self.group_size = group_size
        self.rows = rows

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        """Quantize and append (B, H, L, D) keys and values; fetch all written ones."""
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"expected keys and values (B, H, L, D), got {keys.shape} "
                             f"and {values.shape}")
        for name, x in (("keys", keys), ("values", values)):
            if x.shape[-1] % self.group_size:
                raise ValueError(f"{name} head dim {x.shape[-1]} is not a multiple of "
                                 f"group size {self.group_size}")
        if self.rows.empty and keys.shape[0] != self.rows.num_rows:
            self._reshape_empty(keys.shape[0])
        encoded = (*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                   *mx.quantize(values, group_size=self.group_size, bits=self.bits))
        self.rows.append(dict(zip(PLANES, encoded)))
        return self.fetch()

    def _reshape_empty(self, num_rows: int) -> None:
        raise ValueError(f"a block of {num_rows} rows for a cache of {self.rows.num_rows}")

    def fetch(self) -> tuple[Quantized, Quantized]:
        """The written (wq, scales, biases) of keys and of values, (B, H, idx, W) each."""
        p = self.rows.valid_planes()
        return ((p["key_wq"], p["key_scales"], p["key_biases"]),
                (p["value_wq"], p["value_scales"], p["value_biases"]))

    def _check_same_settings(self, other: _AffineCache) -> None:
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError(f"cannot combine affine caches of bits/group size "
                             f"{self.bits}/{self.group_size} and {other.bits}/{other.group_size}")


class AffineKVCache(SingleRowView, _AffineCache):
    """One row of affine-quantized KV (see the module doc)."""

    def __init__(self, bits: int = 8, group_size: int = 64) -> None:
        """An empty row; bits in KV_BITS, group_size in KV_GROUP_SIZES (else ValueError)."""
        super().__init__(bits, group_size, KvTensorRows())

    @classmethod
    def from_kv_cache(cls, kv_cache: KVCache, bits: int, group_size: int) -> AffineKVCache:
        """Quantize the written K/V of a plain mlx-lm KVCache."""
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"expected an mlx-lm KVCache, got {type(kv_cache).__name__}")
        cache = cls(bits, group_size)
        cache.append_written(kv_cache)
        return cache

    @classmethod
    def merge(cls, caches: Sequence[_AffineCache]) -> BatchedAffineKVCache:
        """A batch of the rows of `caches` (shorter rows are left-padded)."""
        return BatchedAffineKVCache.merge(caches)

    @property
    def state(self) -> tuple[Any, ...]:
        """The six planes (or Nones), the offset, bits, group_size."""
        return (*self._planes_state(), self.offset, self.bits, self.group_size)

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        planes = self._planes_from(v[:6])
        _AffineCache.__init__(self, int(v[7]), int(v[8]), KvTensorRows.from_planes(planes))
        if self.rows.idx != int(v[6]):
            raise ValueError(f"state planes of {self.rows.idx} positions for offset {v[6]}")


class BatchedAffineKVCache(BatchRowsView, _AffineCache):
    """A batch of affine rows with per-row offsets and physical left padding."""

    def __init__(self, bits: int, group_size: int, left_padding: Sequence[int]) -> None:
        """Empty rows with `left_padding` (as BatchKVCache)."""
        super().__init__(bits, group_size, KvTensorRows(left_padding))

    @classmethod
    def merge(cls, caches: Sequence[_AffineCache]) -> BatchedAffineKVCache:
        """One batch of the rows of `caches` (single rows or batches), right-aligned."""
        if not caches:
            raise ValueError("merge needs at least one cache")
        for c in caches[1:]:
            caches[0]._check_same_settings(c)
        batch = cls.__new__(cls)
        _AffineCache.__init__(batch, caches[0].bits, caches[0].group_size,
                              KvTensorRows.merge([c.rows for c in caches]))
        return batch

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep the given rows in that order (in place); shift away shared padding."""
        self.rows.filter(row_indices(batch_indices))

    def extend(self, other: BatchedAffineKVCache) -> None:
        """Append other's rows (in place)."""
        self._check_same_settings(other)
        self.rows.extend(other.rows)

    def extract(self, idx: int) -> AffineKVCache:
        """Row idx as a single-row cache (its bytes, no padding)."""
        row = AffineKVCache(self.bits, self.group_size)
        row.rows = KvTensorRows.from_planes(self.rows.extract(idx))
        return row

    @property
    def state(self) -> tuple[Any, ...]:
        """The six planes (or Nones), left_padding, the write index, bits, group_size."""
        return (*self._planes_state(), self.left_padding, self.rows.idx, self.bits,
                self.group_size)

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        planes = self._planes_from(v[:6])
        padding = [int(p) for p in v[6].tolist()]
        _AffineCache.__init__(self, int(v[8]), int(v[9]),
                              KvTensorRows.from_planes(planes, padding))
        if planes and self.rows.idx != int(v[7]):
            raise ValueError(f"state planes of {self.rows.idx} positions for index {v[7]}")
        self.rows.pad_to(int(v[7]))  # rows never written only carry their write index
