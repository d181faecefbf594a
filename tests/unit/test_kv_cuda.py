"""The CUDA decode kernel equals the compiled-ops and plain paths (runs on MLX-CUDA only)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kv import attention, cuda_decode
from engine.kv.turboquant import TurboQuantKVCache

pytestmark = pytest.mark.skipif(not cuda_decode.available(128, 1),
                                reason="needs MLX's CUDA backend (mx.fast.cuda_kernel)")
TOL = 2e-5


@pytest.mark.parametrize("bits", [(4, 4), (3, 5), (8, 2), (1, 7)])
@pytest.mark.parametrize("head_dim,kv_heads,q_heads", [(128, 2, 8), (64, 4, 4), (256, 1, 2)])
def test_kernel_matches_compiled_and_plain(monkeypatch, bits, head_dim, kv_heads, q_heads):
    rows = []
    for n, seed in ((37, 1), (700, 2)):
        cache = TurboQuantKVCache(*bits, head_dim, fused_decode=True)
        k = mx.random.normal((1, kv_heads, n, head_dim), key=mx.random.key(seed))
        v = mx.random.normal((1, kv_heads, n, head_dim), key=mx.random.key(seed + 10))
        cache.update_and_fetch(k, v)
        rows.append(cache)
    batch = TurboQuantKVCache.merge(rows)
    mask = batch.make_mask(1)
    fetched, _ = batch.update_and_fetch(
        mx.random.normal((2, kv_heads, 1, head_dim), key=mx.random.key(5)),
        mx.random.normal((2, kv_heads, 1, head_dim), key=mx.random.key(6)))
    queries = mx.random.normal((2, q_heads, 1, head_dim), key=mx.random.key(7)) * 3
    kernel = attention._fused_attention(queries, fetched, 0.1)
    monkeypatch.setenv(cuda_decode.KERNEL_ENV, "0")
    compiled = attention._fused_attention(queries, fetched, 0.1)
    reference = _float64_reference(queries, fetched, 0.1)
    # The compiled ops' float32 matmuls may run in TF32 on the GPU; the kernel does not.
    assert np.max(np.abs(np.array(kernel) - reference)) < TOL
    assert np.max(np.abs(np.array(compiled) - reference)) < 5e-3


def _float64_reference(queries, fetched, scale):
    """Attention over the decoded keys/values in float64 (numpy), original basis."""
    keys, values = (np.array(a, dtype=np.float64) for a in fetched.decode_rotated())
    rot = np.array(fetched.key_codec.rotate(queries.astype(mx.float32)), dtype=np.float64)
    batch, heads, _, dim = rot.shape
    kv_heads = keys.shape[1]
    rot = rot.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = np.einsum("bhrd,bhtd->bhrt", rot, keys) * scale
    for b, start in enumerate(fetched.left_padding):
        scores[b, :, :, :start] = -np.inf
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhrt,bhtd->bhrd", weights, values).reshape(batch, heads, 1, dim)
    return np.array(fetched.value_codec.unrotate(mx.array(out.astype(np.float32))))
