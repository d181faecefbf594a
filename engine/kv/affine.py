"""Affine KV (mlx-lm's `kv_bits`) on mlx-lm's cache protocol: a batch in slots, one row.

Keys and values are stored as `mx.quantize` planes of a `SlotRows` (the same bytes
mlx-lm's QuantizedKVCache holds): key_wq (uint32, head_dim*bits/32 words), key_scales and
key_biases (the input dtype, head_dim/group_size), and the same three for values. Each
cache exposes `bits` and `group_size`, so mlx-lm's `scaled_dot_product_attention`
dispatches to `quantized_scaled_dot_product_attention`, and `update_and_fetch` returns
what that expects: the (wq, scales, biases) of keys and of values up to the longest row.

* `AffineSlotsKVCache` is the batch (prefill groups, the decode batch): row i in slot i
  at its own length; `extend` writes only the joining rows, `filter` moves at most one
  row per retirement, `trim_rows` lowers lengths.
* `AffineKVCache` is the same class seen as one sequence (`OneRow`,
  engine/kv/slot_cache.py), like QuantizedKVCache; `from_kv_cache` converts a plain
  mlx-lm KVCache. A batch's `extract(i)` is row i as an AffineKVCache with the same bytes.

Settings come from the first row that joins a batch and must match every later one
(ValueError). A row's `state` is the six planes of the written positions (None while
empty), the offset, then bits and group_size; a batch's is the planes up to its longest
row, the lengths array, bits, group_size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.kv.slot_cache import OneRow, SlotsCache
from tqserve.engine.kv.slot_rows import SlotRows

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


class AffineSlotsKVCache(SlotsCache):
    """A batch of affine-quantized rows in slots (module doc)."""

    def __init__(self, bits: int | None = None, group_size: int | None = None) -> None:
        """Empty; the settings are taken from the first row that joins, unless given."""
        self.bits = bits
        self.group_size = group_size
        self.slots = SlotRows()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        """Quantize (rows, H, L, D) keys and values, write each row at its length; fetch
        the (wq, scales, biases) of keys and of values up to the longest row."""
        if keys.ndim != 4 or values.shape[:3] != keys.shape[:3] or keys.shape[0] != self.num_rows:
            raise ValueError(f"expected keys and values ({self.num_rows}, H, L, D), got "
                             f"{keys.shape} and {values.shape}")
        if self.bits is None or self.group_size is None:
            raise ValueError("an affine slot batch without rows has no settings")
        encoded = (*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                   *mx.quantize(values, group_size=self.group_size, bits=self.bits))
        self.slots.append(dict(zip(PLANES, encoded)))
        p = self.slots.fetch()
        return ((p["key_wq"], p["key_scales"], p["key_biases"]),
                (p["value_wq"], p["value_scales"], p["value_biases"]))

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (an AffineKVCache or another affine slot batch): only
        their bytes are written."""
        if not isinstance(other, AffineSlotsKVCache):
            raise TypeError(f"a {type(other).__name__} cannot join an affine slot batch")
        settings = (other.bits, other.group_size)
        rows = [other.slots.row(i) for i in range(other.num_rows)]
        if self.bits is None:
            self.bits, self.group_size = settings
        elif settings != (self.bits, self.group_size):
            raise ValueError(f"cannot combine affine caches of bits/group size "
                             f"{self.bits}/{self.group_size} and {settings[0]}/{settings[1]}")
        self.slots.add_rows([r or None for r in rows])

    def extract(self, idx: int) -> AffineKVCache:
        """Row idx as a single-row AffineKVCache (a copy of its bytes)."""
        if self.bits is None or self.group_size is None:
            raise ValueError("an affine slot batch without rows has no settings")
        row = AffineKVCache(self.bits, self.group_size)
        row.slots = SlotRows.holding(self.slots.extract(idx))
        return row

    @property
    def state(self) -> tuple[Any, ...]:
        """The six planes up to the longest row (or Nones), lengths, bits, group_size."""
        return (*self._planes_state(PLANES), self.bits, self.group_size)

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        self._set_planes_state(PLANES, v)
        self.bits, self.group_size = int(v[7]), int(v[8])


class AffineKVCache(OneRow, AffineSlotsKVCache):  # type: ignore[misc]  # int offset
    """One row of affine-quantized KV: the slot class seen as one sequence (module doc)."""

    bits: int  # always set: a row is made with its settings
    group_size: int

    def __init__(self, bits: int = 8, group_size: int = 64) -> None:
        """An empty row; bits in KV_BITS, group_size in KV_GROUP_SIZES (else ValueError)."""
        check_affine_settings(bits, group_size)
        super().__init__(bits, group_size)
        self.slots = SlotRows.holding({})

    @classmethod
    def from_kv_cache(cls, kv_cache: KVCache, bits: int, group_size: int) -> AffineKVCache:
        """Quantize the written K/V of a plain mlx-lm KVCache."""
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"expected an mlx-lm KVCache, got {type(kv_cache).__name__}")
        cache = cls(bits, group_size)
        cache.append_written(kv_cache)
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        """Quantize and append (B, H, L, D) keys and values; fetch all written ones."""
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"expected keys and values (B, H, L, D), got {keys.shape} "
                             f"and {values.shape}")
        for name, x in (("keys", keys), ("values", values)):
            if x.shape[-1] % self.group_size:
                raise ValueError(f"{name} head dim {x.shape[-1]} is not a multiple of "
                                 f"group size {self.group_size}")
        self._open(keys.shape[0])
        return super().update_and_fetch(keys, values)

    @property
    def state(self) -> tuple[Any, ...]:
        """The six planes (or Nones), the offset, bits, group_size."""
        return (*self._row_planes(PLANES), self.offset, self.bits, self.group_size)

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        check_affine_settings(int(v[7]), int(v[8]))
        self.bits, self.group_size = int(v[7]), int(v[8])
        self.slots = self._holding(PLANES, v[:6], v[6])
