"""TurboQuant KV on mlx-lm's cache protocol: a batch of rows in slots, and one row.

It stores, per KV head and position, the codes of R x / ||x|| and the fp16 norm for keys
AND values (the rotated basis; engine/codec/turboquant.py), as four planes of a
`SlotRows` (engine/kv/slot_rows.py): key_codes (uint32, d*k_bits/32 words), key_norms
(fp16, 1), value_codes, value_norms. `update_and_fetch` encodes the new block, writes each
row at its own length and returns a `RotatedKV` (the planes, the codecs, each row's end)
as both elements of the (keys, values) pair; attention (engine/attention/sdpa.py)
consumes it. No decoded copy is kept: decoding happens transiently inside one attention
call, and the fused decode (compiled ops, or the CUDA kernel) needs no mask.

`TurboQuantSlotsKVCache` is the batch (prefill groups, the decode batch), a codec of the
slot caches (engine/kv/slot_cache.py): rows join, leave and roll back with their encoded
bytes, never decoded. `TurboQuantKVCache` is the same class seen as one sequence
(`OneRow`): int `offset`, no padding, like mlx-lm's KVCache, and what a batch's
`extract(i)` gives, with the same bytes; `from_kv_cache` is the one conversion from a
plain mlx-lm KVCache. `write` (encode without fetch) and `fetch` serve the delayed
batch's converted part (engine/kv/delayed_slots.py).

A cache's settings are a `TurboQuantConfig` (`config`), its decode path included
(`decode`, one of engine.attention.sdpa.DECODE_PATHS, from `--kv
turboquant:...,decode=PATH`); slot batches, extracted, converted and restored (`state`)
caches carry the config, so the selection never changes. Caches with different configs
refuse to share a batch (ValueError). `state` ends with the config fields (mlx-lm 0.32.2
has no meta_state).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from tqserve.engine.attention import cuda_decode
from tqserve.engine.attention.sdpa import DECODE_PATHS, RotatedKV
from tqserve.engine.codec.turboquant import DEFAULT_ROTATION, TurboQuantCodec
from tqserve.engine.kv.slot_cache import OneRow, SlotsCache
from tqserve.engine.kv.slot_rows import Planes

PLANES = ("key_codes", "key_norms", "value_codes", "value_norms")


@functools.cache
def _codec(head_dim: int, bits: int, seed: int, rotation: str) -> TurboQuantCodec:
    return TurboQuantCodec(head_dim, bits, seed=seed, rotation=rotation, norm_correction=True)


@attrs.frozen(kw_only=True)
class TurboQuantConfig:
    """Bits, head dim, rotation and the decode path of a TurboQuant cache."""

    k_bits: int
    v_bits: int
    head_dim: int
    seed: int
    rotation: str
    decode: str

    def __attrs_post_init__(self) -> None:
        if self.decode not in DECODE_PATHS:
            raise ValueError(f"TurboQuant decode must be one of {', '.join(DECODE_PATHS)}, "
                             f"got {self.decode!r}")
        for bits in (self.k_bits, self.v_bits):  # the codec raises ValueError on a bad field
            _codec(self.head_dim, bits, self.seed, self.rotation)

    @classmethod
    def create(cls, k_bits: int, v_bits: int, head_dim: int, seed: int = 0,
               rotation: str = DEFAULT_ROTATION, decode: str = "auto") -> TurboQuantConfig:
        """A validated config (ValueError names the bad field)."""
        return cls(k_bits=k_bits, v_bits=v_bits, head_dim=head_dim, seed=seed,
                   rotation=rotation, decode=decode)

    @property
    def fused_decode(self) -> bool:
        """Whether decode steps take a fused path (compiled ops or the CUDA kernels)."""
        return self.decode != "unfused"

    @property
    def kernels(self) -> bool:
        """Whether the CUDA kernels may encode and attend (where they run)."""
        return self.decode == "auto"

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
                self.decode)

    @classmethod
    def from_scalars(cls, values: Sequence[Any]) -> TurboQuantConfig:
        """Inverse of `scalars`."""
        k_bits, v_bits, head_dim, seed, rotation, decode = values
        return cls(k_bits=int(k_bits), v_bits=int(v_bits), head_dim=int(head_dim),
                   seed=int(seed), rotation=str(rotation), decode=str(decode))


class TurboQuantSlotsKVCache(SlotsCache):
    """A batch of TurboQuant rows in slots (module doc)."""

    KIND = "TurboQuant"
    PLANES = PLANES
    SETTINGS = TurboQuantConfig
    settings: TurboQuantConfig | None

    @property
    def config(self) -> TurboQuantConfig | None:
        """The settings (None until a row joins an empty batch)."""
        return self.settings

    @config.setter
    def config(self, config: TurboQuantConfig | None) -> None:
        self.settings = config

    @property
    def fused_decode(self) -> bool:
        """Whether decode steps take the fused attention path (fixed by the config)."""
        return self.settings is not None and self.settings.fused_decode

    def encode(self, keys: mx.array, values: mx.array) -> Planes:
        """The codes and norms of (rows, H, L, head_dim) keys and values (the CUDA
        kernels encode where the config lets them and they run)."""
        config = self._settings()
        if keys.shape[-1] != config.head_dim or values.shape != keys.shape:
            raise ValueError(f"expected keys and values ({self.num_rows}, H, L, "
                             f"{config.head_dim}), got {keys.shape} and {values.shape}")
        key_codec, value_codec = config.key_codec, config.value_codec
        if config.kernels and cuda_decode.can_encode(key_codec, value_codec):
            k, v = cuda_decode.encode(keys, values, key_codec, value_codec)
        else:
            k, v = key_codec.encode(keys), value_codec.encode(values)
        return {"key_codes": k.codes, "key_norms": k.norms,
                "value_codes": v.codes, "value_norms": v.norms}

    def fetch(self) -> RotatedKV:
        """The rows' allocated planes (rows, H, T_alloc, W), rows [0, lengths[i])."""
        config = self._settings()
        planes = self.slots.planes()
        lengths = tuple(self.slots.lengths)
        return RotatedKV(**{n: planes[n] for n in PLANES}, key_codec=config.key_codec,
                         value_codec=config.value_codec, decode=config.decode,
                         length=max(lengths, default=0), ends=lengths)

    def fetched(self) -> tuple[RotatedKV, RotatedKV]:
        """A RotatedKV of the rows' allocated planes with their own ends, as keys and values."""
        rotated = self.fetch()
        return rotated, rotated


class TurboQuantKVCache(OneRow, TurboQuantSlotsKVCache):  # type: ignore[misc]  # int offset
    """One row of TurboQuant KV: the slot class seen as one sequence (module doc)."""

    settings: TurboQuantConfig  # always set: a row is made with its settings
    config: TurboQuantConfig

    def __init__(self, k_bits: int, v_bits: int, head_dim: int, seed: int = 0,
                 rotation: str = DEFAULT_ROTATION, decode: str = "auto") -> None:
        """An empty row; `decode` is its decode path (module doc)."""
        super().__init__(TurboQuantConfig.create(k_bits, v_bits, head_dim, seed, rotation,
                                                 decode))

    @classmethod
    def from_kv_cache(cls, kv_cache: KVCache, k_bits: int, v_bits: int, *,
                      head_dim: int | None = None, seed: int = 0,
                      rotation: str = DEFAULT_ROTATION,
                      decode: str = "auto") -> TurboQuantKVCache:
        """Encode the written K/V of a plain mlx-lm KVCache (the one conversion path).

        `head_dim` defaults to the keys' last dim; an empty KVCache needs it given.
        """
        if not isinstance(kv_cache, KVCache):
            raise TypeError(f"expected an mlx-lm KVCache, got {type(kv_cache).__name__}")
        if kv_cache.keys is None and head_dim is None:
            raise ValueError("an empty KVCache converts only with head_dim given")
        dim = head_dim if head_dim is not None else kv_cache.keys.shape[-1]
        return cls.converted(kv_cache, TurboQuantConfig.create(k_bits, v_bits, dim, seed,
                                                               rotation, decode))


TurboQuantSlotsKVCache.ROW = TurboQuantKVCache
