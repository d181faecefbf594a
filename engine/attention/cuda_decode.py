"""TurboQuant encode and decode attention as CUDA kernels (mx.fast.cuda_kernel).

Per layer and decode step the CUDA path launches two kernels, whatever the context:

* encode (`encode`): one block per new vector, keys and values in the same launch:
  normalize, randomized Hadamard rotation (shared-memory butterfly), nearest Lloyd-Max
  centroid (binary search over the boundaries), norm correction, bit packing. It replaces
  the codec's compiled graph (a dozen kernels per tensor on MLX-CUDA).
* attention (`decode_attention`): flash-decoding over the packed planes. Grid: (row x KV
  head, split); a block of 128 threads walks its split's positions in tiles of 128. The
  query rotation (Hadamard butterfly in shared memory) is done once per block, before the
  loop. Phase one: each thread takes one position, reads its key codes once and scores
  it against ALL query heads of the GQA group (queries in shared memory, so no
  cross-lane reduction per position); a block max per tile keeps the online softmax.
  Phase two: each thread owns output coordinates and sums the tile's values (codes
  unpacked in registers, centroids in shared memory). Each block writes its split's
  (max, sum, output); the last block of a (row, KV head) to finish (an atomic counter
  per (row, KV head), left at zero) merges the splits, applies the inverse rotation and
  writes the output in the query dtype, so no separate combine step runs. The counters
  are one module-level array per size, so two attention launches must never run at
  once: not on two streams, and not as independent nodes of one evaluated graph (MLX-CUDA
  may run those concurrently; measured: results corrupted). The engine never does
  either: every MLX op runs on the one runner thread, and a model's layers chain (each
  layer's query depends on the previous layer's output); tools/profile_kv chains its
  calls the same way.

The split count follows the context: about `_TARGET_BLOCKS` blocks in all, at least one
tile per split. Kernels compile once per (head dim, group, bits, dtype): positions, splits
and each row's (start, end) travel as one int32 array, so a growing context never recompiles;
engine.kv.factory's `warm_up_kernels` builds them at engine start. The math is the compiled
path's (scores
<R q, norm_k c[code_k]> * scale, values norm_v c[code_v] in the rotated basis, float32),
which stays the fallback and the reference it is tested against (tests/unit/test_kv_cuda.py).
Used only where `available()` (MLX's CUDA backend); the "qr" rotation keeps its rotations
as mx matmuls outside the kernels.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import mlx.core as mx
import numpy as np

from tqserve.engine.codec.turboquant import EncodedVectors, TurboQuantCodec, lloyd_max_codebook
from tqserve.engine.attention.cuda_sources import ATTEND_SOURCE, ENCODE_SOURCE, HEADER

logger = logging.getLogger(__name__)

_THREADS = 128  # threads per attention block = positions per tile
_TARGET_BLOCKS = 528  # 4 blocks per SM on an H100/H200 (132 SMs): the best of 132..2112 on the H200
# (docs/kv-cache.md, "Speed": 32k, one row: 138 us per call against 155 at 1024)
_SHARED_LIMIT = 46 * 1024  # bytes of static shared memory the attention block may use

def available(head_dim: int, group: int) -> bool:
    """True on MLX's CUDA backend (where mx.fast.cuda_kernel runs) for shapes that fit.
    A cache uses the kernels only with decode "auto" (engine.attention.sdpa)."""
    cuda = getattr(mx, "cuda", None)
    fits = group * (2 * head_dim + _THREADS) * 4 + 2 * 256 * 4 <= _SHARED_LIMIT
    return bool(fits and cuda is not None and cuda.is_available()
                and mx.default_device() == mx.gpu)


@functools.cache
def _kernels() -> dict[str, Any]:
    outputs = {"encode": ["key_codes", "key_norms", "value_codes", "value_norms"],
               "attend": ["part_max", "part_sum", "part_acc", "out"]}
    inputs = {"encode": ["keys", "values", "key_signs", "value_signs", "key_bounds",
                         "key_cents", "value_bounds", "value_cents"],
              "attend": ["q", "key_signs", "value_signs", "params", "key_codes", "key_norms",
                         "value_codes", "value_norms", "key_cents", "value_cents", "meta",
                         "counters"]}
    sources = {"encode": ENCODE_SOURCE, "attend": ATTEND_SOURCE}
    return {name: mx.fast.cuda_kernel(name=f"tqserve_turboquant_{name}",
                                      input_names=inputs[name], output_names=outputs[name],
                                      source=sources[name], header=HEADER)
            for name in sources}


@functools.cache
def _tables(head_dim: int, bits: int) -> tuple[mx.array, mx.array]:
    """(boundaries, centroids) of the codebook as float32 device arrays."""
    book = lloyd_max_codebook(head_dim, bits)
    return (mx.array(book.boundaries, dtype=mx.float32),
            mx.array(book.centroids, dtype=mx.float32))


@functools.cache
def _ones(head_dim: int) -> mx.array:
    # Data, not a graph: a cached mx.ones would belong to the stream of the thread that
    # first built it, and a later engine's runner thread could not evaluate it.
    return mx.array(np.ones((head_dim,), dtype=np.float32))


@functools.cache
def _scalar(value: float) -> mx.array:
    return mx.array([value], dtype=mx.float32)


def _signs(codec: TurboQuantCodec) -> mx.array | None:
    """The Hadamard rotation's +-1 diagonal, or None for a "qr" codec."""
    return codec.hadamard_signs


def can_encode(key_codec: TurboQuantCodec, value_codec: TurboQuantCodec) -> bool:
    """Whether `encode` serves these codecs (Hadamard rotation, norm correction)."""
    return (key_codec.hadamard_signs is not None and value_codec.hadamard_signs is not None
            and key_codec.norm_correction and value_codec.norm_correction
            and key_codec.head_dim == value_codec.head_dim
            and available(key_codec.head_dim, 1))


def encode(keys: mx.array, values: mx.array, key_codec: TurboQuantCodec,
           value_codec: TurboQuantCodec) -> tuple[EncodedVectors, EncodedVectors]:
    """Encode (..., D) keys and values in one launch: (codes, fp16 norms) of each, shaped
    (..., W) and (..., 1) like the codec's `encode` (see `can_encode`)."""
    lead = keys.shape[:-1]
    d = key_codec.head_dim
    n = int(np.prod(lead)) if lead else 1
    kb, vb = key_codec.bits, value_codec.bits
    outs = _kernels()["encode"](
        inputs=[keys, values, key_codec.hadamard_signs, value_codec.hadamard_signs,
                *_tables(d, kb), *_tables(d, vb)],
        template=[("D", d), ("KB", kb), ("VB", vb)],
        grid=(n * d, 2, 1), threadgroup=(d, 1, 1),
        output_shapes=[(*lead, d * kb // 32), (*lead, 1), (*lead, d * vb // 32), (*lead, 1)],
        output_dtypes=[mx.uint32, mx.float16, mx.uint32, mx.float16])
    return EncodedVectors(outs[0], outs[1]), EncodedVectors(outs[2], outs[3])


def _num_splits(blocks: int, end: int) -> int:
    """Splits per (row, KV head): ~_TARGET_BLOCKS blocks in all, >= one tile each."""
    return max(1, min(-(-_TARGET_BLOCKS // blocks), -(-max(end, 1) // _THREADS)))


def decode_attention(queries: mx.array, kv: Any, scale: float) -> mx.array:
    """(B, n_heads, 1, D) queries over a RotatedKV's planes -> (B, n_heads, 1, D) in the
    queries' dtype, original basis. Row b attends positions [0, ends[b])
    (`RotatedKV.ends`: `length` for a single row, per row for slots)."""
    batch, num_heads, _, head_dim = queries.shape
    num_kv_heads = kv.key_codes.shape[1]
    group = num_heads // num_kv_heads
    span = kv.key_codes.shape[2]  # the whole allocation: contiguous, so nothing is copied
    key_signs, value_signs = _signs(kv.key_codec), _signs(kv.value_codec)
    rot = key_signs is not None and value_signs is not None
    q = queries if rot else kv.key_codec.rotate(queries.astype(mx.float32))
    end = kv.length
    blocks = batch * num_kv_heads
    num_splits = _num_splits(blocks, end)
    per_split = -(-end // num_splits)  # ceil(end / num_splits), rounded up to _THREADS
    split_len = -(-per_split // _THREADS) * _THREADS
    num_splits = -(-end // split_len)
    ranges = [x for e in kv.ends for x in (0, e)]
    ranges += [0, end] * (batch - len(kv.ends))
    kb, vb = kv.key_codec.bits, kv.value_codec.bits
    out_dtype = queries.dtype if rot else mx.float32
    ones = _ones(head_dim)
    *_, out = _kernels()["attend"](
        inputs=[q, key_signs if rot else ones, value_signs if rot else ones,
                _scalar(float(scale)), kv.key_codes, kv.key_norms, kv.value_codes,
                kv.value_norms, _tables(head_dim, kb)[1], _tables(head_dim, vb)[1],
                _meta(span, split_len, end, tuple(ranges)), _counters(blocks)],
        template=[("D", head_dim), ("R", group), ("KB", kb), ("VB", vb),
                  ("WK", kv.key_codes.shape[-1]), ("WV", kv.value_codes.shape[-1]),
                  ("HKV", num_kv_heads), ("NT", _THREADS), ("ROT", int(rot)),
                  ("T", out_dtype)],
        grid=(blocks * _THREADS, num_splits, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(blocks, num_splits, group), (blocks, num_splits, group),
                       (blocks, num_splits, group, head_dim), (batch, num_heads, 1, head_dim)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, out_dtype])
    if rot:
        return out
    return kv.value_codec.unrotate(out).astype(queries.dtype)


@functools.lru_cache(maxsize=16)
def _meta(span: int, split_len: int, end: int, ranges: tuple[int, ...]) -> mx.array:
    """The attention kernel's int32 scalars: span, split length, the longest end, then
    (start, end) of each row; every layer of a step shares one array."""
    return mx.array([span, split_len, end, *ranges], dtype=mx.int32)


@functools.cache
def _counters_of(size: int) -> mx.array:
    counters = mx.zeros((size,), dtype=mx.uint32)
    mx.eval(counters)
    return counters


def _counters(blocks: int) -> mx.array:
    """A zeroed uint32 array of >= `blocks` split counters; the kernel leaves it zeroed."""
    return _counters_of(1 << max(blocks - 1, 0).bit_length())
