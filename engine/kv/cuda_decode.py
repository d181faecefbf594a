"""TurboQuant decode attention as one CUDA kernel (mx.fast.cuda_kernel), split over keys.

On MLX's CUDA backend the compiled-ops fused decode materializes the decoded keys and
values in float32 between its elementwise part and its matmuls; this kernel never does.
Grid: one block of 4 warps per (row, KV head, split); each warp walks its positions,
unpacks the key and value codes of its lanes' coordinates (head_dim / 32 per lane),
looks them up in the codebooks, and keeps an online softmax per query head of the GQA
group. A block writes its split's (max, sum, unnormalized output); `decode_attention`
combines the splits with plain mx ops. The math is the plain path's: scores are
<R q, norm_k * c[code_k]> (queries pre-scaled), values norm_v * c[code_v], rotated basis.

Used only where `available()` (CUDA backend); the compiled mx path stays the fallback
and the reference it is tested against.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import mlx.core as mx

_WARPS = 4
_TARGET_BLOCKS = 512  # enough blocks to fill an H100/H200's 132 SMs several times

_SOURCE = """
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int bh = blockIdx.x;
    const int split = blockIdx.y;
    const int nsplit = gridDim.y;
    const int row = bh / HKV;
    const int TSPAN = meta[0];
    const int SPLIT_LEN = meta[1];
    const int t_begin = max(meta[3 + row], split * SPLIT_LEN);
    const int t_end = min(meta[2], (split + 1) * SPLIT_LEN);
    const float* qrow = q + (size_t)bh * R * D;
    float qv[R][NC];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NC; ++j) qv[r][j] = qrow[r * D + lane * NC + j];
    float m[R], l[R], acc[R][NC];
    for (int r = 0; r < R; ++r) {
        m[r] = -1e30f; l[r] = 0.f;
        for (int j = 0; j < NC; ++j) acc[r][j] = 0.f;
    }
    for (int t = t_begin + warp; t < t_end; t += NWARPS) {
        const size_t pos = (size_t)bh * TSPAN + t;
        const uint32_t* kw = key_codes + pos * WK;
        const uint32_t* vw = value_codes + pos * WV;
        float kval[NC], vval[NC];
        for (int j = 0; j < NC; ++j) {
            const int c = lane * NC + j;
            const int kbit = c * KB, vbit = c * VB;
            uint64_t kx = kw[kbit >> 5];
            if ((kbit & 31) + KB > 32) kx |= ((uint64_t)kw[(kbit >> 5) + 1]) << 32;
            uint64_t vx = vw[vbit >> 5];
            if ((vbit & 31) + VB > 32) vx |= ((uint64_t)vw[(vbit >> 5) + 1]) << 32;
            kval[j] = key_centroids[(kx >> (kbit & 31)) & ((1u << KB) - 1)];
            vval[j] = value_centroids[(vx >> (vbit & 31)) & ((1u << VB) - 1)];
        }
        const float kn = key_norms[pos];
        const float vn = value_norms[pos];
        for (int r = 0; r < R; ++r) {
            float s = 0.f;
            for (int j = 0; j < NC; ++j) s += qv[r][j] * kval[j];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            s *= kn;
            const float mn = fmaxf(m[r], s);
            const float corr = __expf(m[r] - mn);
            const float p = __expf(s - mn);
            l[r] = l[r] * corr + p;
            for (int j = 0; j < NC; ++j) acc[r][j] = acc[r][j] * corr + p * vn * vval[j];
            m[r] = mn;
        }
    }
    __shared__ float sm[NWARPS][R];
    __shared__ float sl[NWARPS][R];
    __shared__ float sacc[NWARPS][R][D];
    for (int r = 0; r < R; ++r) {
        if (lane == 0) { sm[warp][r] = m[r]; sl[warp][r] = l[r]; }
        for (int j = 0; j < NC; ++j) sacc[warp][r][lane * NC + j] = acc[r][j];
    }
    __syncthreads();
    const size_t out_base = ((size_t)bh * nsplit + split) * R;
    for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
        const int r = i / D, c = i % D;
        float mm = -1e30f;
        for (int w = 0; w < NWARPS; ++w) mm = fmaxf(mm, sm[w][r]);
        float a = 0.f, ll = 0.f;
        for (int w = 0; w < NWARPS; ++w) {
            const float f = __expf(sm[w][r] - mm);
            a += sacc[w][r][c] * f;
            ll += sl[w][r] * f;
        }
        part_acc[(out_base + r) * D + c] = a;
        if (c == 0) { part_max[out_base + r] = mm; part_sum[out_base + r] = ll; }
    }
"""


_SHARED_LIMIT = 40 * 1024  # bytes of static shared memory the combine step may use


KERNEL_ENV = "TQSERVE_TURBOQUANT_CUDA_KERNEL"  # "0": use the compiled mx ops on CUDA too


def available(head_dim: int, group: int) -> bool:
    """True on MLX's CUDA backend (where mx.fast.cuda_kernel runs) for shapes that fit,
    unless TQSERVE_TURBOQUANT_CUDA_KERNEL=0."""
    cuda = getattr(mx, "cuda", None)
    fits = _WARPS * group * (head_dim + 2) * 4 <= _SHARED_LIMIT
    wanted = os.environ.get(KERNEL_ENV, "1").strip() != "0"
    return bool(wanted and fits and cuda is not None and cuda.is_available()
                and mx.default_device() == mx.gpu)


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="tqserve_turboquant_decode",
        input_names=["q", "key_codes", "key_norms", "value_codes", "value_norms",
                     "key_centroids", "value_centroids", "meta"],
        output_names=["part_max", "part_sum", "part_acc"],
        source=_SOURCE)


def decode_attention(q: mx.array, key_codes: mx.array, key_norms: mx.array,
                     value_codes: mx.array, value_norms: mx.array, key_centroids: mx.array,
                     value_centroids: mx.array, key_bits: int, value_bits: int,
                     start: tuple[int, ...], end: int) -> mx.array:
    """(B, Hkv, R, D) pre-scaled rotated queries over packed planes -> (B, Hkv, R, D).

    Row b attends positions [start[b], end); the few scalars travel as one int32 array."""
    batch, num_kv_heads, group, head_dim = q.shape
    span = key_codes.shape[2]  # the whole allocation: contiguous, so nothing is copied
    blocks = batch * num_kv_heads
    num_splits = max(1, min(-(-_TARGET_BLOCKS // blocks), -(-max(end, 1) // 64)))
    split_len = -(-end // num_splits)
    part_max, part_sum, part_acc = _kernel()(
        inputs=[q.astype(mx.float32), key_codes, key_norms.astype(mx.float32).reshape(
            batch, num_kv_heads, span), value_codes, value_norms.astype(mx.float32).reshape(
            batch, num_kv_heads, span), key_centroids, value_centroids,
            mx.array([span, split_len, end, *start], dtype=mx.int32)],
        template=[("D", head_dim), ("NC", head_dim // 32), ("R", group), ("KB", key_bits),
                  ("VB", value_bits), ("WK", key_codes.shape[-1]), ("WV", value_codes.shape[-1]),
                  ("HKV", num_kv_heads), ("NWARPS", _WARPS)],
        grid=(blocks * 32 * _WARPS, num_splits, 1),
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(blocks, num_splits, group), (blocks, num_splits, group),
                       (blocks, num_splits, group, head_dim)],
        output_dtypes=[mx.float32, mx.float32, mx.float32])
    return _combine(part_max, part_sum, part_acc).reshape(batch, num_kv_heads, group, head_dim)


@mx.compile
def _combine(part_max: mx.array, part_sum: mx.array, part_acc: mx.array) -> mx.array:
    """Merge the splits' online-softmax partials: (blocks, splits, R[, D]) -> (blocks, R, D)."""
    top = mx.max(part_max, axis=1, keepdims=True)
    weight = mx.exp(part_max - top)
    total = mx.sum(part_sum * weight, axis=1)
    return mx.sum(part_acc * weight[..., None], axis=1) / total[..., None]
