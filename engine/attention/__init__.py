"""Attention over the KV planes of engine.kv: how a layer reads what the caches hold.

`sdpa.py` is the rotated attention port (mlx-lm's scaled_dot_product_attention routed for
TurboQuant planes: the query rotated instead of the keys, the inverse rotation applied
once to the output; affine planes; rows of mixed precision) and the fused decode (plain
mx ops under mx.compile); `cuda_decode.py` the CUDA kernels of the fused decode and of
TurboQuant encoding (mx.fast.cuda_kernel, with their sources in `cuda_sources.py`),
used where the backend is CUDA. Kept apart from engine.kv, which stores rows and knows
nothing of how they are attended, as nano-vllm keeps its attention layer apart from its
engine's block manager.
"""

from tqserve.engine.attention.sdpa import (
    DECODE_PATHS,
    MixedRowsKV,
    RotatedKV,
    install_attention,
    turboquant_sdpa,
)

__all__ = [
    "DECODE_PATHS",
    "MixedRowsKV",
    "RotatedKV",
    "install_attention",
    "turboquant_sdpa",
]
