"""TurboQuant KV on mlx-lm's cache protocol: one row.

It stores, per KV head and position, the codes of R x / ||x|| and the fp16 norm for keys
AND values (the rotated basis; engine/codec/turboquant.py), as four planes of a
`KvTensorRows`: key_codes (uint32, d*k_bits/32 words), key_norms (fp16, 1), value_codes,
value_norms. `update_and_fetch` encodes the new block, appends it and returns a
`RotatedKV` (the written planes and the codecs) as both elements of the (keys, values)
pair; attention (engine/attention/sdpa.py) consumes it. No decoded copy is kept: decoding
happens transiently inside one attention call.

* `TurboQuantKVCache` is one row (int `offset`, no padding), like mlx-lm's KVCache; a
  block with B > 1 rows is accepted while the cache is empty (they then share the offset).
  `TurboQuantKVCache.from_kv_cache` is the one conversion from a plain mlx-lm KVCache.
* Batches (prefill groups, the decode batch) keep the same four planes per row in slots:
  `TurboQuantSlotsKVCache` (quant_slots.py), whose `extract(i)` gives row i back as a
  TurboQuantKVCache with the same bytes.

A cache's settings are a `TurboQuantConfig`. Its `fused_decode` is resolved ONCE, when a
cache is constructed without an explicit choice (TQSERVE_TURBOQUANT_FUSED_DECODE); slot
batches, extracted, converted and restored (`state`) caches carry the config, so the
selection never changes. Caches with different configs refuse to share a batch
(ValueError). `state` is (key_codes, key_norms, value_codes, value_norms) of the written
positions (None while empty), the offset, then the config fields (mlx-lm 0.32.2 has no
meta_state).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.codec.turboquant import DEFAULT_ROTATION, TurboQuantCodec
from tqserve.engine.attention import cuda_decode
from tqserve.engine.attention.sdpa import RotatedKV, fused_decode_from_env
from tqserve.engine.kv.rows import KvTensorRows, PlanesCache, SingleRowView

PLANES = ("key_codes", "key_norms", "value_codes", "value_norms")


@functools.cache
def _codec(head_dim: int, bits: int, seed: int, rotation: str) -> TurboQuantCodec:
    return TurboQuantCodec(head_dim, bits, seed=seed, rotation=rotation, norm_correction=True)


@attrs.frozen(kw_only=True)
class TurboQuantConfig:
    """Bits, head dim, rotation and the fused-decode selection of a TurboQuant cache."""

    k_bits: int
    v_bits: int
    head_dim: int
    seed: int
    rotation: str
    fused_decode: bool

    def __attrs_post_init__(self) -> None:
        for bits in (self.k_bits, self.v_bits):  # the codec raises ValueError on a bad field
            _codec(self.head_dim, bits, self.seed, self.rotation)

    @classmethod
    def create(cls, k_bits: int, v_bits: int, head_dim: int, seed: int = 0,
               rotation: str = DEFAULT_ROTATION,
               fused_decode: bool | None = None) -> TurboQuantConfig:
        """A validated config; `fused_decode` None reads TQSERVE_TURBOQUANT_FUSED_DECODE now."""
        fused = fused_decode_from_env() if fused_decode is None else fused_decode
        return cls(k_bits=k_bits, v_bits=v_bits, head_dim=head_dim, seed=seed,
                   rotation=rotation, fused_decode=fused)

    @property
    def key_codec(self) -> TurboQuantCodec:
        """The (shared) codec of the keys."""
        return _codec(self.head_dim, self.k_bits, self.seed, self.rotation)

    @property
    def value_codec(self) -> TurboQuantCodec:
        """The (shared) codec of the values."""
        return _codec(self.head_dim, self.v_bits, self.seed, self.rotation)

    def scalars(self) -> tuple[Any, ...]:
        """The fields in `state` order."""
        return (self.k_bits, self.v_bits, self.head_dim, self.seed, self.rotation,
                self.fused_decode)

    @classmethod
    def from_scalars(cls, values: Sequence[Any]) -> TurboQuantConfig:
        """Inverse of `scalars`."""
        k_bits, v_bits, head_dim, seed, rotation, fused = values
        return cls(k_bits=int(k_bits), v_bits=int(v_bits), head_dim=int(head_dim),
                   seed=int(seed), rotation=str(rotation), fused_decode=bool(fused))


class TurboQuantKVCache(SingleRowView, PlanesCache):
    """One row of TurboQuant KV (see the module doc)."""

    PLANES = PLANES

    def __init__(self, k_bits: int, v_bits: int, head_dim: int, seed: int = 0,
                 rotation: str = DEFAULT_ROTATION, fused_decode: bool | None = None) -> None:
        """`fused_decode` None reads TQSERVE_TURBOQUANT_FUSED_DECODE now, once."""
        self.config = TurboQuantConfig.create(k_bits, v_bits, head_dim, seed, rotation,
                                              fused_decode)
        self.rows = KvTensorRows()

    @classmethod
    def of(cls, config: TurboQuantConfig, rows: KvTensorRows | None = None) -> TurboQuantKVCache:
        """A cache with `config` holding `rows` (a fresh empty row by default)."""
        cache = cls.__new__(cls)
        cache.config = config
        cache.rows = rows if rows is not None else KvTensorRows()
        return cache

    @classmethod
    def from_kv_cache(cls, kv_cache: KVCache, k_bits: int, v_bits: int, *,
                      head_dim: int | None = None, seed: int = 0,
                      rotation: str = DEFAULT_ROTATION,
                      fused_decode: bool | None = None) -> TurboQuantKVCache:
        """Encode the written K/V of a plain mlx-lm KVCache (the one conversion path).

        `head_dim` defaults to the keys' last dim; an empty KVCache needs it given.
        """
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"expected an mlx-lm KVCache, got {type(kv_cache).__name__}")
        if kv_cache.keys is None and head_dim is None:
            raise ValueError("an empty KVCache converts only with head_dim given")
        dim = head_dim if head_dim is not None else kv_cache.keys.shape[-1]
        cache = cls(k_bits, v_bits, dim, seed=seed, rotation=rotation, fused_decode=fused_decode)
        cache.append_written(kv_cache)
        return cache

    @property
    def fused_decode(self) -> bool:
        """Whether decode steps take the fused attention path (fixed for this cache)."""
        return self.config.fused_decode

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[RotatedKV, RotatedKV]:
        """Encode and append (B, H, L, head_dim) keys and values; fetch all written ones."""
        d = self.config.head_dim
        if keys.ndim != 4 or keys.shape[-1] != d or values.shape != keys.shape:
            raise ValueError(f"expected keys and values (B, H, L, {d}), got "
                             f"{keys.shape} and {values.shape}")
        if self.rows.empty and keys.shape[0] != self.rows.num_rows:
            self._reshape_empty(keys.shape[0])
        key_codec, value_codec = self.config.key_codec, self.config.value_codec
        if cuda_decode.can_encode(key_codec, value_codec):
            k, v = cuda_decode.encode(keys, values, key_codec, value_codec)
        else:
            k, v = key_codec.encode(keys), value_codec.encode(values)
        self.rows.append({"key_codes": k.codes, "key_norms": k.norms,
                          "value_codes": v.codes, "value_norms": v.norms})
        fetched = self.fetch()
        return fetched, fetched

    def fetch(self) -> RotatedKV:
        """The allocated planes (B, H, T_alloc, W), the written range, and the codecs."""
        planes = self.rows.planes
        return RotatedKV(key_codes=planes["key_codes"], key_norms=planes["key_norms"],
                         value_codes=planes["value_codes"], value_norms=planes["value_norms"],
                         key_codec=self.config.key_codec,
                         value_codec=self.config.value_codec,
                         fused_decode=self.config.fused_decode, length=self.rows.idx,
                         ends=(self.rows.idx,) * self.rows.num_rows)

    @property
    def state(self) -> tuple[Any, ...]:
        return (*self._planes_state(), self.offset, *self.config.scalars())

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        self.config = TurboQuantConfig.from_scalars(v[5:])
        planes = self._planes_from(v[:4])
        if planes and next(iter(planes.values())).shape[2] != int(v[4]):
            raise ValueError(f"state planes of {next(iter(planes.values())).shape[2]} "
                             f"positions for offset {v[4]}")
        self.rows = KvTensorRows.from_planes(planes)
