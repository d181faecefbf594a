"""Affine KV (mlx-lm's `kv_bits`): a codec of the slot caches (engine/kv/slot_cache.py).

Keys and values are stored as `mx.quantize` planes of a `SlotRows` (the same bytes
mlx-lm's QuantizedKVCache holds): key_wq (uint32, head_dim*bits/32 words), key_scales and
key_biases (the input dtype, head_dim/group_size), and the same three for values. Each
cache exposes `bits` and `group_size`, so mlx-lm's `scaled_dot_product_attention`
dispatches to `quantized_scaled_dot_product_attention`, and `update_and_fetch` returns
what that expects: the (wq, scales, biases) of keys and of values up to the longest row.

`AffineSlotsKVCache` is the batch (prefill groups, the decode batch); `AffineKVCache` is
the same class seen as one sequence (`OneRow`), like QuantizedKVCache, and what a batch's
`extract(i)` gives, with the same bytes; `from_kv_cache` converts a plain mlx-lm KVCache.
The settings (`AffineSettings`: bits and group_size) come from the first row that joins a
batch and must match every later one (ValueError); `state` ends with bits and group_size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.kv.slot_cache import OneRow, SlotsCache
from tqserve.engine.kv.slot_rows import Planes

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


@attrs.frozen
class AffineSettings:
    """Bits and group size of an affine cache (validated: `check_affine_settings`)."""

    bits: int
    group_size: int

    def __attrs_post_init__(self) -> None:
        check_affine_settings(self.bits, self.group_size)

    def scalars(self) -> tuple[int, int]:
        """The fields in `state` order."""
        return self.bits, self.group_size

    @classmethod
    def from_scalars(cls, values: Sequence[Any]) -> AffineSettings:
        """Inverse of `scalars`."""
        bits, group_size = values
        return cls(int(bits), int(group_size))


class AffineSlotsKVCache(SlotsCache):
    """A batch of affine-quantized rows in slots (module doc)."""

    KIND = "affine"
    PLANES = PLANES
    SETTINGS = AffineSettings
    settings: AffineSettings | None

    @property
    def bits(self) -> int | None:
        """Bits per quantized element (None until a row joins)."""
        return None if self.settings is None else self.settings.bits

    @property
    def group_size(self) -> int | None:
        """Elements per scale and bias (None until a row joins)."""
        return None if self.settings is None else self.settings.group_size

    def encode(self, keys: mx.array, values: mx.array) -> Planes:
        """`mx.quantize` of keys and values: (wq, scales, biases) each."""
        bits, group_size = self._settings().scalars()
        for name, x in (("keys", keys), ("values", values)):
            if x.shape[-1] % group_size:
                raise ValueError(f"{name} head dim {x.shape[-1]} is not a multiple of "
                                 f"group size {group_size}")
        return dict(zip(PLANES, (*mx.quantize(keys, group_size=group_size, bits=bits),
                                 *mx.quantize(values, group_size=group_size, bits=bits))))

    def fetched(self) -> tuple[Quantized, Quantized]:
        """The (wq, scales, biases) of keys and of values up to the longest row."""
        p = self.slots.fetch()
        return ((p["key_wq"], p["key_scales"], p["key_biases"]),
                (p["value_wq"], p["value_scales"], p["value_biases"]))


class AffineKVCache(OneRow, AffineSlotsKVCache):  # type: ignore[misc]  # int offset
    """One row of affine-quantized KV: the slot class seen as one sequence (module doc)."""

    settings: AffineSettings  # always set: a row is made with its settings
    bits: int
    group_size: int

    def __init__(self, bits: int = 8, group_size: int = 64) -> None:
        """An empty row; bits in KV_BITS, group_size in KV_GROUP_SIZES (else ValueError)."""
        super().__init__(AffineSettings(bits, group_size))

    @classmethod
    def from_kv_cache(cls, kv_cache: KVCache, bits: int, group_size: int) -> AffineKVCache:
        """Quantize the written K/V of a plain mlx-lm KVCache."""
        return cls.converted(kv_cache, AffineSettings(bits, group_size))


AffineSlotsKVCache.ROW = AffineKVCache
