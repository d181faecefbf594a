"""The CUDA encode and decode kernels equal the codec, the compiled-ops path and a float64
reference (runs on MLX-CUDA only).

float32 here is float32 as the engine runs it (engine.model loads float32 models with
MLX_ENABLE_TF32=0): this module sets it before MLX's first float32 matmul, as
tests/gpu/test_cuda_fidelity.py does, so that no result depends on which module ran
first. Under TF32 the "qr" rotation of the queries, a float32 matmul outside the kernel,
rounds past the tolerance: two k3v5 cases failed on an H100 when this module ran alone,
and passed after the fidelity module had set it (2026-12-07).
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # before MLX's first float32 matmul

import attrs  # noqa: E402
import mlx.core as mx
import numpy as np
import pytest

from tqserve.engine.codec.turboquant import TurboQuantCodec
from tqserve.engine.attention import cuda_decode
from tqserve.engine.kv.factory import warm_up_kernels
from tqserve.engine.attention import sdpa as attention
from tqserve.engine.kv.turboquant import TurboQuantSlotsKVCache
from tqserve.engine.kv.slots import slot_batch_of
from tqserve.engine.kv.turboquant import TurboQuantKVCache

pytestmark = pytest.mark.skipif(not cuda_decode.available(128, 1),
                                reason="needs MLX's CUDA backend (mx.fast.cuda_kernel)")
TOL = 2e-5


@pytest.mark.parametrize("rotation", ["hadamard", "qr"])
@pytest.mark.parametrize("bits", [(4, 4), (3, 5), (8, 2), (1, 7)])
@pytest.mark.parametrize("head_dim,kv_heads,q_heads", [(128, 2, 8), (64, 4, 4), (256, 1, 2),
                                                       (128, 8, 32)])
def test_kernel_matches_compiled_and_plain(bits, head_dim, kv_heads, q_heads,
                                           rotation):
    rows = []
    for n, seed in ((37, 1), (700, 2)):
        cache = TurboQuantKVCache(*bits, head_dim, decode="auto", rotation=rotation)
        k = mx.random.normal((1, kv_heads, n, head_dim), key=mx.random.key(seed))
        v = mx.random.normal((1, kv_heads, n, head_dim), key=mx.random.key(seed + 10))
        cache.update_and_fetch(k, v)
        rows.append(cache)
    batch = slot_batch_of(rows)  # slot rows of 37 and 700 positions, ending at their own
    fetched, _ = batch.update_and_fetch(
        mx.random.normal((2, kv_heads, 1, head_dim), key=mx.random.key(5)),
        mx.random.normal((2, kv_heads, 1, head_dim), key=mx.random.key(6)))
    queries = mx.random.normal((2, q_heads, 1, head_dim), key=mx.random.key(7)) * 3
    kernel = attention._fused_attention(queries, fetched, 0.1)
    compiled = attention._fused_attention(queries, attrs.evolve(fetched, decode="compiled"), 0.1)
    reference = _float64_reference(queries, fetched, 0.1)
    # A "qr" rotation is a float32 matmul outside the kernel, whose rounding differs from
    # the kernel's butterfly: a looser bound for it and for the compiled ops.
    tol = TOL if rotation == "hadamard" else 5e-3
    assert np.max(np.abs(np.array(kernel) - reference)) < tol
    assert np.max(np.abs(np.array(compiled) - reference)) < 5e-3


def _float64_reference(queries, fetched, scale):
    """Attention over the decoded keys/values in float64 (numpy), original basis."""
    keys, values = (np.array(a, dtype=np.float64) for a in fetched.decode_rotated())
    rot = np.array(fetched.key_codec.rotate(queries.astype(mx.float32)), dtype=np.float64)
    batch, heads, _, dim = rot.shape
    kv_heads = keys.shape[1]
    rot = rot.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = np.einsum("bhrd,bhtd->bhrt", rot, keys) * scale
    for b, end in enumerate(fetched.ends):  # row b holds positions [0, ends[b])
        scores[b, :, :, end:] = -np.inf
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhrt,bhtd->bhrd", weights, values).reshape(batch, heads, 1, dim)
    return np.array(fetched.value_codec.unrotate(mx.array(out.astype(np.float32))))


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 512])
def test_encode_kernel_matches_codec(bits, head_dim):
    """Same codes up to float rounding at cell boundaries, same norms up to fp16 rounding."""
    codec = TurboQuantCodec(head_dim, bits, seed=3, norm_correction=True)
    x = mx.random.normal((2, 3, 50, head_dim), key=mx.random.key(bits)) * 4
    x = mx.concatenate([x, mx.zeros((2, 3, 1, head_dim))], axis=2).astype(mx.bfloat16)
    (k, v), ref = cuda_decode.encode(x, x * 2, codec, codec), codec.encode(x)
    assert k.codes.shape == ref.codes.shape and k.norms.shape == ref.norms.shape
    assert k.norms.dtype == mx.float16 and k.codes.dtype == mx.uint32
    ours = np.array(codec.decode_rotated(k))
    theirs = np.array(codec.decode_rotated(ref))
    same = np.mean(np.isclose(ours, theirs, rtol=2e-3, atol=1e-6))
    assert same > 0.999, same
    assert np.allclose(np.array(k.norms, dtype=np.float32), np.array(ref.norms, np.float32),
                       rtol=2e-3)
    assert np.allclose(np.array(v.norms, dtype=np.float32),
                       2 * np.array(ref.norms, np.float32), rtol=2e-3)
    assert np.all(np.array(k.norms)[:, :, -1] == 0)  # a zero vector decodes to zero


def test_many_rows_of_a_single_row_cache():
    """A single-row cache fed a B > 1 block (as bench kv --rows does) decodes every row."""
    cache = TurboQuantKVCache(4, 4, 128, decode="auto")
    cache.update_and_fetch(mx.random.normal((5, 2, 300, 128), key=mx.random.key(1)),
                           mx.random.normal((5, 2, 300, 128), key=mx.random.key(2)))
    fetched, _ = cache.update_and_fetch(mx.random.normal((5, 2, 1, 128), key=mx.random.key(3)),
                                        mx.random.normal((5, 2, 1, 128), key=mx.random.key(4)))
    queries = mx.random.normal((5, 8, 1, 128), key=mx.random.key(7))
    out = attention._fused_attention(queries, fetched, 0.1)
    assert np.max(np.abs(np.array(out) - _float64_reference(queries, fetched, 0.1))) < TOL


@pytest.mark.parametrize("bits", [(4, 4), (8, 3)])
def test_kernel_on_slots_reads_each_rows_own_end(bits):
    """Left-aligned slot rows of 37, 700 and 0 positions (+1): the kernel stops at each
    row's own end (RotatedKV.ends), as the compiled path and the reference do."""
    batch = TurboQuantSlotsKVCache()
    for n, seed in ((37, 1), (700, 2), (0, 3)):
        row = TurboQuantKVCache(*bits, 128, decode="auto")
        if n:
            k = mx.random.normal((1, 2, n, 128), key=mx.random.key(seed))
            row.update_and_fetch(k, k * 0.5 + 1)
        batch.extend(row)
    fetched, _ = batch.update_and_fetch(
        mx.random.normal((3, 2, 1, 128), key=mx.random.key(5)),
        mx.random.normal((3, 2, 1, 128), key=mx.random.key(6)))
    assert fetched.ends == (38, 701, 1) and fetched.length == 701
    queries = mx.random.normal((3, 8, 1, 128), key=mx.random.key(7)) * 3
    kernel = attention._fused_attention(queries, fetched, 0.1)
    compiled = attention._fused_attention(queries, attrs.evolve(fetched, decode="compiled"), 0.1)
    reference = _float64_reference(queries, fetched, 0.1)
    assert np.max(np.abs(np.array(kernel) - reference)) < TOL
    assert np.max(np.abs(np.array(compiled) - reference)) < 5e-3


def test_warm_up_builds_the_kernels():
    assert warm_up_kernels({0: 128}, 4, 4, 4, mx.bfloat16) >= 0.0
