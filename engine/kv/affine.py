"""Affine KV (mlx-lm's `kv_bits`) on mlx-lm's cache protocol: one row.

`AffineKVCache` stores keys and values as `mx.quantize` planes of a `KvTensorRows` (the
same bytes mlx-lm's QuantizedKVCache holds): key_wq (uint32, head_dim*bits/32 words),
key_scales and key_biases (the input dtype, head_dim/group_size), and the same three for
values. Each cache exposes `bits` and `group_size`, so mlx-lm's `scaled_dot_product_attention`
dispatches to `quantized_scaled_dot_product_attention`, and `update_and_fetch` returns
what that expects: the written (wq, scales, biases) of keys and of values.

* `AffineKVCache` is one row (int `offset`, no padding), like QuantizedKVCache; a block
  with B > 1 rows is accepted while the cache is empty (they then share the offset).
  `AffineKVCache.from_kv_cache` converts a plain mlx-lm KVCache.
* Batches (prefill groups, the decode batch) keep the same planes per row in slots:
  `AffineSlotsKVCache` (quant_slots.py), whose `extract(i)` gives row i back as an
  AffineKVCache with the same bytes.

`state` is the six planes of the written positions (None while empty), the offset, then
bits and group_size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.kv.rows import KvTensorRows, PlanesCache, SingleRowView

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


class AffineKVCache(SingleRowView, PlanesCache):
    """One row of affine-quantized KV (see the module doc)."""

    PLANES = PLANES

    def __init__(self, bits: int = 8, group_size: int = 64) -> None:
        """An empty row; bits in KV_BITS, group_size in KV_GROUP_SIZES (else ValueError)."""
        check_affine_settings(bits, group_size)
        self.bits = bits
        self.group_size = group_size
        self.rows = KvTensorRows()

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
        if self.rows.empty and keys.shape[0] != self.rows.num_rows:
            self._reshape_empty(keys.shape[0])
        encoded = (*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                   *mx.quantize(values, group_size=self.group_size, bits=self.bits))
        self.rows.append(dict(zip(PLANES, encoded)))
        return self.fetch()

    def fetch(self) -> tuple[Quantized, Quantized]:
        """The written (wq, scales, biases) of keys and of values, (B, H, idx, W) each."""
        p = self.rows.valid_planes()
        return ((p["key_wq"], p["key_scales"], p["key_biases"]),
                (p["value_wq"], p["value_scales"], p["value_biases"]))

    @property
    def state(self) -> tuple[Any, ...]:
        """The six planes (or Nones), the offset, bits, group_size."""
        return (*self._planes_state(), self.offset, self.bits, self.group_size)

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        planes = self._planes_from(v[:6])
        check_affine_settings(int(v[7]), int(v[8]))
        self.bits, self.group_size = int(v[7]), int(v[8])
        self.rows = KvTensorRows.from_planes(planes)
        if self.rows.idx != int(v[6]):
            raise ValueError(f"state planes of {self.rows.idx} positions for offset {v[6]}")
