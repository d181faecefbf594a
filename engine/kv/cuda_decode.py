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
  are one module-level array per size, so attention kernels must not run on two streams
  at once (the engine runs every MLX op on its one runner thread).

The split count follows the context: about `_TARGET_BLOCKS` blocks in all, at least one
tile per split. Kernels compile once per (head dim, group, bits, dtype): positions, splits
and row starts travel as one int32 array, so a growing context never recompiles;
`warm_up` builds them at engine start. The math is the compiled path's (scores
<R q, norm_k c[code_k]> * scale, values norm_v c[code_v] in the rotated basis, float32),
which stays the fallback and the reference it is tested against (tests/unit/test_kv_cuda.py).
Used only where `available()` (MLX's CUDA backend); the "qr" rotation keeps its rotations
as mx matmuls outside the kernels.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import mlx.core as mx
import numpy as np

from engine.codec.turboquant import EncodedVectors, TurboQuantCodec, lloyd_max_codebook

logger = logging.getLogger(__name__)

KERNEL_ENV = "TQSERVE_TURBOQUANT_CUDA_KERNEL"  # "0": use the compiled mx ops on CUDA too
_THREADS = 128  # threads per attention block = positions per tile
_TARGET_BLOCKS = 1024  # ~8 blocks of 4 warps per SM on an H100/H200 (132 SMs)
_SHARED_LIMIT = 46 * 1024  # bytes of static shared memory the attention block may use

_HEADER = """
#define TQ_INF __int_as_float(0x7f800000)
__device__ __forceinline__ float tq_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
__device__ __forceinline__ float tq_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
// Block-wide sum / max of one value per thread (NWARP warps; red holds NWARP floats).
template <int NWARP>
__device__ __forceinline__ float tq_block_sum(float v, float* red) {
    v = tq_warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
    for (int w = 0; w < NWARP; ++w) t += red[w];
    return t;
}
template <int NWARP>
__device__ __forceinline__ float tq_block_max(float v, float* red) {
    v = tq_warp_max(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = -TQ_INF;
    for (int w = 0; w < NWARP; ++w) t = fmaxf(t, red[w]);
    return t;
}
// Normalized Walsh-Hadamard transform of buf[0..D) in place, one thread per coordinate.
template <int D>
__device__ __forceinline__ void tq_hadamard(float* buf, int c) {
    for (int h = 1; h < D; h <<= 1) {
        __syncthreads();
        const float a = buf[c];
        const float b = buf[c ^ h];
        __syncthreads();
        buf[c] = (c & h) ? (b - a) : (a + b);
    }
    __syncthreads();
    buf[c] *= rsqrtf((float)D);
    __syncthreads();
}
// Code of coordinate c (B bits, densely packed little-endian) from a vector's words.
template <int B>
__device__ __forceinline__ uint32_t tq_code(const uint32_t* w, int c) {
    const int bit = c * B;
    const int i = bit >> 5, sh = bit & 31;
    uint32_t x = w[i] >> sh;
    if (sh + B > 32) x |= w[i + 1] << (32 - sh);
    return x & ((1u << B) - 1u);
}
// Encode one vector (block of D threads): codes (D*B/32 words) and the fp16 norm.
template <int D, int B, typename T>
__device__ void tq_encode_one(const T* x, const float* signs, const float* bounds,
                              const float* cents, uint32_t* codes, __half* norms, int n) {
    __shared__ float buf[D];
    __shared__ float red[D / 32];
    __shared__ uint32_t words[D * B / 32];
    const int c = threadIdx.x;
    const float v = static_cast<float>(x[(size_t)n * D + c]);
    const float scale = tq_block_max<D / 32>(fabsf(v), red);
    const float scaled = v / (scale > 0.f ? scale : 1.f);
    const float sn = sqrtf(tq_block_sum<D / 32>(scaled * scaled, red));
    const float unit = scaled / (sn > 0.f ? sn : 1.f);
    buf[c] = unit * signs[c];
    if (c < D * B / 32) words[c] = 0u;
    tq_hadamard<D>(buf, c);
    const float y = buf[c];
    int lo = 0, hi = (1 << B) - 1;  // index = number of boundaries strictly below y
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (bounds[mid] < y) lo = mid + 1; else hi = mid;
    }
    const float cv = cents[lo];
    const float recon = sqrtf(tq_block_sum<D / 32>(cv * cv, red));
    const int bit = c * B, wi = bit >> 5, sh = bit & 31;
    atomicOr(&words[wi], ((uint32_t)lo) << sh);
    if (sh + B > 32) atomicOr(&words[wi + 1], ((uint32_t)lo) >> (32 - sh));
    __syncthreads();
    if (c < D * B / 32) codes[(size_t)n * (D * B / 32) + c] = words[c];
    if (c == 0) {
        const float norm = scale * sn / (recon > 0.f ? recon : 1.f);
        norms[n] = __float2half_rn(fminf(norm, 65504.f));
    }
}
"""

_ENCODE_SOURCE = """
    if (blockIdx.y == 0)
        tq_encode_one<D, KB>(keys, key_signs, key_bounds, key_cents, key_codes, key_norms,
                             blockIdx.x);
    else
        tq_encode_one<D, VB>(values, value_signs, value_bounds, value_cents, value_codes,
                             value_norms, blockIdx.x);
"""

_ATTEND_SOURCE = """
    constexpr int NW = NT / 32;
    constexpr int NC = (D + NT - 1) / NT;
    const int tid = threadIdx.x;
    const int bh = blockIdx.x;
    const int split = blockIdx.y;
    const int row = bh / HKV;
    const int span = meta[0];
    const int split_len = meta[1];
    const int t_begin = max(meta[3 + row], split * split_len);
    const int t_end = min(meta[2], (split + 1) * split_len);
    __shared__ float qs[R][D];
    __shared__ __align__(16) float qt[D * R];  // qs transposed: one vector load per coord
    __shared__ __align__(16) float ps[NT * R];  // p * norm_v of the tile, position-major
    __shared__ float kc[1 << KB];
    __shared__ float vc[1 << VB];
    __shared__ float red[NW];
    __shared__ float redr[R * NW];
    for (int i = tid; i < (1 << KB); i += NT) kc[i] = key_cents[i];
    for (int i = tid; i < (1 << VB); i += NT) vc[i] = value_cents[i];
    const float qscale = params[0];
    for (int i = tid; i < R * D; i += NT) {
        const int r = i / D, c = i % D;
        const float x = static_cast<float>(q[((size_t)bh * R + r) * D + c]);
        qs[r][c] = ROT ? x * key_signs[c] : x;
    }
    if (ROT) {
        for (int h = 1; h < D; h <<= 1) {
            __syncthreads();
            for (int i = tid; i < R * D / 2; i += NT) {
                const int r = i / (D / 2), j = i % (D / 2);
                const int lo = (j / h) * 2 * h + (j % h);
                const float a = qs[r][lo], b = qs[r][lo + h];
                qs[r][lo] = a + b;
                qs[r][lo + h] = a - b;
            }
        }
    }
    __syncthreads();
    const float qmul = ROT ? qscale * rsqrtf((float)D) : qscale;
    for (int i = tid; i < R * D; i += NT) qt[(i % D) * R + i / D] = qs[i / D][i % D] * qmul;
    __syncthreads();
    float m[R], lsum[R], acc[R][NC];
    for (int r = 0; r < R; ++r) {
        m[r] = -TQ_INF; lsum[r] = 0.f;
        for (int k = 0; k < NC; ++k) acc[r][k] = 0.f;
    }
    const size_t base = (size_t)bh * span;
    const int first_tile = t_begin - (t_begin % NT);
    for (int t0 = (t_begin < t_end ? first_tile : t_end); t0 < t_end; t0 += NT) {
        const int t = t0 + tid;
        const bool valid = t >= t_begin && t < t_end;
        float s[R];
        for (int r = 0; r < R; ++r) s[r] = 0.f;
        float vn = 0.f;
        if (valid) {
            const uint32_t* kw = key_codes + (base + t) * WK;
            #pragma unroll
            for (int g = 0; g < D / 32; ++g) {
                uint32_t w[KB];
                #pragma unroll
                for (int i = 0; i < KB; ++i) w[i] = kw[g * KB + i];
                #pragma unroll
                for (int j = 0; j < 32; ++j) {
                    const float kv = kc[tq_code<KB>(w, j)];
                    #pragma unroll
                    for (int r = 0; r < R; ++r) s[r] += qt[(g * 32 + j) * R + r] * kv;
                }
            }
            const float kn = __half2float(key_norms[base + t]);
            for (int r = 0; r < R; ++r) s[r] *= kn;
            vn = __half2float(value_norms[base + t]);
        }
        float wmax[R];  // one block-wide max per query head, all heads in one pass
        for (int r = 0; r < R; ++r) wmax[r] = tq_warp_max(valid ? s[r] : -TQ_INF);
        if ((tid & 31) == 0)
            for (int r = 0; r < R; ++r) redr[r * NW + (tid >> 5)] = wmax[r];
        __syncthreads();
        for (int r = 0; r < R; ++r) {
            float tile_max = -TQ_INF;
            for (int w = 0; w < NW; ++w) tile_max = fmaxf(tile_max, redr[r * NW + w]);
            const float mn = fmaxf(m[r], tile_max);
            const float corr = __expf(m[r] - mn);
            const float p = valid ? __expf(s[r] - mn) : 0.f;
            lsum[r] = lsum[r] * corr + p;
            for (int k = 0; k < NC; ++k) acc[r][k] *= corr;
            m[r] = mn;
            ps[tid * R + r] = p * vn;
        }
        __syncthreads();
        const int j_begin = max(t_begin, t0) - t0;
        const int j_end = min(t_end, t0 + NT) - t0;
        for (int k = 0; k < NC; ++k) {
            const int c = tid + k * NT;
            if (c >= D) break;
            const int bit = c * VB, wi = bit >> 5, sh = bit & 31;
            const bool two = sh + VB > 32;
            const uint32_t* vw = value_codes + (base + t0) * WV + wi;
            #pragma unroll 8
            for (int j = j_begin; j < j_end; ++j) {
                uint32_t x = vw[(size_t)j * WV] >> sh;
                if (two) x |= vw[(size_t)j * WV + 1] << (32 - sh);
                const float v = vc[x & ((1u << VB) - 1u)];
                for (int r = 0; r < R; ++r) acc[r][k] += ps[j * R + r] * v;
            }
        }
        __syncthreads();
    }
    const int nsplit = gridDim.y;
    const size_t out_base = ((size_t)bh * nsplit + split) * R;
    for (int r = 0; r < R; ++r) {
        const float total = tq_block_sum<NW>(lsum[r], red);
        if (tid == 0) { part_max[out_base + r] = m[r]; part_sum[out_base + r] = total; }
        for (int k = 0; k < NC; ++k) {
            const int c = tid + k * NT;
            if (c < D) part_acc[(out_base + r) * D + c] = acc[r][k];
        }
    }
    // The last block of this (row, KV head) to finish merges the splits (threadFenceReduction
    // pattern). counters[bh] is zero between calls: that block resets it.
    __shared__ bool is_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        unsigned int* cnt = const_cast<unsigned int*>(counters);
        is_last = atomicAdd(&cnt[bh], 1u) == (unsigned int)(nsplit - 1);
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int i = tid; i < R * D; i += NT) {
        const int r = i / D, c = i % D;
        const size_t first = (size_t)bh * nsplit * R + r;
        float top = -TQ_INF;
        for (int sp = 0; sp < nsplit; ++sp) top = fmaxf(top, __ldcg(&part_max[first + sp * R]));
        float a = 0.f, l = 0.f;
        for (int sp = 0; sp < nsplit; ++sp) {
            const size_t j = first + sp * R;
            const float w = __expf(__ldcg(&part_max[j]) - top);
            l += __ldcg(&part_sum[j]) * w;
            a += __ldcg(&part_acc[j * D + c]) * w;
        }
        qs[r][c] = a / l;
    }
    if (ROT) {
        for (int h = 1; h < D; h <<= 1) {
            __syncthreads();
            for (int i = tid; i < R * D / 2; i += NT) {
                const int r = i / (D / 2), j = i % (D / 2);
                const int lo = (j / h) * 2 * h + (j % h);
                const float a = qs[r][lo], b = qs[r][lo + h];
                qs[r][lo] = a + b;
                qs[r][lo + h] = a - b;
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < R * D; i += NT) {
        const int r = i / D, c = i % D;
        const float v = ROT ? qs[r][c] * rsqrtf((float)D) * value_signs[c] : qs[r][c];
        out[((size_t)bh * R + r) * D + c] = static_cast<T>(v);
    }
    if (tid == 0) const_cast<unsigned int*>(counters)[bh] = 0u;
"""


def available(head_dim: int, group: int) -> bool:
    """True on MLX's CUDA backend (where mx.fast.cuda_kernel runs) for shapes that fit,
    unless TQSERVE_TURBOQUANT_CUDA_KERNEL=0."""
    cuda = getattr(mx, "cuda", None)
    fits = group * (2 * head_dim + _THREADS) * 4 + 2 * 256 * 4 <= _SHARED_LIMIT
    wanted = os.environ.get(KERNEL_ENV, "1").strip() != "0"
    return bool(wanted and fits and cuda is not None and cuda.is_available()
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
    sources = {"encode": _ENCODE_SOURCE, "attend": _ATTEND_SOURCE}
    return {name: mx.fast.cuda_kernel(name=f"tqserve_turboquant_{name}",
                                      input_names=inputs[name], output_names=outputs[name],
                                      source=sources[name], header=_HEADER)
            for name in sources}


@functools.cache
def _tables(head_dim: int, bits: int) -> tuple[mx.array, mx.array]:
    """(boundaries, centroids) of the codebook as float32 device arrays."""
    book = lloyd_max_codebook(head_dim, bits)
    return (mx.array(book.boundaries, dtype=mx.float32),
            mx.array(book.centroids, dtype=mx.float32))


@functools.cache
def _ones(head_dim: int) -> mx.array:
    return mx.ones((head_dim,), dtype=mx.float32)


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
    queries' dtype, original basis. Row b attends positions [left_padding[b], length)."""
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
    split_len = -(-(-(-end // num_splits)) // _THREADS) * _THREADS
    num_splits = -(-end // split_len)
    starts = list(kv.left_padding) + [0] * (batch - len(kv.left_padding))
    kb, vb = kv.key_codec.bits, kv.value_codec.bits
    out_dtype = queries.dtype if rot else mx.float32
    ones = _ones(head_dim)
    *_, out = _kernels()["attend"](
        inputs=[q, key_signs if rot else ones, value_signs if rot else ones,
                _scalar(float(scale)), kv.key_codes, kv.key_norms, kv.value_codes,
                kv.value_norms, _tables(head_dim, kb)[1], _tables(head_dim, vb)[1],
                _meta(span, split_len, end, tuple(starts)), _counters(blocks)],
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
def _meta(span: int, split_len: int, end: int, starts: tuple[int, ...]) -> mx.array:
    """The attention kernel's int32 scalars; every layer of a step shares one array."""
    return mx.array([span, split_len, end, *starts], dtype=mx.int32)


@functools.cache
def _counters_of(size: int) -> mx.array:
    counters = mx.zeros((size,), dtype=mx.uint32)
    mx.eval(counters)
    return counters


def _counters(blocks: int) -> mx.array:
    """A zeroed uint32 array of >= `blocks` split counters; the kernel leaves it zeroed."""
    return _counters_of(1 << max(blocks - 1, 0).bit_length())


def warm_up(head_dims: dict[int, int], group: int, k_bits: int, v_bits: int,
            dtype: mx.Dtype, seed: int = 0) -> float:
    """Build (JIT-compile) the kernels for these shapes now, so no request pays for it:
    one encode and one decode step per distinct head dim. Returns the seconds spent."""
    from engine.kv.turboquant import TurboQuantKVCache

    tic = time.perf_counter()
    for head_dim in sorted(set(head_dims.values())):
        if not available(head_dim, group):
            continue
        cache = TurboQuantKVCache(k_bits, v_bits, head_dim, seed=seed, fused_decode=True)
        kv = mx.zeros((1, 1, 2, head_dim), dtype=dtype) + 1
        cache.update_and_fetch(kv, kv)
        fetched, _ = cache.update_and_fetch(kv[:, :, :1], kv[:, :, :1])
        q = mx.ones((1, group, 1, head_dim), dtype=dtype)
        mx.eval(decode_attention(q, fetched, 1.0))
    return time.perf_counter() - tic
