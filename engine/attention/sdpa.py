"""Rotated-query / rotated-value attention over TurboQuant KV, and its mlx-lm dispatch.

TurboQuant caches store keys and values in the rotated basis (codes of R x / ||x|| and
fp16 norms). For one head with query q, keys k_j and values v_j:

    score_j = <q, k_j> = <R q, R k_j>        (R orthogonal), so the query is rotated once
    out     = sum_j p_j v_j = R^T sum_j p_j (R v_j)

so keys are never inverse-rotated and R^T is applied ONCE, to the attention output.

What a TurboQuant cache's `update_and_fetch` returns is a `RotatedKV` (the encoded planes
plus the codecs that carry R and the decode path), as both of the (keys, values)
pair mlx-lm models pass on. `install_attention()` wraps mlx-lm's
`scaled_dot_product_attention` and dispatches on that object, not on the `cache` argument:
a Gemma-style KV-shared layer calls attention with its donor's (keys, values) and
cache=None, and because the transform travels with the fetched object it still gets the
rotated port. On MLX's CUDA backend affine-quantized caches go to `affine_sdpa` (mlx-lm's
quantized attention has no kernel there); other affine caches go to mlx-lm's own
quantized attention, and plain K/V to `sdpa` (the fused op, as mlx-lm's own path, but
short query blocks on MLX-CUDA, such as speculative verify steps, take
`short_block_attention`: cuDNN builds a graph per shape).
A delayed batch with plain and converted rows returns a `MixedRowsKV`: each group of rows
is attended separately and the outputs are put back in batch order.

Decode paths (query length 1), selected per cache by its `decode` (DECODE_PATHS, set by
`--kv turboquant:...,decode=PATH`):
* "unfused": decode the rotated planes with the codec, `mx.fast.scaled_dot_product_attention`
  on the rotated query, unrotate. Every prefill (query length > 1) takes this path.
* "auto" (the default): on MLX's CUDA backend the kernels of engine/attention/cuda_decode.py
  (for shapes that fit; their encode kernel too), elsewhere the compiled path.
* "compiled": one `mx.compile`d function does unpack, centroid lookup,
  scaled scores, mask, softmax and the value sum in float32. It is compiled per
  (bits, mask kind) and per shape (shapeless compile gave wrong results on MLX 0.32.4 when
  the key length changed); the CPU backend reuses its generated kernels across shapes.
Both compute in float32; on the CPU backend they were bitwise equal in every case measured
(bits 1..8, 1..700 keys, batches with padding); the unit test allows 1e-5 absolute.
Attention sinks are refused (ValueError), as mlx-lm's quantized attention does.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from tqserve.engine.codec.turboquant import EncodedVectors, TurboQuantCodec, lloyd_max_codebook
from tqserve.engine.attention import cuda_decode

DECODE_PATHS = ("auto", "compiled", "unfused")  # a TurboQuant cache's decode (module doc)
_ORIGINAL = "_tqserve_original"
_NAME = "scaled_dot_product_attention"
_MASKED = mx.finfo(mx.float32).min  # a masked score, as the fused op's (short_block_attention)


@attrs.frozen(eq=False, kw_only=True)
class RotatedKV:
    """What a TurboQuant cache fetches: rotated-basis planes (B, H, T_alloc, W), the codecs,
    and which positions are written: [0, ends[b]) for row b (every row is left-aligned:
    a single row ends at `length`, a slot batch's rows at their own lengths,
    engine/kv/turboquant.py).

    The planes are the cache's whole allocation, so the fused decode sees a shape that
    changes only when the cache grows (every 256 positions) and its compiled graph is
    reused; the plain path slices to `length`."""

    key_codes: mx.array
    key_norms: mx.array
    value_codes: mx.array
    value_norms: mx.array
    key_codec: TurboQuantCodec
    value_codec: TurboQuantCodec
    decode: str  # one of DECODE_PATHS
    length: int  # the longest row's end
    ends: tuple[int, ...]

    def written(self) -> tuple[mx.array, ...]:
        """Views of the written positions of the four planes."""
        n = self.length
        return tuple(a[:, :, :n] for a in (self.key_codes, self.key_norms, self.value_codes,
                                           self.value_norms))

    def decode_rotated(self) -> tuple[mx.array, mx.array]:
        """Transient float32 keys and values (written positions) in the rotated basis."""
        key_codes, key_norms, value_codes, value_norms = self.written()
        keys = self.key_codec.decode_rotated(EncodedVectors(key_codes, key_norms))
        values = self.value_codec.decode_rotated(EncodedVectors(value_codes, value_norms))
        return keys, values


@attrs.frozen(eq=False, kw_only=True)
class MixedRowsKV:
    """A batch whose rows `plain_rows` hold plain K/V and rows `rotated_rows` TurboQuant,
    each listed in the order of its part's rows (a part without rows holds None)."""

    plain_rows: tuple[int, ...]
    plain_keys: mx.array | None
    plain_values: mx.array | None
    rotated_rows: tuple[int, ...]
    rotated: RotatedKV | None


@functools.cache
def _unpack_tables(head_dim: int, bits: int) -> tuple[mx.array, ...]:
    """Centroids and, per coordinate, the two words its code spans and its bit shift."""
    start = np.arange(head_dim) * bits
    low = start // 32
    high = np.minimum(low + 1, head_dim * bits // 32 - 1)
    centroids = lloyd_max_codebook(head_dim, bits).centroids
    return (mx.array(centroids, dtype=mx.float32), mx.array(low, dtype=mx.uint32),
            mx.array(high, dtype=mx.uint32), mx.array(start % 32, dtype=mx.uint64))


def _lookup(words: mx.array, norms: mx.array, bits: int, centroids: mx.array,
            low: mx.array, high: mx.array, shift: mx.array) -> mx.array:
    """norm * centroid[code] for packed (..., W) words.

    Where `bits` divides 32 every code sits inside one word: word w holds coordinates
    w*(32/bits)... at shifts 0, bits, ..., read with shifts alone. Other widths read each
    code from the 64-bit pair (high:low) of the words it spans."""
    if 32 % bits == 0:
        per_word = 32 // bits
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        codes = (words[..., None] >> shifts) & ((1 << bits) - 1)
        codes = codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)
    else:
        pair = (mx.take(words, high, axis=-1).astype(mx.uint64) << 32) | mx.take(
            words, low, axis=-1).astype(mx.uint64)
        codes = (pair >> shift) & ((1 << bits) - 1)
    return mx.take(centroids, codes.astype(mx.uint32)) * norms.astype(mx.float32)


@functools.cache
def _fused_decode(k_bits: int, v_bits: int) -> Callable[..., mx.array]:
    def attend(q: mx.array, key_codes: mx.array, key_norms: mx.array, value_codes: mx.array,
               value_norms: mx.array, key_tables: tuple[mx.array, ...],
               value_tables: tuple[mx.array, ...], end: mx.array) -> mx.array:
        keys = _lookup(key_codes, key_norms, k_bits, *key_tables)
        values = _lookup(value_codes, value_norms, v_bits, *value_tables)
        scores = q @ keys.swapaxes(-1, -2)
        positions = mx.arange(key_codes.shape[2])
        valid = positions < end[:, None]
        scores = mx.where(valid[:, None, None, :], scores, _MASKED)
        return mx.softmax(scores, axis=-1, precise=True) @ values

    return mx.compile(attend)


_FUSED_GRANULE = 64  # positions: the fused decode's key length is rounded up to this


def _plain_attention(queries: mx.array, kv: RotatedKV, scale: float, mask: Any) -> mx.array:
    keys, values = kv.decode_rotated()
    rotated = kv.key_codec.rotate(queries.astype(mx.float32))
    out = sdpa(rotated, keys, values, scale=scale, mask=mask)
    return kv.value_codec.unrotate(out).astype(queries.dtype)


# Query blocks of at most this many positions (speculative verify blocks: 1 + k <= 17;
# the tails of chunked prefills) attend with plain ops on MLX's CUDA backend.
SHORT_BLOCK = 32


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
         mask: Any = None, sinks: Any = None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`, except for short query blocks on MLX's CUDA
    backend (2..SHORT_BLOCK positions, no sinks): there the fast op takes cuDNN's SDPA,
    whose graphs are built per (query, key, value) shape, and a verify block's keys grow
    every step, so every verify step paid a graph build (the H200 measured verify steps at
    12-66 tok/s against 400-660 tok/s plain). `short_block_attention` has no per-shape
    build; single positions keep MLX's vector kernel, long blocks cuDNN."""
    if sinks is None and 1 < queries.shape[2] <= SHORT_BLOCK and on_cuda():
        return short_block_attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask,
                                                sinks=sinks)


def short_block_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                          mask: Any) -> mx.array:
    """Attention of L query positions (the LAST L of the key span, as in a cache) with
    plain ops: GQA by reshaping the queries per KV head, `mask` None, "causal", boolean
    (True = attend) or additive, softmax in float32.

    A masked-out score is the float32 minimum, not -inf, as in the fused op: a query
    position with every key masked then attends uniformly and stays finite. With -inf its softmax is NaN, the next layer
    stores NaN K/V at the padding positions, and 0 * NaN poisons every real position of
    that row (the MLX-CUDA batched-prefill defect: first tokens of unequal prompts wrong)."""
    batch, num_heads, length, head_dim = queries.shape
    num_kv_heads, span = keys.shape[1], keys.shape[2]
    groups = num_heads // num_kv_heads
    q = (queries * scale).reshape(batch, num_kv_heads, groups, length, head_dim)
    scores = (q @ keys[:, :, None].swapaxes(-1, -2)).astype(mx.float32)  # (B, Hkv, G, L, T)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        allowed = (mx.arange(span)[None] <= (span - length + mx.arange(length))[:, None])
        scores = mx.where(allowed, scores, _MASKED)
    elif mask is not None:
        m = mask.reshape(mask.shape[0], -1, 1, *mask.shape[-2:]) if mask.ndim == 4 else mask
        scores = mx.where(m, scores, _MASKED) if m.dtype == mx.bool_ else scores + m
    probs = mx.softmax(scores, axis=-1).astype(values.dtype)
    out = probs @ values[:, :, None]                                        # (B, Hkv, G, L, D)
    return out.reshape(batch, num_heads, length, values.shape[-1])


def _fused_attention(queries: mx.array, kv: RotatedKV, scale: float) -> mx.array:
    """Decode attention; the mask is rebuilt from the rows' written ranges (for one query
    position after every written one, the causal mask is exactly that range)."""
    batch, num_heads, _, head_dim = queries.shape
    num_kv_heads = kv.key_codes.shape[1]
    repeats = num_heads // num_kv_heads
    if kv.decode == "auto" and cuda_decode.available(head_dim, repeats):
        return cuda_decode.decode_attention(queries, kv, scale)
    rotated = kv.key_codec.rotate(queries.astype(mx.float32)) * scale
    rotated = rotated.reshape(batch, num_kv_heads, repeats, head_dim)
    span = min(kv.key_codes.shape[2], -(-kv.length // _FUSED_GRANULE) * _FUSED_GRANULE)
    key_codes, key_norms, value_codes, value_norms = (
        a[:, :, :span] for a in (kv.key_codes, kv.key_norms, kv.value_codes, kv.value_norms))
    attend = _fused_decode(kv.key_codec.bits, kv.value_codec.bits)
    out = attend(rotated, key_codes, key_norms, value_codes, value_norms,
                 _unpack_tables(head_dim, kv.key_codec.bits),
                 _unpack_tables(head_dim, kv.value_codec.bits),
                 mx.array(kv.ends, dtype=mx.int32))
    out = out.reshape(batch, num_heads, 1, head_dim)
    return kv.value_codec.unrotate(out).astype(queries.dtype)


def _rows_of(x: Any, index: mx.array, num_rows: int, width: int) -> Any:
    """Rows `index` of a per-row mask, its key axis cut to `width` (a part of a slot batch
    holds only as many positions as its own longest row: the positions cut are beyond
    every one of its rows); masks that broadcast over the batch keep their rows."""
    if not isinstance(x, mx.array) or x.ndim != 4:
        return x
    if x.shape[0] == num_rows > 1:
        x = x[index]
    return x[..., :width]


def _mixed_attention(queries: mx.array, kv: MixedRowsKV, scale: float, mask: Any) -> mx.array:
    num_rows = queries.shape[0]
    outputs = []
    if kv.plain_rows:
        assert kv.plain_keys is not None and kv.plain_values is not None
        index = mx.array(kv.plain_rows, dtype=mx.int32)
        outputs.append(mx.fast.scaled_dot_product_attention(
            queries[index], kv.plain_keys, kv.plain_values, scale=scale,
            mask=_rows_of(mask, index, num_rows, kv.plain_keys.shape[2])))
    if kv.rotated_rows:
        assert kv.rotated is not None
        index = mx.array(kv.rotated_rows, dtype=mx.int32)
        outputs.append(turboquant_sdpa(
            queries[index], kv.rotated, scale,
            _rows_of(mask, index, num_rows, kv.rotated.length)))
    order = np.argsort(np.array(kv.plain_rows + kv.rotated_rows))
    return mx.concatenate(outputs)[mx.array(order, dtype=mx.int32)]


def turboquant_sdpa(queries: mx.array, cache_state: RotatedKV | MixedRowsKV, scale: float,
                    mask: Any) -> mx.array:
    """Attention of (B, n_heads, L, D) queries over a TurboQuant cache's fetched state.

    `mask` is what mlx-lm passes: None, "causal", a boolean mask or an additive one.
    Decode (L == 1) takes the cache's decode path (module doc); prefill the unfused one.
    """
    if isinstance(cache_state, MixedRowsKV):
        return _mixed_attention(queries, cache_state, scale, mask)
    if queries.shape[-1] != cache_state.key_codec.head_dim:
        raise ValueError(f"queries of dim {queries.shape[-1]} for a cache of head_dim "
                         f"{cache_state.key_codec.head_dim}")
    if cache_state.decode != "unfused" and queries.shape[2] == 1:
        return _fused_attention(queries, cache_state, scale)
    return _plain_attention(queries, cache_state, scale, mask)


def on_cuda() -> bool:
    """True when MLX's default device is a GPU of its CUDA backend."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu)


def affine_sdpa(queries: mx.array, keys: tuple[mx.array, ...], values: tuple[mx.array, ...],
                scale: float, mask: Any, group_size: int, bits: int) -> mx.array:
    """Attention over affine-quantized (wq, scales, biases) K/V by dequantizing them
    transiently and calling the fused SDPA: what `--kv-quant` uses on MLX's CUDA backend,
    whose `quantized_matmul` has no kernel for mlx-lm's quantized attention shapes
    ("No implementation for problem shape"). Same math as mlx-lm's path."""
    (kq, ks, kb), (vq, vs, vb) = keys, values
    k = mx.dequantize(kq, ks, kb, group_size=group_size, bits=bits)
    v = mx.dequantize(vq, vs, vb, group_size=group_size, bits=bits)
    return sdpa(queries, k.astype(queries.dtype), v.astype(queries.dtype), scale=scale,
                mask=mask)


def _dispatching(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries: mx.array, keys: Any, values: Any, cache: Any,
                                     scale: float, mask: Any, sinks: Any = None) -> mx.array:
        if isinstance(keys, (RotatedKV, MixedRowsKV)):
            if sinks is not None:
                raise ValueError("TurboQuant attention does not support attention sinks")
            return turboquant_sdpa(queries, keys, scale, mask)
        if sinks is None and hasattr(cache, "bits") and isinstance(keys, tuple) and on_cuda():
            return affine_sdpa(queries, keys, values, scale, mask, cache.group_size,
                               cache.bits)
        if not hasattr(cache, "bits"):  # mlx-lm's own path for these: the fused op
            return sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                        sinks=sinks)

    setattr(scaled_dot_product_attention, _ORIGINAL, original)
    return scaled_dot_product_attention


def install_attention() -> None:
    """Route mlx-lm attention over TurboQuant state to `turboquant_sdpa`, and over affine
    caches on MLX's CUDA backend to `affine_sdpa` (idempotent).

    Replaces `mlx_lm.models.base.scaled_dot_product_attention` (model modules imported
    later bind the wrapper) and the copy bound in every `mlx_lm.models.*` module already
    imported; a module whose name is bound to some other function is left alone.
    """
    from mlx_lm.models import base

    current = base.scaled_dot_product_attention
    original = getattr(current, _ORIGINAL, current)
    wrapper = current if original is not current else _dispatching(original)
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and module is not None and vars(module).get(
                _NAME) is original:
            vars(module)[_NAME] = wrapper
