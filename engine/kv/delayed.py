"""Delayed TurboQuant KV: rows stay plain until `quantized_kv_start`, then convert.

One row (`DelayedTurboQuantKVCache`) holds a plain mlx-lm KVCache (keys and values in the
model dtype) until its offset reaches `quantized_kv_start`; the NEXT append first converts
it through `TurboQuantKVCache.from_kv_cache`, then encodes as TurboQuant from then on. A
block that crosses the threshold is appended (and attended) plain, so the conversion
happens at the actual offset after that block. The offset at conversion is the row's
`minimum_reusable_offset`, an irreversible precision boundary (0 while the row is plain):
`trim` is CLAMPED so the offset never goes below it (trim returns how many positions it
really dropped, as mlx-lm's trim does); extract, slot batches, deepcopy and `state` keep it.

Batches (prefill groups, the decode batch) keep delayed rows in slots:
`DelayedTurboQuantSlotsKVCache` (delayed_slots.py), a plain and a converted slot part;
its `extract(i)` gives row i back as a DelayedTurboQuantKVCache with the same bytes and
boundary.

The decode path and the codec settings are one TurboQuantConfig per cache,
resolved at construction and carried by every copy, slot batch and extraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from tqserve.engine.codec.turboquant import DEFAULT_ROTATION
from tqserve.engine.kv.turboquant import TurboQuantConfig, TurboQuantKVCache

Fetched = tuple[Any, Any]


def _convert(plain: KVCache, config: TurboQuantConfig) -> TurboQuantKVCache:
    return TurboQuantKVCache.from_kv_cache(
        plain, config.k_bits, config.v_bits, head_dim=config.head_dim, seed=config.seed,
        rotation=config.rotation, decode=config.decode)


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
                 decode: str = "auto") -> None:
        """An empty row; `decode` is its TurboQuant decode path (engine/kv/turboquant.py)."""
        if quantized_kv_start < 0:
            raise ValueError(f"quantized_kv_start must be >= 0, got {quantized_kv_start}")
        self.config = TurboQuantConfig.create(k_bits, v_bits, head_dim, seed, rotation,
                                              decode)
        self.quantized_kv_start = quantized_kv_start
        self.inner: KVCache | TurboQuantKVCache = KVCache()
        self.minimum_reusable_offset = 0

    @classmethod
    def of(cls, start: int, config: TurboQuantConfig, inner: KVCache | TurboQuantKVCache,
           minimum_reusable_offset: int) -> DelayedTurboQuantKVCache:
        """A row holding `inner` (plain, or converted with its boundary)."""
        cache = cls(start, config.k_bits, config.v_bits, config.head_dim, config.seed,
                    config.rotation, config.decode)
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


def _plain_planes(plain: KVCache) -> dict[str, mx.array]:
    if plain.keys is None:
        return {}
    return {"keys": plain.keys[..., : plain.offset, :],
            "values": plain.values[..., : plain.offset, :]}
