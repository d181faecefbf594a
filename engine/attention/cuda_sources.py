"""CUDA sources of the TurboQuant kernels (engine/attention/cuda_decode.py describes them).

HEADER holds device helpers (warp/block reductions, the Hadamard butterfly, code
extraction, one-vector encode); ENCODE_SOURCE and ATTEND_SOURCE are kernel bodies for
mx.fast.cuda_kernel, which generates their signatures from the input/output names and
the template arguments (D, R, KB, VB, WK, WV, HKV, NT, ROT, T).
"""

HEADER = """
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
// Unnormalized Walsh-Hadamard butterfly of each of the R rows of qs in place, all NT
// threads of the block sharing the work; the caller scales by 1/sqrt(D) and syncs after.
template <int D, int R, int NT>
__device__ __forceinline__ void tq_hadamard_rows(float (*qs)[D], int tid) {
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

ENCODE_SOURCE = """
    if (blockIdx.y == 0)
        tq_encode_one<D, KB>(keys, key_signs, key_bounds, key_cents, key_codes, key_norms,
                             blockIdx.x);
    else
        tq_encode_one<D, VB>(values, value_signs, value_bounds, value_cents, value_codes,
                             value_norms, blockIdx.x);
"""

ATTEND_SOURCE = """
    constexpr int NW = NT / 32;
    constexpr int NC = (D + NT - 1) / NT;
    const int tid = threadIdx.x;
    const int bh = blockIdx.x;
    const int split = blockIdx.y;
    const int row = bh / HKV;
    const int span = meta[0];
    const int split_len = meta[1];
    const int t_begin = max(meta[3 + 2 * row], split * split_len);
    const int t_end = min(meta[4 + 2 * row], (split + 1) * split_len);
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
    if (ROT) tq_hadamard_rows<D, R, NT>(qs, tid);
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
    if (ROT) tq_hadamard_rows<D, R, NT>(qs, tid);
    __syncthreads();
    for (int i = tid; i < R * D; i += NT) {
        const int r = i / D, c = i % D;
        const float v = ROT ? qs[r][c] * rsqrtf((float)D) * value_signs[c] : qs[r][c];
        out[((size_t)bh * R + r) * D + c] = static_cast<T>(v);
    }
    if (tid == 0) const_cast<unsigned int*>(counters)[bh] = 0u;
"""
